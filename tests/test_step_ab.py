"""bench/step_ab.py, the in-process interleaved A/B of the training step: its arm syntax, the switches it sets and
restores, and a tiny CPU run in which every arm compiles a graph of its own."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import step_ab  # noqa: E402
from fp4compile.kernels import gemm as G  # noqa: E402
from fp4compile.kernels import quantize as Q  # noqa: E402


def test_parse_arm_reads_switches_dict_entries_and_options():
    name, sw, opts = step_ab.parse_arm("x:fp4compile.kernels.gemm.SCALE_CAST=0,"
                                       "fp4compile.kernels.quantize.CONFIG[e_maxnreg]=128,options.debug=true,"
                                       "fp4compile.kernels.gemm.DEFAULT_IMPL=tuned")
    assert name == "x"
    assert sw == {(G, "SCALE_CAST", None): 0, (Q, "CONFIG", "e_maxnreg"): 128, (G, "DEFAULT_IMPL", None): "tuned"}
    assert opts == {"debug": True}
    assert step_ab.parse_arm("base") == ("base", {}, {})
    assert step_ab.parse_arm("bf16:backend=inductor") == ("bf16", {}, {"backend": "inductor"})


def test_median_ci_brackets_the_median_and_resolves_a_clear_shift():
    lo, hi = step_ab.median_ci([0.1, -0.2, 0.05, 0.0, -0.1, 0.15, -0.05, 0.02])
    assert lo <= 0.01 <= hi and lo < 0 < hi                  # noise around 0: not resolved
    lo, hi = step_ab.median_ci([0.6, 0.5, 0.7, 0.55, 0.65, 0.4, 0.62, 0.58])
    assert 0.4 <= lo <= 0.59 <= hi <= 0.7                    # a clear +0.6 ms: resolved, and bracketed
    assert step_ab.median_ci([0.3]) == (0.3, 0.3)


def test_profile_must_name_an_arm():
    with pytest.raises(SystemExit, match="names no arm"):
        step_ab.main(["--tiny", "--arm", "a", "--arm", "b", "--profile", "c"])


@pytest.mark.parametrize("spec", ["x:SCALE_CAST=0", "x:fp4compile.kernels.gemm.SCALE_CAST",
                                  "x:fp4compile.kernels.gemm.NOPE=1", "x:fp4compile.kernels.quantize.CONFIG[nope]=1"])
def test_parse_arm_rejects_bad_settings(spec):
    with pytest.raises(SystemExit):
        step_ab.parse_arm(spec)


def test_applied_sets_and_restores_even_on_error():
    before, cap = G.SCALE_CAST, Q.CONFIG["e_maxnreg"]
    _, sw, _ = step_ab.parse_arm(f"x:fp4compile.kernels.gemm.SCALE_CAST={str(not before).lower()},"
                                 "fp4compile.kernels.quantize.CONFIG[e_maxnreg]=7")
    with pytest.raises(RuntimeError):
        with step_ab.applied(sw):
            assert G.SCALE_CAST is (not before) and Q.CONFIG["e_maxnreg"] == 7
            raise RuntimeError
    assert G.SCALE_CAST is before and Q.CONFIG["e_maxnreg"] == cap


def test_tiny_run_times_every_arm_on_a_graph_of_its_own(capsys, tmp_path):
    out = tmp_path / "ab.jsonl"
    rows = step_ab.main(["--tiny", "--rounds", "2", "--block", "1", "--warmup", "0", "--json", str(out),
                         "--arm", "base", "--arm", "nobias:fp4compile.passes.linear.FUSE_BIAS=false",
                         "--arm", "bf16:backend=inductor", "--profile", "nobias", "--profile-top", "3"])
    assert [r["arm"] for r in rows] == ["base", "nobias", "bf16"]
    assert all(len(r["times"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert rows[0]["median_diff_ms"] == 0 and rows[0]["ratio"] == 1
    text = capsys.readouterr().out
    assert "(1 Dynamo graphs)" in text and "ABBA" in text and "== profile: arm nobias, 2 steps ==" in text
    assert out.read_text().count("\n") == 1


def test_an_arm_can_name_its_own_policy(monkeypatch):
    """``options.policy=PRESET`` replaces ``--policy`` for that arm alone (the linear-only step beside the full
    stack in one run): it reached the backend instead of failing on a repeated keyword."""
    import fp4compile.backend as B

    real, seen = B.fullstack_fp4, []

    def spy(gm, example_inputs, **kw):
        seen.append(kw["options"]["policy"])
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(B, "fullstack_fp4", spy)
    rows = step_ab.main(["--tiny", "--rounds", "1", "--block", "1", "--warmup", "0",
                         "--arm", "fs", "--arm", "q2:options.policy=quartet2"])
    assert [r["arm"] for r in rows] == ["fs", "q2"]
    assert seen[0] != "quartet2" and "quartet2" in seen
