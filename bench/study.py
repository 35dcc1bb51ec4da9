"""Issue 7's quality study: BF16 vs NVFP4 arms on the shared corpus, resumable across 10-minute GPU calls.

Arms (each adds one recipe to the previous; same seed, data order and hyper-parameters):

    bf16       BF16 (backend inductor)                                    AdamW
    quartet2   linear layers NVFP4, Quartet II (policy quartet2)          AdamW
    lora       + LoRA-SVD (fp4compile.prepare)                           AdamW
    lora32, lora64, lora128   the lora arm at rank 32 / 64 / 128 (not in the default list; issue 6's rank forks;
               prepare()'s default is 64 since session 12, 32 before)
    lora64f    the lora64 arm with frozen factors (prepare(train_factors=False): W steps as the dense weight
               would, the BF16 branch is refreshed at each realignment; not in the default list)
    q2w        only the forward GEMMs' weight operand NVFP4 (not in the default list): the share of the
               quartet2 gap that the forward's weight quantization alone causes
    qattn      + Q-Attn (policy full_stack)                              AdamW
    qattn_none, qattn_sk, qattn_had, qattn_skh   qattn with Q, K quantized as they are / K smoothed / Q, K rotated
               by a Hadamard along head_dim / both before Q-Attn quantizes them (FP4COMPILE_QK_TRANSFORM=none /
               smooth_k / hadamard / smooth_k+hadamard; not in the default list). Since session 37 the default
               transform is smooth_k+hadamard, so qattn (and every arm after it) = qattn_skh; sessions up to 36 ran
               qattn_none
    qadamw     + Q-AdamW                                                 QAdamW
    qroot      + Q-Root = the full stack                                 QRoot (matrices) + QAdamW (rest)
    bf16root   BF16 again, with Q-Root's optimizer in BF16: the full       Root, BF16 NS (matrices) + AdamW
               stack's optimizer-matched baseline (ROOT alone moves the loss far more than any precision)
    q2root     NVFP4 linears alone (Quartet II) under bf16root's optimizer (not in the default list)
    full       the full stack under its 124M name (= qroot); fullf: with frozen LoRA-SVD factors
    fullbest   the best full stack of the 30M study (session 14): block 0 in BF16, frozen rank-256 LoRA-SVD
               factors re-split every 100 steps from step 100 (its flags are part of the arm)
    fullbest_late  fullbest with the late switch: the linears' forward GEMMs in BF16 from 85 % of the steps on;
               fullbest_late70: from 70 %; fullbest_late_all: every linear GEMM in BF16 from 85 % (not in the default list)
    fullbest_qk1x16, fullbest_qk16x16  fullbest with Q-Attn's Q, K in 1x16 blocks along head_dim (the default
               since session 61) / in 16x16 tiles (the default until session 60: fullbest and the arms built on it
               ran the tiles in earlier sessions' runs) (FP4COMPILE_QK_BLOCKS; not in the default list);
               fullbest_qk1x16_none: 1x16 without the Q, K transform (FP4COMPILE_QK_TRANSFORM=none);
               fullbest_qk1x16_nsold: 1x16 with the NS of sessions <= 46;
               fullbest_nsold, fullbest_v6: the NS of sessions <= 46, Q-AdamW's v without 4/6

On the GPU machine (the tree that travels is <= 64 MiB, so carry the xz shards and tokenize there, ~10 s):

    mkdir -p .data/corpus && cp /work/shared/data/corpus/*.xz .data/corpus/ \
        && cp /work/shared/data/gpt2.tiktoken .data/          # here, once; .data/ is git-ignored
    # each call, carry [".data/corpus", ".data/gpt2.tiktoken"] (.study lives on the warm machine):
    python bench/study.py --size 30m --arms bf16,quartet2 --tokens 100e6 --time-budget 540 --export $OUT

A call trains the arms in order until its time budget is spent, leaving checkpoints in ``.study/<size>/<arm>``;
the next call with the same command resumes where it stopped (the machine must still be warm: checkpoints of
a 30M model are too large to come back through $OUT). ``--export DIR`` writes the comparison table
(markdown), the loss-curve PNG and a tar.gz of every arm's metrics.jsonl/summary.json/config.json — 3 files.
``--report`` only (re)writes the table and plot from what is on disk (``--matched-steps``: with the gaps at
every eval step as well). ``--print-commands`` shows each arm's
equivalent ``fp4compile train`` command. ``--nproc N`` runs each arm on N GPUs (torchrun, DDP, the config's
global batch split over the ranks; ``bash bench/run_h200.sh study124_x4 ...`` for the 124M study on four GPUs).

``--pair-late``: a late-switch arm (``fullbest_late``) listed after its base arm (``fullbest``) starts from the
base's checkpoint at the switch step instead of from scratch. The base trains to that step (``fp4compile train
--stop-after``), its run directory is copied to the late arm's, then the base goes on to the end and the late arm
resumes the copy with the switch. The two runs are then the same run up to the switch, and their difference is the
switch's alone: two GPU runs of the same recipe differ by 0.1-0.4 point of gap (session 16), as much as the switch
gives. It also saves the late arm's steps before the switch (85 % of them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {
    "bf16": dict(backend="inductor", policy="bf16", optimizer="adamw", lora=False),
    "quartet2": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=False),
    "lora": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=True),
    # LoRA-SVD at given ranks (issue 6's rank question, e.g. in a fork; "lora" takes prepare()'s default)
    "lora32": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=True, lora_rank=32),
    "lora64": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=True, lora_rank=64),
    "lora128": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=True, lora_rank=128),
    # frozen factors: the optimizer steps W exactly as the dense weight, the branch is only re-split at realignments
    "lora64f": dict(backend="fullstack_fp4", policy="quartet2", optimizer="adamw", lora=True, lora_rank=64,
                    lora_train_factors=False),
    # only the forward GEMMs' weight operand in NVFP4: the share of the NVFP4-linear gap that the forward's weight
    # quantization alone causes (session 12: +0.29 % of +0.91 %). LoRA-SVD cuts more than that share: its branch
    # also multiplies the unquantized activations, the activations' NVFP4 error meets only W_res, and dgrad's W
    # operand shrinks the same way
    "q2w": dict(backend="fullstack_fp4", policy=str(ROOT / "configs" / "policy_quartet2_fwd_weight_only.toml"),
                optimizer="adamw", lora=False),
    "qattn": dict(backend="fullstack_fp4", policy="full_stack", optimizer="adamw", lora=True),
    "qadamw": dict(backend="fullstack_fp4", policy="full_stack", optimizer="qadamw", lora=True),
    "qroot": dict(backend="fullstack_fp4", policy="full_stack", optimizer="qroot", lora=True),
    # the optimizer-matched baseline of the qroot arm: BF16 with Root (BF16 Newton–Schulz) + AdamW
    "bf16root": dict(backend="inductor", policy="bf16", optimizer="qroot+adamw", lora=False),
    # NVFP4 linears alone (Quartet II) under bf16root's optimizer: the linear layers' share of the full stack's gap
    "q2root": dict(backend="fullstack_fp4", policy="quartet2", optimizer="qroot+adamw", lora=False),
    # the 124M comparison: BF16 vs the full stack
    "full": dict(backend="fullstack_fp4", policy="full_stack", optimizer="qroot", lora=True),
    # the full stack with frozen LoRA-SVD factors: under ROOT, trained factors change the principal subspace's step
    # size (an orthogonalized step of each factor moves W through the other one); frozen ones leave ROOT's step of
    # W as it is (docs/LORA.md, session 13)
    "fullf": dict(backend="fullstack_fp4", policy="full_stack", optimizer="qroot", lora=True,
                  lora_train_factors=False),
    # the best full stack of the 30M study (session 14: +2.52 % train / +1.93 % val against bf16root): block 0 in
    # BF16, a rank-256 LoRA-SVD branch with frozen factors re-split every 100 steps from step 100. Its flags come
    # after the study's extra flags, so they are the arm's definition, not a default a mode's flags override
    "fullbest": dict(backend="fullstack_fp4", policy=str(ROOT / "configs" / "policy_full_stack_first_block_bf16.toml"),
                     optimizer="qroot", lora=True, lora_rank=256, lora_train_factors=False,
                     flags=["--lora-realign-every", "100", "--lora-realign-after", "100"]),
}


def env_arm(base: str, **env: str) -> dict:
    """``base`` run with these environment variables (the module switches that ``fp4compile train`` has no flag
    for); ``arm_env`` applies them to the arm's process."""
    return dict(ARMS[base], env={**ARMS[base].get("env", {}), **env})


def arm_env(arm: str, env: dict) -> dict:
    """The environment of ``arm``'s ``fp4compile train`` process: ``env`` plus the arm's own variables."""
    return {**env, **ARMS[arm].get("env", {})}


# Q and K prepared for Q-Attn's quantization (passes/attention.py QK_TRANSFORM): K minus its sequence mean, or both
# rotated along head_dim
ARMS["qattn_none"] = env_arm("qattn", FP4COMPILE_QK_TRANSFORM="none")
ARMS["qattn_sk"] = env_arm("qattn", FP4COMPILE_QK_TRANSFORM="smooth_k")
ARMS["qattn_had"] = env_arm("qattn", FP4COMPILE_QK_TRANSFORM="hadamard")
ARMS["qattn_skh"] = env_arm("qattn", FP4COMPILE_QK_TRANSFORM="smooth_k+hadamard")


def late_arm(base: str, at: float, roles: str = "") -> dict:
    """``base`` with the late switch at ``at`` (fp4compile train --late-bf16-at; ``roles``: --late-bf16-roles, default
    the linears' forward GEMMs); ``late_of``/``late_at`` let --pair-late start it from ``base``'s run."""
    flags = ARMS[base].get("flags", []) + ["--late-bf16-at", str(at)] + (["--late-bf16-roles", roles] if roles else [])
    return dict(ARMS[base], flags=flags, late_of=base, late_at=at)


# fullbest with the late switch (NVIDIA's recipe): the linear layers' forward GEMMs in BF16 for the last 15 % of the
# steps; from 70 %; every linear GEMM (fprop, dgrad, wgrad) in BF16 for the last 15 % (how much of the gap the end of
# training can take back at all: NVIDIA's full switch at 82 % matched FP8)
ARMS["fullbest_late"] = late_arm("fullbest", 0.85)
ARMS["fullbest_late70"] = late_arm("fullbest", 0.70)
ARMS["fullbest_late_all"] = late_arm("fullbest", 0.85, "linear.fprop,linear.dgrad,linear.wgrad")
# fullbest with the NVFP4 Newton–Schulz of sessions <= 46 (QRoot's ns_sym_b and ns_shared_x off, the amax passes
# not folded: the defaults until session 47, which made the faster options the default), and fullbest with Q-AdamW's
# v without 4/6 (-9 % of its time): fork A/Bs of those choices (run mode s47_fork)
ARMS["fullbest_nsold"] = dict(env_arm("fullbest", FP4COMPILE_NS_AMAX="0"),
                              flags=ARMS["fullbest"]["flags"] + ["--no-ns-sym-b", "--no-ns-shared-x"])
ARMS["fullbest_v6"] = dict(ARMS["fullbest"], flags=ARMS["fullbest"]["flags"] + ["--no-qadamw-v-four-over-six"])
# fullbest with Q-Attn's Q and K in 1x16 blocks along head_dim (passes/attention.py QK_BLOCKS "1x16": the dS products
# on the copy re-quantized in tiles) and with the 16x16 tiles (the default, so the same run as fullbest): the fork A/B
# of run mode s49_qk (session 49's calls ran fullbest against fullbest_qk1x16 before the re-quantization existed)
ARMS["fullbest_qk1x16"] = env_arm("fullbest", FP4COMPILE_QK_BLOCKS="1x16")
ARMS["fullbest_qk16x16"] = env_arm("fullbest", FP4COMPILE_QK_BLOCKS="16x16")
# 1x16 without the Q, K transform (passes/attention.py QK_TRANSFORM "none"): does the finer scale take over what the
# transform buys (sessions 37-40: -0.31 point of val gap on the tiles, 2.0-2.4 % of tokens/s)? Run mode s51_fork
ARMS["fullbest_qk1x16_none"] = env_arm("fullbest", FP4COMPILE_QK_BLOCKS="1x16", FP4COMPILE_QK_TRANSFORM="none")
# 1x16 with the NS of sessions <= 46: the two options that each came out 0.12-0.16 point lower in val gap than the
# tiles with today's NS in session 59's comparisons (1x16 -0.16 ± 0.08 paired over seeds 0, 1; the former NS -0.12 at
# seed 0; both within the 0.1-0.2 point spread between reruns across sessions), together
ARMS["fullbest_qk1x16_nsold"] = dict(env_arm("fullbest_qk1x16", FP4COMPILE_NS_AMAX="0"),
                                     flags=ARMS["fullbest_nsold"]["flags"])
# a fork source for the QRoot arms (a fork needs the source's optimizer, Root + Q-AdamW): BF16 with QRoot's BF16
# Newton–Schulz and Q-AdamW for the rest
ARMS["bf16qroot"] = dict(backend="inductor", policy="bf16", optimizer="qroot", lora=False)
#: written into a late arm's run directory when --pair-late hands it its base arm's run
PAIRED = "paired_from.json"
LABELS = {"bf16": "BF16", "quartet2": "NVFP4 linear (Quartet II)", "lora": "+ LoRA-SVD",
          "lora32": "+ LoRA-SVD rank 32", "lora64": "+ LoRA-SVD rank 64", "lora128": "+ LoRA-SVD rank 128",
          "lora64f": "+ LoRA-SVD rank 64, frozen factors",
          "q2w": "NVFP4 fprop weights only",
          "fullbest_nsold": "full stack, NVFP4 NS of sessions <= 46", "fullbest_v6": "full stack, v without 4/6",
          "fullbest_qk1x16": "full stack, Q, K in 1x16 blocks",
          "fullbest_qk1x16_none": "full stack, Q, K in 1x16 blocks, no transform",
          "fullbest_qk1x16_nsold": "full stack, Q, K in 1x16 blocks, NVFP4 NS of sessions <= 46",
          "fullbest_qk16x16": "full stack, Q, K in 16x16 tiles",
          "bf16qroot": "BF16 + Root (BF16 NS) + Q-AdamW",
          "qattn": "+ Q-Attn", "qattn_none": "+ Q-Attn, Q, K as they are", "qattn_sk": "+ Q-Attn, K smoothed",
          "qattn_had": "+ Q-Attn, Q, K rotated (H64)",
          "qattn_skh": "+ Q-Attn, K smoothed, Q, K rotated",
          "qadamw": "+ Q-AdamW", "qroot": "+ Q-Root (full stack)",
          "bf16root": "BF16 + Root (BF16 NS) + AdamW", "full": "full stack",
          "fullf": "full stack, frozen LoRA-SVD factors",
          "fullbest": "full stack, block 0 BF16, frozen LoRA-SVD r256",
          "q2root": "NVFP4 linear (Quartet II) + Root (BF16 NS) + AdamW",
          "fullbest_late": "fullbest, fprop BF16 for the last 15 % of steps",
          "fullbest_late70": "fullbest, fprop BF16 for the last 30 % of steps",
          "fullbest_late_all": "fullbest, linears all BF16 for the last 15 % of steps"}


def _tokenize_shard(path: str):
    from fp4compile.train import data as D

    return D.tokenize_files([Path(path)], D.get_tokenizer("gpt2"))


# the token files of the whole shared corpus (shared/data/corpus: train-00..10, val, brown) with the GPT-2 BPE:
# every study is comparable with the others only on these exact tokens (n_tokens, sha256 of the uint16 array)
FULL_CORPUS = {
    "train.bin": (61_008_013, "3caa96a0fda213c02b069f3cff2210af39a62d2e202f0fc35e323b9ef701279b"),
    "val.bin": (240_070, "969433f2f6d1b80bf6571c3af3e24e29246f60717c7af7155f09fe7ed4b97185"),
    "brown.bin": (1_300_156, "6dcbf44672ac77e4e9914c2079ec89cd315e680c42243bfbeb20ab20d111cd51"),
}


def _bin_identity(path: Path):
    """(n_tokens, sha256) from a token file's ``.json`` sidecar (``fp4compile.train.data.write_bin``), or None."""
    from fp4compile.train.data import _bin_meta_path

    meta = _bin_meta_path(path)
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    return m.get("n_tokens"), m.get("sha256")


def _remove_bin(path: Path) -> None:
    """Delete a token file and its sidecar (either may be missing)."""
    from fp4compile.train.data import _bin_meta_path

    for f in (path, _bin_meta_path(path)):
        f.unlink(missing_ok=True)


def prepare_data(data_dir: Path, max_tokens: int | None, partial_ok: bool = False) -> None:
    """Tokenize carried ``.xz`` shards into ``train.bin``/``val.bin``/``brown.bin``.

    The train shards are tokenized in parallel, one process per shard, and concatenated in shard order (the
    same tokens as tokenizing them in one pass: every document ends with its own EOT). Without a cap, every file
    must hold the whole corpus's tokens (``FULL_CORPUS``): a file that does is kept, one that does not is made
    again from the carried shards, and if those are not the whole corpus either (a shard left behind to fit
    the 64 MiB a device call carries) the file is deleted again and the call stops (``SystemExit``) -- a study on
    fewer unique tokens repeats them more often and is not comparable with the others -- unless ``partial_ok``
    (``--partial-corpus``), which keeps it and warns. With ``max_tokens`` an existing ``train.bin``
    is kept as it is."""
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

    from fp4compile.train import data as D

    corpus = data_dir / "corpus"
    if (data_dir / "gpt2.tiktoken").is_file():
        os.environ.setdefault("FP4COMPILE_GPT2", str((data_dir / "gpt2.tiktoken").resolve()))
    jobs = [("train.bin", sorted(corpus.glob("train-*.txt.xz")), max_tokens),
            ("val.bin", [corpus / "val.txt.xz"], None), ("brown.bin", [corpus / "brown.txt.xz"], None)]
    tok = None
    for name, files, cap in jobs:
        out = data_dir / name
        if out.is_file() and (cap is not None or _bin_identity(out) == FULL_CORPUS[name]):
            continue
        _remove_bin(out)                              # a stale file is never left for a --skip-data run to train on
        files = [f for f in files if f.is_file()]
        if not files:
            raise SystemExit(f"{out} is missing (or not the whole corpus) and there are no shards in {corpus} "
                             "to tokenize")
        t0 = time.time()
        if tok is None:
            tok = D.get_tokenizer("gpt2")
        if len(files) > 1:
            with ProcessPoolExecutor(min(len(files), os.cpu_count() or 1)) as pool:
                arr = np.concatenate(list(pool.map(_tokenize_shard, [str(f) for f in files])))
            arr = arr[:cap] if cap is not None else arr
        else:
            arr = D.tokenize_files(files, tok, cap)
        meta = D.write_bin(arr, out, tok, [str(f) for f in files])    # its sidecar holds the identity checked here
        got = (meta["n_tokens"], meta["sha256"])
        if cap is None and got != FULL_CORPUS[name]:
            msg = (f"{name} from the {len(files)} carried shard(s) ({', '.join(f.name for f in files)}) is "
                   f"{got[0]:,} tokens (sha256 {got[1][:12]}), not the whole corpus's {FULL_CORPUS[name][0]:,} "
                   f"(sha256 {FULL_CORPUS[name][1][:12]})")
            if not partial_ok:
                _remove_bin(out)
                raise SystemExit(f"[study] {msg}: carry the whole corpus, or pass --partial-corpus")
            print(f"[study] WARNING: {msg}; --partial-corpus: the runs are not comparable with full-corpus ones",
                  flush=True)
        print(f"[study] tokenized {name}: {meta['n_tokens']:,} tokens in {time.time() - t0:.0f}s", flush=True)


def arm_command(size: str, arm: str, out: Path, steps: int, extra: list, warmup: int | None = None,
                nproc: int = 1, batch_size: int | None = None, master_port: int = 29500,
                deadline: float | None = None) -> list:
    """The arm's ``fp4compile train`` command. ``nproc > 1``: launched by torchrun with ``--parallel ddp`` and
    ``batch_size // nproc`` sequences per rank, so the global batch (and with it the schedule, the data order
    and the tokens per step) stays the config's ``batch_size``. ``deadline`` (a Unix time): the run's time budget
    (``--deadline``: it stops and checkpoints in time for it, start-up included). The run also stops and checkpoints
    once a file ``STOP`` appears in its directory (``--stop-file``: a detached arm stopped early from outside)."""
    a = ARMS[arm]
    if nproc > 1:
        if batch_size is None or batch_size % nproc:
            raise SystemExit(f"--nproc {nproc} must divide the config's batch size {batch_size}")
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                  "--master-addr=127.0.0.1", f"--master-port={master_port}"]
        ddp = ["--parallel", "ddp", "--batch-size", str(batch_size // nproc)]
    else:
        launch, ddp = [sys.executable], []
    cmd = launch + ["-m", "fp4compile", "train", "--config", str(ROOT / "configs" / f"study_{size}.toml"),
                    "--out-dir", str(out / arm), "--backend", a["backend"], "--policy", a["policy"],
                    "--optimizer", a["optimizer"], "--lora" if a["lora"] else "--no-lora", "--steps", str(steps),
                    "--resume", "--no-progress", "--stop-file", str(out / arm / "STOP")] + ddp
    if warmup is not None:
        cmd += ["--warmup-steps", str(warmup)]
    if deadline is not None:
        cmd += ["--deadline", f"{deadline:.0f}"]
    if "lora_rank" in a:
        cmd += ["--lora-rank", str(a["lora_rank"])]
    if a.get("lora_train_factors") is False:
        cmd += ["--no-lora-train-factors"]
    return cmd + extra + a.get("flags", [])


def hand_over(src: Path, dst: Path, step: int) -> None:
    """--pair-late: make ``dst`` a copy of the run directory ``src`` (stopped at ``step``) marked with ``PAIRED``. The
    copy is written beside ``dst`` and renamed into place, so an interrupted copy leaves no half checkpoint; a
    ``dst`` without a checkpoint (nothing to resume) is replaced."""
    tmp = dst.with_name(dst.name + ".copying")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / PAIRED).write_text(json.dumps({"run": str(src), "step": step}) + "\n")
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)


#: seconds an arm needs to be started at all (compile + a useful stretch of training), unless it is nearly done
MIN_START_S = 120
#: seconds the driver keeps after an arm's deadline (its own bookkeeping: a --pair-late hand-over, the export)
POST_S = 15
#: seconds an arm takes to reach its training loop (imports, data, model, checkpoint load), for start_need
STARTUP_S = 25


def finish_need(summary: dict | None, target: int) -> float | None:
    """Seconds of time budget that should take a resumed arm to ``target`` in one call: its start-up
    (:data:`STARTUP_S`) + its last call's time to the first step (compile) + its remaining steps at its last rate +
    the loop's checkpoint reserve (``checkpoint_reserve`` of the save time its summary records, 30 s without one) +
    :data:`POST_S`. None for a run without those numbers."""
    from fp4compile.train.loop import checkpoint_reserve

    s = summary or {}
    step, tps, first, tokens = (s.get(k) for k in ("step", "tok_per_s", "first_step_s", "tokens"))
    if not (step and tps and first and tokens):
        return None
    return (STARTUP_S + first + max(target - step, 0) * (tokens / step) / tps
            + checkpoint_reserve(s.get("checkpoint_s")) + POST_S)


def start_need(summary: dict | None, target: int) -> float:
    """Seconds of time budget that make an arm worth starting: :data:`MIN_START_S`, or less for a resumed run close
    to ``target`` (:func:`finish_need`, when that is smaller)."""
    need = finish_need(summary, target)
    return MIN_START_S if need is None else min(MIN_START_S, need)


def summaries(out: Path, arms):
    res = {}
    for arm in arms:
        p = out / arm / "summary.json"
        if p.is_file():
            res[arm] = json.loads(p.read_text())
    return res


def curves(run_dir: Path) -> dict:
    """A run's logged points from its ``metrics.jsonl``: ``{"loss": {step: train loss}, "val_loss": {step: v},
    "brown_loss": {step: v}}`` (a resumed run's later record of a step wins); empty dicts without the file."""
    from fp4compile.train.loop import eval_losses, read_metrics, train_losses

    recs = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return {"loss": train_losses(recs), **eval_losses(recs)}


def at_common_step(a: dict, b: dict, key: str, upto: int, last: int = 10) -> tuple | None:
    """``(step, value of a, value of b)`` at the latest point both :func:`curves` ``a`` and ``b`` logged for ``key``
    at or before step ``upto``: an eval's step for val/Brown; for the train loss the last common log step, with each
    run's mean over the last ``last`` common log steps (10: the summaries' smoothing). None without a common point."""
    common = sorted(set(a[key]) & set(b[key]))
    common = [t for t in common if t <= upto][-last:] if key == "loss" else [t for t in common if t <= upto][-1:]
    if not common:
        return None
    return common[-1], sum(a[key][t] for t in common) / len(common), sum(b[key][t] for t in common) / len(common)


def root_arms(s: dict, arms) -> list:
    """The arms of ``arms`` with a summary in ``s`` that are also compared with BF16 ROOT (when it ran): every
    ROOT-trained arm (optimizer qroot*). ROOT alone moves the loss more than any precision choice, so their gap to the
    AdamW BF16 arm says little about NVFP4."""
    if "bf16root" not in s:
        return []
    return [a for a in arms if a in s and a != "bf16root" and ARMS[a]["optimizer"].startswith("qroot")]


def pct(x: float, ref: float) -> str:
    """The relative gap of ``x`` to ``ref`` as the report prints it: ``+1.23 %``."""
    return f"{100 * (x - ref) / ref:+.2f} %"


def lowest(curve: dict, upto: int) -> tuple | None:
    """``(step, value)`` of the lowest point of a :func:`curves` entry at or before step ``upto``; None without one."""
    pts = [(v, t) for t, v in curve.items() if t <= upto]
    return None if not pts else min(pts)[::-1]


def lowest_table(s: dict, pts: dict, arms, size: str) -> list:
    """Markdown lines: each arm's lowest val and Brown loss over its evals (with the eval's step) and the relative gap
    of those lowest values to BF16's, and of ROOT-trained arms to BF16 ROOT's. A run that repeats its corpus can
    overfit, so its last eval need not be its best; for arms stopped at different steps both lowest values are taken
    over the evals up to the earlier stop, marked "to step"."""
    def cell(arm, key):
        m = lowest(pts[arm].get(key, {}), s[arm]["step"])
        return "—" if m is None else f"{m[1]:.4f} @ {m[0]}"

    def gap(arm, key, ref_arm):
        if ref_arm not in s or arm == ref_arm:
            return "—"
        upto = min(s[arm]["step"], s[ref_arm]["step"])
        a, b = lowest(pts[arm].get(key, {}), upto), lowest(pts[ref_arm].get(key, {}), upto)
        if a is None or b is None:
            return "—"
        return pct(a[1], b[1]) + ("" if s[arm]["step"] == s[ref_arm]["step"] else f" to step {upto}")

    lines = [f"| arm ({size}): lowest eval | lowest val loss | lowest Brown loss | gap val | gap Brown |", "|" + "---|" * 5]
    for arm in arms:
        if arm in s:
            lines.append(f"| {LABELS[arm]} | {cell(arm, 'val_loss')} | {cell(arm, 'brown_loss')} | "
                         f"{gap(arm, 'val_loss', 'bf16')} | {gap(arm, 'brown_loss', 'bf16')} |")
    for arm in root_arms(s, arms):
        lines.append(f"| **{LABELS[arm]} vs {LABELS['bf16root']}** | | | **{gap(arm, 'val_loss', 'bf16root')}** | "
                     f"**{gap(arm, 'brown_loss', 'bf16root')}** |")
    return lines


def compared_pairs(s: dict, arms) -> list:
    """``(arm, reference arm)`` pairs the report gives gaps for: each arm against BF16 (when it ran), and each
    ROOT-trained arm (:func:`root_arms`) against BF16 ROOT as well."""
    pairs = [(a, "bf16") for a in arms if a in s and a != "bf16" and "bf16" in s]
    return pairs + [(a, "bf16root") for a in root_arms(s, arms)]


def matched_table(s: dict, pts: dict, arms, size: str) -> list:
    """Markdown lines (``--report --matched-steps``): for each :func:`compared_pairs` pair, the gaps at every step
    both runs evaluated: val, Brown, and the train loss as each run's mean over the last 100 common log steps up to
    that step. The end-of-run gap is one point of this curve; on a corpus the schedule repeats, the curve shows where
    repetition (one arm memorizing faster) starts to move it."""
    def gap(a, b, key, t):
        m = at_common_step(a, b, key, t, last=100)   # `last` counts for the train loss only
        if m is None or (key != "loss" and m[0] != t):  # an eval gap needs both evals at step t itself
            return "—"
        return pct(m[1], m[2])

    lines = [f"| {size}: arm vs reference | step | reference val | arm val | gap val | gap Brown | gap train |",
             "|" + "---|" * 7]
    for arm, ref in compared_pairs(s, arms):
        a, b = pts[arm], pts[ref]
        for t in sorted(set(a["val_loss"]) & set(b["val_loss"])):
            lines.append(f"| {LABELS[arm]} vs {LABELS[ref]} | {t} | {b['val_loss'][t]:.4f} | {a['val_loss'][t]:.4f} | "
                         f"{gap(a, b, 'val_loss', t)} | {gap(a, b, 'brown_loss', t)} | {gap(a, b, 'loss', t)} |")
    return lines


def report(out: Path, arms, size: str, every_step: bool = False) -> str:
    """Markdown table: final train loss, val loss, Brown loss, relative gaps to BF16, tokens/s, memory. Arms that
    stopped at different steps (a study not yet finished) are compared at the latest step both logged (from their
    ``metrics.jsonl``, marked "@ step"), and a val/Brown loss from an eval before the run's last step says so: a
    summary's val/Brown loss is its last eval's. Below it, :func:`lowest_table`: each arm's lowest eval losses, and
    with ``every_step`` :func:`matched_table`: the gaps at every eval step."""
    s = summaries(out, arms)
    pts = {arm: curves(out / arm) for arm in s}

    def gap(arm, key, ref_arm="bf16"):
        ref = s.get(ref_arm)
        if ref is None or arm == ref_arm or s[arm].get(key) is None or ref.get(key) is None:
            return "—"
        if s[arm]["step"] == ref["step"]:
            return pct(s[arm][key], ref[key])
        m = at_common_step(pts[arm], pts[ref_arm], key, min(s[arm]["step"], ref["step"]))
        return "—" if m is None else f"{pct(m[1], m[2])} @ {m[0]}"

    lines = [f"| arm ({size}) | status | tokens | train loss | val loss | Brown loss | gap train | gap val | "
             "gap Brown | tokens/s | peak GiB | compile mode |", "|" + "---|" * 12]
    for arm in arms:
        if arm not in s:
            lines.append(f"| {LABELS[arm]} | not run | | | | | | | | | | |")
            continue
        r = s[arm]
        def f(k):
            if r.get(k) is None:
                return "—"
            at = max(pts[arm].get(k) or [r["step"]])   # the step of the last eval (summaries keep its value)
            return f"{r[k]:.4f}" + ("" if k == "loss" or at == r["step"] else f" @ {at}")
        paired = out / arm / PAIRED                   # --pair-late: the base's run up to the switch step
        status = f"{r['status']} ({r['step']}/{r['steps']})" + (
            f", {ARMS[arm]['late_of']}'s run to step {json.loads(paired.read_text())['step']}" if paired.is_file() else "")
        lines.append(f"| {LABELS[arm]} | {status} | {r['tokens'] / 1e6:.0f}M | "
                     f"{f('loss')} | {f('val_loss')} | {f('brown_loss')} | {gap(arm, 'loss')} | "
                     f"{gap(arm, 'val_loss')} | {gap(arm, 'brown_loss')} | "
                     f"{'—' if r.get('tok_per_s') is None else format(r['tok_per_s'], ',.0f')} | "
                     f"{r['peak_mem_mib'] / 1024:.1f} | {r.get('compile_mode', 'default')} |")
    for arm in root_arms(s, arms):                    # ROOT-trained arms against BF16 with the same optimizer
        lines.append(f"| **{LABELS[arm]} vs {LABELS['bf16root']}** | | | | | | "
                     f"**{gap(arm, 'loss', 'bf16root')}** | **{gap(arm, 'val_loss', 'bf16root')}** | "
                     f"**{gap(arm, 'brown_loss', 'bf16root')}** | | | |")
    if any(pts[arm].get("val_loss") for arm in s):
        lines += [""] + lowest_table(s, pts, arms, size)
    if every_step:
        lines += [""] + matched_table(s, pts, arms, size)
    return "\n".join(lines)


def export(out: Path, arms, size: str, dest: Path, every_step: bool = False) -> None:
    from fp4compile.train.cli import plot_runs

    dest.mkdir(parents=True, exist_ok=True)
    table = report(out, arms, size, every_step)
    (dest / f"study_{size}.md").write_text(table + "\n")
    have = [a for a in arms if (out / a / "metrics.jsonl").is_file()]
    if have:
        plot_runs([out / a for a in have], dest / f"study_{size}.png", labels=[LABELS[a] for a in have],
                  title=f"fp4compile study, {size}: train loss and relative gap to {LABELS[have[0]]}")
    with tarfile.open(dest / f"study_{size}_metrics.tar.gz", "w:gz") as tar:
        for a in have:
            for fn in ("metrics.jsonl", "summary.json", "config.json", PAIRED):
                if (out / a / fn).is_file():
                    tar.add(out / a / fn, arcname=f"{size}/{a}/{fn}")
    print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="30m", choices=["30m", "124m"])
    ap.add_argument("--arms", default=None, help="comma list (default: all seven for 30m, bf16,bf16root,full for 124m)")
    ap.add_argument("--tokens", type=float, default=None, help="training tokens per arm (default: the config's)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (overrides --tokens)")
    ap.add_argument("--out", default=".study", help="run directories go to OUT/SIZE/ARM")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--max-train-tokens", type=int, default=None, help="cap when tokenizing the train shards")
    ap.add_argument("--partial-corpus", action="store_true",
                    help="tokenize whatever shards were carried even if they are not the whole corpus (warns)")
    ap.add_argument("--time-budget", type=float, default=540, help="seconds for this call (all arms)")
    ap.add_argument("--export", default=None, help="write table, plot and metrics tarball here (e.g. $OUT)")
    ap.add_argument("--report", action="store_true", help="only write the table/plot from what exists")
    ap.add_argument("--matched-steps", action="store_true",
                    help="the report also gives each compared pair's gaps at every step both evaluated")
    ap.add_argument("--print-commands", action="store_true")
    ap.add_argument("--data-only", action="store_true", help="only tokenize the carried shards into DATA_DIR")
    ap.add_argument("--skip-data", action="store_true", help="do not tokenize .data/ (data given in extra flags)")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs per arm: torchrun + DDP, same global batch")
    ap.add_argument("--master-port", type=int, default=29500, help="torchrun's port (one per concurrent study)")
    ap.add_argument("--pair-late", action="store_true",
                    help="a late-switch arm listed after its base arm starts from the base's checkpoint at the switch")
    ap.add_argument("extra", nargs="*", help="extra flags for `fp4compile train` after --")
    args = ap.parse_args(argv)

    from fp4compile.train.cli import load_config_file
    from fp4compile.train.loop import TrainConfig

    arms = args.arms.split(",") if args.arms else (
        ["bf16", "quartet2", "lora", "qattn", "qadamw", "qroot", "bf16root"] if args.size == "30m"
        else ["bf16", "bf16root", "full"])
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arms {bad}; arms are {list(ARMS)}")
    base = TrainConfig.from_dict(load_config_file(ROOT / "configs" / f"study_{args.size}.toml"))
    tokens_per_step = base.batch_size * base.seq_len * base.grad_accum
    steps = args.steps or (int(args.tokens // tokens_per_step) if args.tokens else base.steps)
    # --pair-late: base arm -> [(switch step, late arm), ...] in switch order (the step as fp4compile train computes it)
    pairs = {}
    for arm in arms if args.pair_late else []:
        of = ARMS[arm].get("late_of")
        if of is None or of not in arms:
            continue
        if arms.index(of) > arms.index(arm):
            raise SystemExit(f"--pair-late: {arm} starts from {of}'s checkpoint, so {of} must come first in --arms")
        if args.nproc > 1:
            raise SystemExit("--pair-late: the late switch runs in one process; leave --nproc at 1")
        at = dataclasses.replace(base, steps=steps, backend="fullstack_fp4", parallel="none",
                                 late_bf16_at=ARMS[arm]["late_at"]).late_switch_step()
        pairs[of] = sorted(pairs.get(of, []) + [(at, arm)])
    warmup = min(base.warmup_steps, max(1, steps // 20))      # short runs: warm up over 5 % of the steps
    out = Path(args.out) / args.size
    ddp = dict(nproc=args.nproc, batch_size=base.batch_size, master_port=args.master_port)

    if args.data_only:
        prepare_data(Path(args.data_dir), args.max_train_tokens, args.partial_corpus)
        return 0
    if args.print_commands:
        for arm in arms:
            prefix = [f"{k}={v}" for k, v in ARMS[arm].get("env", {}).items()]
            print(" ".join(prefix + arm_command(args.size, arm, out, steps, args.extra, warmup, **ddp)))
        return 0
    if not args.report:
        t_start = time.time()
        if not args.skip_data:
            prepare_data(Path(args.data_dir), args.max_train_tokens, args.partial_corpus)
        # an arm whose NVFP4 graph fails to compile stops instead of training in BF16 under its name
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1", FP4COMPILE_ON_ERROR="raise")
        if (Path(args.data_dir) / "gpt2.tiktoken").is_file():
            env.setdefault("FP4COMPILE_GPT2", str(Path(args.data_dir) / "gpt2.tiktoken"))
        cuda_graphs = base.compile_mode == "reduce-overhead" and "--compile-mode" not in args.extra

        def run_arm(arm, flags):
            """One ``fp4compile train`` of ``arm`` (with ``flags`` after the study's extra flags) in what is left of
            the time budget, once more without CUDA graphs if it fails under them (from the arm's last checkpoint,
            if any: the compile mode is not part of a checkpoint, so resuming in another mode continues the same
            run). Its exit code, or None when too little time is left to start it."""
            left = args.time_budget - (time.time() - t_start)
            target = int(flags[flags.index("--stop-after") + 1]) if "--stop-after" in flags else steps
            need = start_need(summaries(out, [arm]).get(arm), target)
            if left < need:
                print(f"[study] {left:.0f}s left: stopping before {arm} (it needs {need:.0f}s to start); run the "
                      "same command again to continue")
                return None
            # the arm stops by a deadline (not a duration): its own start-up counts, the driver keeps POST_S
            deadline = t_start + args.time_budget - POST_S
            cmd = arm_command(args.size, arm, out, steps, args.extra + flags, warmup, deadline=deadline, **ddp)
            print(f"[study] {arm}: {' '.join(cmd)}", flush=True)
            rc = subprocess.run(cmd, env=arm_env(arm, env), cwd=ROOT).returncode
            if rc != 0 and cuda_graphs:
                left = args.time_budget - (time.time() - t_start)
                print(f"[study] WARNING {arm} failed under CUDA graphs (exit {rc}): retrying with "
                      f"--compile-mode default ({left:.0f}s left)", flush=True)
                cmd = arm_command(args.size, arm, out, steps, args.extra + flags + ["--compile-mode", "default"],
                                  warmup, deadline=deadline, **ddp)
                rc = subprocess.run(cmd, env=arm_env(arm, env), cwd=ROOT).returncode
            return rc

        def finished(arm, rc, target):
            """Report how the run ended; True when it reached ``target`` (the next arm, or phase, may start)."""
            s = summaries(out, [arm]).get(arm, {})
            if rc != 0:
                print(f"[study] {arm} failed with exit code {rc}; continuing with the next arm", flush=True)
            elif s.get("step") != target:
                need = finish_need(s, target)
                more = f" (~{need:.0f}s of budget would take it to step {target})" if need else ""
                print(f"[study] {arm} stopped at step {s.get('step')}/{steps} ({s.get('status')}): "
                      f"run the same command again to continue{more}", flush=True)
            return rc == 0 and s.get("step") == target

        unpaired = set()        # late arms whose base cannot hand them its run: not trained (they would be unpaired)

        def pair_up(arm):
            """--pair-late for the base ``arm``: for each of its late arms without a run yet, in switch order, train
            the base to the switch step and hand its run over. "go" (the base may train on), "next" (the base
            failed: on to the next arm) or "stop" (out of time, or stopped early: the next call continues)."""
            for at, late in pairs.get(arm, []):
                if (out / late / "checkpoint").is_dir():
                    if not (out / late / PAIRED).is_file():
                        print(f"[study] WARNING --pair-late: {late} has a run of its own (not started from {arm}'s); "
                              f"it continues unpaired (remove {out / late} to pair it)", flush=True)
                    continue
                now = (summaries(out, [arm]).get(arm) or {}).get("step", 0)
                if now > at:
                    print(f"[study] WARNING --pair-late: {arm} is at step {now}, past {late}'s switch step {at}, so "
                          f"{late} cannot start from it; run {late} without --pair-late to train it from step 0",
                          flush=True)
                    unpaired.add(late)
                    continue
                if now < at:
                    rc = run_arm(arm, ["--stop-after", str(at)])
                    if rc is None:
                        return "stop"
                    if not finished(arm, rc, at):
                        if rc != 0:
                            unpaired.update(x for t, x in pairs[arm] if t >= at)
                            return "next"
                        return "stop"
                hand_over(out / arm, out / late, at)
                print(f"[study] {late} starts from {arm}'s checkpoint at step {at}, its switch step (--pair-late)",
                      flush=True)
            return "go"

        for arm in arms:
            if arm in unpaired:
                print(f"[study] {arm} skipped: --pair-late could not start it from its base arm's run", flush=True)
                continue
            how = pair_up(arm)
            if how == "stop":
                break
            if how == "next":
                continue
            done = summaries(out, [arm]).get(arm)
            if done and done["status"] == "done" and done["steps"] == steps:
                continue
            rc = run_arm(arm, [])
            if rc is None:
                break
            if not finished(arm, rc, steps) and rc == 0:
                break
    if args.export:
        export(out, arms, args.size, Path(args.export), args.matched_steps)
    else:
        print(report(out, arms, args.size, args.matched_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
