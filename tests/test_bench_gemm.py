"""bench/gemm.py's ``--tma-configs`` candidates: every TMA GEMM tile both as listed and flattened, each once."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gemm as B  # noqa: E402
from fp4compile.kernels import gemm as G  # noqa: E402
from fp4compile.kernels import gemm_wgmma as W  # noqa: E402


def test_candidates_are_every_tile_plain_and_flattened_once():
    cands = B.tma_candidates()
    names = [n for n, _ in cands]
    assert len(names) == len(set(names))
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], bool(c.get("EPI_SUBTILE")))
             for c in G.TMA_CONFIGS}
    got = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"], bool(c.get("EPI_SUBTILE")),
            c["FLATTEN"]) for _, c in cands}
    assert got == {t + (f,) for t in tiles for f in (False, True)}
    for n, c in cands:                                       # the name says what the config holds
        assert n == B.tile_name(c) and n.endswith(" flat") == c["FLATTEN"]


def test_tile_name():
    assert B.tile_name(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=True),
                       flatten=True) == "128x256x64 w8 s3 sub flat"
    assert B.tile_name(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)) == "128x128x64 w4 s4"


def test_tma_configs_table_finds_a_slower_pick(monkeypatch, capsys):
    """The table's logic on the CPU: timings come from a fake clock that makes every tile cost its name's length in µs
    except one fast tile; the fake GEMM records the config it runs and, without one, 'autotunes' to a slow tile. The
    row names the pick, the fastest tile and their ratio, and the autotuner's disk cache is restored afterwards."""
    cands = B.tma_candidates()
    fast = cands[1][0]                                   # the listed 128x256 tile, flattened
    slow = next(c for n, c in cands if n == "128x128x64 w4 s4")
    ran = []

    def fake_gemm(a, b, ag, bg, out_dtype=None, *, config=None, **kw):
        if config is None:                               # the autotuner: picks the slow tile, as on session 56's H100
            assert G.AUTOTUNE_CACHE is False             # tuned anew, not loaded from disk
            G._TMA_BEST[(a.shape[0], b.shape[0], a.shape[1], a.dtype, a.device.index, False, False)] = dict(slow)
            config = slow
        ran.append(B.tile_name(config))
        return a[:, :1]

    def clock(fn, rep):
        fn()
        return 100.0 if not ran or ran[-1] != fast else 80.0
    monkeypatch.setattr(G, "bf16_gemm_scaled", fake_gemm)
    monkeypatch.setattr(B, "_us_graph", clock)
    monkeypatch.setattr(B, "_us_flushed", clock)
    monkeypatch.setattr(B, "linear_shapes", lambda d: [("fc1.fprop", 32, 48, 16), ("fc1.wgrad", 48, 16, 32)])
    monkeypatch.setattr(G, "AUTOTUNE_CACHE", True)
    monkeypatch.setattr(G, "_TMA_BEST", {})              # the fake pick must not outlive the test
    monkeypatch.setattr(G, "_load_tuned", lambda key: dict(cands[1][1]))   # a stored choice: the fast tile
    rows = B.tma_configs_table(rep=1, device="cpu")
    assert G.AUTOTUNE_CACHE is True                      # restored
    assert [r["shape"] for r in rows] == ["fc1.fprop"]   # wgrad shapes are not the TMA GEMM's
    r = rows[0]
    assert r["pick"] == "128x128x64 w4 s4" and r["fastest"] == fast
    assert r["pick_us"] == 100.0 and r["fastest_us"] == 80.0 and r["flushed"] == (100.0, 80.0)
    assert set(r["times"]) == {n for n, _ in cands}
    assert r["stored"] == fast and r["stored_us"] == 80.0
    assert "| 124M fc1.fprop | 32 | 48 | 16 | 100.0 | 128x128x64 w4 s4 | 100.0 | " + fast in capsys.readouterr().out


def test_gemm_wgmma_columns_are_distinct():
    """bench/gemm_wgmma.py keys its timings by config name: two configs with one name would overwrite each other's
    times (session 72's first RS table did)."""
    from bench import gemm_wgmma as BW

    names = [BW._cfg_name(c) for c in BW.CHECKED + BW.DIAG + BW.DIAG_RS + BW.DIAG_MIXED]
    assert len(names) == len(set(names)), names
    assert {BW._kind(c) for c in BW.CHECKED} == {"sp", "ws", "rs", "mixed"}


@pytest.mark.skipif(not W.available(), reason="needs Triton's Gluon")
def test_gemm_wgmma_sass_table(capsys):
    """``bench/gemm_wgmma_sass.py`` prints one row per register-A config, none with spills or hazards, and the
    HALVES configs wait with one wgmma group left in flight."""
    from bench import gemm_wgmma_sass as S

    assert S.main() == 0
    rows = [ln.split("|")[1:-1] for ln in capsys.readouterr().out.splitlines()[2:]]
    # one row per main loop: a SPLIT config has one per warpgroup partition (one of which issues B's TMA loads), a
    # HALVES config an unrolled loop of 3 K-tiles and a remainder loop of one per partition
    labels = [r[0].strip() for r in rows]

    def loops(c):
        return (2 if c.get("SPLIT") else 1) * (2 if c.get("HALVES") else 1)

    for c in W.RS_CONFIGS + W.MIXED_CONFIGS:
        mine = [lb for lb in labels if lb == S.name(c) or lb.startswith(S.name(c) + " (") or
                lb.startswith(S.name(c) + ",")]
        assert len(mine) == loops(c), (S.name(c), mine)
    assert len(rows) == sum(loops(c) for c in W.RS_CONFIGS + W.MIXED_CONFIGS)
    by_label = {S.name(c): c for c in W.RS_CONFIGS + W.MIXED_CONFIGS}
    for cells in rows:
        label, regs, local, instructions, hgmma, waits, bars, hazards, load_waits, fewest = (x.strip() for x in cells)
        assert re.fullmatch(r"\d+ \(\d+\)", load_waits) and (fewest == "-" or int(fewest) > 0)
        c = by_label[re.split(r" \(|,", label)[0]]
        assert local == "0" and hazards == "0" and hgmma == "4"
        assert waits == ("1,1" if c.get("HALVES") else "0")
