"""bench/study.py: arm commands, resumable driver and the report table (CPU, tiny stand-in runs)."""
import importlib.util
import json
import re
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study", ROOT / "bench" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def moved(cmd, a, b):
    """An arm command of arm ``a`` with its run directory (``--out-dir`` and ``--stop-file``) that of arm ``b``."""
    return cmd.replace(f"/{a} ", f"/{b} ").replace(f"/{a}/STOP", f"/{b}/STOP")


def test_arm_commands_differ_only_in_the_recipe(study, capsys):
    assert study.main(["--print-commands", "--tokens", "6553600"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7
    assert all("--steps 100 " in ln and "--resume" in ln and "--warmup-steps 5" in ln for ln in lines)
    assert all(re.search(r"--out-dir (\S+) .*--stop-file \1/STOP ", ln) for ln in lines)   # bg_stop's file
    assert "--backend inductor --policy bf16 --optimizer adamw --no-lora" in lines[0]
    assert "--backend fullstack_fp4 --policy quartet2 --optimizer adamw --no-lora" in lines[1]
    assert "--policy quartet2 --optimizer adamw --lora" in lines[2]
    assert "--policy full_stack --optimizer adamw --lora" in lines[3]
    assert "--optimizer qadamw --lora" in lines[4] and "--optimizer qroot --lora" in lines[5]
    assert "--backend inductor --policy bf16 --optimizer qroot+adamw --no-lora" in lines[6]   # Q-Root's baseline
    assert all("--lora-rank" not in ln for ln in lines)                 # prepare()'s default rank
    # the rank arms are the lora arm with one more flag
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "lora,lora64,lora128"]) == 0
    lora, r64, r128 = capsys.readouterr().out.strip().splitlines()
    assert r64 == moved(lora, "lora", "lora64") + " --lora-rank 64"
    assert r128 == moved(lora, "lora", "lora128") + " --lora-rank 128"
    # the frozen-factor arms: one more flag each (lora64f on lora64, fullf on the full stack)
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "lora64,lora64f,full,fullf"]) == 0
    r64, r64f, full, fullf = capsys.readouterr().out.strip().splitlines()
    assert r64f == moved(r64, "lora64", "lora64f") + " --no-lora-train-factors"
    assert fullf == moved(full, "full", "fullf") + " --no-lora-train-factors"
    # fullbest: fullf with block 0 in BF16, rank 256 and its re-split cadence; its flags come after the study's
    # extra flags, so a mode's defaults (e.g. run_h200.sh seeds' "--lora-realign-every 300") cannot override them
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "fullf,fullbest", "--",
                       "--lora-realign-every", "300"]) == 0
    fullf, best = capsys.readouterr().out.strip().splitlines()
    fb_pol = str(ROOT / "configs" / "policy_full_stack_first_block_bf16.toml")
    assert best.startswith(fullf.split(" --steps")[0].replace("/fullf ", "/fullbest ")
                           .replace("--policy full_stack ", f"--policy {fb_pol} "))
    assert best.endswith("--lora-realign-every 300 --lora-realign-every 100 --lora-realign-after 100")
    assert "--lora-rank 256 --no-lora-train-factors" in best
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "fullbest,fullbest_late"]) == 0
    best, late = capsys.readouterr().out.strip().splitlines()
    assert late == moved(best, "fullbest", "fullbest_late") + " --late-bf16-at 0.85"
    # the Q/K transform arms: qattn's command in an environment that sets passes/attention.py's QK_TRANSFORM
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms",
                       "qattn,qattn_sk,qattn_had,qattn_skh,qattn_none"]) == 0
    qa, sk, had, skh, none = capsys.readouterr().out.strip().splitlines()
    assert sk == "FP4COMPILE_QK_TRANSFORM=smooth_k " + moved(qa, "qattn", "qattn_sk")
    assert had == "FP4COMPILE_QK_TRANSFORM=hadamard " + moved(qa, "qattn", "qattn_had")
    assert skh == "FP4COMPILE_QK_TRANSFORM=smooth_k+hadamard " + moved(qa, "qattn", "qattn_skh")
    assert none == "FP4COMPILE_QK_TRANSFORM=none " + moved(qa, "qattn", "qattn_none")
    assert study.arm_env("qattn_sk", {"A": "1"}) == {"A": "1", "FP4COMPILE_QK_TRANSFORM": "smooth_k"}
    assert study.arm_env("qattn", {"A": "1"}) == {"A": "1"}
    # q2root: bf16root's optimizer with Quartet II linears
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "bf16root,q2root"]) == 0
    root, q2root = capsys.readouterr().out.strip().splitlines()
    assert q2root == moved(root, "bf16root", "q2root").replace("--backend inductor --policy bf16 ",
                                                                   "--backend fullstack_fp4 --policy quartet2 ")
    # q2w: the quartet2 arm with the forward-weight-only policy file, which loads
    assert study.main(["--print-commands", "--tokens", "6553600", "--arms", "quartet2,q2w"]) == 0
    q2, q2w = capsys.readouterr().out.strip().splitlines()
    pol = str(ROOT / "configs" / "policy_quartet2_fwd_weight_only.toml")
    assert q2w == moved(q2, "quartet2", "q2w").replace("--policy quartet2 ", f"--policy {pol} ")
    from fp4compile.policy import NVFP4
    from fp4compile.train.loop import load_policy

    p = load_policy(pol)
    assert p.resolve("blocks.0.mlp.fc", "linear.fprop") == NVFP4("rtn", four_over_six=True, operands="weight")
    assert str(p.resolve("blocks.0.mlp.fc", "linear.dgrad")) == "bf16"
    # the configs parse and validate
    from fp4compile.train.cli import load_config_file
    from fp4compile.train.loop import TrainConfig

    for size in ("30m", "124m"):
        cfg = TrainConfig.from_dict(load_config_file(ROOT / "configs" / f"study_{size}.toml"))
        cfg.validate()
        assert cfg.model == size and cfg.tokenizer == "gpt2"


def test_arm_command_on_several_gpus_keeps_the_global_batch(study, capsys):
    """--nproc N: the arm runs under torchrun with DDP and batch_size / N sequences per rank (the data
    pipeline gives rank r its rows of the same global batch), the same steps; N must divide the batch."""
    assert study.main(["--size", "124m", "--arms", "full", "--tokens", "6553600", "--nproc", "2",
                       "--master-port", "29611", "--print-commands"]) == 0
    line = capsys.readouterr().out.strip()
    assert "-m torch.distributed.run --nproc-per-node=2 " in line and "--master-port=29611" in line
    assert "-m fp4compile train " in line and "--parallel ddp --batch-size 32" in line and "--steps 100 " in line
    assert study.main(["--arms", "bf16", "--tokens", "6553600", "--print-commands"]) == 0
    assert "torch.distributed.run" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="must divide"):
        study.main(["--arms", "bf16", "--nproc", "3", "--print-commands"])


def test_report_compares_arms_stopped_at_different_steps_at_their_latest_common_step(study, tmp_path):
    """An unfinished study (fullbest stopped at step 7, bf16root at 10): the gaps come from the metrics at the latest
    step both logged (eval step 5 for val/Brown; log steps 1..7 for train), marked with it, and a val loss from an
    eval before the run's last step is marked with the eval's step."""
    out = tmp_path / "124m"

    def run(arm, last, offset):
        d = out / arm
        d.mkdir(parents=True)
        recs = [dict(step=t, tokens=t * 65536, loss=3.0 + offset - t / 100) for t in range(1, last + 1)]
        recs += [dict(step=t, tokens=t * 65536, val_loss=3.2 + offset - t / 100) for t in (5, 10) if t <= last]
        recs += [dict(step=t, tokens=t * 65536, brown_loss=5.0 + offset) for t in (5, 10) if t <= last]
        recs.append(dict(step=last, event="stopped", loss=1.0))          # an event record: not a train point
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        ev = max(t for t in (5, 10) if t <= last)
        d.joinpath("summary.json").write_text(json.dumps(dict(
            status="stopped", step=last, steps=20, tokens=last * 65536, loss=3.0 + offset - last / 100,
            val_loss=3.2 + offset - ev / 100, brown_loss=5.0 + offset, tok_per_s=1e6, peak_mem_mib=2048)))

    run("bf16root", 10, 0.0)
    run("fullbest", 7, 0.06)
    table = study.report(out, ["bf16root", "fullbest"], "124m")
    row = next(ln for ln in table.splitlines() if ln.startswith("| **"))
    train = (3.06 - 0.04) / (3.0 - 0.04) - 1          # mean over log steps 1..7 of each: 3.0x - 4/100
    val = (3.26 - 0.05) / (3.2 - 0.05) - 1             # the step-5 evals
    assert f"**{100 * train:+.2f} % @ 7**" in row and f"**{100 * val:+.2f} % @ 5**" in row
    assert f"**{100 * 0.06 / 5.0:+.2f} % @ 5**" in row
    fb = next(ln for ln in table.splitlines() if ln.startswith("| " + study.LABELS["fullbest"] + " |"))
    assert "| 3.2100 @ 5 | 5.0600 @ 5 |" in fb                       # its last eval was at step 5, not 7
    br = next(ln for ln in table.splitlines() if ln.startswith("| " + study.LABELS["bf16root"] + " |"))
    assert "| 3.1000 | 5.0000 |" in br                                # evaluated at its last step: no mark


def test_report_lowest_eval_table_takes_each_arm_lowest_val_within_the_common_steps(study, tmp_path):
    """A run that overfits (bf16root's val falls to 2.0 at step 4, then rises to 2.4 by step 8) is compared by its
    lowest eval as well as its last: the lowest-eval table has each arm's minimum with its step, and the gap of the
    two minima, taken over the evals up to the earlier stop (step 8 here, so that fullbest's 1.95 at step 10 does not
    count against it) and marked with it."""
    out = tmp_path / "124m"
    vals = {"bf16root": {2: 2.5, 4: 2.0, 6: 2.2, 8: 2.4}, "fullbest": {2: 2.6, 4: 2.1, 6: 2.05, 8: 2.3, 10: 1.95}}
    for arm, v in vals.items():
        d = out / arm
        d.mkdir(parents=True)
        last = max(v)
        recs = [dict(step=t, tokens=t, loss=3.0 - t / 10) for t in range(1, last + 1)]
        recs += [dict(step=t, tokens=t, val_loss=x) for t, x in v.items()]
        recs += [dict(step=t, tokens=t, brown_loss=5.0 + t / 100) for t in v]
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        d.joinpath("summary.json").write_text(json.dumps(dict(
            status="stopped", step=last, steps=10, tokens=last, loss=3.0 - last / 10,
            val_loss=v[last], brown_loss=5.0 + last / 100, tok_per_s=1e6, peak_mem_mib=2048)))
    table = study.report(out, ["bf16root", "fullbest"], "124m")
    low = table.split("lowest eval |", 1)[1].splitlines()
    br = next(ln for ln in low if ln.startswith("| " + study.LABELS["bf16root"] + " |"))
    fb = next(ln for ln in low if ln.startswith("| " + study.LABELS["fullbest"] + " |"))
    assert "| 2.0000 @ 4 | 5.0200 @ 2 |" in br and "| 1.9500 @ 10 | 5.0200 @ 2 |" in fb
    row = next(ln for ln in low if ln.startswith("| **"))
    assert f"**{100 * (2.05 - 2.0) / 2.0:+.2f} % to step 8**" in row and "**+0.00 % to step 8**" in row
    # the main table still compares the last common evals (step 8): 2.3 against 2.4
    main = next(ln for ln in table.splitlines() if ln.startswith("| **"))
    assert f"**{100 * (2.3 - 2.4) / 2.4:+.2f} % @ 8**" in main


def test_report_matched_steps_gives_the_gaps_at_every_common_eval_step(study, tmp_path):
    """--matched-steps: one row per step both runs evaluated (fullbest also evaluated step 3, bf16root did not; only
    bf16root evaluated Brown at step 6), with the train gap over each run's last 100 common log steps up to the step
    (fullbest logged every step, bf16root every other step, so the common ones are the even steps)."""
    out = tmp_path / "124m"
    evals = {"bf16root": {2: 2.5, 4: 2.0, 6: 2.4}, "fullbest": {2: 2.6, 3: 2.3, 4: 2.1, 6: 2.2}}
    brown = {"bf16root": {2: 5.0, 4: 4.0, 6: 6.0}, "fullbest": {2: 5.5, 3: 5.0, 4: 4.2}}
    logs = {"bf16root": range(2, 7, 2), "fullbest": range(1, 7)}
    loss = {"bf16root": lambda t: 3.0 - t / 10, "fullbest": lambda t: 3.5 - t / 10}
    for arm in evals:
        d = out / arm
        d.mkdir(parents=True)
        recs = [dict(step=t, tokens=t, loss=loss[arm](t)) for t in logs[arm]]
        recs += [dict(step=t, tokens=t, val_loss=x) for t, x in evals[arm].items()]
        recs += [dict(step=t, tokens=t, brown_loss=x) for t, x in brown[arm].items()]
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        d.joinpath("summary.json").write_text(json.dumps(dict(
            status="done", step=6, steps=6, tokens=6, loss=loss[arm](6), val_loss=evals[arm][6],
            brown_loss=brown[arm].get(6), tok_per_s=1e6, peak_mem_mib=2048)))
    assert "arm vs reference" not in study.report(out, ["bf16root", "fullbest"], "124m")
    table = study.report(out, ["bf16root", "fullbest"], "124m", every_step=True)
    rows = [ln.split(" | ")[1:] for ln in table.split("arm vs reference", 1)[1].splitlines()[2:]]
    assert [r[0] for r in rows] == ["2", "4", "6"]
    pct = lambda a, b: f"{100 * (a - b) / b:+.2f} %"
    mean = lambda f, ts: sum(map(f, ts)) / len(ts)
    for r, t in zip(rows, (2, 4, 6)):
        ts = [s for s in (2, 4, 6) if s <= t]
        assert r[1:4] == [f"{evals['bf16root'][t]:.4f}", f"{evals['fullbest'][t]:.4f}",
                          pct(evals["fullbest"][t], evals["bf16root"][t])]
        assert r[4] == ("—" if t == 6 else pct(brown["fullbest"][t], brown["bf16root"][t]))
        assert r[5].rstrip(" |") == pct(mean(loss["fullbest"], ts), mean(loss["bf16root"], ts))


def test_report_and_export(study, tmp_path):
    out = tmp_path / "30m"
    rows = {"bf16": 3.00, "quartet2": 3.06, "qroot": 2.94, "bf16root": 2.80}
    for arm, loss in rows.items():
        d = out / arm
        d.mkdir(parents=True)
        summary = dict(status="done", step=10, steps=10, tokens=655360, loss=loss, val_loss=loss + 0.1,
                       brown_loss=loss + 1, tok_per_s=1e6, peak_mem_mib=2048)
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "metrics.jsonl").write_text("".join(json.dumps(dict(step=s, tokens=s * 65536, loss=loss + 1 / s)) + "\n"
                                                 for s in range(1, 11)))
    table = study.report(out, ["bf16", "quartet2", "lora", "qroot", "bf16root"], "30m")
    assert "| BF16 | done (10/10) | 1M | 3.0000 | 3.1000 | 4.0000 | — |" in table
    assert "+2.00 %" in table                                      # (3.06 - 3.00) / 3.00
    assert "| + LoRA-SVD | not run |" in table
    # the Q-Root arm is also compared with the optimizer-matched BF16 arm: (2.94 - 2.80) / 2.80
    assert "| **+ Q-Root (full stack) vs BF16 + Root (BF16 NS) + AdamW** | | | | | | **+5.00 %** |" in table
    # so are the other ROOT-trained NVFP4 arms (here q2root, present only in this call's list)
    d = out / "q2root"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(dict(status="done", step=10, steps=10, tokens=655360, loss=2.87,
                                                    val_loss=2.97, brown_loss=3.87, tok_per_s=1e6,
                                                    peak_mem_mib=2048)))
    table = study.report(out, ["bf16root", "q2root"], "30m")
    assert "| **NVFP4 linear (Quartet II) + Root (BF16 NS) + AdamW vs BF16 + Root (BF16 NS) + AdamW** | | | | | | " \
           "**+2.50 %** |" in table
    study.export(out, ["bf16", "quartet2", "lora"], "30m", tmp_path / "export")
    files = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert files == ["study_30m.md", "study_30m.png", "study_30m_metrics.tar.gz"]
    with tarfile.open(tmp_path / "export" / "study_30m_metrics.tar.gz") as tar:
        assert "30m/quartet2/metrics.jsonl" in tar.getnames()


def test_an_arm_failing_under_cuda_graphs_is_retried_without_them(study, tmp_path, monkeypatch, capsys):
    """The study configs run with CUDA graphs; an arm that fails under them is run once more (resuming its
    last checkpoint, if any) with ``--compile-mode default`` (a warning says so) instead of being lost."""
    calls = []

    class Done:
        def __init__(self, rc):
            self.returncode = rc

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return Done(0 if "default" in cmd else 1)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    assert study.main(["--arms", "bf16", "--tokens", "6553600", "--skip-data", "--out", str(tmp_path),
                       "--time-budget", "1000"]) == 0
    assert len(calls) == 2
    assert "--compile-mode" not in calls[0]
    assert calls[1][-2:] == ["--compile-mode", "default"]
    assert "WARNING bf16 failed under CUDA graphs (exit 1)" in capsys.readouterr().out


def test_a_nearly_done_arm_starts_in_less_than_the_usual_budget(study, tmp_path, monkeypatch, capsys):
    """An arm needs MIN_START_S (120 s) of budget to start, unless its run is nearly done: then its last compile time
    plus its remaining steps at its last rate, plus margins, is enough (session 17: bf16root stopped 27 steps short
    and two 75-85 s calls refused to finish it)."""
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    run = tmp_path / "30m" / "bf16"
    (run / "checkpoint").mkdir(parents=True)

    def summary(step, tok_per_s=940_000.0):
        (run / "summary.json").write_text(json.dumps(
            {"status": "time_budget", "step": step, "steps": 100, "tokens": step * 65536, "tok_per_s": tok_per_s,
             "first_step_s": 17.0, "peak_mem_mib": 1024.0}))

    def main(budget):
        calls.clear()
        assert study.main(["--arms", "bf16", "--tokens", "6553600", "--skip-data", "--out", str(tmp_path),
                           "--time-budget", str(budget)]) == 0
        return len(calls)

    summary(97)  # 3 steps left: 17 + 0.2 + 30 + 40 s
    assert study.start_need(json.loads((run / "summary.json").read_text()), 100) == pytest.approx(87.2, abs=0.1)
    assert main(85) == 0 and "85s left: stopping before bf16" in capsys.readouterr().out
    assert main(95) == 1
    summary(40, tok_per_s=94_000.0)  # 60 steps left at 0.7 s each: the estimate (129 s) is capped at 120 s
    assert main(110) == 0 and "110s left: stopping before bf16 (it needs 120s to start)" in capsys.readouterr().out
    assert study.finish_need(json.loads((run / "summary.json").read_text()), 100) == pytest.approx(128.8, abs=0.1)
    assert main(125) == 1
    assert study.start_need({"step": 40}, 100) == study.MIN_START_S
    # a summary that records its checkpoint save (2 s) keeps 2 x 2 + 5 s for it instead of 30 s
    s = {"step": 97, "tokens": 97 * 65536, "tok_per_s": 940_000.0, "first_step_s": 17.0, "checkpoint_s": 2.0}
    assert study.start_need(s, 100) == pytest.approx(87.2 - 30.0 + 9.0, abs=0.1)


def test_an_arm_stopped_by_its_budget_says_what_budget_would_finish_it(study, tmp_path, monkeypatch, capsys):
    """After an arm stops short, the study prints the budget that would take it to the end in the next call
    (start-up + its compile time + its remaining steps at its rate + checkpoint reserve + POST_S), so chained device
    calls can give it enough (session 22: a budget under the arm's start need skipped it twice)."""
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, budget={"bf16": 40}, first_step_s=17.0))
    assert study.main(["--arms", "bf16", "--tokens", "6553600", "--skip-data", "--out", str(tmp_path),
                       "--time-budget", "300"]) == 0
    out = capsys.readouterr().out
    need = study.STARTUP_S + 17.0 + 60 * 65536 / 1e5 + 30.0 + study.POST_S  # no save time recorded: 30 s reserve
    assert len(calls) == 1
    assert f"bf16 stopped at step 40/100 (time_budget): run the same command again to continue (~{need:.0f}s of " \
           "budget would take it to step 100)" in out


def test_arms_get_the_calls_deadline_not_a_duration(study, tmp_path, monkeypatch):
    """Each arm runs to a Unix-time deadline of the call's start + budget - POST_S (start-up counts against it), not
    to --max-seconds from its loop's start with 40 s guessed for the rest (session 20 lost 45-51 s per arm and call)."""
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    t0 = time.time()
    assert study.main(["--arms", "bf16,quartet2", "--tokens", "6553600", "--skip-data", "--out", str(tmp_path),
                       "--time-budget", "300"]) == 0
    t1 = time.time()
    assert len(calls) == 2
    for cmd in calls:
        assert "--max-seconds" not in cmd
        deadline = float(cmd[cmd.index("--deadline") + 1])
        assert t0 + 300 - study.POST_S - 1 <= deadline <= t1 + 300 - study.POST_S + 1


def _fake_train(calls, fail=(), budget=None, crash_at=None, first_step_s=None):
    """A stand-in for ``fp4compile train`` under bench/study.py: records the command, then does what the loop does
    to a run directory: resumes at the step of its summary, trains to ``--stop-after`` (nothing when already there)
    or ``--steps``, or ``budget[arm]`` more steps per call (a time budget), and writes checkpoint/ and summary.json.
    Exit 1 at once for arms in ``fail``; ``crash_at=(arm, step)``: that arm exits 1 after training up to the step and
    writing its run (a crash at teardown). ``first_step_s``: recorded in the summary (the compile time the study's
    budget estimates read)."""
    class Done:
        def __init__(self, rc):
            self.returncode = rc

    def run(cmd, **kw):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out-dir") + 1])
        if out.name in fail:
            return Done(1)
        steps = int(cmd[cmd.index("--steps") + 1])
        stop = int(cmd[cmd.index("--stop-after") + 1]) if "--stop-after" in cmd else None
        start = json.loads((out / "summary.json").read_text())["step"] if (out / "checkpoint").is_dir() else 0
        target = steps if stop is None or start >= steps else max(start, stop)
        step = min(target, start + (budget or {}).get(out.name, steps))
        status = "done" if step == steps else "stopped" if step == stop else "time_budget"
        (out / "checkpoint").mkdir(parents=True, exist_ok=True)
        late = cmd[cmd.index("--late-bf16-at") + 1] if "--late-bf16-at" in cmd else None
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"run": out.name, "late": late, "from": start, "to": step}) + "\n")
        (out / "summary.json").write_text(json.dumps(
            {"status": status, "step": step, "steps": steps, "tokens": step * 65536, "loss": 3.0,
             "tok_per_s": 1e5 if step > start else None, "peak_mem_mib": 1024.0,
             **({"first_step_s": first_step_s} if first_step_s else {})}))
        return Done(1 if crash_at == (out.name, step) and step > start else 0)
    return run


def test_pair_late_hands_the_base_arms_run_to_the_late_arm_at_the_switch_step(study, tmp_path, monkeypatch, capsys):
    """--pair-late: the base arm (fullbest) trains to the late arm's switch step (round(0.85 * steps)) and stops, its
    run directory is copied to the late arm's (marked as handed over), the base goes on to the end, and the late arm
    resumes the copy with its switch; without the flag every arm starts from step 0. Time-budget stops before and
    after the hand-over continue on the next call; a crash at the switch step is retried without overshooting it. A
    base already past the switch, or one that fails before it, leaves the late arm untrained (it would be unpaired);
    a late arm with a run of its own continues with a warning; the late arm must come second."""
    calls = []

    def study_run(out, arms, *flags, **fake):
        calls.clear()
        monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, **fake))
        assert study.main(["--arms", arms, "--tokens", "6553600", "--skip-data", "--out", str(tmp_path / out),
                           "--time-budget", "1000", *flags]) == 0
        return [(Path(c[c.index("--out-dir") + 1]).name, c[c.index("--stop-after") + 1] if "--stop-after" in c else "")
                for c in calls]

    def log(out, arm):
        return [json.loads(x) for x in (tmp_path / out / "30m" / arm / "metrics.jsonl").read_text().splitlines()]

    assert study_run("a", "bf16root,fullbest,fullbest_late", "--pair-late") == [
        ("bf16root", ""), ("fullbest", "85"), ("fullbest", ""), ("fullbest_late", "")]   # 85 = round(0.85 * 100)
    assert "--late-bf16-at" not in calls[2] and calls[3][-2:] == ["--late-bf16-at", "0.85"]
    # the late arm's directory is the base's run up to step 85, then its own: it never trained steps 1-85 itself
    assert log("a", "fullbest_late") == [{"run": "fullbest", "late": None, "from": 0, "to": 85},
                                         {"run": "fullbest_late", "late": "0.85", "from": 85, "to": 100}]
    assert (tmp_path / "a" / "30m" / "fullbest_late" / study.PAIRED).is_file()
    assert not list((tmp_path / "a" / "30m").glob("*.copying"))
    assert "fullbest_late starts from fullbest's checkpoint at step 85" in capsys.readouterr().out
    assert study_run("a", "bf16root,fullbest,fullbest_late", "--pair-late") == []       # all done: nothing runs
    table = study.report(tmp_path / "a" / "30m", ["fullbest", "fullbest_late"], "30m")
    assert "| done (100/100), fullbest's run to step 85 |" in table and table.count("run to step") == 1

    # several late arms of one base, in switch order: the base stops at 70, then at 85 (handing over to two arms)
    assert study_run("m", "fullbest,fullbest_late,fullbest_late70,fullbest_late_all", "--pair-late") == [
        ("fullbest", "70"), ("fullbest", "85"), ("fullbest", ""), ("fullbest_late", ""), ("fullbest_late70", ""),
        ("fullbest_late_all", "")]
    assert [(r["from"], r["to"], r["late"]) for r in log("m", "fullbest_late70")] == [(0, 70, None), (70, 100, "0.7")]
    assert [(r["from"], r["to"]) for r in log("m", "fullbest_late_all")] == [(0, 70), (70, 85), (85, 100)]
    assert calls[-1][-4:] == ["--late-bf16-at", "0.85", "--late-bf16-roles", "linear.fprop,linear.dgrad,linear.wgrad"]

    # time budgets: 50 steps per call; the pair is handed over at 85 whatever the calls' boundaries
    ran = [study_run("t", "fullbest,fullbest_late", "--pair-late", budget={"fullbest": 50, "fullbest_late": 50})
           for _ in range(3)]
    assert ran == [[("fullbest", "85")], [("fullbest", "85"), ("fullbest", ""), ("fullbest_late", "")],
                   []], ran
    assert [r["to"] for r in log("t", "fullbest")] == [50, 85, 100]
    assert [(r["from"], r["to"]) for r in log("t", "fullbest_late")] == [(0, 50), (50, 85), (85, 100)]
    # a crash right after the switch step's checkpoint: the retry stops at once at step 85, and the pair goes on
    assert study_run("x", "fullbest,fullbest_late", "--pair-late", crash_at=("fullbest", 85)) == [
        ("fullbest", "85"), ("fullbest", "85"), ("fullbest", ""), ("fullbest_late", "")]
    assert [(r["from"], r["to"]) for r in log("x", "fullbest_late")][-1] == (85, 100)

    # a base already past the switch step: the late arm is not trained from step 0 behind the user's back
    capsys.readouterr()
    assert study_run("b", "fullbest") == [("fullbest", "")]
    assert study_run("b", "fullbest,fullbest_late", "--pair-late") == []
    text = capsys.readouterr().out
    assert "past fullbest_late's switch step 85" in text and "fullbest_late skipped" in text
    assert not (tmp_path / "b" / "30m" / "fullbest_late").exists()
    # a base that fails before the switch (and once more without CUDA graphs): the late arm is skipped too
    assert study_run("c", "fullbest,fullbest_late", "--pair-late", fail=("fullbest",)) == [("fullbest", "85")] * 2
    assert "fullbest_late skipped" in capsys.readouterr().out
    # without --pair-late the late arm trains from step 0 on its own; with it afterwards, that run goes on, with a
    # warning; listed before its base, --pair-late refuses
    assert study_run("d", "fullbest,fullbest_late", budget={"fullbest_late": 30}) == [("fullbest", ""),
                                                                                       ("fullbest_late", "")]
    assert study_run("d", "fullbest,fullbest_late", "--pair-late") == [("fullbest_late", "")]
    assert "fullbest_late has a run of its own" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="fullbest must come first"):
        study.main(["--arms", "fullbest_late,fullbest", "--tokens", "6553600", "--pair-late", "--print-commands"])


def _bench_module(name):
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny_run(run, **kw):
    from fp4compile.train.loop import TrainConfig, train

    cfg = TrainConfig(model="cpu", tokenizer="bytes", train_data="stdlib", val_data="stdlib:val", batch_size=4,
                      seq_len=64, steps=4, warmup_steps=1, eval_batches=2, log_interval=1, backend="aot_eager",
                      policy="bf16", out_dir=str(run), progress=False, device="cpu", **kw)
    return train(cfg)


def test_ptq_eval_reproduces_the_runs_val_loss_and_quantizes_the_forward(tmp_path):
    """bench/ptq_eval.py: its BF16 evaluation of a finished run's checkpoint equals the run's own final val
    loss, and the NVFP4-forward policies change the loss (by little: a 4-bit forward, not a broken model)."""
    import torch

    ptq = _bench_module("ptq_eval")
    run = tmp_path / "run"
    result = _tiny_run(run, optimizer="qroot+adamw")

    seen = []
    res, step = ptq.evaluate_run(run, ["bf16", "quartet2", "W"], torch.device("cpu"),
                                 on_result=lambda name, r, s: seen.append((name, r, s)))
    assert seen == [(name, res[name], 4) for name in ("bf16", "quartet2", "W")]     # each row as it finishes
    assert step == 4 and set(res["bf16"]) == {"train-next", "val"}
    assert res["bf16"]["val"] == pytest.approx(result.summary["val_loss"], rel=1e-6)
    for name in ("quartet2", "W"):
        for s in ("train-next", "val"):
            assert res[name][s] != res["bf16"][s]
            assert abs(res[name][s] / res["bf16"][s] - 1) < 0.05
    assert "| quartet2 |" in ptq.table(run, res, step)

    # bench/root_fragility.py on the same run: eager evaluation reproduces the val loss; NVFP4 RTN + 4/6 has
    # the relative error of a 4-bit format on every layer; every whole-model perturbation changes the loss
    frag = _bench_module("root_fragility")
    r = frag.analyse(run, "val", 1, torch.device("cpu"))
    assert r["base_loss"] == pytest.approx(res["bf16"]["val"], rel=1e-4)
    assert len(r["per_layer"]) == 16                     # 4 blocks x (qkv, attn proj, fc, mlp proj)
    for row in r["per_layer"].values():
        assert 0.05 < row["eW"] < 0.15 and 0.05 < row["eX"] < 0.15 and row["srank"] >= 1 and row["res"] == 1
    assert all(v != 0 and abs(v) < 0.05 for v in r["whole"].values())
    assert "| whole model |" in frag.report(r)

    # --policy-out: the two layers of largest dLw + dLx resolve to BF16, every other hidden linear keeps the
    # preset's NVFP4 forward
    from fp4compile.train.loop import load_policy

    path = tmp_path / "sensitive.toml"
    path.write_text(frag.sensitive_policy(r, 2, "quartet2"))
    pol = load_policy(str(path))
    score = {k: row["dLw"] + row["dLx"] for k, row in r["per_layer"].items()}
    top = sorted(score, key=score.get, reverse=True)[:2]
    for k in score:
        assert pol.resolve(k, "linear.fprop").name == ("bf16" if k in top else "nvfp4")
    with pytest.raises(ValueError):
        frag.sensitive_policy(r, 17, "quartet2")
    cli = tmp_path / "cli.toml"                    # the command line writes the same policy
    assert frag.main([str(run), "--draws", "1", "--device", "cpu", "--policy-out", str(cli), "--bf16-layers", "2",
                      "--preset", "quartet2"]) == 0
    assert [r.pattern for r in load_policy(str(cli)).rules if r.user] == top


def test_ptq_eval_post_hoc_svd_split(tmp_path):
    """``NAME@rN``: the finished weights are split into a BF16 top-N SVD branch and an NVFP4 residual. The split
    keeps the function (``bf16@r8``); a rank-8 branch leaves a quantization effect; at full rank (128 = every
    hidden linear's min(in, out)) the residual is ~0, so the NVFP4 forward must cost (almost) nothing."""
    ptq = _bench_module("ptq_eval")
    assert ptq.split_rank("quartet2@r32") == ("quartet2", 32) and ptq.split_rank("W") == ("W", 0)
    assert ptq.split_rank("configs/p@x.toml") == ("configs/p@x.toml", 0)
    assert ptq.split_rank("configs/a@run.toml") == ("configs/a@run.toml", 0)
    assert ptq.split_rank("configs/a.toml@r8") == ("configs/a.toml", 8)
    with pytest.raises(SystemExit):
        ptq.split_rank("quartet2@r0")
    run = tmp_path / "run"
    _tiny_run(run, optimizer="qroot+adamw")
    rows = tmp_path / "ptq.jsonl"                  # through the command line: one JSON line per policy
    assert ptq.main([str(run), "--policies", "bf16,quartet2,bf16@r8,quartet2@r8,quartet2@r128", "--device", "cpu",
                     "--json", str(rows)]) == 0
    res = {d["policy"]: d for d in map(json.loads, rows.read_text().splitlines())}
    assert list(res) == ["bf16", "quartet2", "bf16@r8", "quartet2@r8", "quartet2@r128"]
    base, full = res["bf16"]["val"], abs(res["quartet2"]["val"] - res["bf16"]["val"])
    assert res["bf16@r8"]["val"] == pytest.approx(base, rel=1e-5)
    assert res["quartet2@r8"]["val"] != base
    assert abs(res["quartet2@r128"]["val"] - base) < 0.02 * full


def test_ptq_eval_and_fragility_of_a_lora_svd_run(tmp_path):
    """A LoRA-SVD run is rebuilt with its branch (the BF16 evaluation reproduces its val loss); the fragility
    analysis quantizes only the residual GEMM: the residual holds part of each weight (res < 1), and the
    residual's input perturbation leaves the layers' own forward in place afterwards."""
    import torch

    ptq, frag = _bench_module("ptq_eval"), _bench_module("root_fragility")
    run = tmp_path / "lora"
    result = _tiny_run(run, optimizer="adamw", lora=True, lora_rank=8)
    res, _ = ptq.evaluate_run(run, ["bf16", "quartet2"], torch.device("cpu"))
    assert res["bf16"]["val"] == pytest.approx(result.summary["val_loss"], rel=1e-6)
    assert res["quartet2"]["val"] != res["bf16"]["val"]
    r = frag.analyse(run, "val", 1, torch.device("cpu"))
    assert r["base_loss"] == pytest.approx(res["bf16"]["val"], rel=1e-4)
    assert len(r["per_layer"]) == 16 and all(0 < row["res"] < 1 for row in r["per_layer"].values())
    assert all(0.05 < row["eW"] < 0.15 for row in r["per_layer"].values())
    cfg, make_model, *_ = ptq.load_run(run, torch.device("cpu"))
    model = make_model()
    lora = [m for m in model.modules() if hasattr(m, "lora_a")]
    p = frag.Perturb(lora, "q", torch.Generator().manual_seed(0))
    m, x = lora[0], torch.randn(2, lora[0].in_features)
    with torch.no_grad():
        branch = m.lora_b(m.lora_a(x) * m.beta)
        assert torch.equal(m(x), torch.nn.functional.linear(frag.qdq(x), m.weight) + branch)
        p.remove()
        assert all("forward" not in vars(layer) for layer in lora)
        assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight) + branch)


def _write_metrics(run, losses, evals=()):
    run.mkdir(parents=True)
    recs = [{"step": 0, "event": "start"}]
    recs += [{"step": i + 1, "tokens": 10 * (i + 1), "loss": x} for i, x in enumerate(losses)]
    recs += [{"step": s, "val_loss": v} for s, v in evals]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_seed_gaps_val_png_puts_runs_of_different_schedules_on_tokens(tmp_path):
    """--val-png: each pair's val gap at the evals both runs logged, at the tokens seen there (the eval lines'
    "tokens"), so runs with different steps or batch sizes share one axis; evals only one run logged are left out."""
    sg = _bench_module("seed_gaps")

    def run(name, evals, tokens_per_step):
        d = tmp_path / name
        d.mkdir()
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
            {"step": 0, "event": "start"}, {"step": 1, "tokens": tokens_per_step, "loss": 3.0},
            *({"step": s, "tokens": s * tokens_per_step, "val_loss": v} for s, v in evals)]))
        return d

    b, a = run("b", [(10, 2.0), (20, 1.5), (30, 1.2)], 100), run("a", [(10, 2.02), (20, 1.53)], 100)
    assert sg.eval_gap_points(b, a) == [(1000, pytest.approx(1.0)), (2000, pytest.approx(2.0))]
    b2, a2 = run("b2", [(5, 2.0)], 400), run("a2", [(5, 2.1)], 400)
    assert sg.eval_gap_points(b2, a2) == [(2000, pytest.approx(5.0))]
    sg.main(["--pair", "short", str(b), str(a), "--pair", "long", str(b2), str(a2),
             "--val-png", str(tmp_path / "v.png")])
    assert (tmp_path / "v.png").stat().st_size > 0


def test_seed_gaps_evals_prints_every_eval_and_the_per_eval_difference(tmp_path, capsys):
    """--evals: each pair's val gap at every eval both runs logged, and per --diff (pairs matched by base run) the
    difference at the evals all four runs logged, with the count of evals where A is lower; hand arithmetic."""
    sg = _bench_module("seed_gaps")
    b, x, y = (str(tmp_path / n) for n in "bxy")
    _write_metrics(tmp_path / "b", [3.0], [(10, 2.0), (20, 2.0), (30, 2.0)])
    _write_metrics(tmp_path / "x", [3.0], [(10, 2.02), (20, 2.04), (30, 2.01)])   # +1, +2, +0.5 %
    _write_metrics(tmp_path / "y", [3.0], [(10, 2.04), (20, 2.03)])               # +2, +1.5 %; no eval at 30
    sg.main(["--pair", "x", b, x, "--pair", "y", b, y, "--diff", "x", "y", "--evals"])
    out = capsys.readouterr().out
    assert f"| x | {x} | 10: +1.00, 20: +2.00, 30: +0.50 |" in out
    assert f"| y | {y} | 10: +2.00, 20: +1.50 |" in out
    assert "x − y, val_loss gap at each eval" in out
    assert "10: -1.00, 20: +0.50; x lower at 1 of 2, mean -0.25 points" in out


def test_seed_gaps_compares_the_same_steps_and_pairs_the_seeds(tmp_path, capsys):
    """bench/seed_gaps.py: train gaps over the 10-step window ending at a step both runs reached (an arm stopped
    early is compared at its own last step), eval gaps at common eval steps, mean ± standard error per label
    and the paired difference; values checked against hand arithmetic."""
    sg = _bench_module("seed_gaps")
    base = [2.0] * 30
    _write_metrics(tmp_path / "b0", base, [(20, 4.0)])
    _write_metrics(tmp_path / "a0", [2.0] * 10 + [2.02] * 10 + [9.0] * 5, [(20, 4.04)])   # stops at step 25
    _write_metrics(tmp_path / "b1", base, [(20, 4.0)])
    _write_metrics(tmp_path / "a1", [2.0] * 15 + [2.04] * 15, [(20, 4.0)])
    g = sg.pair_gaps(tmp_path / "b0", tmp_path / "a0", steps=(20, 29))
    assert g["last"] == 25 and set(g["train"]) == {20, 25}                      # 29 > last: dropped
    assert g["train"][20] == pytest.approx(1.0)                                 # steps 11..20 at +1 %
    assert g["train"][25] == pytest.approx(100 * ((5 * 2.02 + 5 * 9.0) / 10 - 2.0) / 2.0)
    assert g["val_loss"] == {20: pytest.approx(1.0)}
    assert sg.mean_se([1.0, 3.0]) == (2.0, pytest.approx(1.0))
    assert sg.mean_se([1.0])[1] is None
    sg.main(["--pair", "q", str(tmp_path / "b1"), str(tmp_path / "a1"), "--pair", "l", str(tmp_path / "b1"),
             str(tmp_path / "a0"), "--steps", "20", "--diff", "q", "l", "--diff", "l", "q",
             "--png", str(tmp_path / "g.png")])
    out = capsys.readouterr().out
    # q's train gap at step 30: +2 %; l's at step 25 (a0's last): +175.5 %; paired difference -173.5
    assert "| q | 1 | +2.00 % |" in out and "paired q − l, train: per seed -173.50" in out
    assert "paired l − q, train: per seed +173.50" in out
    # pairs are matched by base run: q's second seed (base b0) has no l partner, so it is left out and counted;
    # two pairs of one label on one base cannot be matched
    sg.main(["--pair", "q", str(tmp_path / "b0"), str(tmp_path / "a1"), "--pair", "q", str(tmp_path / "b1"),
             str(tmp_path / "a1"), "--pair", "l", str(tmp_path / "b1"), str(tmp_path / "a0"), "--steps", "20",
             "--diff", "q", "l"])
    out = capsys.readouterr().out
    assert "| q | 2 | +2.00 % ± 0.00 |" in out
    assert "paired q − l, train: per seed -173.50; " in out
    assert "(1 pair(s) without a same-base partner left out)" in out
    with pytest.raises(SystemExit, match="same base run"):
        sg.main(["--pair", "q", str(tmp_path / "b1"), str(tmp_path / "a1"), "--pair", "q", str(tmp_path / "b1"),
                 str(tmp_path / "a0"), "--pair", "l", str(tmp_path / "b1"), str(tmp_path / "a0"), "--diff", "q", "l"])
    # --windows: the gap over step ranges and its change from the first range (a1 steps 16..30 at +2 %)
    w = sg.pair_gaps(tmp_path / "b1", tmp_path / "a1", windows=[(1, 10), (16, 25), (40, 50)])["windows"]
    assert w[(1, 10)] == pytest.approx(0.0) and w[(16, 25)] == pytest.approx(2.0) and w[(40, 50)] is None
    sg.main(["--pair", "q", str(tmp_path / "b1"), str(tmp_path / "a1"), "--windows", "1-10,11-20,16-25"])
    out = capsys.readouterr().out
    assert "| q | 0 | +0.00, +1.00, +2.00 | +1.00, +2.00 |" in out
    assert "q: change from 1-10 to 11-20 +1.00 %; 16-25 +2.00 % (1 pairs)" in out
    with pytest.raises(SystemExit, match="--windows"):
        sg.main(["--pair", "q", str(tmp_path / "b1"), str(tmp_path / "a1"), "--windows", "20-10"])
    assert (tmp_path / "g.png").stat().st_size > 0
    # a forked arm logs only from its fork step on: a requested step before it prints "–", not a crash
    fork = tmp_path / "fork"
    fork.mkdir()
    fork.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 20, "event": "start"}, *({"step": s, "loss": 2.02} for s in range(21, 31))]))
    assert sg.pair_gaps(tmp_path / "b1", fork, steps=(5, 30))["train"] == {5: None, 30: pytest.approx(1.0)}
    sg.main(["--pair", "f", str(tmp_path / "b1"), str(fork), "--steps", "5,30"])
    assert "| f | " + str(fork) + " | 30 | –, +1.00 |" in capsys.readouterr().out


def test_attn_qk_error_on_a_runs_own_qkv(tmp_path, capsys):
    """bench/attn_qk_error.py: every layer's Q, K, V captured from a finished run's val batches; each transform's
    O / dQ / dK errors are those of ``qattn_sdpa`` with it (recomputed here for layer 0 of the first batch); the
    K mean share is in [0, 1]."""
    import json

    import torch

    from fp4compile.kernels import attention_ref as R

    mod = _bench_module("attn_qk_error")
    run = tmp_path / "run"
    _tiny_run(run)
    out = tmp_path / "e.json"
    assert mod.main([str(run), "--batches", "1", "--batch-size", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["layers"]) == ["0", "1", "2", "3"]
    from bench.ptq_eval import load_run

    cfg, make_model, sets, _, autocast = load_run(run, torch.device("cpu"))
    calls = mod.capture_qkv(make_model().eval(), sets["val"][0], 1, 2, autocast, torch.device("cpu"))
    assert [c[0] for c in calls] == [0, 1, 2, 3]
    _, q, k, v = calls[0]
    assert q.shape == (2, 2, cfg.seq_len, 64)
    q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
    ref = mod.reference(q, k, v)
    for how in ("none", "smooth_k"):
        assert res["layers"]["0"][how] == pytest.approx(list(mod.errors(q, k, v, ref, how)), rel=1e-9)
        assert all(0.0 < e < 1.0 for e in res["layers"]["0"][how])
    assert 0.0 <= res["layers"]["0"]["k_mean_share"] <= 1.0
    printed = capsys.readouterr().out
    assert "vs none (all layers)" in printed and "Q, K in 1x16 blocks" in printed
    # the op with Q and K in 1x16 blocks (QK_1X16), without and with the default transform
    for how in ("none", "smooth_k+hadamard"):
        want = mod.errors(q, k, v, ref, how, roles=R.PAPER_ROLES | R.QK_1X16)
        assert res["layers"]["0"][f"1x16 {how}"] == pytest.approx(list(want), rel=1e-9)
        assert want != mod.errors(q, k, v, ref, how)
    # the split: the op with a precision mask of QK^T alone, of the dS products alone; the fake quantizations are the
    # format's eager quantize (1x16 blocks, 16x16 tiles, 4/6)
    from fp4compile.formats import nvfp4
    from fp4compile.kernels import attention_ref as R

    assert res["layers"]["0"]["qk_only"] == pytest.approx(list(mod.errors(q, k, v, ref, "none", roles=R.QK)), rel=1e-9)
    assert res["layers"]["0"]["ds_only"] == pytest.approx(
        list(mod.errors(q, k, v, ref, "none", roles=R.DSK | R.DSQ)[1:]), rel=1e-9)
    for name, (block2d, fos) in mod.FAKE_QUANT.items():
        want = nvfp4.quantize(k, block=(16, 16) if block2d else 16, four_over_six=fos).dequantize(torch.float32)
        assert torch.equal(mod.fake_quant(k, block2d, fos), want.double()), name
        assert 0.0 < res["layers"]["0"]["fwd"][name] < 1.0


def test_prepare_data_trains_only_on_the_whole_corpus(study, tmp_path, monkeypatch, capsys):
    """A study's token files must be the whole corpus: kept when they are, made again when not, and never written
    from a partial set of shards unless --partial-corpus (session 48 trained on 9 of 11 shards unnoticed)."""
    import concurrent.futures
    import lzma

    from fp4compile.train import data as D

    monkeypatch.setattr(D, "get_tokenizer", lambda spec: D.ByteTokenizer())          # no GPT-2 file in CI
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", concurrent.futures.ThreadPoolExecutor)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {"train-00": "alpha\n<|endoftext|>\nbeta\n", "train-01": "gamma\n", "val": "vv\n", "brown": "bbb\n"}
    for name, text in texts.items():
        with lzma.open(corpus / f"{name}.txt.xz", "wt", encoding="utf-8") as f:
            f.write(text)
    # the whole corpus, tokenized once under --partial-corpus, defines FULL_CORPUS for this test
    study.prepare_data(tmp_path, None, partial_ok=True)
    full = {n: study._bin_identity(tmp_path / n) for n in ("train.bin", "val.bin", "brown.bin")}
    # three documents of UTF-8 bytes, each followed by one EOT: 6 + 1, 5 + 1, 6 + 1 tokens
    assert full["train.bin"][0] == 20 and full["val.bin"][0] == 4 and full["brown.bin"][0] == 5
    monkeypatch.setattr(study, "FULL_CORPUS", full)
    capsys.readouterr()
    study.prepare_data(tmp_path, None)                          # all whole: nothing is tokenized again
    assert "tokenized" not in capsys.readouterr().out
    (corpus / "train-01.txt.xz").rename(tmp_path / "aside.xz")
    study.prepare_data(tmp_path, None)                          # a whole train.bin is kept, shards or not
    (tmp_path / "train.bin").unlink()
    with pytest.raises(SystemExit, match=r"train.bin from the 1 carried shard\(s\) \(train-00.txt.xz\) is 13 tokens"):
        study.prepare_data(tmp_path, None)
    assert not (tmp_path / "train.bin").exists()
    study.prepare_data(tmp_path, None, partial_ok=True)         # written, with a warning
    assert "WARNING: train.bin from the 1 carried shard(s)" in capsys.readouterr().out
    assert study._bin_identity(tmp_path / "train.bin")[0] == 13
    with pytest.raises(SystemExit):                             # a partial file left from before is not kept ...
        study.prepare_data(tmp_path, None)
    assert not (tmp_path / "train.bin").exists() and not (tmp_path / "train.bin.json").exists()
    study.prepare_data(tmp_path, None, partial_ok=True)
    (tmp_path / "aside.xz").rename(corpus / "train-01.txt.xz")
    study.prepare_data(tmp_path, None)                          # ... but made again once the shards are whole
    assert study._bin_identity(tmp_path / "train.bin") == full["train.bin"]
    assert D.load_bin(tmp_path / "train.bin").tolist()[-7:] == list(b"gamma\n") + [D.ByteTokenizer().eot]
    study.prepare_data(tmp_path, 9)                             # a cap keeps an existing train.bin as it is
    assert study._bin_identity(tmp_path / "train.bin") == full["train.bin"]


def test_compare_runs_finds_same_bits_and_the_first_differing_step(tmp_path, capsys):
    """bench/compare_runs.py: a real run's metrics (with its start and eval records) against themselves are
    identical at every step; a run with another seed differs from step 1 (another initialisation); a hand-made pair
    differing only from step 3 reports step 3 first, its largest difference and the last step's; a resumed run's
    later record of a step wins; runs with no common step exit 2. (Two runs of one seed are not compared here: on
    a multi-threaded CPU they need deterministic mode from the process's start, tests/test_determinism.py.)"""
    from fp4compile.train.loop import read_metrics

    cr = _bench_module("compare_runs")
    for name, seed in (("a", 0), ("c", 1)):
        _tiny_run(tmp_path / name, seed=seed)
    assert cr.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.startswith("identical: the train loss of all 4 common steps (1..4)")
    assert cr.main([str(tmp_path / "a"), str(tmp_path / "c"), "--json", str(tmp_path / "ac.json")]) == 0
    ac = json.loads((tmp_path / "ac.json").read_text())
    assert ac["first_differ"] == 1 and ac["n_differ"] == 4 and ac["common_steps"] == 4

    _write_metrics(tmp_path / "x", [3.0, 2.5, 2.0, 1.5, 1.25])
    _write_metrics(tmp_path / "y", [3.0, 2.5, 2.125, 1.0, 1.5], evals=[(5, 9.0)])
    with open(tmp_path / "y" / "metrics.jsonl", "a") as f:      # a resumed run logs step 2 again: the later wins
        f.write(json.dumps({"step": 2, "tokens": 20, "loss": 2.5}) + "\n")
    r = cr.compare(cr.train_losses(read_metrics(tmp_path / "x")), cr.train_losses(read_metrics(tmp_path / "y")))
    assert (r["first_differ"], r["n_differ"], r["max_abs_diff"], r["max_abs_diff_step"]) == (3, 3, 0.5, 4)
    assert (r["last_step"], r["last_diff"]) == (5, -0.25)
    assert cr.compare({1: float("nan")}, {1: float("nan")})["n_differ"] == 0
    _write_metrics(tmp_path / "z", [])
    assert cr.main([str(tmp_path / "x"), str(tmp_path / "z")]) == 2
