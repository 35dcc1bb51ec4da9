"""Optimizer benchmarks: Q-AdamW vs torch AdamW(fused), Q-Root (NVFP4 NS) vs Root with BF16 NS.

    python bench/optim.py                 # H200: 124M and 1B parameter sets, GPT-124M peak memory, Q-Root
    python bench/optim.py --tiny          # CPU smoke run at toy sizes (seconds)
    python bench/optim.py --out results.json

Prints one table at the end; every section is guarded (a failure prints its error and the rest still runs)
and time-boxed so the whole run stays under ~150 s on an H200.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fp4compile.optim import QAdamW, QRoot  # noqa: E402


def gpt_shapes(d, layers, vocab=50304, ctx=1024):
    """Parameter shapes of a GPT-2-style model (tied head)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


SETS = {"124M": dict(d=768, layers=12), "1B": dict(d=2048, layers=18)}
TINY = {"tiny": dict(d=64, layers=2, vocab=512, ctx=64)}


def make_params(shapes, device, dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(0)  # on the device: 1B CPU randn would take ~10 s
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(*s, generator=g, device=device).mul_(0.02).to(dtype))
        p.grad = torch.randn(*s, generator=g, device=device).mul_(1e-3).to(dtype)
        ps.append(p)
    return ps


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


HOST_MS = {}


def time_steps(opt, device, iters, warmup):
    """CUDA-event milliseconds per step (also records the host time per step of the launch loop in
    ``HOST_MS[id(opt)]``: when it is close to the event time the step is launch-bound, not GPU-bound)."""
    for _ in range(warmup):
        opt.step()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        for _ in range(iters):
            opt.step()
        HOST_MS[id(opt)] = (time.perf_counter() - t) * 1e3 / iters
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        opt.step()
    return (time.perf_counter() - t) * 1e3 / iters


def state_bytes(opt):
    n = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                n += v.numel() * v.element_size()
    return n


def bench_adamw(name, cfg, device, iters, warmup, rows, warps=None, impl=None, qkw=None, sse64=None):
    shapes = gpt_shapes(**cfg)
    nparam = sum(math.prod(s) for s in shapes)
    res = {}
    makers = [("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=device.type == "cuda")),
              ("QAdamW", lambda ps: QAdamW(ps, lr=1e-4, **(qkw or {})))]
    if warps:  # only the Q-AdamW kernel with another warp count / butterfly implementation / settings
        makers = makers[1:]
        from fp4compile.optim import fused, qadamw
        fused.NUM_WARPS, fused.RHT_IMPL = warps, impl
        sse64_default = qadamw.SSE64_4OVER6
        if sse64 is not None:
            qadamw.SSE64_4OVER6 = sse64
    for label, make in makers:
        ps = make_params(shapes, device)
        opt = make(ps)
        t0 = time.perf_counter()
        ms = time_steps(opt, device, iters, warmup)
        res[label] = (ms, state_bytes(opt), time.perf_counter() - t0, HOST_MS.get(id(opt), float("nan")))
        del opt, ps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if warps:
        from fp4compile.optim import fused
        fused.NUM_WARPS = int(os.environ.get("FP4COMPILE_QADAMW_WARPS", "0"))
        fused.RHT_IMPL = int(os.environ.get("FP4COMPILE_QADAMW_RHT_IMPL", "1"))
        qadamw.SSE64_4OVER6 = sse64_default
        rows.append(dict(section="QAdamW config", set=name, warps=warps, rht_impl=impl,
                         sse64_4over6=sse64 if sse64 is not None else sse64_default, settings=str(qkw or "default"),
                         qadamw_ms=res["QAdamW"][0], host_ms=res["QAdamW"][3]))
        return
    (t_ref, b_ref, _, h_ref), (t_q, b_q, wall_q, h_q) = res["torch AdamW fused"], res["QAdamW"]
    # bytes moved per step: AdamW fp32 reads p, g, m, v and writes p, m, v (28 B/param);
    # Q-AdamW reads p, g and the NVFP4 states and writes p and the states
    q_state_per_param = b_q / nparam
    rows.append(dict(section="QAdamW step", set=name, params=nparam, adamw_ms=t_ref, qadamw_ms=t_q,
                     time_ratio=t_q / t_ref, adamw_host_ms=h_ref, qadamw_host_ms=h_q, adamw_GBps=28 * nparam / t_ref / 1e6,
                     qadamw_GBps=(12 + 2 * q_state_per_param) * nparam / t_q / 1e6,
                     adamw_state_MB=b_ref / 2**20, qadamw_state_MB=b_q / 2**20,
                     state_ratio=b_q / b_ref, qadamw_wall_incl_compile_s=wall_q))


def _profiled_steps(opt, device, n, prefix=""):
    """torch.profiler of ``n`` steps of ``opt`` (CPU activity, and CUDA's on CUDA) -> (the profile, the event field
    to sort by: ``prefix`` + the device time total on CUDA, the CPU time total elsewhere)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            opt.step()
        sync(device)
    return prof, prefix + ("device_time_total" if device.type == "cuda" else "cpu_time_total")


def profile_step(name, cfg, device, rows):
    """torch.profiler of 3 Q-AdamW steps: GPU time per kernel (is the fused kernel or the overhead the cost?)."""
    ps = make_params(gpt_shapes(**cfg), device)
    opt = QAdamW(ps, lr=1e-4)
    for _ in range(2):
        opt.step()
    sync(device)
    prof, key = _profiled_steps(opt, device, 3)
    avgs = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0.0))
    top = [(e.key[:60], getattr(e, key, 0.0) / 3e3, e.count // 3) for e in avgs[:8]]
    print("\n".join(f"[profile {name}] {k}: {ms:.3f} ms/step, {c} calls/step" for k, ms, c in top))
    rows.append(dict(section="QAdamW profile", set=name, **{f"top{i}": f"{k} {ms:.3f}ms x{c}"
                                                           for i, (k, ms, c) in enumerate(top[:5])}))


def _root_on_set(cfg, device, precision, warmup, options=None):
    """A QRoot on a parameter set's hidden matrices (BF16 parameters with gradients), ``warmup`` steps taken;
    ``options``: further Root-group keys."""
    shapes = [s for s in gpt_shapes(**cfg)[2:] if len(s) == 2]
    opt = QRoot([{"params": make_params(shapes, device, torch.bfloat16), "use_root": True, **(options or {})}],
                lr=1e-3, precision=precision)
    for _ in range(warmup):
        opt.step()
    sync(device)
    return opt


def profile_root(name, cfg, device, rows, precision):
    """The GPU kernel time of 2 Q-Root steps (eager, ``precision`` "bf16" or "nvfp4" NS) on a set's hidden matrices,
    by kernel family (``bench.timing.kernel_table``): the issue's "NS GEMM time share" (cuBLAS gemm: the NS
    products' bmm; nvfp4 quantize / dequantize: their operands; other: the clip, the guard, the element-wise step)."""
    from bench.timing import profile_steps

    opt = _root_on_set(cfg, device, precision, warmup=1)

    def run(n):
        for _ in range(n):
            opt.step()
    table = profile_steps(run, 2, top=12)
    print(f"[profile root {name} {precision}]\n{table}", flush=True)
    fam = table.splitlines()[-1].partition(": ")[2]
    rows.append(dict(section="QRoot profile", set=name, precision=precision, families_us_per_step=fam))


def profile_root_ops(name, cfg, device, precision, top=30, arm=None):
    """Which torch ops of 2 Q-Root steps (eager, ``precision`` NS) take the GPU time: torch.profiler's op table sorted
    by the self device time of the kernels each op launched (where the time between the NS products goes); ``arm``:
    as :func:`bench_root`'s, its switches set and its Root-group keys given while it runs."""
    from bench.step_ab import applied

    arm_name, switches, options = _root_arm(arm)
    with applied(switches):
        prof, key = _profiled_steps(_root_on_set(cfg, device, precision, warmup=2, options=options), device, 2,
                                    prefix="self_")
    print(f"[root ops {name} {precision}, arm {arm_name}, 2 steps, by op]", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=48), flush=True)


def bench_peak_memory(device, tiny, rows, batch=None):
    """Peak of a full train step with each optimizer, and what the peak is made of (params, grads, optimizer
    state, the rest = activations/logits/workspaces at the peak)."""
    from fp4compile.optim.study import TinyGPT

    cfg = dict(d=64, layers=2, heads=4, ctx=64, vocab=256) if tiny else dict(d=768, layers=12, heads=12, ctx=1024,
                                                                           vocab=50304)
    batch = batch or (2 if tiny else 8)
    cuda = device.type == "cuda"
    out = {}
    for label in ("torch AdamW fused", "QAdamW", "no optimizer state"):
        torch.manual_seed(0)
        model = TinyGPT(**cfg).to(device)
        params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda) if label.startswith("torch")
               else QAdamW(model.parameters(), lr=1e-4) if label == "QAdamW" else None)
        x = torch.randint(0, cfg["vocab"], (batch, cfg["ctx"]), device=device)
        for i in range(3):
            if cuda and i == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x, x)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        state_mb = state_bytes(opt) / 2**20 if opt is not None else 0.0
        out[label] = dict(peak_MB=peak, params_MB=params_mb, grads_MB=params_mb, state_MB=state_mb,
                          rest_at_peak_MB=peak - 2 * params_mb - state_mb)
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    a, q = out["torch AdamW fused"]["peak_MB"], out["QAdamW"]["peak_MB"]
    row = dict(section="GPT-124M train step peak" if not tiny else "tiny GPT train step peak", batch=batch,
               adamw_peak_MB=a, qadamw_peak_MB=q, peak_change=(q - a) / a if a == a else float("nan"))
    for label, d in out.items():
        for k, v in d.items():
            row[f"{label.split()[0]}_{k}"] = v
    rows.append(row)


def bench_root(name, cfg, device, iters, warmup, rows, budget_s, arm=None):
    """Q-Root's step and its NS alone, BF16 against NVFP4 NS (and both from CUDA graphs on a GPU), on the hidden
    matrices of a parameter set; ``arm``: ``NAME:SETTING,...`` as ``bench/step_ab.py``'s ``--arm`` (module switches
    such as ``fp4compile.optim.root.QUANTILE_IMPL="topk"``, set while it runs, and ``options.KEY=JSON`` for QRoot's
    Root-group keys, e.g. ``options.ns_sym_b=true``; ``options.ns_residual=x+xt`` for the tuple ("x", "xt"), as the
    arm syntax splits settings at commas), the row's ``arm``."""
    from bench.step_ab import applied

    arm_name, switches, options = _root_arm(arm)
    with applied(switches):
        _bench_root(name, cfg, device, iters, warmup, rows, budget_s, options)
    rows[-1]["arm"] = arm_name


def _root_arm(arm):
    """``--root-arm`` syntax -> (name, module switches, Root-group keys), the keys checked (``ns_residual=x+xt`` as
    the tuple)."""
    from bench.step_ab import parse_arm
    from fp4compile.optim.root import ROOT_DEFAULTS

    arm_name, switches, options = parse_arm(arm or "default")
    if set(options) - set(ROOT_DEFAULTS):
        raise SystemExit(f"--root-arm {arm!r}: options.KEY must be QRoot group keys ({sorted(ROOT_DEFAULTS)}), "
                         f"got {sorted(options)}")
    if isinstance(options.get("ns_residual"), str):
        options["ns_residual"] = tuple(options["ns_residual"].split("+"))
    return arm_name, switches, options


def _bench_root(name, cfg, device, iters, warmup, rows, budget_s, group_keys=None):
    shapes = [s for s in gpt_shapes(**cfg)[2:] if len(s) == 2]  # hidden matrices (Root's part)
    res = {}
    variants = [("bf16", False), ("nvfp4", False)]
    if device.type == "cuda":                       # QRoot(cuda_graphs=True): NS replayed from CUDA graphs
        variants += [("bf16", True), ("nvfp4", True)]
    for prec, graphs in variants:
        ps = make_params(shapes, device, torch.bfloat16)
        opt = QRoot([{"params": ps, "use_root": True, **(group_keys or {})}], lr=1e-3, precision=prec,
                    cuda_graphs=graphs)
        t0 = time.perf_counter()
        opt.step()  # warm-up (fits coefficients for unseen shapes, builds kernels)
        sync(device)
        first = time.perf_counter() - t0
        n = iters if first * iters < budget_s else 1
        ms = time_steps(opt, device, n, 0)
        # NS share: time orthogonalize() alone on the same stacks
        stacks = {}
        for p in ps:
            stacks.setdefault(tuple(p.shape), []).append(p.grad.float())
        g = opt.param_groups[0]
        sync(device)
        t1 = time.perf_counter()
        ortho = opt.orthogonalize_graphed if graphs else opt.orthogonalize
        for st in stacks.values():
            ortho(torch.stack(st), g)
        sync(device)
        ns_ms = (time.perf_counter() - t1) * 1e3
        res[prec, graphs] = (ms, ns_ms)
        del opt, ps
    (tb, nb), (tq, nq) = res["bf16", False], res["nvfp4", False]
    row = dict(section="QRoot step", set=name, bf16_ns_ms=tb, nvfp4_ns_ms=tq, speedup=tb / tq,
               ns_share_bf16=min(1.0, nb / tb), ns_share_nvfp4=min(1.0, nq / tq))
    if ("nvfp4", True) in res:
        (tbg, _), (tqg, _) = res["bf16", True], res["nvfp4", True]
        row.update(bf16_graphs_ms=tbg, nvfp4_graphs_ms=tqg, speedup_graphs=tbg / tqg,
                   nvfp4_graphs_vs_eager_bf16=tb / tqg)
    rows.append(row)


def check_fused(device, rows):
    """Correctness on this device: codec RTN vs the format reference (bitwise); the fused Q-AdamW kernel vs the
    per-parameter torch reference step (mismatching elements after 5 steps; 0 = bit-exact)."""
    from fp4compile.formats import nvfp4
    from fp4compile.optim import codec

    x = torch.randn(1 << 16, device=device) * torch.rand(1 << 16, device=device) ** 3
    c, sc, g = codec.encode(x, rounding="rtn", four_over_six=True)
    c2, s2, g2 = nvfp4.quantize_rtn_(x, False, True)
    codec_ok = torch.equal(c, c2) and torch.equal(sc, s2.view(torch.uint8)) and torch.equal(g, g2)
    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(512, 256, device=device))
        opt = QAdamW([p], lr=1e-3, fused=fused, compile=False)
        gen = torch.Generator(device="cpu").manual_seed(1)
        for _ in range(5):
            p.grad = torch.randn(512, 256, generator=gen).to(device)
            opt.step()
        out.append((p.detach().clone(), opt.state[p]))
    (pe, se), (pc, sc_) = out
    row = dict(section="check", codec_rtn_bitwise=codec_ok,
               fused_vs_ref_param_maxdiff_over_lr=float((pe - pc).abs().max()) / 1e-3,
               fused_vs_ref_param_mismatch=int((pe != pc).sum()))
    for k in ("m_codes", "v_codes", "v_mean", "m_gbits", "v_gbits"):
        row[f"{k}_mismatch"] = int((se[k] != sc_[k]).sum())
    rows.append(row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check,adamw,profile,warps,peak,root")
    ap.add_argument("--root-sets", default="124M", help="comma list of parameter sets for the Q-Root section "
                    f"(of {','.join(SETS)}; --tiny: tiny)")
    ap.add_argument("--root-arm", action="append", default=None,
                    help="NAME[:module.ATTR=JSON,...|options.KEY=JSON,...] (bench/step_ab.py's arm syntax: module "
                         "switches, and QRoot group keys as options.KEY): the Q-Root section once per arm, in the "
                         "order given, e.g. 'topk:fp4compile.optim.root.QUANTILE_IMPL=\"topk\"' or "
                         "'res:options.ns_sym_b=true,options.ns_residual=x+xt' (default: one arm, the defaults)")
    ap.add_argument("--root-profile", default="", help="comma list of parameter sets whose Q-Root step (BF16 and "
                    "NVFP4 NS, eager) is profiled by kernel family")
    ap.add_argument("--root-ops", default="", help="comma list of parameter sets whose Q-Root step (NVFP4 and BF16 NS, "
                    "eager) is profiled by torch op")
    ap.add_argument("--root-ops-arm", default=None, help="the --root-ops profile with this --root-arm's settings")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    sets = TINY if args.tiny else SETS
    iters, warmup = (3, 1) if args.tiny else (20, 3)
    skip = set(filter(None, args.skip.split(",")))
    rows, t_start = [], time.perf_counter()
    jobs = []
    if "check" not in skip:
        jobs.append(("check", lambda: check_fused(device, rows)))
    if "adamw" not in skip:
        jobs += [("adamw " + k, lambda k=k, c=c: bench_adamw(k, c, device, iters, warmup, rows)) for k, c in sets.items()]
    if "profile" not in skip:
        k = "tiny" if args.tiny else "124M"
        jobs.append(("profile " + k, lambda: profile_step(k, sets[k], device, rows)))
    if "warps" not in skip and not args.tiny:
        # launch config, then ablations (what each part of the kernel costs): no 4/6, no RHT, RTN m, RTN v (the
        # default before session 17: the cost of v's stochastic rounding), all off
        no46 = dict(m_four_over_six=False, v_four_over_six=False)
        norht = dict(m_hadamard=None, v_hadamard=None)
        rtn = dict(m_rounding="rtn", v_rounding="rtn")
        # (warps 2 = the block-per-thread kernel's default; bench/qadamw_variants.py compares kernels and options)
        configs = [(2, 1, None, True), (1, 1, None, None), (2, 1, no46, None), (2, 1, norht, None),
                   (2, 1, dict(m_rounding="rtn"), None), (2, 1, dict(v_rounding="rtn"), None),
                   (2, 1, {**no46, **norht, **rtn}, None)]
        jobs += [(f"config warps={w} rht_impl={i} sse64={e} {q or ''}", lambda w=w, i=i, q=q, e=e: bench_adamw(
            "124M", SETS["124M"], device, iters, warmup, rows, warps=w, impl=i, qkw=q, sse64=e))
            for w, i, q, e in configs]
    if "peak" not in skip:
        jobs.append(("peak", lambda: bench_peak_memory(device, args.tiny, rows)))
        jobs.append(("peak batch 1", lambda: bench_peak_memory(device, args.tiny, rows, batch=1)))
    if "root" not in skip:
        for k in (["tiny"] if args.tiny else [k for k in args.root_sets.split(",") if k]):
            cfg = (TINY if args.tiny else SETS)[k]
            for arm in args.root_arm or [None]:
                jobs.append((f"root {k} {arm or ''}", lambda k=k, cfg=cfg, arm=arm: bench_root(
                    k, cfg, device, 5 if not args.tiny else 2, 1, rows, budget_s=20.0, arm=arm)))
    for k in [k for k in args.root_ops.split(",") if k]:
        cfg = (TINY if args.tiny else SETS)[k]
        for prec in ("nvfp4", "bf16"):
            jobs.append((f"root ops {k} {prec}", lambda k=k, cfg=cfg, prec=prec: profile_root_ops(
                k, cfg, device, prec, arm=args.root_ops_arm)))
    for k in [k for k in args.root_profile.split(",") if k]:
        cfg = (TINY if args.tiny else SETS)[k]
        for prec in ("bf16", "nvfp4"):
            jobs.append((f"root profile {k} {prec}", lambda k=k, cfg=cfg, prec=prec: profile_root(
                k, cfg, device, rows, prec)))

    def fmt(r):
        return " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())

    for name, job in jobs:
        t, n0 = time.perf_counter(), len(rows)
        try:
            job()
        except Exception as e:  # keep going: one failing section must not lose the others
            traceback.print_exc()
            rows.append(dict(section=name, error=f"{type(e).__name__}: {e}"))
        for r in rows[n0:]:  # print and save as we go: a time box that ends the run keeps what finished
            print("[row] " + fmt(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"[bench/optim] {name}: {time.perf_counter() - t:.1f}s", flush=True)
    print(f"\n## Optimizers ({device}, torch {torch.__version__}, total {time.perf_counter() - t_start:.0f}s)")
    for r in rows:
        print(fmt(r))


if __name__ == "__main__":
    main()
