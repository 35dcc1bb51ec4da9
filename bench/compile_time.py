"""Where the first training step's time goes (issue 3's "first compile <= 1.5x Inductor's"), cold caches.

    python bench/compile_time.py                      # BF16 Inductor vs fullstack_fp4 full_stack, GPT-124M,
                                                      # B=16, T=1024, mode reduce-overhead (bench/train_step.py)
    python bench/compile_time.py --policies quartet2,full_stack --mode default
    python bench/compile_time.py --policies full_stack,full_stack:noprecompile --warm   # precompile on / off
    python bench/compile_time.py --policies full_stack --warm --repeat 3     # 3 rounds: the run-to-run spread

Each backend runs its first step in its own child process with empty Triton and Inductor cache directories
(a fresh machine), and the child reports:

* ``first step``: Dynamo + AOT + backend compile + the first forward/backward/AdamW step (what
  ``bench/train_step.py`` reports as "first compile");
* ``backend``: time inside the backend callable (fullstack_fp4's passes and Inductor's ``compile_fx``,
  including the wait for Inductor's parallel kernel compiles), summed over the graphs it compiled (outermost
  calls only; AOTAutograd compiles the backward lazily, at the first backward, outside this number);
* ``triton jit``: seconds in ``triton.compile`` called from this process (kernels compiled lazily at their
  first launch: fp4compile's own Triton kernels; Inductor compiles its kernels in worker processes),
  with the number of compiles and the top kernels;
* ``autotune``: seconds in Triton autotuners' config benchmarking (compiles of the configs included);
* ``workers``: fp4compile.precompile's worker processes started, and how many had finished when the first step
  ended (a policy suffixed ``:noprecompile`` runs with ``FP4COMPILE_PRECOMPILE=0``).

``--warm`` runs one BF16 child first and reports it apart: the first process on a fresh machine also pays
for reading torch's files from disk, which would otherwise fall on the BF16 baseline alone.

Prints one table; ``--json`` writes the children's reports.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _instrument():
    """Wrap triton.compile and Autotuner.run; returns the shared record."""
    from triton.runtime import autotuner

    from fp4compile.precompile import trace_compiles

    rec = dict(jit=collections.defaultdict(float), jit_n=collections.Counter(), autotune=0.0, autotune_n=0,
               events=[])
    depth = threading.local()

    def on_compile(name, w0, dt, key, spec):
        rec["jit"][name] += dt
        rec["jit_n"][name] += 1
        if dt > 0.05:  # a real compile, not a disk-cache hit: when, and which specialization (as the workers log)
            rec["events"].append((name, round(w0, 2), round(dt, 2), key))
            if spec:
                print(f"SPEC {name} {spec}", flush=True)

    trace_compiles(on_compile)
    real_run = autotuner.Autotuner.run

    def run_timed(self, *a, **k):
        if getattr(depth, "n", 0):
            return real_run(self, *a, **k)
        before = len(self.cache)
        depth.n = 1
        t0 = time.perf_counter()
        try:
            return real_run(self, *a, **k)
        finally:
            depth.n = 0
            if len(self.cache) != before:  # a cache miss: the configs were benchmarked
                rec["autotune"] += time.perf_counter() - t0
                rec["autotune_n"] += 1

    autotuner.Autotuner.run = run_timed
    return rec


def child(args):
    import torch

    rec = _instrument()
    from bench.train_step import GPT, policy_for

    dev = "cpu" if args.tiny else "cuda"
    torch.manual_seed(0)
    dims = dict(vocab=256, d=64, n_layer=2, n_head=2, block_size=args.T) if args.tiny else {}
    model = GPT(**dims).to(device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not args.tiny)
    backend_s = [0.0]
    marks = {}  # wall-clock (time.time()) marks of the first step, to line up with the workers' logs
    if args.child == "bf16":  # exactly bench/train_step.py's baseline; compile_fx timed where Inductor looks it up
        import torch._inductor.compile_fx as cfx
        real_fx = cfx.compile_fx

        nested = [0]

        def compile_fx_timed(*a, **k):  # compile_fx calls itself inside its config patches: the outermost call
            if nested[0]:
                return real_fx(*a, **k)
            nested[0] = 1
            t0 = time.perf_counter()
            try:
                return real_fx(*a, **k)
            finally:
                nested[0] = 0
                backend_s[0] += time.perf_counter() - t0

        cfx.compile_fx = compile_fx_timed
        step_fn = torch.compile(model, backend="inductor", mode=args.mode)
    else:
        from fp4compile import precompile as pc
        from fp4compile.backend import fullstack_fp4
        args.child = args.child.split(":")[0]
        real_start = pc.start

        def start_logged(graph, *a, **k):  # the joint-graph pass's end: when the workers get their calls
            marks["precompile_start"] = round(time.time(), 2)
            return real_start(graph, *a, **k)
        pc.start = start_logged

        def backend(gm, ex):
            t0 = time.perf_counter()
            try:
                return fullstack_fp4(gm, ex, options=dict(policy=policy_for(args.child), mode=args.mode))
            finally:
                backend_s[0] += time.perf_counter() - t0

        step_fn = torch.compile(model, backend=backend)
    g = torch.Generator(device="cpu").manual_seed(1)
    d = torch.randint(0, model.wte.num_embeddings, (args.B, args.T + 1), generator=g).to(dev)
    if not args.tiny:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    marks["step"] = round(time.time(), 2)
    if args.mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    loss = step_fn(d[:, :-1], d[:, 1:])
    marks["backward"] = round(time.time(), 2)
    loss.backward()
    marks["optimizer"] = round(time.time(), 2)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    first = time.perf_counter() - t0
    marks["end"] = round(time.time(), 2)
    from fp4compile import precompile
    workers = [p.poll() for p in precompile._WORKERS]
    jit = sorted(rec["jit"].items(), key=lambda kv: -kv[1])
    out = dict(backend=args.child, mode=args.mode, first_step_s=first, backend_s=backend_s[0],
               triton_jit_s=sum(v for _, v in jit), triton_jit_n=sum(rec["jit_n"].values()),
               autotune_s=rec["autotune"], autotune_n=rec["autotune_n"],
               top_jit=[(k, round(v, 2), rec["jit_n"][k]) for k, v in jit[:12]],
               workers=len(workers), workers_done=sum(c is not None for c in workers), marks=marks,
               compiles=rec["events"])
    print("REPORT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="full_stack", help="comma list of bench/train_step.py policies")
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode ('default' for none)")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--warm", action="store_true", help="a BF16 child first, reported apart (see above)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of [bf16, policies...]; each ratio is against its own round's BF16 child")
    ap.add_argument("--tiny", action="store_true", help="toy model on the CPU (a smoke run of this script)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode == "default":
        args.mode = None
    if args.child:
        return child(args)
    reports = []
    rounds = [(0, "bf16 (first process)")] if args.warm else []
    rounds += [(i + 1, n) for i in range(args.repeat) for n in ["bf16"] + args.policies.split(",")]
    for rnd, name in rounds:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
            if name.endswith(":noprecompile"):
                env["FP4COMPILE_PRECOMPILE"] = "0"
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name.split(" ")[0], "--B", str(args.B), "--T", str(args.T),
                   "--mode", args.mode or "default"] + (["--tiny"] if args.tiny else [])
            t0 = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
        line = [x for x in p.stdout.splitlines() if x.startswith("REPORT ")]
        for x in p.stdout.splitlines():
            if x.startswith("SPEC "):
                print(f"{name}: {x}", flush=True)
        if p.returncode or not line:
            print(f"{name}: child failed (rc {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(line[-1][7:])
        r["process_s"], r["backend"], r["round"] = wall, name, rnd
        reports.append(r)
        print(f"{name}: {json.dumps(r)}", flush=True)
    if not reports:
        return 1
    base = {r["round"]: r["first_step_s"] for r in reports if r["backend"] == "bf16"}
    base[0] = base.get(1, float("nan"))
    for r in reports:
        r["vs_bf16"] = r["first_step_s"] / base.get(r["round"], float("nan"))
    print(f"\n| round | backend | first step s | vs BF16 | backend s | triton jit s (n) | autotune s (n) | workers "
          f"(done) | process s |\n|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(f"| {r['round']} | {r['backend']} | {r['first_step_s']:.1f} | {r['vs_bf16']:.2f}x | "
              f"{r['backend_s']:.1f} | {r['triton_jit_s']:.1f} ({r['triton_jit_n']}) | "
              f"{r['autotune_s']:.1f} ({r['autotune_n']}) | {r['workers']} ({r['workers_done']}) | "
              f"{r['process_s']:.1f} |")
    if args.repeat > 1:
        by = collections.defaultdict(list)
        for r in reports:
            if r["round"] > 0 and r["backend"] != "bf16":
                by[r["backend"]].append(r["vs_bf16"])
        for name, ratios in by.items():
            print(f"{name}: vs BF16 per round {', '.join(f'{x:.2f}x' for x in ratios)}; "
                  f"median {statistics.median(ratios):.2f}x")
    for r in reports:
        if r["backend"].startswith("bf16"):
            continue
        print(f"{r['backend']} top in-process Triton compiles (name, s, n): {r['top_jit']}")
        t = r.get("marks", {}).get("step")
        if t:
            marks = ", ".join(f"{k} +{v - t:.1f}" for k, v in r["marks"].items() if k != "step")
            events = ", ".join(f"{n} +{w - t:.1f} ({dt} s, {key})" for n, w, dt, key in r.get("compiles", []))
            print(f"{r['backend']} timeline, s after the step began: {marks}; compiles: {events or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
