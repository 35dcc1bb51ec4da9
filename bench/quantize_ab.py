"""A/B of the quantize kernels against another revision's ``fp4compile/kernels/quantize.py``, in one run.

    git show REV:fp4compile/kernels/quantize.py > /tmp/quantize_old.py
    python bench/quantize_ab.py --old /tmp/quantize_old.py [--rounds 5]

Loads the old file as a second module of the same package (its relative imports resolve against the current
``fp4compile``), then times ``quantize`` of both on the same inputs, alternating old / new for ``--rounds``
rounds (CUDA-graph replay, ``bench/quantize.py``'s timer), and prints per case the median µs of each, new / old,
and both as a fraction of the copy bandwidth measured in the same run (actual bytes, ``bench/quantize.py``'s
``case_bytes``). Outputs are checked bit-identical between the two before timing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quantize as QB  # noqa: E402  (bench/quantize.py: timer, copy bandwidth, byte counts)

from fp4compile.kernels import quantize as K  # noqa: E402

#: the rows of bench/quantize.py's table that are timed (--cases picks others by name)
CASES = ("RTN", "RTN 2D 16x16 (weights)", "RTN + RHT16", "SR")


def load_old(path):
    """The other revision's module; its import-time registration of the ops' CUDA launchers is skipped (torch
    2.11 refuses a second Python kernel for the same op and key; the ops keep the current launchers)."""
    from fp4compile import ops

    spec = importlib.util.spec_from_file_location("fp4compile.kernels._quantize_ab_old", path)
    mod = importlib.util.module_from_spec(spec)
    register, ops.register_cuda = ops.register_cuda, lambda *a, **k: None
    try:
        spec.loader.exec_module(mod)
    finally:
        ops.register_cuda = register
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="path of the other revision's kernels/quantize.py")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="4096x4096,16384x8192")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of bench/quantize.py's cases")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    cases = dict(QB.BENCH_CASES)
    unknown = [c for c in args.cases.split(",") if c not in cases]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; bench/quantize.py has {list(cases)}")
    old = load_old(args.old)
    copy_bw = QB.copy_bandwidth()
    rows = []
    print(f"\n| shape | case | old µs | new µs | new / old | old, fraction of copy BW | new, fraction |")
    print("|---|---|---|---|---|---|---|")
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randn(shape, device=QB.DEV, dtype=torch.bfloat16)
        for name in args.cases.split(","):
            case = cases[name]
            fns = {}
            for tag, kernels in (("old", old), ("new", K)):
                torch.manual_seed(0)                      # the same RHT signs for both
                fns[tag] = QB.run_case(x, case, case.get("config"), kernels)
            a, b = fns["old"](), fns["new"]()
            if not all(torch.equal(u, v) for u, v in zip(a, b)):
                raise SystemExit(f"{shape} {name}: old and new outputs differ")
            t = {"old": [], "new": []}
            for _ in range(args.rounds):
                for tag in ("old", "new"):
                    t[tag].append(QB.bench_ms(fns[tag], rep=25) * 1e3)
            mo, mn = statistics.median(t["old"]), statistics.median(t["new"])
            actual = QB.case_bytes(x.numel(), case)[1]
            fo, fn = actual / mo / 1e3 / copy_bw, actual / mn / 1e3 / copy_bw
            rows.append({"shape": list(shape), "case": name, "old_us": t["old"], "new_us": t["new"],
                         "copy_GBps": copy_bw})
            print(f"| {shape[0]}x{shape[1]} | {name} | {mo:.2f} | {mn:.2f} | {mn / mo:.3f} | {fo:.3f} | {fn:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
