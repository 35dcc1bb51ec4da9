"""Q-AdamW: AdamW with both moments stored in NVFP4 (Full-Stack FP4's quantized optimizer).

    opt = fp4compile.QAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)   # drop-in for torch.optim.AdamW

Per parameter of at least ``min_numel`` elements, 2-D or more, with ``numel % tile == 0``:

* first moment m: flat vector -> RHT-``m_hadamard`` (fixed random signs per tensor, kept in the state)
  -> NVFP4 with stochastic rounding and 4/6 block scaling (defaults; configurable);
* second moment v: r = sqrt(v) -> BF16 mean of each ``tile`` (32) consecutive elements subtracted ->
  RHT-``v_hadamard`` -> NVFP4 (SR + 4/6 by default); reconstruction v = max(deq + mean, 0)^2
  (clamped at the block's resolution, see ``codec.decode_v_sqrt``). Tile 32 and 4/6 were chosen on real
  tiny-GPT states (docs/OPTIM.md): tile 128 spans several rows of narrow matrices and loses the row scale.
  The update's denominator uses the reconstructed sqrt(v) directly, plus eps (> 0 keeps it finite).
* 4.5 + 5.0 bits/element of state (incl. scales, means) instead of 64 bits for FP32 AdamW (~0.15x).

Smaller, 1-D, or indivisible tensors keep FP32 ``exp_avg``/``exp_avg_sq`` exactly as torch's AdamW.

Master weights: an FP32 parameter is its own master copy. A BF16 parameter is updated in FP32 and written
back with ``bf16_master="sr"`` (stochastic rounding, no extra state; default), ``"kahan"`` (a BF16
compensation buffer, +2 bytes/param) or ``"rtn"`` (plain rounding; updates smaller than half a BF16 ulp
are lost).

On CUDA the step runs as fused multi-tensor Triton kernels (:mod:`fp4compile.optim.fused`): per param
group at most two launches (NVFP4-state tensors, FP32-state tensors) that decode, update, re-encode and write
every tensor of the group in one pass over memory, with no host syncs (``lr`` is a device tensor, step
counters stay on the device). The per-parameter update :func:`q_adamw_step` (pure tensor code) is its
reference, bit for bit, and runs where Triton does not (CPU; ``fused=False``; ``compile=True`` compiles it).
The second-level NVFP4 scale of the states is per run of ``SCALE_CHUNK`` (1024) elements instead of per
tensor, so no tensor-wide amax is needed before encoding. Stochastic rounding draws its bits from a
counter-based hash of (element, per-tensor seed, step), so a resumed run reproduces the uninterrupted one
bit for bit; one hash word per element serves both moments (``codec.shared_sr_uniforms``).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch.optim import Optimizer

from . import codec

_HADAMARDS = (None, 16, 32, 64, 128)
_MASTER = ("sr", "kahan", "rtn")


# ----------------------------------------------------------------------------------------------
# the functional steps (pure tensor code; the compiled path traces exactly these)
def _write_param(p: torch.Tensor, p32: torch.Tensor, comp: Optional[torch.Tensor], seed: torch.Tensor,
                 master: str, p_old32: torch.Tensor):
    if p.dtype == torch.float32:
        p.copy_(p32.reshape(p.shape))
    elif p.dtype == torch.bfloat16 and master == "sr":
        p.copy_(codec.bf16_stochastic_round(p32, seed).reshape(p.shape))
    elif p.dtype == torch.bfloat16 and master == "kahan" and comp is not None:
        s = p32 + comp.reshape(-1).to(torch.float32)
        new = s.to(torch.bfloat16)
        comp.copy_((s - new.to(torch.float32)).to(comp.dtype).reshape(comp.shape))
        p.copy_(new.reshape(p.shape))
    else:
        p.copy_(p32.reshape(p.shape).to(p.dtype))


def adam_coefficients(step: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, weight_decay: float):
    """(decay, step_size, bc2_sqrt) = (1 - lr*wd, lr / (1 - beta1^t), sqrt(1 - beta2^t)) as FP32 tensors.

    ``step`` (FP32, any shape: 0-dim per parameter, or the stacked steps of a group for the fused kernel)
    and ``lr`` (an FP32 device tensor) stay on the device. Both the reference steps and the fused kernel's
    launcher take their per-tensor scalars from here, so the two agree bit for bit."""
    bc1 = 1 - torch.pow(beta1, step)
    bc2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    return 1 - lr * weight_decay, lr / bc1, bc2_sqrt


def adamw_step(p, g, exp_avg, exp_avg_sq, step, lr, comp, seed, *, beta1: float, beta2: float, eps: float,
               weight_decay: float, maximize: bool, master: str):
    """AdamW with FP32 states (torch's single-tensor AdamW; ``step`` is a 0-dim tensor, ``lr`` a tensor).

    The moment updates are written as separate multiplies and adds (no lerp/addcmul, whose FMA use differs
    between CPU and CUDA builds) so the fused kernel (``fused.py``) reproduces them bit for bit."""
    step.add_(1)
    g32 = g.to(torch.float32)
    if maximize:
        g32 = -g32
    decay, step_size, bc2_sqrt = adam_coefficients(step, lr, beta1, beta2, weight_decay)
    m = exp_avg + (g32 - exp_avg) * (1 - beta1)
    v = exp_avg_sq * beta2 + (g32 * g32) * (1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = codec.sqrt_rn(v) / bc2_sqrt + eps
    p32 = p.to(torch.float32) * decay
    p32 = p32 - step_size * (m / denom)
    _write_param(p, p32.reshape(-1), comp, codec.step_seed(seed, step, 2), master, None)


#: elements per second-level (FP32) scale of the NVFP4 moment states. The NVFP4 format's per-tensor global
#: scale needs a tensor-wide amax before any element can be encoded (two passes over the tensor, or a grid
#: sync); a scale per 1024-element run lets one fused kernel program decode, update and re-encode its run
#: alone. Same two-level arithmetic per run; at least as accurate as one per tensor; 4 bytes / 1024 elements.
SCALE_CHUNK = 1024

#: the 4/6 block-scale choice of the moment states compares FP32 (False) or FP64 (True) squared-error sums
#: (same pairwise tree; they differ only in near-ties). Read by both the reference step and the fused kernel.
#: FP32 because on the H200 the 4/6 search was ~46 % of the fused step's time (window-2 ablation, BENCHMARKS.md).
SSE64_4OVER6 = False


def q_adamw_step(p, g, m_codes, m_scales, m_gbits, v_codes, v_scales, v_gbits, v_mean, m_signs, v_signs, step,
                 lr, comp, seed, *, beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool,
                 tile: int, m_rounding: str, m_four_over_six: bool, v_rounding: str, v_four_over_six: bool,
                 master: str, v_state: str = "floored"):
    """One Q-AdamW step of one parameter: decode m, v -> AdamW update -> encode m, v -> write p.

    All state tensors are updated in place. ``m_signs``/``v_signs`` may be None (no Hadamard). This is the
    reference of the fused Triton kernel (``fused.py``), which reproduces it bit for bit (``v_state="floored"``;
    the experimental ``"signed"`` runs only here, see :data:`QADAMW_DEFAULTS`).
    """
    step.add_(1)
    ch = SCALE_CHUNK
    g32 = g.reshape(-1).to(torch.float32)
    if maximize:
        g32 = -g32
    ms = None if m_signs is None else m_signs.to(torch.float32)
    vs = None if v_signs is None else v_signs.to(torch.float32)
    m = codec.decode_m(m_codes, m_scales, m_gbits, ms, chunk=ch)
    if v_state == "signed":  # one decode serves both: the signed state, and its floored copy for the update
        rs = codec.decode_v_sqrt(v_codes, v_scales, v_gbits, v_mean, vs, tile=tile, signed=True, chunk=ch)
        r = torch.maximum(rs, codec.v_floor(v_scales, v_gbits, vs, rs.numel(), ch))
    else:
        r = codec.decode_v_sqrt(v_codes, v_scales, v_gbits, v_mean, vs, tile=tile, floor=True, chunk=ch)
    m = m + (g32 - m) * (1 - beta1)
    # sqrt(beta2 r^2 + (1 - beta2) g^2) without squaring into FP32 overflow (|g| up to ~1e38 stays finite)
    r = codec.saturate_sqrt_v(codec.scaled_hypot(r * math.sqrt(beta2), g32.abs() * math.sqrt(1 - beta2)))
    r_state = r
    if v_state == "signed":
        # the stored EMA starts from the unclamped decode and keeps its sign (with g = 0 a linear, unbiased decay
        # under SR); the floored r above only guards this step's denominator
        hyp = codec.saturate_sqrt_v(codec.scaled_hypot(rs.abs() * math.sqrt(beta2),
                                                       g32.abs() * math.sqrt(1 - beta2)))
        r_state = torch.where(rs < 0, -hyp, hyp)
    decay, step_size, bc2_sqrt = adam_coefficients(step, lr, beta1, beta2, weight_decay)
    # torch's step_size * m / (r / bc2_sqrt + eps), as (step_size bc2_sqrt) * m / (r + eps bc2_sqrt): the same real
    # number with one division per element instead of two (both factors are per-tensor scalars)
    denom = r + eps * bc2_sqrt
    p32 = p.reshape(-1).to(torch.float32) * decay
    p32 = p32 - (step_size * bc2_sqrt) * (m / denom)
    # one hash per element serves both moments' SR: m takes its high 16 bits, v the low 16 (codec.shared_sr_uniforms)
    um = uv = None
    if m_rounding == "sr" or v_rounding == "sr":
        um, uv = codec.shared_sr_uniforms(m.numel(), codec.step_seed(seed, step, 0), m.device)
    mc, msc, mg = codec.encode_m(m, ms, rounding=m_rounding, four_over_six=m_four_over_six, chunk=ch,
                                 sse64=SSE64_4OVER6, u=um if m_rounding == "sr" else None)
    vc, vsc, vg, vmu = codec.encode_v(r_state, vs, tile=tile, rounding=v_rounding, four_over_six=v_four_over_six,
                                      from_sqrt=True, chunk=ch, sse64=SSE64_4OVER6,
                                      u=uv if v_rounding == "sr" else None)
    m_codes.copy_(mc)
    m_scales.copy_(msc)
    m_gbits.copy_(mg)
    v_codes.copy_(vc)
    v_scales.copy_(vsc)
    v_gbits.copy_(vg)
    v_mean.copy_(vmu)
    _write_param(p, p32, comp, codec.step_seed(seed, step, 2), master, None)


_COMPILED = {}
#: compiled per-parameter steps allowed per step function (one per distinct parameter shape and dtype)
_RECOMPILE_LIMIT = 256


def _compiled(fn):
    """``torch.compile(fn, fullgraph=True)``, falling back to eager ``fn`` (one warning) if compilation fails."""
    c = _COMPILED.get(fn)
    if c is None:
        compiled = torch.compile(fn, fullgraph=True)

        def c(*args, **kwargs):
            if _COMPILED.get((fn, "failed")):
                return fn(*args, **kwargs)
            try:
                # one compiled graph per distinct parameter shape (Dynamo specializes on sizes): a model has
                # more distinct shapes than Dynamo's default recompile limit (8), so raise it for this call
                with torch._dynamo.config.patch(recompile_limit=max(_RECOMPILE_LIMIT,
                                                                    torch._dynamo.config.recompile_limit)):
                    return compiled(*args, **kwargs)
            except Exception as e:  # compile-time failure: the step has not run yet
                from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
                from torch._inductor.exc import InductorError

                if not isinstance(e, (TorchDynamoException, InductorError, FailOnRecompileLimitHit)):
                    raise
                _COMPILED[(fn, "failed")] = True
                _warn_once(f"fp4compile.optim: torch.compile of {fn.__name__} failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); running the eager torch step instead")
                return fn(*args, **kwargs)

        _COMPILED[fn] = c
    return c


# ----------------------------------------------------------------------------------------------
# state layout (shared with QRoot's AdamW part)
QSTATE_KEYS = ("step", "seed", "m_codes", "m_scales", "m_gbits", "v_codes", "v_scales", "v_gbits", "v_mean")


def decoded_sqrt_v(state: dict, group: dict) -> torch.Tensor:
    """The flat FP32 sqrt(v) that a quantized parameter ``state`` holds under ``group``'s settings: what the next
    step reads (the decoder's floor included). For inspection: drift studies, tests."""
    signs = state.get("v_signs")
    return codec.decode_v_sqrt(state["v_codes"], state["v_scales"], state["v_gbits"], state["v_mean"],
                               None if signs is None else signs.to(torch.float32), tile=group["tile"], floor=True,
                               chunk=SCALE_CHUNK)


def n_chunks(n: int) -> int:
    """Number of per-chunk global scales of an ``n``-element quantized state."""
    return -(-n // SCALE_CHUNK)


def is_quantized(p: torch.Tensor, group: dict) -> bool:
    """The state of ``p`` is NVFP4 under ``group``'s settings (else FP32, like torch's AdamW)."""
    return bool(group["quantize"]) and p.dim() >= 2 and p.numel() >= group["min_numel"] \
        and p.numel() % group["tile"] == 0


def _param_seed(base: int, index: int) -> int:
    return (base * 1000003 + index * 7919 + 12345) & 0x7FFFFFFF


def _signs(d: Optional[int], seed: int, device) -> Optional[torch.Tensor]:
    if d is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).to(torch.int8).to(device)


def init_state(p: torch.Tensor, group: dict, state: dict, index: int):
    """Fill an empty per-parameter state (zeros decode to zero moments)."""
    dev = p.device
    seed = _param_seed(group["seed"], index)
    state["step"] = torch.zeros((), dtype=torch.float32, device=dev)
    state["seed"] = torch.tensor(seed, dtype=torch.int64, device=dev)
    if is_quantized(p, group):
        n = p.numel()
        for k in ("m", "v"):
            state[f"{k}_codes"] = torch.zeros(n // 2, dtype=torch.uint8, device=dev)
            state[f"{k}_scales"] = torch.zeros(n // 16, dtype=torch.uint8, device=dev)
            state[f"{k}_gbits"] = torch.zeros(n_chunks(n), dtype=torch.int32, device=dev)
            signs = _signs(group[f"{k}_hadamard"], seed + (1 if k == "m" else 2), dev)
            if signs is not None:
                state[f"{k}_signs"] = signs
        state["v_mean"] = torch.zeros(n // group["tile"], dtype=torch.int16, device=dev)
    else:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    if p.dtype == torch.bfloat16 and group["bf16_master"] == "kahan":
        state["comp"] = torch.zeros_like(p, dtype=torch.bfloat16)


def expected_state_spec(p: torch.Tensor, group: dict) -> dict:
    """{key: (shape, dtype)} that the state of ``p`` must have under ``group`` (for load validation)."""
    n = p.numel()
    spec = {"step": ((), torch.float32), "seed": ((), torch.int64)}
    if is_quantized(p, group):
        for k in ("m", "v"):
            spec[f"{k}_codes"] = ((n // 2,), torch.uint8)
            spec[f"{k}_scales"] = ((n // 16,), torch.uint8)
            spec[f"{k}_gbits"] = ((n_chunks(n),), torch.int32)
            if group[f"{k}_hadamard"] is not None:
                spec[f"{k}_signs"] = ((group[f"{k}_hadamard"],), torch.int8)
        spec["v_mean"] = ((n // group["tile"],), torch.int16)
    else:
        spec["exp_avg"] = (tuple(p.shape), None)
        spec["exp_avg_sq"] = (tuple(p.shape), None)
    if p.dtype == torch.bfloat16 and group["bf16_master"] == "kahan":
        spec["comp"] = (tuple(p.shape), None)
    return spec


def validate_state(p: torch.Tensor, group: dict, st: dict, where: str, extra_keys=()):
    """Raise ValueError naming ``where`` if ``st`` is not a valid state for ``p`` under ``group``."""
    spec = expected_state_spec(p, group)
    for k, (shape, dtype) in spec.items():
        if k not in st:
            raise ValueError(f"{where}: missing state entry {k!r} (expected keys {sorted(spec)}); the checkpoint "
                             f"was saved with a different optimizer configuration or parameter")
        t = st[k]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: state entry {k!r} is a {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != shape and not (k.endswith("_gbits") and t.dim() == 0):  # 0-dim: legacy per-tensor
            raise ValueError(f"{where}: state entry {k!r} has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{where}: state entry {k!r} has dtype {t.dtype}, expected {dtype}")
    unknown = set(st) - set(spec) - set(extra_keys)
    if unknown:
        raise ValueError(f"{where}: unexpected state entries {sorted(unknown)} (expected {sorted(spec)})")
    step = st["step"].detach().float().cpu()
    if not bool(torch.isfinite(step)) or float(step) < 0 or float(step) != math.floor(float(step)):
        raise ValueError(f"{where}: corrupt step counter {float(step)}")
    for k in ("m", "v"):
        if f"{k}_codes" not in st:
            continue
        g = st[f"{k}_gbits"].detach().cpu().view(torch.float32)
        if not bool(torch.isfinite(g).all()) or bool((g < 0).any()):
            raise ValueError(f"{where}: corrupt {k} global scale(s) (NaN, Inf or negative)")
        sc = st[f"{k}_scales"].detach().cpu()
        if bool(((sc & 0x7F) == 0x7F).any()) or bool((sc >= 0x80).any()):
            raise ValueError(f"{where}: corrupt {k} block scales (NaN or negative E4M3 bytes)")
        if f"{k}_signs" in st:
            s = st[f"{k}_signs"].detach().cpu()
            if not bool(((s == 1) | (s == -1)).all()):
                raise ValueError(f"{where}: corrupt {k} Hadamard signs (must be +-1)")
    if "v_mean" in st:
        mu = st["v_mean"].detach().cpu().view(torch.bfloat16).float()
        if not bool(torch.isfinite(mu).all()):
            raise ValueError(f"{where}: corrupt second-moment tile means (NaN/Inf)")
    for k in ("exp_avg", "exp_avg_sq", "comp"):
        if k in st and not bool(torch.isfinite(st[k]).all()):
            raise ValueError(f"{where}: state entry {k!r} contains NaN/Inf")
    if "exp_avg_sq" in st and bool((st["exp_avg_sq"] < 0).any()):
        raise ValueError(f"{where}: negative second moment in 'exp_avg_sq'")


def check_group(group: dict):
    """Validate the hyper-parameters of one param group (clear errors, like torch's AdamW)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    elif not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    b1, b2 = group["betas"]
    if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameters: {group['betas']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    if group.get("amsgrad"):
        raise NotImplementedError("QAdamW does not implement amsgrad (its max-of-v state has no NVFP4 codec)")
    if group.get("differentiable"):
        raise NotImplementedError("QAdamW is not differentiable")
    tile = group["tile"]
    if not isinstance(tile, int) or tile <= 0 or tile % 16:
        raise ValueError(f"tile must be a positive multiple of 16, got {tile!r}")
    for k in ("m_hadamard", "v_hadamard"):
        d = group[k]
        if d not in _HADAMARDS:
            raise ValueError(f"{k} must be one of {_HADAMARDS}, got {d!r}")
        if d is not None and tile % d:
            raise ValueError(f"tile ({tile}) must be a multiple of {k} ({d})")
    for k in ("m_rounding", "v_rounding"):
        if group[k] not in ("rtn", "sr"):
            raise ValueError(f"{k} must be 'rtn' or 'sr', got {group[k]!r}")
    if group["v_state"] not in V_STATES:
        raise ValueError(f"v_state must be one of {V_STATES}, got {group['v_state']!r}")
    if group["bf16_master"] not in _MASTER:
        raise ValueError(f"bf16_master must be one of {_MASTER}, got {group['bf16_master']!r}")
    if group["quantize"] and group["v_rounding"] == "rtn":
        _warn_once("fp4compile.optim: v_rounding='rtn' is biased when v is re-encoded every step: with little "
                   "gradient sqrt(v) grows instead of decaying (docs/OPTIM.md); the default 'sr' is not")


QADAMW_DEFAULTS = dict(quantize=True, min_numel=4096, tile=32, m_hadamard=16, v_hadamard=16,
                       m_rounding="sr", m_four_over_six=True, v_rounding="sr", v_four_over_six=True,
                       bf16_master="sr", seed=0, v_state="floored")
#: ``v_state`` values: "floored" (default; the decoder's floor and its clamp at 0 feed the stored EMA) and the
#: experimental "signed" (the stored EMA keeps the unclamped decode's sign; the floor only guards the update's
#: denominator). "signed" halves the zero-gradient drift of the stored sqrt(v) on the CPU stress (docs/OPTIM.md,
#: session 20) but is untried in training, and runs only in the per-parameter torch step (no fused kernel).
V_STATES = ("floored", "signed")


class _LrBuffers:
    """One device tensor per (group, device) holding the current lr, refreshed with ``fill_`` (no sync)."""

    def __init__(self):
        self._bufs = {}

    def get(self, gi: int, lr, device) -> torch.Tensor:
        if isinstance(lr, torch.Tensor):
            return lr.to(device=device, dtype=torch.float32)
        key = (gi, str(device))
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty((), dtype=torch.float32, device=device)
        b.fill_(lr)
        return b


def run_adamw_update(p, state, group, gi, lr_bufs, use_compile):
    """Apply one (Q-)AdamW update to ``p`` with ``state`` under ``group``'s settings."""
    beta1, beta2 = group["betas"]
    g = p.grad
    if g.is_sparse:
        raise RuntimeError("QAdamW does not support sparse gradients")
    kw = dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
              weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]),
              master=group["bf16_master"])
    if state["step"].device != p.device:
        state["step"] = state["step"].to(p.device)
        state["seed"] = state["seed"].to(p.device)
    lr = lr_bufs.get(gi, group["lr"], p.device)
    comp = state.get("comp")
    if "m_codes" in state:
        fn = _compiled(q_adamw_step) if use_compile else q_adamw_step
        fn(p, g, state["m_codes"], state["m_scales"], state["m_gbits"], state["v_codes"], state["v_scales"],
           state["v_gbits"], state["v_mean"], state.get("m_signs"), state.get("v_signs"), state["step"], lr,
           comp, state["seed"], tile=group["tile"], m_rounding=group["m_rounding"],
           m_four_over_six=bool(group["m_four_over_six"]), v_rounding=group["v_rounding"],
           v_four_over_six=bool(group["v_four_over_six"]), v_state=group["v_state"], **kw)
    else:
        fn = _compiled(adamw_step) if use_compile else adamw_step
        fn(p, g, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, comp, state["seed"], **kw)


def _fused():
    from . import fused  # imports Triton: only when a fused step actually runs

    return fused


def use_fused(flag: Optional[bool], p: torch.Tensor) -> bool:
    """Whether a step over parameters like ``p`` runs the fused kernels under the ``fused`` flag."""
    if flag is False:
        return False
    ok = _fused_available(p.device)
    if flag and not ok:
        raise RuntimeError(f"fused=True needs CUDA parameters (or TRITON_INTERPRET=1 on CPU); got a parameter on "
                           f"{p.device}")
    return ok


def _fused_available(device) -> bool:
    if device.type == "cuda":
        return True
    import os

    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_compile(flag, params) -> bool:
    """Whether to torch.compile the per-parameter step: ``flag`` when given, else (None) True exactly when one
    of ``params`` is on CUDA."""
    if flag is None:
        return any(p.is_cuda for p in params)
    return bool(flag)



def init_and_run_fused(opt, gi: int, group: dict, params: list) -> list:
    """Shared first half of QAdamW's and QRoot's (AdamW part) step for the parameters of group ``gi`` that
    have gradients: create missing states (which invalidates the fused kernels' cached tables), then run the
    fused kernels where they apply. Returns the parameters left for the per-parameter step."""
    for p in params:
        state = opt.state[p]
        if not state:
            init_state(p, group, state, opt._param_index(p))
            opt._plan_version += 1
    if use_fused(opt._fused_flag, params[0]):
        lr = opt._lr_bufs.get(gi, group["lr"], params[0].device)
        params = _fused().run_group(opt, gi, group, params, lr, opt._plans, opt._plan_version)
    return params


def invalidate_plans(opt) -> None:
    """Drop the fused kernels' cached pointer tables of ``opt`` (QAdamW or QRoot): states were replaced."""
    opt._plan_version += 1
    opt._plans.clear()


def restore_plan_fields(opt) -> None:
    """After unpickling or ``load_state_dict``: the fused-step fields that are not part of an optimizer's pickled
    state, and the group settings that state dicts saved before them lack (their behaviour then)."""
    opt.__dict__.setdefault("_fused_flag", None)
    opt.__dict__["_plans"] = {}
    opt.__dict__.setdefault("_plan_version", 0)
    for g in opt.param_groups:
        g.setdefault("v_state", "floored")   # session 20

class QAdamW(Optimizer):
    """AdamW with NVFP4 moment states (see the module docstring for the storage format).

    Args (torch.optim.AdamW's, same meaning and defaults): params, lr, betas, eps, weight_decay, amsgrad
        (must be False), maximize. ``fused``: the fused multi-tensor Triton kernels (``fused.py``: one launch
        per param group and kind, no host syncs); None (default) uses them for CUDA parameters, True
        requires them (CUDA, or CPU under ``TRITON_INTERPRET=1``), False runs the per-parameter torch step
        (compiled with ``compile``). Both paths give bit-identical results. ``foreach``/``capturable`` are
        accepted and ignored; ``differentiable`` must be False.
    Quantization (also settable per param group):
        quantize: False keeps FP32 states for the group (plain AdamW).
        min_numel: tensors with fewer elements (or 1-D, or numel % tile != 0) keep FP32 states (4096).
        tile: second-moment mean tile (32 elements, one BF16 mean each).
        m_hadamard / v_hadamard: RHT size for m / v (16; None disables).
        m_rounding, m_four_over_six: "sr", True.   v_rounding, v_four_over_six: "sr", True. (``v_rounding="rtn"``
            has the lower one-shot error but is biased under repeated re-encoding: with little gradient its
            sqrt(v) stalls and then grows geometrically instead of decaying, docs/OPTIM.md; avoid it in training.)
        bf16_master: how BF16 parameters absorb FP32 updates: "sr" | "kahan" | "rtn".
        v_state: "floored" (default) | "signed" (experimental, per-parameter step only; :data:`V_STATES`).
        seed: base seed of the per-tensor Hadamard signs and stochastic-rounding streams.
    compile: torch.compile the per-parameter torch step where it runs (None: on CUDA only).
    """

    #: weight decay is W <- (1 - lr wd) W, outside the gradient (LoRA-SVD's frozen branches follow it)
    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 compile: Optional[bool] = None, **qkw):
        unknown = set(qkw) - set(QADAMW_DEFAULTS)
        if unknown:
            raise TypeError(f"QAdamW got unexpected keyword arguments {sorted(unknown)}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, differentiable=differentiable, **{**QADAMW_DEFAULTS, **qkw})
        super().__init__(params, defaults)
        for g in self.param_groups:
            check_group(g)
        self._compile_flag = compile
        self._fused_flag = fused
        self._lr_bufs = _LrBuffers()
        self._index = {}
        self._plans = {}         # fused-kernel pointer tables per param group (fused.FusedPlan)
        self._plan_version = 0   # bumped whenever states are created or replaced: invalidates the plans

    def add_param_group(self, param_group):
        """Add a parameter group (as ``torch.optim.Optimizer.add_param_group``: missing hyperparameters take the
        constructor's defaults), then validate it; a bad value raises ``ValueError`` and leaves the optimizer's
        groups as they were."""
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def _param_index(self, p) -> int:
        return param_index(self, p)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step (``closure`` re-evaluates the loss, as in torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        use_compile = None
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            params = init_and_run_fused(self, gi, group, params)
            for p in params:
                if use_compile is None:
                    use_compile = resolve_compile(self._compile_flag, [p])
                run_adamw_update(p, self.state[p], group, gi, self._lr_bufs, use_compile)
        return loss

    def load_state_dict(self, state_dict):
        """Load a state dict; every entry is validated first, so a bad one raises and changes nothing."""
        validate_loadable(self, state_dict)
        super().load_state_dict(state_dict)
        post_load(self, state_dict)
        invalidate_plans(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        restore_plan_fields(self)


def param_index(opt: Optimizer, p) -> int:
    """Position of ``p`` among ``opt``'s parameters (keys its random streams); cached in ``opt._index``."""
    if not opt._index:
        i = 0
        for g in opt.param_groups:
            for q in g["params"]:
                opt._index[id(q)] = i
                i += 1
    return opt._index.get(id(p), len(opt._index))


def validate_loadable(opt: Optimizer, state_dict, extra_keys=(), *, check_group_fn=None, validate_entry=None):
    """Raise ``ValueError`` (naming the group/parameter) unless ``state_dict`` fits ``opt``; changes nothing.

    ``check_group_fn(merged_group)`` validates a group's hyperparameters (default: Q-AdamW's) and
    ``validate_entry(p, merged_group, state, where)`` one parameter's state (default: Q-AdamW's)."""
    check_group_fn = check_group_fn or check_group
    if validate_entry is None:
        def validate_entry(p, merged, st, where):
            validate_state(p, merged, st, where, extra_keys)
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state dict: expected a dict with 'state' and 'param_groups'")
    groups, saved = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved):
        raise ValueError(f"loaded state dict has {len(saved)} parameter groups, the optimizer has {len(groups)}")
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"parameter group {gi}: loaded state dict has {len(sg['params'])} parameters, the "
                             f"optimizer has {len(g['params'])}")
    for gi, (g, sg) in enumerate(zip(groups, saved)):
        merged = {**g, **{k: v for k, v in sg.items() if k != "params"}}
        try:
            check_group_fn(merged)
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"parameter group {gi} of the loaded state dict: {e}") from None
        for p, pid in zip(g["params"], sg["params"]):
            st = state_dict["state"].get(pid)
            if st is None:
                continue
            validate_entry(p, merged, st, f"param {pid} (group {gi}, shape {tuple(p.shape)})")


def post_load(opt: Optimizer, state_dict):
    """Undo torch's cast of every state tensor to the parameter dtype (``Optimizer.load_state_dict`` casts
    integer codes too, and FP32 moments of a BF16 parameter must stay FP32 for a bit-exact resume) and move
    the step counters to the parameter's device."""
    saved_groups = state_dict["param_groups"]
    for group, sg in zip(opt.param_groups, saved_groups):
        for p, pid in zip(group["params"], sg["params"]):
            st = opt.state.get(p)
            saved = state_dict["state"].get(pid)
            if not st or saved is None:
                continue
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and k != "step" and v.dtype != p.dtype:
                    st[k] = v.detach().to(device=p.device).clone()
                if k.endswith("_gbits") and v.dim() == 0:
                    # a checkpoint with one global scale per tensor (before per-chunk scales): the same scale
                    # for every chunk decodes to exactly the same values
                    st[k] = v.detach().to(device=p.device).expand(n_chunks(p.numel())).clone()
            if "step" in st:
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


def _warn_once(msg, _seen=set()):
    if msg not in _seen:
        _seen.add(msg)
        warnings.warn(msg, stacklevel=3)
