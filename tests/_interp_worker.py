"""Runs the Triton kernels under TRITON_INTERPRET=1 in a fresh process (the interpreter must be chosen before
Triton is first imported) and prints a JSON report; driven by tests/test_quantize_kernels.py."""
import json
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from fp4compile import ops  # noqa: E402
from fp4compile.kernels import quantize as K  # noqa: E402
from test_quantize_kernels import INTERP_CASES, SEED, SIGNS, case_id, data  # noqa: E402


def compare(got, ref):
    out = {}
    for name, a, b in zip(("codes", "scales", "global"), got, ref):
        a = a.cpu()
        out[name] = "shape/dtype" if (a.shape != b.shape or a.dtype != b.dtype) else int((a != b).sum())
    return out


def main():
    warnings.simplefilter("ignore")  # 1/0 in a discarded where() branch
    report = {}
    for case in INTERP_CASES:
        kind, shape, r, f46, b2, h, tr = case[:7]
        cfg = case[7] if len(case) > 7 else None
        x = data(kind, shape)
        if kind == "bf16":
            x = data("heavy", shape).to(torch.bfloat16)
        sg = SIGNS[:h] if h else None
        try:
            got = K.quantize(x, r, f46, b2, h, sg, SEED, tr, config=cfg)
            ref = ops._quantize_reference(x, r, f46, b2, h, sg, SEED, tr)
            report[case_id(case)] = compare(got, ref)
        except Exception as e:  # noqa: BLE001  (reported per case)
            report[case_id(case)] = f"{type(e).__name__}: {e}"
    for h, dt in [(0, torch.bfloat16), (16, torch.float32), (128, torch.bfloat16)]:
        x = data("heavy", (16, 256))
        sg = SIGNS[:h] if h else None
        c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
        try:
            got = K.dequantize(c, s, g, h, sg, dt, config={"rht_impl": 1} if h == 16 else None)
            report[f"dequantize-{h}-{dt}"] = int((got != torch.ops.fp4compile.dequantize(c, s, g, h, sg, dt)).sum())
        except Exception as e:  # noqa: BLE001
            report[f"dequantize-{h}-{dt}"] = f"{type(e).__name__}: {e}"
    print("REPORT" + json.dumps(report))


if __name__ == "__main__":
    main()
