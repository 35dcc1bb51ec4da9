"""Hardware-counter profiles (Nsight Compute, ``ncu``) of the kernels that miss their targets (issues 2, 3, 4 and 5).

Static SASS counts and timed variants (``bench/attention_sass.py``, ``bench/quantize_sass.py``, the A/Bs) leave
open *why* a kernel takes its time: for instance why Q-Attn's dQ kernel is 20 % slower with Q, K in 1x16 blocks
when it executes 5 % more instructions, or why MS-EDEN's quantize reaches 0.45 of copy bandwidth. ncu reads the
answer off the hardware: issue-slot use, achieved occupancy, and the warp stall reasons.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats --page raw --csv \\
        python bench/ncu_kernels.py WORKLOAD > ncu_WORKLOAD.csv
    python bench/ncu_kernels.py --summarize ncu_WORKLOAD.csv

A workload runs ``--warmup`` times (compiles, fills caches), then once between ``torch.cuda.profiler.start()`` and
``stop()``, so that ncu with ``--profile-from-start off`` profiles one launch of each of its kernels. It runs with
``FP4COMPILE_AUTOTUNE_CACHE=read`` unless set otherwise: a TMA GEMM tile stored on disk is used, one tuned under
ncu is not stored (to profile a training run's tiles, run the workload once without ncu first). Workloads
(:data:`WORKLOADS`): ``attn_paper`` / ``attn_paper1x16`` (Q-Attn's forward and backward kernels at the GPT-124M
layer's shape B, H, T, D = 16, 12, 1024, 64, the paper's split with Q, K in 16x16 tiles / in 1x16 blocks), ``eden``
(MS-EDEN + RHT-128 quantize of a 16384x8192 BF16 tensor, issue 2's row) and ``rtn`` (RTN quantize of the same,
which reaches 0.88 of copy bandwidth: the reference point), ``qadamw`` / ``adamw`` (one Q-AdamW step on GPT-124M's
parameters, issue 5, and torch's fused AdamW step, its baseline), ``gemm124`` (the 124M step's fc1 and fc2 forward
GEMMs as the step runs them, each beside cuBLAS BF16 on the same operands; issue 3), ``gemm_inloop`` (the Gluon
GEMMs that decode NVFP4 in their main loop, warp-specialized, software-pipelined and register-A, beside cuBLAS BF16
at 4096^3; issue 3), ``gemm_mixed`` (the mixed GEMM's kernel with and without A's decode, and cuBLAS, at the 124M
qkv.dgrad shape; issue 3). ``--summarize`` prints, per
profiled kernel, the duration, throughputs, occupancy, issue activity and the largest stall reasons found in ncu's
raw CSV page (metric names as ncu 2025 writes them; any that a version does not write print as "-").

Needs CUDA (and Triton) for the workloads; ``--summarize`` runs anywhere.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/: the scripts whose workloads run here

#: (label, ncu raw metric names) printed for every kernel, in this order: the first name the output holds is taken
#: (ncu's ``--metrics`` list and its sections name DRAM throughput differently)
METRICS = (
    ("duration", ("gpu__time_duration.sum",)),
    ("SM throughput % of peak", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("memory throughput % of peak", ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("DRAM throughput % of peak", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                                   "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")),
    ("registers per thread", ("launch__registers_per_thread",)),
    ("shared memory per program", ("launch__shared_mem_per_block",)),
    ("programs per SM allowed by registers", ("launch__occupancy_limit_registers",)),
    ("programs per SM allowed by shared memory", ("launch__occupancy_limit_shared_mem",)),
    ("theoretical occupancy %", ("sm__maximum_warps_per_active_cycle_pct",)),
    ("achieved occupancy %", ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    ("issue slots busy %", ("smsp__issue_active.avg.pct_of_peak_sustained_active",)),
    ("warp cycles per issued instruction", ("smsp__average_warp_latency_per_inst_issued.ratio",)),
    ("instructions executed", ("smsp__inst_executed.sum",)),
    ("ALU pipe % of peak", ("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed",)),
    ("FMA pipe % of peak", ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed",)),
    ("tensor pipe (HMMA/HGMMA) % of peak",
     ("sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
      "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed")),
    ("LSU instructions % of peak", ("sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_elapsed",)),
    ("XU (special function) instructions % of peak", ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed",)),
)
#: a stall-reason column of the raw page: cycles per issued instruction that warps spent stalled for one reason
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(?P<why>.+?)_per_issue_active\.ratio$")
SHAPE_124M = (16, 12, 1024, 64)


def _attn(mask_name: str):
    """Q-Attn's forward + backward at the 124M layer's shape, as ``bench/attention_kernels_at.py`` times it."""
    import attention_kernels_at as AK  # bench/attention_kernels_at.py

    return AK.make_step(*AK.make_inputs(SHAPE_124M), AK.role_masks()[mask_name])


def _quantize(case: dict):
    """One quantize of a 16384x8192 BF16 tensor as ``bench/quantize.py`` runs its case."""
    import torch

    import quantize as QB  # bench/quantize.py

    torch.manual_seed(0)
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    return QB.run_case(x, case)


def _optimizer(name: str):
    """One optimizer step on GPT-124M's parameter set, as ``bench/optim.py`` times it: Q-AdamW (issue 5) or torch's
    fused AdamW (its baseline). The warm-up runs create the states, so the profiled step is a steady one."""
    import torch

    import optim as OB  # bench/optim.py
    from fp4compile.optim import QAdamW

    ps = OB.make_params(OB.gpt_shapes(**OB.SETS["124M"]), torch.device("cuda"))
    opt = QAdamW(ps, lr=1e-4) if name == "qadamw" else torch.optim.AdamW(ps, lr=1e-4, fused=True)
    return opt.step


def _gemm():
    """The 124M step's fc1 and fc2 forward GEMMs (16384 tokens, d = 768, MLP 3072) as the step runs them
    (``gemm_dequantized``: bf16 q·S operands, the global scales in the TMA GEMM's epilogue; issue 3), each followed
    by cuBLAS BF16 (``torch.mm``) on the same operands, its baseline."""
    import torch

    from fp4compile.kernels import gemm as G

    g = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones((), device="cuda")
    pairs = [(torch.randn(16384, k, device="cuda", generator=g).to(torch.bfloat16),
              torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)) for n, k in ((3072, 768), (768, 3072))]

    def step():
        for a, b in pairs:
            G.gemm_dequantized(a, one, b, one)
            torch.mm(a, b.t())
    return step


def _gemm_inloop():
    """The Gluon in-loop-decode NVFP4 GEMMs at 4096^3 (issue 3; ``kernels/gemm_wgmma.py``): the warp-specialized
    kernel (``WS_CONFIGS[0]``), session 25's software-pipelined one (``WGMMA_CONFIGS[0]``), the register-A ones
    (``RS_CONFIGS``), then cuBLAS BF16 on
    bf16 operands of the same shape, the baseline."""
    import torch

    from fp4compile.formats import nvfp4
    from fp4compile.kernels import gemm_wgmma as W

    g = torch.Generator(device="cuda").manual_seed(0)
    qa, qb = (nvfp4.quantize(torch.randn(4096, 4096, device="cuda", generator=g)) for _ in range(2))
    args = (qa.codes, qa.scales.view(torch.uint8), qa.global_scale, qb.codes, qb.scales.view(torch.uint8),
            qb.global_scale)
    a16, b16 = qa.dequantize(), qb.dequantize()

    def step():
        W.nvfp4_gemm_wgmma(*args, config=W.WS_CONFIGS[0])
        W.nvfp4_gemm_wgmma(*args, config=W.WGMMA_CONFIGS[0])
        for cfg in W.RS_CONFIGS:
            W.nvfp4_gemm_wgmma(*args, config=cfg)
        torch.mm(a16, b16.t())
    return step


def _gemm_mixed():
    """The mixed GEMM's kernel alone (A decoded in registers, B prepared bf16) at the 124M qkv.dgrad shape
    (16384, 768, 2304; issue 3): the 128 x 256 ``HALVES`` tile, the same without A's decode (``DIAG`` 1, timing only),
    the first ``SPLIT`` tile, then cuBLAS BF16 on bf16 operands of the same shape, the baseline."""
    import torch

    from fp4compile.formats import nvfp4
    from fp4compile.kernels import gemm_wgmma as W

    g = torch.Generator(device="cuda").manual_seed(0)
    qa = nvfp4.quantize(torch.randn(16384, 2304, device="cuda", generator=g))
    qb = nvfp4.quantize(torch.randn(768, 2304, device="cuda", generator=g))
    b16p = W.prepare_b(qb.codes, qb.scales.view(torch.uint8))
    a16, b16 = qa.dequantize(), qb.dequantize()
    halves = next(c for c in W.MIXED_CONFIGS if c.get("HALVES"))
    split = next(c for c in W.MIXED_CONFIGS if c.get("SPLIT"))

    def step():
        for cfg in (halves, dict(halves, DIAG=1), split):
            W.nvfp4_gemm_mixed(qa.codes, qa.scales.view(torch.uint8), qa.global_scale, b16p, qb.global_scale,
                               config=cfg)
        torch.mm(a16, b16.t())
    return step


#: workload name -> a function returning the no-argument callable that is profiled
WORKLOADS = {
    "attn_paper": lambda: _attn("paper"),
    "attn_paper1x16": lambda: _attn("paper1x16"),
    "eden": lambda: _quantize(dict(rounding="ms_eden", hadamard=128)),
    "rtn": lambda: _quantize(dict(rounding="rtn")),
    "qadamw": lambda: _optimizer("qadamw"),
    "adamw": lambda: _optimizer("adamw"),
    "gemm124": _gemm,
    "gemm_inloop": _gemm_inloop,
    "gemm_mixed": _gemm_mixed,
}


def run(workload: str, warmup: int = 3) -> None:
    """Run ``workload`` ``warmup`` times, then once inside the CUDA profiler range that ncu profiles."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/ncu_kernels.py: the workloads need a CUDA device (--summarize does not)")
    # under ncu a TMA GEMM autotune may rank the tiles differently from a training run (session 56 kept such a
    # choice on disk, and later processes ran it): load a stored choice, store none (set before fp4compile imports)
    os.environ.setdefault("FP4COMPILE_AUTOTUNE_CACHE", "read")
    fn = WORKLOADS[workload]()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"# ncu_kernels: {workload} profiled once after {warmup} warm-up runs on {torch.cuda.get_device_name()}")
    G = sys.modules.get("fp4compile.kernels.gemm")
    for key, config in sorted((G._TMA_BEST if G else {}).items(), key=str):
        print(f"# TMA GEMM {key[0]}x{key[1]}x{key[2]}: {config} (disk cache {os.environ['FP4COMPILE_AUTOTUNE_CACHE']})")


def _float(s: str):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> tuple[dict, list]:
    """ncu's ``--page raw --csv`` output (other lines, such as ncu's ``==PROF==`` messages and the program's own
    output, are skipped) as (units {metric: unit}, rows [{metric: value}] one per profiled kernel)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return {}, []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    units = {}
    if rows and not rows[0].get("ID", "").strip():           # the second line holds each metric's unit
        units, rows = rows[0], rows[1:]
    return units, rows


def summarize(text: str, stalls: int = 6) -> str:
    """A markdown table per profiled kernel: :data:`METRICS`, then the ``stalls`` largest stall reasons."""
    units, rows = parse_raw_csv(text)
    if not rows:
        return "no kernel rows in this ncu output (did ncu run, with --page raw --csv?)"
    out = []
    for r in rows:
        name = r.get("Kernel Name") or r.get("Function Name") or "?"
        out.append(f"\n### {name} (ID {r.get('ID', '?')}, grid {r.get('Grid Size', '?')}, "
                   f"block {r.get('Block Size', '?')})\n\n| metric | value |\n|---|---|")
        for label, names in METRICS:
            key = next((k for k in names if r.get(k) not in (None, "")), names[0])
            val = r.get(key)
            unit = units.get(key, "")
            out.append(f"| {label} | {val if val not in (None, '') else '-'}{' ' + unit if unit and val else ''} |")
        found = []
        for key, val in r.items():
            m = STALL.match(key or "")
            v = _float(val or "")
            if m and v is not None and not m.group("why").endswith("_not_issued"):
                found.append((v, m.group("why")))
        for v, why in sorted(found, reverse=True)[:stalls]:
            out.append(f"| stall: {why} (cycles per issued instruction) | {v:g} |")
        if not found:
            out.append("| stall reasons | - (not in this output) |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", choices=sorted(WORKLOADS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--summarize", metavar="CSV", help="summarize a saved ncu --page raw --csv output instead")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print(summarize(f.read()))
        return 0
    if args.workload is None:
        ap.error("name a workload or --summarize CSV")
    run(args.workload, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
