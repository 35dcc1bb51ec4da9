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

CASES = [("RTN", dict(rounding="rtn")), ("RTN 2D 16x16 (weights)", dict(rounding="rtn", block2d=True)),
         ("RTN + RHT16", dict(rounding="rtn", hadamard=16)), ("SR", dict(rounding="sr"))]


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
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    old = load_old(args.old)
    copy_bw = QB.copy_bandwidth()
    rows = []
    print(f"\n| shape | case | old µs | new µs | new / old | old, fraction of copy BW | new, fraction |")
    print("|---|---|---|---|---|---|---|")
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for name, case in CASES:
            h = case.get("hadamard", 0)
            signs = (torch.randint(0, 2, (h,), device="cuda") * 2 - 1).float() if h else None
            seed = torch.tensor(7, dtype=torch.int64, device="cuda")
            fns = {tag: (lambda m=m: m.quantize(x, case["rounding"], False, case.get("block2d", False), h, signs,
                                                seed))
                   for tag, m in (("old", old), ("new", K))}
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
