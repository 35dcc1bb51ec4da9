"""Runs QAdamW's fused Triton step under TRITON_INTERPRET=1 (fresh process: the interpreter must be chosen
before Triton is imported) against the per-parameter torch reference step and prints a JSON report of
mismatching elements per case and tensor; driven by tests/test_optim_fused.py (also usable on CUDA:
``python tests/_optim_fused_worker.py --device cuda``)."""
import json
import os
import sys
import warnings

if __name__ == "__main__" and ("--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cpu"):
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from fp4compile.optim import QAdamW  # noqa: E402

SHAPES = [(64, 64), (48, 80), (100,), (8, 8), (2, 1056)]
CASES = {
    "fp32-default": dict(dtype=torch.float32, kw={}),
    "fp32-variant": dict(dtype=torch.float32, kw=dict(m_hadamard=32, v_hadamard=None, v_rounding="rtn",
                                                        m_four_over_six=False, tile=64, maximize=True,
                                                        weight_decay=0.1)),
    "fp32-had128-rtn": dict(dtype=torch.float32, kw=dict(m_hadamard=None, v_hadamard=128, m_rounding="rtn",
                                                           v_four_over_six=False, tile=128)),
    "bf16-sr": dict(dtype=torch.bfloat16, kw={}),
    "bf16-kahan": dict(dtype=torch.bfloat16, kw=dict(bf16_master="kahan")),
    "bf16-rtn": dict(dtype=torch.bfloat16, kw=dict(bf16_master="rtn")),
    "qroot-adamw": dict(dtype=torch.float32, kw={}, root=True),
    # the first parameter 4 bytes off 16-byte alignment: the kernels (16-byte vector loads) must leave it to torch
    "fp32-unaligned": dict(dtype=torch.float32, kw={}, unaligned=True),
}


def grads(shape, dtype, step, device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4
    if step == 1 and len(shape) == 2:
        # extremes: the scaled hypot, the floor, and sqrt(v)'s saturation at codec.SQRT_V_MAX
        x.view(-1)[:4] = torch.tensor([1e20, -1e-20, 0.0, 3e38])
    return x.to(device, dtype)


def run(case, fused, device, steps=3):
    cfg = CASES[case]
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s).mul_(0.1).to(device, cfg["dtype"])) for s in SHAPES]
    if cfg.get("unaligned"):
        buf = torch.empty(ps[0].numel() + 1, device=device, dtype=cfg["dtype"])
        ps[0] = torch.nn.Parameter(buf[1:].view(ps[0].shape).copy_(ps[0].detach()))
        assert ps[0].data_ptr() % 16
    if cfg.get("root"):  # QRoot's AdamW part (use_root=False group) through the same kernels
        from fp4compile.optim import QRoot

        opt = QRoot([{"params": ps, "use_root": False}], lr=3e-3, precision="bf16", fused=fused, compile=False,
                    min_numel=64, **cfg["kw"])
    else:
        opt = QAdamW(ps, lr=torch.tensor(3e-3), fused=fused, compile=False, min_numel=64, **cfg["kw"])
    for i in range(steps):
        for j, p in enumerate(ps):
            p.grad = grads(p.shape, cfg["dtype"], i * 10 + j, device)
        opt.step()
    return ps, opt


def report(device, cases=None, steps=3):
    """{case: {tensor: mismatching elements (0 = bit-exact) or an error string}} of fused vs reference."""
    out_all = {}
    for case in cases or list(CASES):
        try:
            pf, of = run(case, True, device, steps)
            pr, orf = run(case, False, device, steps)
            out = {}
            for i, (a, b) in enumerate(zip(pf, pr)):
                out[f"p{i}"] = int((a.detach().view(-1) != b.detach().view(-1)).sum())
                for k, v in orf.state[b].items():
                    w = of.state[a][k]
                    out[f"p{i}.{k}"] = "shape/dtype" if (w.shape != v.shape or w.dtype != v.dtype) \
                        else int((w.reshape(-1) != v.reshape(-1)).sum())
            out_all[case] = out
            print(f"CASE {case}: mismatches " + json.dumps({k: v for k, v in out.items() if v != 0}), flush=True)
        except Exception as e:  # report, don't hide
            import traceback
            traceback.print_exc()
            out_all[case] = f"{type(e).__name__}: {e}"
    return out_all


def main():
    warnings.simplefilter("ignore")
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    cases = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else None
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
    rep = report(device, cases, steps)
    bad = {c: {k: v for k, v in r.items() if v != 0} if isinstance(r, dict) else r for c, r in rep.items()}
    print("MISMATCHES" + json.dumps(bad))
    print("REPORT" + json.dumps(rep))


if __name__ == "__main__":
    main()
