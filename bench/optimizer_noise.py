"""Does ROOT's orthogonalization amplify the NVFP4 gradient error more than AdamW's normalization? (CPU)

    python bench/optimizer_noise.py                  # ~3 min on 2 idle CPU cores (~8 min on a busy box)
    python bench/optimizer_noise.py --seed 1 --draws 4 --per-matrix
    python bench/optimizer_noise.py --policy configs/policy_quartet2_fwd_only.toml   # or _bwd_only.toml

Background: on GPU, NVFP4 linears (policy ``quartet2``: forward RTN + 4/6, dgrad/wgrad MS-EDEN with RHT-128)
cost +1.12 % train loss vs BF16 when both arms use AdamW, but +3.44 % when both use ROOT (``QRoot`` with BF16
Newton–Schulz). Hypothesis: NS maps every singular value of the momentum to ~1, so the gradient error that
NVFP4's backward adds is amplified in the weak singular directions, while AdamW's per-element normalization
passes it through roughly unchanged.

How: the ``cpu`` GPT preset (0.9M parameters) is trained in FP32 eager for ``--steps`` steps on the stdlib byte
corpus (16 x 128 tokens per step, lr 3e-3, same init) twice: with ``QRoot(precision="bf16", adamw="adamw")`` and
with ``torch.optim.AdamW(betas=(0.9, 0.95), weight_decay=0.1)``. Then, on a fresh batch, the gradient ``g`` of
every block matrix (2-D ``blocks.*`` params, 16 matrices, 4 shapes) is taken twice: exactly (FP32 eager) and
through ``torch.compile(backend="fullstack_fp4", options={"policy": "quartet2", "debug": True})`` (the same
passes as on GPU; on CPU the fp4compile ops run their bit-exact torch references), ``--draws`` times with
different RNG seeds (fresh MS-EDEN seeds and RHT signs): ``g4``. Per matrix, given each optimizer's own state:

- ``e_g  = ||g4 - g|| / ||g||``                                                   gradient error
- ROOT:  ``u(g) = g + mu (mu buf + g)`` (Nesterov input), ``O = NS(clip(u))`` exactly as ``QRoot.orthogonalize``
  (BF16 NS, ROOT's coefficients, p99 clip); ``e_u = ||u(g4) - u(g)|| / ||u(g)||``, ``e_O = ||O(g4) - O(g)|| / ||O(g)||``
- AdamW: ``m' = b1 m + (1-b1) g``, ``v' = b2 v + (1-b2) g^2``, ``d = (m'/bc1) / (sqrt(v'/bc2) + eps)`` as
  torch's AdamW (bias corrections at the next step); ``e_m`` (of m'), ``e_d`` (of d) the same way.
- amplification: ``e_O / e_g``, ``e_d / e_g`` (gradient -> update direction), and ``e_O / e_u``, ``e_d / e_m``
  (the normalization alone, after momentum has diluted the error).

Table 2 repeats the direction errors for two other noises. "K=20": the error also sat in the momentum for the
K-1 previous steps. Approximation (not a real NVFP4 history): the past errors are independent with the size of
the error ``xi`` measured on the previous training batch (g4 - g of batch ``steps-1``, same final weights), so
they add ``sqrt(sum_{j<K-1} mu^2j) * xi`` to ROOT's buffer (sum form), ``(1-b1) sqrt(sum b1^2j) * xi`` to AdamW's
m and, in expectation, ``(1-b2) sum b2^j * xi^2`` to v. "iso": an isotropic Gaussian gradient error of the same
norm as the NVFP4 one (does the structure of the NVFP4 error matter, or only its size?).

Table 3 tests the mechanism in the ROOT run: in the singular basis of u(g) on its short side (left vectors
when m <= n, right ones when m > n: that basis is complete), the share of u's energy in the bottom half of the
singular directions, the share of the input error ``u(g4) - u(g)`` and of the output error ``O(g4) - O(g)``
there, and the relative input error inside the top and the bottom half. If NS amplifies the error in the weak
directions, the output error sits mostly in the bottom half although the input error does not, and the
bottom half's relative input error is the larger one.

Checks line: ROOT's e_O with FP32 NS products (is BF16 NS rounding part of e_O?); the cosine between two draws'
gradient errors (1: the error is deterministic given weights and batch, as the forward's RTN is) and between
the errors of two batches (a shared part is a bias that adds up in the momentum, which table 2 ignores); the
eval-batch loss in FP32 and through the NVFP4 model.

Reading: e_* are relative Frobenius errors averaged over the draws and over the layers of a shape (amplifications
are averages of per-matrix ratios). ROOT amplifying more than AdamW means ``e_O/e_g > e_d/e_g``. The two runs
have different weights, so compare ratios, not raw e_g. Small model, small batch (2,048 tokens: e_g is far larger
than at the GPU study's batch), 150 steps: it measures the per-step mechanism, not the loss gap.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.optim import QRoot  # noqa: E402
from fp4compile.optim.root import clip_by_quantile, ns_coefficients  # noqa: E402
from fp4compile.train import data as D  # noqa: E402
from fp4compile.train.model import GPT, config_from_preset  # noqa: E402

BATCH, SEQ = 16, 128


def block_mats(net):
    """{name: param} of the block matrices (what QRoot orthogonalizes)."""
    return {n: p for n, p in net.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}


def grads(model, params, x, y, seed=None):
    """The loss and {name: FP32 grad} of ``params`` for one forward/backward of ``model`` on (x, y)."""
    for p in params.values():
        p.grad = None
    if seed is not None:
        torch.manual_seed(seed)          # MS-EDEN seeds and RHT signs are drawn from torch's generator
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in params.items()}


def train(kind, tokens, steps, seed, lr):
    """``steps`` FP32 eager steps of ``kind`` ("root" | "adamw") from the init of ``seed``: (net, opt, batches, loss)."""
    torch.manual_seed(seed)
    tok = D.get_tokenizer("bytes")
    net = GPT(config_from_preset("cpu", vocab_size=tok.vocab_size, max_seq_len=SEQ))
    batches = D.TokenBatches(tokens, SEQ, seed=seed)
    if kind == "root":
        opt = QRoot(QRoot.param_groups_for(net), lr=lr, precision="bf16", adamw="adamw")
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batches.batch(step * BATCH, BATCH)
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return net, opt, batches, sum(losses[-10:]) / len(losses[-10:])


def log(msg):
    print(f"[optimizer_noise] {msg}", file=sys.stderr, flush=True)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def ns_fp32(U, group):
    """QRoot.orthogonalize's clip + NS with every product in FP32 (to see what BF16 NS adds)."""
    X = clip_by_quantile(U[None], group["clip_quantile"])[0].float()
    tall = X.shape[0] > X.shape[1]
    X = X.mT if tall else X
    X = X / (X.norm() + 1e-7)
    for a, b, c in ns_coefficients((1, *U.shape), group["ns_steps"], group["ns_schedule"]):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def short_basis(u):
    """Orthonormal singular vectors of ``u`` on its short side (descending), and which side: complete basis."""
    U, S, Vh = torch.linalg.svd(u.double(), full_matrices=False)
    return (U, "left", S) if u.shape[0] <= u.shape[1] else (Vh.mT, "right", S)


def halves(E, Q, side):
    """Squared Frobenius norms of E's components in the top / bottom half of the basis Q."""
    k = Q.shape[1]
    C = Q.mT @ E.double() if side == "left" else E.double() @ Q       # coordinates in the basis
    C2 = C.pow(2).sum(dim=1 if side == "left" else 0)
    return float(C2[: k // 2].sum()), float(C2[k // 2:].sum())


def root_metrics(opt, params, g, g4s, xi, K, seed):
    group = next(gr for gr in opt.param_groups if gr["use_root"])
    mu = group["momentum"]
    cK = math.sqrt(sum(mu ** (2 * j) for j in range(K - 1)))
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for n, p in params.items():
        buf = opt.state[p]["momentum_buffer"]
        u = lambda gg, b=buf: gg + mu * (mu * b + gg)                       # noqa: E731
        O = lambda uu: opt.orthogonalize(uu[None], group)[0].float()        # noqa: E731
        u0 = u(g[n])
        O0, O0_32 = O(u0), ns_fp32(u0, group)
        Q, side, _ = short_basis(u0)
        ut, ub = halves(u0, Q, side)
        r = defaultdict(list)
        for g4 in g4s:
            d = g4[n] - g[n]
            r["e_g"].append(float(d.norm() / g[n].norm()))
            u4 = u(g4[n])
            O4 = O(u4)
            r["e_u"].append(rel(u4, u0))
            r["e_O"].append(rel(O4, O0))
            r["e_O32"].append(rel(ns_fp32(u4, group), O0_32))
            r["e_OK"].append(rel(O(u(g4[n], buf + cK * xi[n])), O0))
            z = torch.randn(d.shape, generator=gen) * (d.norm() / math.sqrt(d.numel()))
            r["e_Oiso"].append(rel(O(u(g[n] + z)), O0))
            dt, db = halves(u4 - u0, Q, side)
            ot, ob = halves(O4 - O0, Q, side)
            r["bot_du"].append(db / (dt + db))
            r["bot_dO"].append(ob / (ot + ob))
            r["rel_top"].append(math.sqrt(dt / ut))
            r["rel_bot"].append(math.sqrt(db / ub))
        out[n] = {k: sum(v) / len(v) for k, v in r.items()}
        out[n]["bot_u"] = ub / (ut + ub)
        out[n]["bf16_vs_fp32_ns"] = rel(O0, O0_32)
    return out


def adamw_metrics(opt, params, g, g4s, xi, K, seed):
    group = opt.param_groups[0]
    b1, b2 = group["betas"]
    eps = group["eps"]
    c1 = (1 - b1) * math.sqrt(sum(b1 ** (2 * j) for j in range(K - 1)))
    c2 = (1 - b2) * sum(b2 ** j for j in range(K - 1))
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for n, p in params.items():
        st = opt.state[p]
        t = float(st["step"]) + 1
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t

        def step(gg, m=st["exp_avg"], v=st["exp_avg_sq"]):
            m2 = b1 * m + (1 - b1) * gg
            v2 = b2 * v + (1 - b2) * gg * gg
            return m2, (m2 / bc1) / ((v2 / bc2).sqrt() + eps)

        m0, d0 = step(g[n])
        r = defaultdict(list)
        for g4 in g4s:
            d = g4[n] - g[n]
            r["e_g"].append(float(d.norm() / g[n].norm()))
            m4, d4 = step(g4[n])
            r["e_m"].append(rel(m4, m0))
            r["e_d"].append(rel(d4, d0))
            _, dK = step(g4[n], st["exp_avg"] + c1 * xi[n], st["exp_avg_sq"] + c2 * xi[n] ** 2)
            r["e_dK"].append(rel(dK, d0))
            z = torch.randn(d.shape, generator=gen) * (d.norm() / math.sqrt(d.numel()))
            r["e_diso"].append(rel(step(g[n] + z)[1], d0))
        out[n] = {k: sum(v) / len(v) for k, v in r.items()}
    return out


def kind_of(name):
    """'blocks.3.attn.qkv.weight' -> 'attn.qkv'."""
    return ".".join(name.split(".")[2:-1])


def grouped(rows, shapes, per_matrix):
    """[(label, {metric: mean})]: per matrix, or per kind (shape) averaged over layers; ratios per matrix first."""
    if per_matrix:
        return [(f"{n.removesuffix('.weight')} {tuple(shapes[n])}", r) for n, r in rows.items()]
    acc = defaultdict(lambda: defaultdict(list))
    for n, r in rows.items():
        for k, v in r.items():
            acc[kind_of(n)][k].append(v)
    label = {kind_of(n): f"{kind_of(n)} {tuple(shapes[n])}" for n in rows}
    return [(label[k], {m: sum(v) / len(v) for m, v in d.items()}) for k, d in acc.items()]


def add_ratios(rows):
    for r in rows.values():
        if "e_O" in r:
            r.update(amp_O=r["e_O"] / r["e_g"], amp_Ou=r["e_O"] / r["e_u"], amp_OK=r["e_OK"] / r["e_g"],
                     amp_Oiso=r["e_Oiso"] / r["e_g"])
        else:
            r.update(amp_d=r["e_d"] / r["e_g"], amp_dm=r["e_d"] / r["e_m"], amp_dK=r["e_dK"] / r["e_g"],
                     amp_diso=r["e_diso"] / r["e_g"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="training steps of each run")
    ap.add_argument("--draws", type=int, default=2, help="NVFP4 gradients per run (different RNG seeds)")
    ap.add_argument("--K", type=int, default=20, help="steps the error is carried in the momentum (table 2)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="quartet2",
                    help="policy of the NVFP4 gradients: a preset name or a policy .toml (e.g. "
                         "configs/policy_quartet2_fwd_only.toml / _bwd_only.toml to split forward and backward)")
    ap.add_argument("--per-matrix", action="store_true", help="one row per matrix instead of per shape")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tok = D.get_tokenizer("bytes")
    tokens = D.load_tokens("stdlib", tok, "bytes", 2_000_000)

    runs, times = {}, {}
    for kind in ("root", "adamw"):
        t = time.perf_counter()
        runs[kind] = train(kind, tokens, args.steps, args.seed, args.lr)
        times[f"train {kind}"] = time.perf_counter() - t
        log(f"trained {kind}: {times[f'train {kind}']:.0f} s")

    from fp4compile.train.distributed import resolve_backend
    from fp4compile.train.loop import load_policy

    net4 = copy.deepcopy(runs["root"][0])
    fp4 = torch.compile(net4, backend=resolve_backend("fullstack_fp4"), dynamic=False,
                        options={"policy": load_policy(args.policy), "debug": True})
    params4 = block_mats(net4)
    results, shapes, info = {}, {}, {}
    for kind, (net, opt, batches, train_loss) in runs.items():
        t = time.perf_counter()
        params = block_mats(net)
        shapes.update({n: p.shape for n, p in params.items()})
        net4.load_state_dict(net.state_dict())
        x, y = batches.batch(args.steps * BATCH, BATCH)                     # a batch no step trained on
        xp, yp = batches.batch((args.steps - 1) * BATCH, BATCH)             # the last training batch
        loss, g = grads(net, params, x, y)
        _, gp = grads(net, params, xp, yp)
        loss4, g4s = [], []
        for r in range(args.draws):
            l4, g4 = grads(fp4, params4, x, y, seed=1000 + r)
            log(f"{kind}: NVFP4 gradient {r + 1}/{args.draws} at {time.perf_counter() - t0:.0f} s")
            loss4.append(l4)
            g4s.append(g4)
        _, g4p = grads(fp4, params4, xp, yp, seed=2000)
        xi = {n: g4p[n] - gp[n] for n in params}
        # how much of the NVFP4 error is the same in every draw (forward RTN, ...) vs fresh randomness
        # and how much is shared by two batches (the same weights): a shared part adds up in the momentum
        cos, cos_b = [], []
        cosine = lambda a, b: float((a * b).sum() / (a.norm() * b.norm()))     # noqa: E731
        for n in params:
            cos_b.append(cosine(g4s[0][n] - g[n], xi[n]))
            if len(g4s) > 1:
                cos.append(cosine(g4s[0][n] - g[n], g4s[1][n] - g[n]))
        metric = root_metrics if kind == "root" else adamw_metrics
        results[kind] = metric(opt, params, g, g4s, xi, args.K, args.seed + 7)
        add_ratios(results[kind])
        info[kind] = dict(train_loss=train_loss, loss=loss, loss4=sum(loss4) / len(loss4),
                          cos=sum(cos) / len(cos) if cos else float("nan"), cos_b=sum(cos_b) / len(cos_b))
        times[f"nvfp4 grads {kind}"] = time.perf_counter() - t

    R = dict(grouped(results["root"], shapes, args.per_matrix))
    A = dict(grouped(results["adamw"], shapes, args.per_matrix))
    avg = lambda rows, k: sum(r[k] for r in rows.values()) / len(rows)    # noqa: E731
    R["**mean**"] = {k: avg(results["root"], k) for k in next(iter(results["root"].values()))}
    A["**mean**"] = {k: avg(results["adamw"], k) for k in next(iter(results["adamw"].values()))}

    print(f"## NVFP4 ({args.policy}) gradient error through ROOT (BF16 NS) vs AdamW: 'cpu' GPT, "
          f"{args.steps} FP32 steps each, {BATCH}x{SEQ} tokens, {args.draws} NVFP4 draws\n")
    print("### 1. Per-step update-direction error (each optimizer's own trained state)\n")
    print("| matrix (shape) | ROOT e_g | e_u | e_O | **e_O/e_g** | e_O/e_u | AdamW e_g | e_m | e_d | **e_d/e_g** "
          "| e_d/e_m | ROOT/AdamW amp. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lab in R:
        r, a = R[lab], A[lab]
        print(f"| {lab} | {r['e_g']:.3f} | {r['e_u']:.3f} | {r['e_O']:.3f} | **{r['amp_O']:.2f}** | "
              f"{r['amp_Ou']:.2f} | {a['e_g']:.3f} | {a['e_m']:.3f} | {a['e_d']:.3f} | **{a['amp_d']:.2f}** | "
              f"{a['amp_dm']:.2f} | {r['amp_O'] / a['amp_d']:.2f} |")
    print(f"\n### 2. Error carried in the momentum for K={args.K} steps (approximation, see docstring), "
          "and isotropic noise of the same norm\n")
    print("| matrix (shape) | ROOT e_O (K) | e_O/e_g (K) | AdamW e_d (K) | e_d/e_g (K) | ROOT/AdamW (K) "
          "| ROOT e_O/e_g iso | AdamW e_d/e_g iso | ROOT/AdamW iso |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lab in R:
        r, a = R[lab], A[lab]
        print(f"| {lab} | {r['e_OK']:.3f} | {r['amp_OK']:.2f} | {a['e_dK']:.3f} | {a['amp_dK']:.2f} | "
              f"{r['amp_OK'] / a['amp_dK']:.2f} | {r['amp_Oiso']:.2f} | {a['amp_diso']:.2f} | "
              f"{r['amp_Oiso'] / a['amp_diso']:.2f} |")
    print("\n### 3. Mechanism (ROOT run): bottom half of u(g)'s singular directions (short side)\n")
    print("| matrix (shape) | u energy in bottom half | input error share in bottom half | **NS output error "
          "share in bottom half** | rel. input error, top half | rel. input error, bottom half |")
    print("|---|---|---|---|---|---|")
    for lab, r in R.items():
        print(f"| {lab} | {r['bot_u']:.3f} | {r['bot_du']:.3f} | **{r['bot_dO']:.3f}** | {r['rel_top']:.3f} | "
              f"{r['rel_bot']:.3f} |")
    rm = R["**mean**"]
    print(f"\nChecks: ROOT e_O with FP32 NS products {rm['e_O32']:.3f} (BF16 NS {rm['e_O']:.3f}; BF16 vs FP32 NS "
          f"of the same input {rm['bf16_vs_fp32_ns']:.3f}). Cosine between two draws' gradient errors: ROOT run "
          f"{info['root']['cos']:.2f}, AdamW run {info['adamw']['cos']:.2f} (1 = deterministic error); between the "
          f"errors of two batches: ROOT run {info['root']['cos_b']:.2f}, AdamW run {info['adamw']['cos_b']:.2f} "
          "(table 2 assumes 0).")
    for kind in ("root", "adamw"):
        i = info[kind]
        print(f"{kind}: train loss (last 10 steps) {i['train_loss']:.3f}; eval batch loss FP32 {i['loss']:.4f}, "
              f"NVFP4 {i['loss4']:.4f}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
          + f"; total {time.perf_counter() - t0:.0f} s")
    return results


if __name__ == "__main__":
    main()
