"""NVFP4 x NVFP4 GEMM for sm_90 (Hopper has no FP4 tensor cores): dequantize to exact BF16, BF16 wgmma.

``C[M, N] = alpha * sum_b (S^A[m,b] * S^B[n,b]) * sum_{k in b} qA[m,k] * qB[n,k]``, alpha = a_global * b_global
(TN layout: A codes ``[M, K/2]``, B codes ``[N, K/2]``, both quantized along K; see
``/work/shared/notes/nvfp4-format.md`` section 11 and ``fp4compile.ops._gemm_reference``).

How the kernels compute it, exactly:

* Each E2M1 x E4M3 product ``q * S`` has at most 6 significant bits and lies in [2^-10, 2688], so it is exact
  in BF16. In-kernel dequantization forms ``q * S * 2^-8`` (the 2^-8 keeps every intermediate a normal
  number and is a power of two, so it changes no rounding) and feeds it to ``tl.dot`` (wgmma on Hopper)
  with FP32 accumulation; a pre-dequantized operand holds ``q * S`` exactly.
* At the end ``acc * 2^16 * alpha`` (or ``2^8`` with one pre-dequantized operand) is the reference's
  ``(A @ B^T) * (a_global * b_global)`` up to the FP32 accumulation order. The global scales are never
  folded into the BF16 operands (that would round).
* E2M1 -> float by bit placement: code ``s e1 e0 m`` becomes the float whose sign is ``s`` and whose lowest
  exponent bits and top mantissa bit are ``e1 e0 m``; that float equals ``q * 2^-126`` for every code (the
  code for 0.5 becomes a subnormal), and the E4M3 scale pre-multiplied by 2^118 brings the product to
  ``q * S * 2^-8``.

Implementations (``impl=``; the registered op uses :data:`DEFAULT_IMPL`, ``"auto"``; measurements and the
SASS analysis of each are in docs/BENCHMARKS.md ## GEMM):

* ``"half"`` (:func:`_bf16_nvfp4_gemm_kernel`): the operand with fewer rows is dequantized once to bf16 by
  :func:`dequantize_bf16`; the other is dequantized tile by tile in registers and stored to shared memory;
  both wgmma operands come from shared memory.
* ``"half_rega"`` (:func:`_nvfp4_bf16_gemm_kernel`): same split, the NVFP4 operand is the wgmma register
  operand (Triton pipelines the dot, but ptxas serializes the HGMMAs).
* ``"full"`` (:func:`_nvfp4_gemm_kernel`): both operands dequantized inside the GEMM; no bf16 copies.
* ``"dequant_cublas"`` (:func:`gemm_dequant_cublas`): both operands dequantized to bf16, cuBLAS with FP32
  output, then the scale and the cast.
* ``"dq_triton"`` (:func:`gemm_dequant_triton`): both operands dequantized to exact bf16 ``q * S`` by one
  Triton pass each, then a persistent TMA bf16 GEMM (:func:`bf16_gemm_scaled`) whose epilogue multiplies
  the FP32 accumulator by ``a_global * b_global`` and rounds once to the output dtype. The dequantization
  leaves the tensor cores' critical path entirely (it is a memory-bound pass: 0.5625 bytes read, 2 written
  per element, and the GEMM then reads 2 bytes per element instead of 0.5625); the GEMM runs at bf16 rate.
* ``"dq_splitk"``: the same dequantization, then a deterministic split-K TMA GEMM (:func:`bf16_gemm_splitk`:
  FP32 partial sums per K range, summed in FP32, scaled, rounded once) for long-K GEMMs with few output
  tiles (wgrad: K = tokens, 768x768 outputs are 36 tiles on 132 SMs).
* ``"wgmma"`` (:func:`fp4compile.kernels.gemm_wgmma.nvfp4_gemm_wgmma`, Gluon): codes staged by cp.async,
  dequantized in the main loop into double-buffered shared memory while the tensor cores run the previous
  K-tile's async wgmma; no bf16 copy in global memory. K % 64 == 0. Measured slower than ``"dq_triton"``
  (0.15-0.55x cuBLAS vs 0.3-0.95x, session 25): never picked by ``"auto"``; the module says why.
* ``"mixed"`` (:func:`fp4compile.kernels.gemm_wgmma.nvfp4_gemm_mixed`, Gluon): B dequantized once to bf16 in the
  wgmma's K order (:func:`~fp4compile.kernels.gemm_wgmma.prepare_b`), A decoded in the main loop straight into
  the wgmma's register fragment, one 32-deep wgmma always in flight, the tile's two warpgroups as two
  partitions (:data:`MIXED_DEFAULT`'s config unless ``config`` names one of ``MIXED_CONFIGS``). CUDA, K % 64 == 0.
* ``"auto"``: one of the above per shape (:func:`choose_impl`).
* ``"tuned"``: the fastest of :data:`TUNED_CANDIDATES`, timed on the first call of each shape (a
  measurement tool; choices in :data:`TUNED_CHOICES`).

"Dequantize to exact bf16, then a bf16 tensor-core GEMM" is faithful NVFP4 on sm_90: every product
``(q_a S_a)(q_b S_b)`` is exact in the wgmma, sums are FP32, the global scales multiply the FP32 result.
What it costs is memory traffic and, for the graph, transient bf16 operand copies (freed after the GEMM,
never saved for backward: the op takes packed codes).

All Triton GEMMs are autotuned per (M, N, K, out dtype) on first use (a few configs; see ``*_CONFIGS``; the
choice is kept in Triton's disk cache for later processes, :data:`AUTOTUNE_CACHE`) and
use a GROUP_M-swizzled tile order; M, N tails wrap in the loads and are masked in the store, a K tail (K a
multiple of 16 but not of BLOCK_K) is masked.

Two dequantization paths (``DEQUANT``): ``"fp32"`` (portable Triton, runs under ``TRITON_INTERPRET=1``) and
``"asm"`` (inline PTX, sm_90), both in :mod:`fp4compile.kernels.dequant` (shared with the attention backward).

Public names: :func:`nvfp4_gemm` (the launcher; also callable eagerly on CPU tensors under the interpreter),
:func:`choose_impl`, :func:`dequantize_bf16`, :func:`gemm_dequant_cublas`, :func:`gemm_dequant_triton`,
:func:`gemm_dequantized`, :func:`bf16_gemm_scaled`, :func:`bf16_gemm_splitk`, :func:`splitk_factor`, :func:`tma_ok`.
Importing this module registers :func:`nvfp4_gemm` as the CUDA kernel of ``fp4compile::gemm`` and
:func:`gemm_dequantized` as that of ``fp4compile::gemm_dequantized``; it imports cleanly on machines without CUDA.
"""
from __future__ import annotations

import hashlib
import json
import functools
import os
import warnings
from typing import Optional

import torch

from .. import determinism
from .. import ops as _ops  # noqa: F401  (defines fp4compile::gemm before we register against it)
from .dequant import DEFAULT_DEQUANT, _dequant_rows, _dequant_tile  # noqa: F401  (jitted helpers the kernels call)
from .gemm_wgmma import MIXED_SPLIT_ATMA, nvfp4_gemm_wgmma
from .launch import cdiv, launch, placeholder, stable_cache_keys

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton is a hard dependency on GPU machines only
    triton = None
    tl = None
    TensorDescriptor = None

__all__ = ["nvfp4_gemm", "choose_impl", "mixed_wins", "dequantize_bf16", "dequantize_pair_bf16", "gemm_dequant_cublas",
           "gemm_dequantized", "gemm_dequant_triton", "bf16_gemm_scaled", "deterministic_configs", "first_that_fits",
           "bf16_gemm_splitk", "splitk_factor",
           "tma_ok", "GEMM_CONFIGS", "HALF_CONFIGS", "HALF_REGA_CONFIGS", "TMA_CONFIGS", "SPLITK_CONFIG",
           "DEFAULT_DEQUANT", "DEFAULT_IMPL", "DQ_IMPLS"]

#: implementation used by the registered CUDA op: "auto" (per shape, see :func:`choose_impl`), "half" (the
#: operand with fewer rows pre-dequantized to bf16 by one Triton pass, the other dequantized tile by tile
#: inside the GEMM), "half_rega", "full" (both dequantized inside the GEMM), "dequant_cublas" (both
#: pre-dequantized, cuBLAS), "dq_triton" / "dq_splitk" (both pre-dequantized, Triton TMA GEMM with the scaled
#: epilogue; split-K for long K on small outputs). See docs/BENCHMARKS.md for the measurements.
DEFAULT_IMPL = os.environ.get("FP4COMPILE_GEMM_IMPL", "auto")
IMPLS = ("auto", "tuned", "half", "half_rega", "full", "dequant_cublas", "dq_triton", "dq_splitk", "wgmma", "mixed")
#: the implementations that dequantize both operands to exact bf16 and then run a bf16 GEMM: the ones that
#: :func:`gemm_dequantized` (``fp4compile::gemm_dequantized``) does from operands dequantized already
DQ_IMPLS = ("dequant_cublas", "dq_triton", "dq_splitk")
#: "dequant_cublas" on CUDA: the FP32 cuBLAS product's global scales, bias and cast in one Triton pass
#: (:func:`_scale_cast_kernel`) instead of three eager torch kernels (the scales' product, the in-place multiply, the
#: cast; 48 + 48 + 48 launches and 0.46 ms of a 124M step, session 33's profile). The same values. On since session
#: 34's H200 A/B (interleaved, ``bench/step_ab.py``: off +0.34 ms per step, 48.03 vs 47.69 ms);
#: ``FP4COMPILE_SCALE_CAST=0`` turns it off at import.
SCALE_CAST = os.environ.get("FP4COMPILE_SCALE_CAST", "1") != "0"
#: candidates that ``impl="tuned"`` times on the first call of each shape
TUNED_CANDIDATES = ("full", "dequant_cublas", "dq_triton", "dq_splitk", "mixed")
#: ``impl="auto"`` picks ``"mixed"`` for the shapes :func:`mixed_wins` names (``FP4COMPILE_GEMM_MIXED=0``: never)
MIXED_AUTO = os.environ.get("FP4COMPILE_GEMM_MIXED", "1") != "0"
#: the tile ``impl="mixed"`` uses unless given one (one of :data:`~fp4compile.kernels.gemm_wgmma.MIXED_CONFIGS`): the
#: 128 x 256 ``SPLIT`` tile with a 4-slot B ring, on the 124M dgrad shapes that ``auto`` sends here 2-5 % faster than
#: the one-partition ``HALVES`` tile in two runs (H100, session 74); since session 78 with A by TMA
#: (:data:`~fp4compile.kernels.gemm_wgmma.MIXED_SPLIT_ATMA`; the linear-only 124M step 0.17 ms faster, 95 % CI
#: [-0.20, -0.14] ms, H100), which falls back to A's global loads where rows are not whole 16-byte pieces
MIXED_DEFAULT = MIXED_SPLIT_ATMA
#: ``impl="tuned"``'s choices so far: (M, N, K, out dtype, device index) -> (impl, {impl: ms})
TUNED_CHOICES: dict = {}


def choose_impl(M: int, N: int, K: int, out_dtype=torch.bfloat16) -> str:
    """The implementation ``impl="auto"`` uses for an ``[M, K] x [N, K]^T`` GEMM.

    Rule from the H200 measurements in docs/BENCHMARKS.md (## GEMM), by **GPU time** (``bench/gemm.py --lower
    --cudagraph``; 1B / square shapes by ``--lower``, where GPU time dominates): the training step is meant to
    run under CUDA graphs (``mode="reduce-overhead"``), where a GEMM's host-side launch cost is not paid per
    step. (Launched eagerly, the 124M step is host-bound and fewer launches per GEMM would matter more.)

    * skinny problems (min(M, N) <= 256): ``"full"`` (no bf16 copy; memory-bound anyway);
    * shapes the TMA kernel cannot take (row strides not 16-byte aligned): the earlier rule
      (``"dequant_cublas"`` for long K on large outputs, else ``"full"`` / ``"half"``);
    * long contractions on small outputs (K >= 8192 and M*N < 2^22: the wgrad GEMMs of d <= 1024 models,
      K = tokens): ``"dequant_cublas"`` (cuBLAS splits K; 60-165 us vs 103-202 for dq_triton on the 124M wgrads);
    * many rows and a narrow output (:func:`mixed_wins`, sm_90 with Gluon, :data:`MIXED_AUTO`): ``"mixed"``
      (the 124M dgrad shapes: 103-133 us against dq_triton's 120-161 on an H100, session 73);
    * otherwise ``"dq_triton"`` (124M fprop/dgrad: 0.67-0.81x cuBLAS BF16 GPU time, vs 0.44-0.49x for
      ``"full"``; 1B linears 0.65-0.82x per call incl. launch cost).
    """
    if min(M, N) <= 256:
        return "full"
    if MIXED_AUTO and mixed_wins(M, N, K):
        return "mixed"
    if not tma_ok(M, N, K, out_dtype):
        if K >= 4096 and M * N >= 8 * 2 ** 20:
            return "dequant_cublas"
        if min(M, N) <= 768 or K <= 1024:
            return "full"
        return "half"
    if K >= 8192 and M * N < 2 ** 22:
        return "dequant_cublas"
    return "dq_triton"


def mixed_wins(M: int, N: int, K: int) -> bool:
    """Where ``"mixed"`` beat ``"dq_triton"`` (the op as registered, B's preparation included; H100, session 73): many
    rows, a narrow output and K of 768-3072 (the 124M dgrad shapes and the attention projection: 103-133 against
    120-161 us; with session 74's default tile 94, 38 and 123 us against 121, 45 and 159), where dequantizing A costs
    ``"dq_triton"`` more than the in-loop decode costs the mixed kernel; it lost on the wide outputs (qkv / fc1 fprop
    112-147 against 100-130 us), the squares and the long-K wgrads. Needs Gluon and an sm_90 GPU."""
    if not (M >= 8192 and N <= 1024 and 768 <= K <= 4096 and K % 64 == 0):
        return False
    return _mixed_runs()


@functools.lru_cache(maxsize=None)
def _mixed_runs() -> bool:
    from .gemm_wgmma import available

    return available() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _check_inputs(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype):
    for name, t in (("a_codes", a_codes), ("a_scales", a_scales), ("b_codes", b_codes), ("b_scales", b_scales)):
        if t.dim() != 2:
            raise ValueError(f"fp4compile::gemm: {name} must be 2D, got shape {tuple(t.shape)}")
        if t.dtype != torch.uint8:
            raise TypeError(f"fp4compile::gemm: {name} must be uint8 (scales as raw E4M3 bytes), got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"fp4compile::gemm: {name} must be contiguous")
    M, Kh = a_codes.shape
    N, Kh_b = b_codes.shape
    if Kh != Kh_b:
        raise ValueError(f"fp4compile::gemm: K mismatch: A has K={2 * Kh}, B has K={2 * Kh_b}")
    K = 2 * Kh
    if K % 16 != 0:
        raise ValueError(f"fp4compile::gemm: K must be a multiple of 16 (NVFP4 block), got K={K}")
    if tuple(a_scales.shape) != (M, K // 16) or tuple(b_scales.shape) != (N, K // 16):
        raise ValueError(f"fp4compile::gemm: scales must be [rows, K/16]: got A {tuple(a_scales.shape)}, "
                         f"B {tuple(b_scales.shape)} for M={M}, N={N}, K={K}")
    if a_global.numel() != 1 or b_global.numel() != 1:
        raise ValueError("fp4compile::gemm: global scales must be 1-element tensors")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp4compile::gemm: out_dtype must be bfloat16 or float32, got {out_dtype}")
    return M, N, K


if triton is not None:
    @triton.jit
    def _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of output tile ``tile_id`` in grouped order: GROUP_M row-tiles in a row share their
        B column-tiles in L2."""
        num_pid_in_group = GROUP_M * num_pid_n
        first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _nvfp4_gemm_kernel(a_ptr, as_ptr, ag_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr,
                           M, N, K, stride_a, stride_as, stride_b, stride_bs, stride_c,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DEQUANT_ASM: tl.constexpr,
                           OUT_FP32: tl.constexpr, K_ITERS: tl.constexpr = 0):
        # K_ITERS > 0 only under TRITON_INTERPRET=1 (CPU tests): a compile-time trip count (the interpreter's
        # loops cannot take a runtime bound with NumPy >= 2.4) and an fp32 dot (see below).
        # K_ITERS == 0 (CUDA): the runtime trip count cdiv(K, BLOCK_K) and a bf16 dot.
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        # rows beyond M/N wrap around (loads stay in bounds, no mask); the store is masked
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_kb[None, :]
        as_ptrs = as_ptr + offs_m.to(tl.int64)[:, None] * stride_as + offs_ks[None, :]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_b + offs_kb[None, :]
        bs_ptrs = bs_ptr + offs_n.to(tl.int64)[:, None] * stride_bs + offs_ks[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K_ITERS if K_ITERS > 0 else tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a_c = tl.load(a_ptrs)
                a_s = tl.load(as_ptrs)
                b_c = tl.load(b_ptrs)
                b_s = tl.load(bs_ptrs)
            else:
                kb_left = K // 2 - kk * (BLOCK_K // 2)
                ks_left = K // 16 - kk * (BLOCK_K // 16)
                a_c = tl.load(a_ptrs, mask=offs_kb[None, :] < kb_left, other=0)
                a_s = tl.load(as_ptrs, mask=offs_ks[None, :] < ks_left, other=0)
                b_c = tl.load(b_ptrs, mask=offs_kb[None, :] < kb_left, other=0)
                b_s = tl.load(bs_ptrs, mask=offs_ks[None, :] < ks_left, other=0)
            a = _dequant_tile(a_c, a_s, BLOCK_M, BLOCK_K, DEQUANT_ASM)
            b = _dequant_tile(b_c, b_s, BLOCK_N, BLOCK_K, DEQUANT_ASM)
            if K_ITERS > 0:
                # interpreter only: its tl.dot multiplies the raw uint16 bits of bf16 operands, so feed the
                # (exactly representable) values as fp32; same products, same fp32 accumulation
                acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K // 2
            b_ptrs += BLOCK_K // 2
            as_ptrs += BLOCK_K // 16
            bs_ptrs += BLOCK_K // 16

        alpha = tl.load(ag_ptr).to(tl.float32) * tl.load(bg_ptr).to(tl.float32)
        out = (acc * 65536.0) * alpha
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_c + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if OUT_FP32:
            tl.store(c_ptrs, out, mask=mask)
        else:
            tl.store(c_ptrs, out.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _nvfp4_bf16_gemm_kernel(a_ptr, as_ptr, ag_ptr, b_ptr, bg_ptr, c_ptr,
                                M, N, K, stride_a, stride_as, stride_b, stride_cm, stride_cn,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DEQUANT_ASM: tl.constexpr,
                                OUT_FP32: tl.constexpr, PREFETCH_S: tl.constexpr = False,
                                K_ITERS: tl.constexpr = 0):
        """Half-fused variant: A is NVFP4 (dequantized in registers: the wgmma register operand), B is the
        exact bf16 ``q * S`` of the other operand (from :func:`dequantize_bf16`), streamed through shared
        memory by the pipeliner so the wgmma can stay in flight while the next A tile is dequantized.
        C[m, n] is written at ``c_ptr + m * stride_cm + n * stride_cn`` (transposed output when swapped).
        PREFETCH_S: load the block scales one iteration ahead into registers (with BLOCK_K=64 a scale row is
        4 bytes, too narrow for the pipeliner's async copies, so the plain load would stall every iteration)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_kb[None, :]
        as_ptrs = as_ptr + offs_m.to(tl.int64)[:, None] * stride_as + offs_ks[None, :]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_b + offs_k[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PREFETCH_S:
            a_s_next = tl.load(as_ptrs, mask=offs_ks[None, :] < K // 16, other=0)
        for kk in range(0, K_ITERS if K_ITERS > 0 else tl.cdiv(K, BLOCK_K)):
            if PREFETCH_S:
                a_s = a_s_next
                a_s_next = tl.load(as_ptrs + BLOCK_K // 16,
                                   mask=offs_ks[None, :] < K // 16 - (kk + 1) * (BLOCK_K // 16), other=0)
            if EVEN_K:
                a_c = tl.load(a_ptrs)
                if not PREFETCH_S:
                    a_s = tl.load(as_ptrs)
                b = tl.load(b_ptrs)
            else:
                a_c = tl.load(a_ptrs, mask=offs_kb[None, :] < K // 2 - kk * (BLOCK_K // 2), other=0)
                if not PREFETCH_S:
                    a_s = tl.load(as_ptrs, mask=offs_ks[None, :] < K // 16 - kk * (BLOCK_K // 16), other=0)
                b = tl.load(b_ptrs, mask=offs_k[None, :] < K - kk * BLOCK_K, other=0.0)
            a = _dequant_tile(a_c, a_s, BLOCK_M, BLOCK_K, DEQUANT_ASM)
            if K_ITERS > 0:  # interpreter: fp32 dot (see _nvfp4_gemm_kernel)
                acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K // 2
            as_ptrs += BLOCK_K // 16
            b_ptrs += BLOCK_K

        alpha = tl.load(ag_ptr).to(tl.float32) * tl.load(bg_ptr).to(tl.float32)
        out = (acc * 256.0) * alpha
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if OUT_FP32:
            tl.store(c_ptrs, out, mask=mask)
        else:
            tl.store(c_ptrs, out.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _bf16_nvfp4_gemm_kernel(a_ptr, ag_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr,
                                M, N, K, stride_a, stride_b, stride_bs, stride_c,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DEQUANT_ASM: tl.constexpr,
                                OUT_FP32: tl.constexpr, TRANS_OUT: tl.constexpr = False,
                                PREFETCH_S: tl.constexpr = False, K_ITERS: tl.constexpr = 0):
        """Half-fused variant with the roles swapped: A is the exact bf16 ``q * S`` operand (pipelined
        through shared memory by async copies), B is NVFP4, dequantized in registers and stored to shared
        memory for the wgmma. Both wgmma operands then come from shared memory (no register-operand
        serialization); the dequantization of the next tile is not overlapped inside one CTA, but between
        the CTAs resident on an SM. TRANS_OUT: C is stored as ``c[n, m]`` (row stride ``stride_c``), i.e. the
        kernel computes the transpose of the op's product (the tile is transposed in registers first, so the
        store stays coalesced). PREFETCH_S: see :func:`_nvfp4_bf16_gemm_kernel`."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_b + offs_kb[None, :]
        bs_ptrs = bs_ptr + offs_n.to(tl.int64)[:, None] * stride_bs + offs_ks[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PREFETCH_S:
            b_s_next = tl.load(bs_ptrs, mask=offs_ks[None, :] < K // 16, other=0)
        for kk in range(0, K_ITERS if K_ITERS > 0 else tl.cdiv(K, BLOCK_K)):
            if PREFETCH_S:
                b_s = b_s_next
                b_s_next = tl.load(bs_ptrs + BLOCK_K // 16,
                                   mask=offs_ks[None, :] < K // 16 - (kk + 1) * (BLOCK_K // 16), other=0)
            if EVEN_K:
                a = tl.load(a_ptrs)
                b_c = tl.load(b_ptrs)
                if not PREFETCH_S:
                    b_s = tl.load(bs_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - kk * BLOCK_K, other=0.0)
                b_c = tl.load(b_ptrs, mask=offs_kb[None, :] < K // 2 - kk * (BLOCK_K // 2), other=0)
                if not PREFETCH_S:
                    b_s = tl.load(bs_ptrs, mask=offs_ks[None, :] < K // 16 - kk * (BLOCK_K // 16), other=0)
            b = _dequant_tile(b_c, b_s, BLOCK_N, BLOCK_K, DEQUANT_ASM)
            if K_ITERS > 0:  # interpreter: fp32 dot (see _nvfp4_gemm_kernel)
                acc = tl.dot(a.to(tl.float32), tl.trans(b).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // 2
            bs_ptrs += BLOCK_K // 16

        alpha = tl.load(ag_ptr).to(tl.float32) * tl.load(bg_ptr).to(tl.float32)
        out = (acc * 256.0) * alpha
        if not OUT_FP32:
            out = out.to(tl.bfloat16)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if TRANS_OUT:
            c_ptrs = c_ptr + rn.to(tl.int64)[:, None] * stride_c + rm[None, :]
            tl.store(c_ptrs, tl.trans(out), mask=(rn[:, None] < N) & (rm[None, :] < M))
        else:
            c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_c + rn[None, :]
            tl.store(c_ptrs, out, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _dequant_kernel(c_ptr, s_ptr, o_ptr, R, KH, stride_c, stride_s, stride_o,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DEQUANT_ASM: tl.constexpr):
        """Stand-alone dequantization to bf16 ``q * S`` (no global scale); for the cuBLAS baseline."""
        _dequant_rows(c_ptr, s_ptr, o_ptr, R, KH, tl.program_id(0), tl.program_id(1), BLOCK_R, BLOCK_K, DEQUANT_ASM,
                      stride_c, stride_s, stride_o)


    @triton.jit
    def _tma_tile(a_desc, b_desc, c_desc, alpha, bias_ptr, N, tile_id, num_pid_m, num_pid_n, k_tiles,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  EPI_SUBTILE: tl.constexpr, INTERP: tl.constexpr, HAS_BIAS: tl.constexpr):
        pid_m, pid_n = _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M
        offs_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([offs_m, ki * BLOCK_K])
            b = b_desc.load([offs_n, ki * BLOCK_K])
            if INTERP:  # interpreter: fp32 dot of the (exact) bf16 values, see _nvfp4_gemm_kernel
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        out = acc * alpha
        if HAS_BIAS:  # the bias in FP32 before the one rounding (cuBLAS's bias epilogue)
            cols = offs_n + tl.arange(0, BLOCK_N)
            out = out + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if EPI_SUBTILE:  # two half-width stores: smaller epilogue buffer, the second overlaps the first
            o = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            o0, o1 = tl.split(o)
            c_desc.store([offs_m, offs_n], o0.to(c_desc.dtype))
            c_desc.store([offs_m, offs_n + BLOCK_N // 2], o1.to(c_desc.dtype))
        else:
            c_desc.store([offs_m, offs_n], out.to(c_desc.dtype))

    @triton.jit
    def _bf16_tma_gemm_kernel(a_desc, b_desc, c_desc, ag_ptr, bg_ptr, bias_ptr, M, N, K,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, EPI_SUBTILE: tl.constexpr,
                              WARP_SPEC: tl.constexpr, FLATTEN: tl.constexpr, OUT_FP32: tl.constexpr = False,
                              K_ITERS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
        """Persistent TMA bf16 x bf16 -> bf16/fp32 GEMM, TN (A [M, K], B [N, K], both K-major), for operands
        that :func:`dequantize_bf16` made exact ``q * S``: ``C = (A @ B^T) * (a_global * b_global)`` with
        FP32 accumulation and one final rounding (the global scales are applied to the FP32 accumulator
        in the epilogue, never to the operands). Tensor descriptors zero-fill out-of-bounds loads (M, N, K
        tails) and clip the stores. ``NUM_SMS`` programs stride over the GROUP_M-swizzled output tiles.
        ``HAS_BIAS``: ``C = (A @ B^T) * (a_global * b_global) + bias`` ([N], added in FP32 before the rounding).
        K_ITERS > 0 only under TRITON_INTERPRET=1: one tile per program and a compile-time K trip count."""
        start_pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        alpha = tl.load(ag_ptr).to(tl.float32) * tl.load(bg_ptr).to(tl.float32)
        if K_ITERS > 0:
            _tma_tile(a_desc, b_desc, c_desc, alpha, bias_ptr, N, start_pid, num_pid_m, num_pid_n, K_ITERS,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPI_SUBTILE, True, HAS_BIAS)
        else:
            k_tiles = tl.cdiv(K, BLOCK_K)
            num_tiles = num_pid_m * num_pid_n
            for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
                _tma_tile(a_desc, b_desc, c_desc, alpha, bias_ptr, N, tile_id, num_pid_m, num_pid_n, k_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPI_SUBTILE, False, HAS_BIAS)


    @triton.jit
    def _bf16_tma_splitk_kernel(a_desc, b_desc, ws_ptr, M, N, K_TILES_PER_SPLIT,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                K_ITERS: tl.constexpr = 0):
        """Split-K partial products for long-K, small-output GEMMs (the wgrad shapes: K = tokens): program
        (tile, split) accumulates its K range in FP32 and stores the raw partial sum to
        ``ws[split, M, N]`` (FP32); the caller sums the splits, applies the global scales and rounds once."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        offs_m = pid_m * BLOCK_M
        offs_n = pid_n * BLOCK_N
        k0 = split * K_TILES_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, K_ITERS if K_ITERS > 0 else K_TILES_PER_SPLIT):
            a = a_desc.load([offs_m, (k0 + ki) * BLOCK_K])
            b = b_desc.load([offs_n, (k0 + ki) * BLOCK_K])
            if K_ITERS > 0:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        rm = offs_m + tl.arange(0, BLOCK_M)
        rn = offs_n + tl.arange(0, BLOCK_N)
        ptrs = ws_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


    @triton.jit
    def _scale_cast_kernel(acc_ptr, ag_ptr, bg_ptr, bias_ptr, out_ptr, N, numel, BLOCK: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
        """The FP32 product of a cuBLAS GEMM to its result in one pass: ``out = acc * (a_global * b_global)
        [+ bias]``, rounded once to ``out``'s dtype (the torch ops' values: two FP32 products, the add, one cast;
        launched without FMA contraction). ``acc`` and ``out`` contiguous [M, N]."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        alpha = tl.load(ag_ptr).to(tl.float32) * tl.load(bg_ptr).to(tl.float32)
        y = tl.load(acc_ptr + offs, mask=mask, other=0.0) * alpha
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant2_kernel(ac_ptr, as_ptr, ao_ptr, RA, bc_ptr, bs_ptr, bo_ptr, RB, KH, NBLK_A,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DEQUANT_ASM: tl.constexpr):
        """Both GEMM operands (same K, contiguous) dequantized to exact bf16 ``q * S`` in ONE launch:
        row-blocks [0, NBLK_A) are A's, the rest B's (one launch instead of two: less host overhead)."""
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        if pid_r < NBLK_A:
            _dequant_rows(ac_ptr, as_ptr, ao_ptr, RA, KH, pid_r, pid_k, BLOCK_R, BLOCK_K, DEQUANT_ASM)
        else:
            _dequant_rows(bc_ptr, bs_ptr, bo_ptr, RB, KH, pid_r - NBLK_A, pid_k, BLOCK_R, BLOCK_K, DEQUANT_ASM)


def _cfg(bm, bn, bk, warps, stages, group_m=8, **extra):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages, **extra)


#: autotuning space of the ``"half"`` kernel (the default; M = rows of the bf16 operand, N = rows of the
#: NVFP4 operand). BLOCK_K=64 tiles prefetch their 4-byte scale rows; BLOCK_K=128 ones are pipelined.
HALF_CONFIGS = [
    _cfg(128, 128, 64, 8, 3, PREFETCH_S=True),
    _cfg(128, 128, 64, 8, 4, PREFETCH_S=True),
    _cfg(128, 256, 64, 8, 3, PREFETCH_S=True),
    _cfg(256, 128, 64, 8, 3, PREFETCH_S=True),
    _cfg(256, 128, 64, 8, 4, PREFETCH_S=True),
    _cfg(128, 128, 128, 8, 2),
    _cfg(64, 128, 128, 4, 3),
    _cfg(64, 64, 128, 4, 4),
]

#: autotuning space of the ``"full"`` kernel (both operands NVFP4; best tiles of the first H200 sweep)
GEMM_CONFIGS = [
    _cfg(128, 256, 128, 8, 3),
    _cfg(128, 128, 64, 4, 4),
    _cfg(256, 128, 64, 8, 3),
    _cfg(64, 128, 128, 4, 4),
]

#: autotuning space of the ``"half_rega"`` kernel (NVFP4 operand as the wgmma register operand)
HALF_REGA_CONFIGS = [
    _cfg(128, 128, 64, 8, 3, PREFETCH_S=True),
    _cfg(128, 256, 64, 8, 3, PREFETCH_S=True),
    _cfg(128, 128, 128, 8, 3),
    _cfg(64, 64, 128, 4, 4),
]


#: autotuning space of the persistent TMA bf16 GEMM behind ``"dq_triton"`` (Hopper wgmma tiles; configs that
#: do not fit shared memory are dropped by the autotuner)
TMA_CONFIGS = [
    _cfg(128, 256, 64, 8, 3, EPI_SUBTILE=True),
    # the same tile with the persistent loop flattened (``tl.range(flatten=True)``: the next tile's loads are
    # issued while the current tile's epilogue runs): matched cuBLAS on the 124M fprop shapes in the GPU-time
    # table of docs/BENCHMARKS.md "GEMM" (2026-11-29: qkv.fprop 84 vs 94 us unflattened, fc1.fprop 116 vs 123,
    # proj.fprop 31 vs 34) and lost on the wgrad shapes (153 vs 86 us), which the autotuner then leaves
    _cfg(128, 256, 64, 8, 3, EPI_SUBTILE=True, FLATTEN=True),
    _cfg(128, 128, 64, 8, 4, EPI_SUBTILE=False),
    _cfg(128, 128, 64, 4, 4, EPI_SUBTILE=False),
    _cfg(256, 128, 64, 8, 3, EPI_SUBTILE=True),
]

def _tile_fits(block_m: int, block_n: int, M: int, N: int) -> bool:
    """Whether a tile fits the problem: 64-wide tiles only for dims < 512 (or N tiles when M < 128, to get more
    CTAs on skinny problems), 256-wide only for dims >= 256."""
    def fits(block, dim, small_ok=False):
        return block <= max(64, triton.next_power_of_2(dim)) and (block >= 128 or dim < 512 or small_ok)

    return fits(block_m, M) and fits(block_n, N, small_ok=M < 128)


def _prune_configs(configs, named_args, **kwargs):
    """The autotuner's pruning: keep the configs whose tile fits the problem (:func:`_tile_fits`)."""
    M, N = named_args["M"], named_args["N"]
    kept = [c for c in configs if _tile_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], M, N)]
    return kept or configs


#: the autotuning space of each autotuned NVFP4 GEMM kernel
CONFIG_SPACES = {"full": GEMM_CONFIGS, "half": HALF_CONFIGS, "half_rega": HALF_REGA_CONFIGS}


def deterministic_configs(impl: str, M: int, N: int) -> list:
    """The tiles ``impl`` ("full", "half", "half_rega") tries under deterministic mode, in order, instead of timing
    them: the entries of its autotuning space the autotuner keeps for the [M, N] problem (:func:`_prune_configs`),
    in the space's order. :func:`first_that_fits` launches the first that compiles within the GPU's resources: the
    same tile in every process on one machine and software stack."""
    space = CONFIG_SPACES[impl]
    return [c for c in space if _tile_fits(c["BLOCK_M"], c["BLOCK_N"], M, N)] or list(space)


def _out_of_resources(e: Exception) -> bool:
    """Whether a launch failed because its tile needs more shared memory or registers than the GPU has."""
    return "OutOfResources" in type(e).__name__ or "out of resource" in str(e).lower()


#: first_that_fits's choice per caller key: later calls launch it directly, without re-raising the tiles before it
_FITS: dict = {}


def first_that_fits(configs, run, key=None):
    """``run(config)`` for the first of ``configs`` that compiles within the GPU's resources, skipping those that
    raise Triton's ``OutOfResources`` (as the autotuner does): deterministic mode's stand-in for the autotuner,
    same candidates, no timing. With ``key`` (the launch's shape and flags) the choice is kept, so later calls
    launch it at once."""
    if key is not None and key in _FITS:
        return run(_FITS[key])
    for c in configs:
        try:
            result = run(c)
        except Exception as e:  # noqa: BLE001  (only out-of-resources is skipped; anything else is raised)
            if not _out_of_resources(e):
                raise
            continue
        if key is not None:
            _FITS[key] = c
        return result
    raise RuntimeError(f"fp4compile: none of {len(configs)} GEMM tiles fits this GPU's resources")


_tuned = {}


def _get_tuned_kernel(impl="full"):
    """The autotuned launcher of the ``"full"`` or ``"half"`` kernel (built on first use)."""
    if impl not in _tuned:
        space = CONFIG_SPACES[impl]
        fn = {"full": _nvfp4_gemm_kernel, "half": _bf16_nvfp4_gemm_kernel,
              "half_rega": _nvfp4_bf16_gemm_kernel}[impl]
        configs = [triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                                 num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in space]
        _tuned[impl] = triton.autotune(configs, key=["M", "N", "K", "OUT_FP32", "DEQUANT_ASM"],
                                       prune_configs_by={"early_config_prune": _prune_configs},
                                       warmup=5, rep=20, cache_results=AUTOTUNE_CACHE and AUTOTUNE_STORE)(fn)
    return _tuned[impl]


def _tma_block_hook(nargs):
    """Autotuner pre-hook: the descriptors' block shapes follow the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn // 2 if nargs["EPI_SUBTILE"] else bn]


def _get_tma_kernel(flatten: bool = False):
    """The autotuned TMA GEMM over :data:`TMA_CONFIGS` (each config sets FLATTEN, False where it does not say);
    ``flatten=True``: every config with the persistent loop flattened."""
    name = "tma_flat" if flatten else "tma"
    if name not in _tuned:
        # flatten=True: the flattened entry is its plain twin flattened, so it is left out
        configs = [triton.Config(dict({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                                      FLATTEN=flatten or c.get("FLATTEN", False)),
                                 num_warps=c["num_warps"], num_stages=c["num_stages"], pre_hook=_tma_block_hook)
                   for c in TMA_CONFIGS if not (flatten and c.get("FLATTEN"))]
        _tuned[name] = triton.autotune(configs, key=["M", "N", "K", "OUT_FP32"], warmup=5, rep=20)(
            _bf16_tma_gemm_kernel)
    return _tuned[name]


def _tma_choice(config, flatten: bool) -> dict:
    """The :data:`TMA_CONFIGS` entry of one of :func:`_get_tma_kernel`'s configs, as kept in ``_TMA_BEST`` and on
    disk: FLATTEN is kept only for TMA_CONFIGS' flattened entry (with ``flatten=True`` every config is flattened
    and the launch flattens whatever entry was chosen)."""
    kw = dict(config.kwargs)
    if kw.pop("FLATTEN", False) and not flatten:
        kw["FLATTEN"] = True
    return dict(kw, num_warps=config.num_warps, num_stages=config.num_stages)


_SMS: dict = {}
#: the autotuner's choice per (M, N, K, out dtype, device, warp_specialize, flatten) of the TMA GEMM: later
#: calls launch that config directly, skipping the autotuner's per-call work (same kernel, same numerics)
_TMA_BEST: dict = {}
#: keep the TMA GEMM autotuner's choices on disk, in Triton's cache next to the compiled kernels (Triton's own
#: ``cache_results`` skips kernels with a config pre-hook, as this one has): a later process, or the training
#: process after a precompile worker (``fp4compile/precompile.py``) has tuned the shape, launches the chosen
#: config without benchmarking. Keyed by Triton's version, the kernel's source hash, the GPU's name, the shape and
#: the configs. ``FP4COMPILE_AUTOTUNE_CACHE``: ``1`` (default) loads and stores choices; ``read`` loads stored
#: choices but stores none (:data:`AUTOTUNE_STORE`: tuning under a profiler, whose serialised, replayed launches can
#: rank the tiles differently from a training run, must not leave its choice for later processes; the other
#: autotuned GEMMs, whose Triton ``cache_results`` loads and stores together, then tune in the process); ``0``: tune
#: in every process.
_CACHE_MODE = os.environ.get("FP4COMPILE_AUTOTUNE_CACHE", "1").strip().lower()
if _CACHE_MODE not in ("0", "1", "read"):
    warnings.warn(f"fp4compile: FP4COMPILE_AUTOTUNE_CACHE={_CACHE_MODE!r} is not 0, 1 or read: using 1")
    _CACHE_MODE = "1"
AUTOTUNE_CACHE = _CACHE_MODE != "0"
#: whether a TMA GEMM autotune choice made in this process is written to the disk cache (``FP4COMPILE_AUTOTUNE_CACHE``
#: is ``1``)
AUTOTUNE_STORE = _CACHE_MODE == "1"
_TUNED_FILE = "bf16_tma_gemm.autotune.json"


def _tuned_cache(tuned_key):
    """Triton's cache manager (directory) of one TMA GEMM autotune choice."""
    from triton.runtime.cache import get_cache_manager

    M, N, K, out_dtype, index, warp_specialize, flatten = tuned_key
    ident = [triton.__version__, _bf16_tma_gemm_kernel.cache_key, torch.cuda.get_device_name(index),
             [M, N, K, str(out_dtype), warp_specialize, flatten], TMA_CONFIGS]
    return get_cache_manager(hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest())


def _load_tuned(tuned_key) -> Optional[dict]:
    """The TMA GEMM config chosen for ``tuned_key`` by an earlier process, or None (none stored, the cache off, or a
    stored entry that is not one of :data:`TMA_CONFIGS`: it is ignored)."""
    if not AUTOTUNE_CACHE:
        return None
    try:
        path = _tuned_cache(tuned_key).get_file(_TUNED_FILE)
        if path is None:
            return None
        with open(path) as f:
            config = json.load(f)["config"]
        return config if config in TMA_CONFIGS else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_tuned(tuned_key, config: dict) -> None:
    """Keep ``config``, the choice for ``tuned_key``, on disk for later processes (unless :data:`AUTOTUNE_CACHE`
    or :data:`AUTOTUNE_STORE` is off)."""
    if not (AUTOTUNE_CACHE and AUTOTUNE_STORE):
        return
    try:
        _tuned_cache(tuned_key).put(json.dumps({"shape": list(tuned_key[:3]), "config": config}), _TUNED_FILE,
                                    binary=False)
    except OSError:  # a read-only or full cache directory: the choice stays in this process only
        pass


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 1
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _output(M: int, N: int, K: int, device, out_dtype):
    """The [M, N] result tensor, and whether it is already final: an empty product, or K = 0 (zeros)."""
    out = torch.empty((M, N), device=device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out, True
    if K == 0:
        return out.zero_(), True
    return out, False


def _f32_scalar(t: torch.Tensor) -> torch.Tensor:
    """A 1-element global scale as an FP32 0-dim tensor (no copy when it already is one)."""
    return t.reshape(()).to(torch.float32)


def _bias_arg(bias: Optional[torch.Tensor], N: int, like: torch.Tensor) -> torch.Tensor:
    """The GEMM kernels' bias pointer: ``bias`` ([N], contiguous) or a placeholder when there is none."""
    _ops._check_bias(bias, N)
    return placeholder(like.device, torch.float32) if bias is None else bias.contiguous()


def _add_bias(out: torch.Tensor, bias: Optional[torch.Tensor], out_dtype) -> torch.Tensor:
    """``out`` (FP32) + ``bias`` in FP32, then one rounding to ``out_dtype``: the bias epilogue of the GEMMs that
    have none in their kernel (the same values as :func:`_bf16_tma_gemm_kernel`'s)."""
    if bias is None:
        return out.to(out_dtype)
    return out.add_(bias.float()).to(out_dtype)


def tma_ok(M: int, N: int, K: int, out_dtype=torch.bfloat16) -> bool:
    """Whether the TMA GEMM can take the shape: descriptor row strides must be multiples of 16 bytes."""
    return K % 8 == 0 and (N * out_dtype.itemsize) % 16 == 0


def bf16_gemm_scaled(a, b, a_global, b_global, out_dtype=torch.bfloat16, *, config: Optional[dict] = None,
                     warp_specialize: bool = False, flatten: bool = False, bias: Optional[torch.Tensor] = None):
    """``(a @ b.T) * (a_global * b_global)`` for bf16 ``a [M, K]``, ``b [N, K]`` (both K-major), FP32
    accumulation, one rounding to ``out_dtype``: the persistent TMA kernel :func:`_bf16_tma_gemm_kernel`.
    ``bias`` ([N]): added to the FP32 result in the kernel's epilogue, before the rounding.

    Exact NVFP4 semantics when ``a`` and ``b`` hold exact ``q * S`` values (:func:`dequantize_bf16`): the
    products are exact, the sums FP32, the global scales applied to the FP32 accumulator.
    ``config``: an explicit tile (keys of :data:`TMA_CONFIGS`); default autotunes on CUDA.
    ``warp_specialize``, ``flatten``: Triton's automatic warp specialization / loop flattening of the
    persistent loop for every config (experimental on sm_90; measured in bench/gemm.py --lower); without
    ``flatten`` the autotuner still tries the one flattened entry of :data:`TMA_CONFIGS`."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"bf16_gemm_scaled takes bf16 operands, got {a.dtype}/{b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"bf16_gemm_scaled: need a [M, K], b [N, K], got {tuple(a.shape)}, {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    M, K = a.shape
    N = b.shape[0]
    if not tma_ok(M, N, K, out_dtype):
        raise ValueError(f"bf16_gemm_scaled: N={N}, K={K} break the TMA 16-byte row alignment for {out_dtype}")
    if bias is not None and (K == 0 or M == 0 or N == 0):
        return _add_bias(_output(M, N, K, a.device, torch.float32)[0], bias, out_dtype)
    out, done = _output(M, N, K, a.device, out_dtype)
    if done:
        return out
    a_global, b_global = _f32_scalar(a_global), _f32_scalar(b_global)
    bias_arg = _bias_arg(bias, N, a)
    on_cuda = a.is_cuda
    # with a bias: no FMA contraction of the epilogue's scale and add (two FP32 ops, as the other implementations')
    opts = {"enable_fp_fusion": False} if bias is not None and on_cuda else {}
    if config is None and not on_cuda:
        config = _cfg(32, 32, 32, 4, 1, EPI_SUBTILE=True)

    def run(config):
        c = dict(config)
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        sub = bool(c.get("EPI_SUBTILE", False))
        ad = TensorDescriptor.from_tensor(a, [bm, bk])
        bd = TensorDescriptor.from_tensor(b, [bn, bk])
        cd = TensorDescriptor.from_tensor(out, [bm, bn // 2 if sub else bn])
        tiles = cdiv(M, bm) * cdiv(N, bn)
        nsm = tiles if not on_cuda else min(tiles, _num_sms(a.device))
        launch(_bf16_tma_gemm_kernel, (nsm,), ad, bd, cd, a_global, b_global, bias_arg, M, N, K, BLOCK_M=bm,
               BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c.get("GROUP_M", 8), NUM_SMS=nsm, EPI_SUBTILE=sub,
               WARP_SPEC=warp_specialize, FLATTEN=flatten or bool(c.get("FLATTEN", False)),
               OUT_FP32=out_dtype == torch.float32, K_ITERS=0 if on_cuda else cdiv(K, bk),
               HAS_BIAS=bias is not None, num_warps=c.get("num_warps", 4), num_stages=c.get("num_stages", 3),
               **opts)
        return out

    tuned_key = (M, N, K, out_dtype, a.device.index, warp_specialize, flatten)
    if config is None and determinism.enabled():  # no timing: the first TMA_CONFIGS tile that fits, every time
        return first_that_fits(TMA_CONFIGS, run, key=("tma", bias is not None) + tuned_key)
    if config is None:
        config = _TMA_BEST.get(tuned_key)  # autotuned before: launch its config directly (no autotuner pass)
    if config is None and on_cuda:
        config = _load_tuned(tuned_key)  # ... or in an earlier process (AUTOTUNE_CACHE)
        if config is not None:
            _TMA_BEST[tuned_key] = config
    if config is not None:
        return run(config)
    dummy = [1, 1]
    ad = TensorDescriptor(a, a.shape, a.stride(), dummy)
    bd = TensorDescriptor(b, b.shape, b.stride(), dummy)
    cd = TensorDescriptor(out, out.shape, out.stride(), dummy)
    nsm = _num_sms(a.device)
    grid = lambda meta: (min(nsm, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)  # noqa: E731
    kern = _get_tma_kernel(flatten)
    kern[grid](ad, bd, cd, a_global, b_global, bias_arg, M, N, K, NUM_SMS=nsm, WARP_SPEC=warp_specialize,
               OUT_FP32=out_dtype == torch.float32, HAS_BIAS=bias is not None, **opts)
    if not torch.cuda.is_current_stream_capturing():
        _TMA_BEST[tuned_key] = _tma_choice(kern.best_config, flatten)
        _store_tuned(tuned_key, _TMA_BEST[tuned_key])
    return out


#: tile of the split-K kernel (128x128x64, 8 warps, 4 stages: fits shared memory, wgmma-shaped)
SPLITK_CONFIG = _cfg(128, 128, 64, 8, 4)


def splitk_factor(M: int, N: int, K: int, num_sms: int = 132, block=(128, 128, 64)) -> int:
    """Number of K splits for the split-K kernel: enough (tile, split) programs for ~2 waves, each split
    at least 16 K-tiles long; 1 when the output alone fills the machine."""
    bm, bn, bk = block
    tiles = -(-M // bm) * -(-N // bn)
    k_tiles = -(-K // bk)
    if tiles >= num_sms:
        return 1
    return max(1, min(k_tiles // 16, -(-2 * num_sms // tiles)))


def bf16_gemm_splitk(a, b, a_global, b_global, out_dtype=torch.bfloat16, *, split_k: Optional[int] = None,
                     config: Optional[dict] = None, bias: Optional[torch.Tensor] = None):
    """``(a @ b.T) * (a_global * b_global)`` by split-K (:func:`_bf16_tma_splitk_kernel`): FP32 partial
    sums per K range, summed in FP32 (a different FP32 accumulation order, nothing else), then one scale and
    one rounding. Deterministic (no atomics). For long-K GEMMs whose output has too few tiles to fill the
    GPU (wgrad: K = tokens). ``bias`` ([N]): added in FP32 before the rounding."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2 \
            or a.shape[1] != b.shape[1]:
        raise ValueError(f"bf16_gemm_splitk: need bf16 a [M, K], b [N, K], got {a.dtype} {tuple(a.shape)}, "
                         f"{b.dtype} {tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    M, K = a.shape
    N = b.shape[0]
    if K % 8:
        raise ValueError(f"bf16_gemm_splitk: K={K} breaks the TMA 16-byte row alignment")
    on_cuda = a.is_cuda
    c = dict(config or (SPLITK_CONFIG if on_cuda else _cfg(32, 32, 32, 4, 1)))
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    alpha = _f32_scalar(a_global) * _f32_scalar(b_global)
    _ops._check_bias(bias, N)
    if K == 0 or M == 0 or N == 0:
        return _add_bias(_output(M, N, K, a.device, torch.float32)[0], bias, out_dtype)
    k_tiles = cdiv(K, bk)
    if split_k is None:
        split_k = splitk_factor(M, N, K, _num_sms(a.device), (bm, bn, bk))
    split_k = max(1, min(int(split_k), k_tiles))
    per = cdiv(k_tiles, split_k)
    split_k = cdiv(k_tiles, per)                  # no empty split
    ws = torch.empty((split_k, M, N), device=a.device, dtype=torch.float32)
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bn, bk])
    grid = (cdiv(M, bm) * cdiv(N, bn), split_k)
    _bf16_tma_splitk_kernel[grid](ad, bd, ws, M, N, per, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                  K_ITERS=0 if on_cuda else per, num_warps=c["num_warps"],
                                  num_stages=c["num_stages"])
    acc = ws[0] if split_k == 1 else ws.sum(0)
    return _add_bias(acc * alpha, bias, out_dtype)


def gemm_dequant_triton(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16,
                        *, config: Optional[dict] = None, dequant: Optional[str] = None):
    """``impl="dq_triton"``: both operands dequantized to exact bf16 ``q * S`` (:func:`dequantize_bf16`, one
    Triton pass each), then the persistent TMA bf16 GEMM with the global scales in its FP32 epilogue and a
    bf16 (or fp32) output: one rounding, no FP32 [M, N] round trip. Extra memory traffic against a native
    NVFP4 GEMM: each operand's bf16 copy is written once and read by the GEMM (2 + 2 bytes per element
    instead of 0.5625)."""
    _check_inputs(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype)
    a = dequantize_bf16(a_codes, a_scales, dequant=dequant)
    b = dequantize_bf16(b_codes, b_scales, dequant=dequant)
    return bf16_gemm_scaled(a, b, a_global, b_global, out_dtype, config=config)

def nvfp4_gemm(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16,
               bias: Optional[torch.Tensor] = None, *, impl: Optional[str] = None, config: Optional[dict] = None,
               dequant: Optional[str] = None):
    """NVFP4 GEMM ``C = (A @ B^T) * a_global * b_global`` with the Triton kernels (TN layout).

    Args:
        a_codes, b_codes: uint8 ``[M, K/2]`` / ``[N, K/2]`` packed E2M1 codes (element 2i in the low nibble).
        a_scales, b_scales: uint8 ``[M, K/16]`` / ``[N, K/16]`` raw E4M3 block-scale bytes.
        a_global, b_global: FP32 1-element global decode scales.
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.
        bias: optional ``[N]`` vector added to the FP32 result before the rounding (the TMA GEMM's epilogue;
            the other implementations compute an FP32 result and add it after: the same values).
        impl: ``"auto"`` (per shape, :func:`choose_impl`; off CUDA: ``"half"``), ``"half"`` (the operand
            with fewer rows pre-dequantized to exact bf16 by :func:`dequantize_bf16`, the other dequantized
            in registers tile by tile and stored to shared memory for the wgmma), ``"half_rega"`` (same
            split, the NVFP4 operand is the wgmma register operand), ``"full"`` (both dequantized in
            registers; no bf16 copy at all), ``"dequant_cublas"``, ``"dq_triton"``, ``"dq_splitk"`` or
            ``"wgmma"`` (the Gluon kernel of :mod:`fp4compile.kernels.gemm_wgmma`: in-loop dequantization
            overlapped with async wgmma; CUDA, K % 64 == 0; slower, an experiment); default
            :data:`DEFAULT_IMPL`.
        config: explicit tile config (keys of :data:`GEMM_CONFIGS`); default autotunes on CUDA and uses a
            small fixed tile under the interpreter.
        dequant: ``"asm"`` (inline PTX, sm_90) or ``"fp32"`` (portable); default :data:`DEFAULT_DEQUANT` on
            CUDA, ``"fp32"`` off CUDA.
    """
    if triton is None:
        raise RuntimeError("fp4compile::gemm Triton kernel needs triton")
    M, N, K = _check_inputs(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype)
    on_cuda = a_codes.is_cuda
    impl = impl or DEFAULT_IMPL
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = choose_impl(M, N, K, out_dtype) if on_cuda else "half"
    elif impl == "tuned":
        impl = _tuned_impl(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype) if on_cuda \
            else "half"
    if dequant is None:
        dequant = DEFAULT_DEQUANT if on_cuda else "fp32"
    if dequant not in ("asm", "fp32"):
        raise ValueError(f"dequant must be 'asm' or 'fp32', got {dequant!r}")
    _ops._check_bias(bias, N)
    if impl == "dequant_cublas":
        return gemm_dequant_cublas(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, bias)
    if impl in ("dq_triton", "dq_splitk"):
        a16, b16 = dequantize_pair_bf16(a_codes, a_scales, b_codes, b_scales, dequant=dequant)
        return gemm_dequantized(a16, a_global, b16, b_global, out_dtype, bias, impl=impl, config=config)
    if bias is not None:   # in-register kernels: an FP32 result, then the bias and the rounding
        out = nvfp4_gemm(a_codes, a_scales, a_global, b_codes, b_scales, b_global, torch.float32, impl=impl,
                         config=config, dequant=dequant)
        return _add_bias(out, bias, out_dtype)
    if impl in ("wgmma", "mixed"):
        if not on_cuda:
            raise RuntimeError(f"impl={impl!r} (Gluon, sm_90) runs on CUDA only")
        if impl == "mixed" and config is None:
            config = MIXED_DEFAULT
        return nvfp4_gemm_wgmma(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, config=config)
    out, done = _output(M, N, K, a_codes.device, out_dtype)
    if done:
        return out
    a_global, b_global = _f32_scalar(a_global), _f32_scalar(b_global)
    extra = {}
    if impl == "full":
        args = (a_codes, a_scales, a_global, b_codes, b_scales, b_global, out, M, N, K,
                a_codes.stride(0), a_scales.stride(0), b_codes.stride(0), b_scales.stride(0), out.stride(0))
        kernel = _nvfp4_gemm_kernel
    elif impl == "half":
        # the operand with fewer rows is pre-dequantized (bf16, kernel's A); the other stays NVFP4 (kernel's B)
        if M < N:
            y16 = dequantize_bf16(a_codes, a_scales, dequant=dequant)
            args = (y16, a_global, b_codes, b_scales, b_global, out, M, N, K,
                    y16.stride(0), b_codes.stride(0), b_scales.stride(0), out.stride(0))
            extra["TRANS_OUT"] = False
        else:
            y16 = dequantize_bf16(b_codes, b_scales, dequant=dequant)
            args = (y16, b_global, a_codes, a_scales, a_global, out, N, M, K,
                    y16.stride(0), a_codes.stride(0), a_scales.stride(0), out.stride(0))
            extra["TRANS_OUT"] = True
            M, N = N, M
        kernel = _bf16_nvfp4_gemm_kernel
    else:  # half_rega: the operand with more rows is the in-register (wgmma A) operand
        if M >= N:
            x_c, x_s, x_g, y16, y_g, MM, NN, scm, scn = (a_codes, a_scales, a_global,
                                                         dequantize_bf16(b_codes, b_scales, dequant=dequant),
                                                         b_global, M, N, out.stride(0), 1)
        else:
            x_c, x_s, x_g, y16, y_g, MM, NN, scm, scn = (b_codes, b_scales, b_global,
                                                         dequantize_bf16(a_codes, a_scales, dequant=dequant),
                                                         a_global, N, M, 1, out.stride(0))
        args = (x_c, x_s, x_g, y16, y_g, out, MM, NN, K, x_c.stride(0), x_s.stride(0), y16.stride(0), scm, scn)
        M, N = MM, NN
        kernel = _nvfp4_bf16_gemm_kernel
    flags = dict(DEQUANT_ASM=dequant == "asm", OUT_FP32=out_dtype == torch.float32, **extra)
    if config is None and not on_cuda:
        config = _cfg(32, 32, 32, 4, 1)

    def run(config):
        c = dict(config)
        bm, bn, bk = c.pop("BLOCK_M"), c.pop("BLOCK_N"), c.pop("BLOCK_K")
        nw, ns, gm = c.pop("num_warps", 4), c.pop("num_stages", 3), c.pop("GROUP_M", 8)
        if impl == "full":
            c.pop("PREFETCH_S", None)  # the full kernel has no scale prefetch
        grid = (cdiv(M, bm) * cdiv(N, bn),)
        kernel[grid](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EVEN_K=K % bk == 0,
                     num_warps=nw, num_stages=ns, K_ITERS=0 if on_cuda else cdiv(K, bk), **c, **flags)
        return out

    if config is not None:
        return run(config)
    if determinism.enabled():  # no timing: the tiles differ in BLOCK_K, so in summation order
        return first_that_fits(deterministic_configs(impl, M, N), run,
                               key=(impl, M, N, K, out_dtype, dequant, a_codes.device.index, tuple(extra.items())))
    kern = _get_tuned_kernel(impl)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    # every tuned BLOCK_K divides 128: K % 128 == 0 is EVEN for all of them; otherwise the masked variant
    kern[grid](*args, EVEN_K=K % 128 == 0, **flags)
    return out


def _tuned_impl(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype) -> str:
    """``impl="tuned"``: on the first call of a shape, time every :data:`TUNED_CANDIDATES` implementation
    that can take it (``triton.testing.do_bench`` median, after each one's own autotuning) and keep the
    fastest in :data:`TUNED_CHOICES`. A measurement tool (bench/train_step.py --impls tuned): the first call
    of each shape costs a few hundred ms."""
    M, N, K = a_codes.shape[0], b_codes.shape[0], 2 * a_codes.shape[1]
    if torch.cuda.is_current_stream_capturing():      # no timing inside a CUDA-graph capture
        return choose_impl(M, N, K, out_dtype)
    key = (M, N, K, out_dtype, a_codes.device.index)
    hit = TUNED_CHOICES.get(key)
    if hit is not None:
        return hit[0]
    from triton.testing import do_bench

    args = (a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype)
    times = {}
    for cand in TUNED_CANDIDATES:
        if cand.startswith("dq_") and not tma_ok(M, N, K, out_dtype):
            continue
        try:
            times[cand] = do_bench(lambda: nvfp4_gemm(*args, impl=cand), warmup=5, rep=10, return_mode="median")
        except Exception:  # noqa: BLE001  (a candidate that cannot run this shape is not a choice)
            continue
    best = min(times, key=times.get) if times else choose_impl(M, N, K, out_dtype)
    TUNED_CHOICES[key] = (best, times)
    return best

def dequantize_pair_bf16(a_codes, a_scales, b_codes, b_scales, *, dequant: Optional[str] = None):
    """Both operands of one GEMM (contiguous, same K) to exact bf16 ``q * S`` with one launch of
    :func:`_dequant2_kernel`; same values as two :func:`dequantize_bf16` calls."""
    RA, KH = a_codes.shape
    RB = b_codes.shape[0]
    dev = a_codes.device
    a16 = torch.empty((RA, 2 * KH), device=dev, dtype=torch.bfloat16)
    b16 = torch.empty((RB, 2 * KH), device=dev, dtype=torch.bfloat16)
    if dequant is None:
        dequant = DEFAULT_DEQUANT if a_codes.is_cuda else "fp32"
    br, bk = (64, 128) if a_codes.is_cuda else (16, 32)
    nblk_a = cdiv(RA, br)
    grid = (nblk_a + cdiv(RB, br), cdiv(2 * KH, bk))
    launch(_dequant2_kernel, grid, a_codes, a_scales, a16, RA, b_codes, b_scales, b16, RB, KH, nblk_a,
           BLOCK_R=br, BLOCK_K=bk, DEQUANT_ASM=dequant == "asm", num_warps=4)
    return a16, b16

def dequantize_bf16(codes, scales, *, dequant: Optional[str] = None):
    """Dequantize packed NVFP4 ``[R, K/2]`` codes + ``[R, K/16]`` E4M3 bytes to bf16 ``q * S`` (exact; no
    global scale). One Triton pass; the first half of the "dequantize then cuBLAS" baseline."""
    if triton is None:
        raise RuntimeError("dequantize_bf16 needs triton")
    R, KH = codes.shape
    if scales.shape != (R, 2 * KH // 16):
        raise ValueError(f"scales must be [R, K/16], got {tuple(scales.shape)} for codes {tuple(codes.shape)}")
    out = torch.empty((R, 2 * KH), device=codes.device, dtype=torch.bfloat16)
    if dequant is None:
        dequant = DEFAULT_DEQUANT if codes.is_cuda else "fp32"
    br, bk = (64, 128) if codes.is_cuda else (16, 32)
    grid = (cdiv(R, br), cdiv(2 * KH, bk))
    launch(_dequant_kernel, grid, codes, scales, out, R, KH, codes.stride(0), scales.stride(0), out.stride(0),
           BLOCK_R=br, BLOCK_K=bk, DEQUANT_ASM=dequant == "asm", num_warps=4)
    return out


def gemm_dequant_cublas(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16,
                        bias: Optional[torch.Tensor] = None):
    """Baseline: dequantize both operands to exact bf16 (one :func:`dequantize_pair_bf16` launch), then
    cuBLAS BF16 GEMM with FP32 output (``torch.mm(..., out_dtype=torch.float32)``), then ``* a_global *
    b_global`` (in place) and the cast.
    Same numerics as :func:`nvfp4_gemm`; costs two bf16 operand copies and an FP32 [M, N] round trip."""
    _check_inputs(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype)
    a, b = dequantize_pair_bf16(a_codes, a_scales, b_codes, b_scales)
    return gemm_dequantized(a, a_global, b, b_global, out_dtype, bias, impl="dequant_cublas")


def _gemm_cuda(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16, bias=None):
    return nvfp4_gemm(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, bias)


_ops.register_cuda("gemm", _gemm_cuda)


def gemm_dequantized(a, a_global, b, b_global, out_dtype=torch.bfloat16, bias: Optional[torch.Tensor] = None, *,
                     impl: Optional[str] = None, config: Optional[dict] = None):
    """:func:`nvfp4_gemm` of two NVFP4 copies given as their exact bf16 ``q * S`` (``a [M, K]``, ``b [N, K]``,
    e.g. ``fp4compile::quantize_dq``'s fourth output): ``C = (a @ b^T) * a_global * b_global``, the bf16 GEMM of
    the :data:`DQ_IMPLS` implementation by shape (``impl``: one of them; default :func:`choose_impl`'s, and
    ``"dq_triton"`` -- or cuBLAS where the TMA GEMM cannot take the shape -- when it picks an in-register one),
    without their dequantize pass. The same values as :func:`nvfp4_gemm` of the codes with that implementation
    (which calls this after its dequantize pass). ``config``: the Triton GEMMs' tile (their default: autotuned).
    ``bias`` ([N]): ``C + bias`` added in FP32 before the one rounding (the TMA GEMM's epilogue; split-K and cuBLAS
    add it to their FP32 result)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"gemm_dequantized takes bf16 operands, got {a.dtype}/{b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm_dequantized: need a [M, K], b [N, K], got {tuple(a.shape)}, {tuple(b.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    M, K = a.shape
    N = b.shape[0]
    if impl is None:
        impl = choose_impl(M, N, K, out_dtype)
        if impl not in DQ_IMPLS:
            impl = "dq_triton" if tma_ok(M, N, K, out_dtype) else "dequant_cublas"
    if impl not in DQ_IMPLS:
        raise ValueError(f"impl must be one of {DQ_IMPLS}, got {impl!r}")
    if impl == "dq_triton":
        return bf16_gemm_scaled(a, b, a_global, b_global, out_dtype, config=config, bias=bias)
    if impl == "dq_splitk":
        return bf16_gemm_splitk(a, b, a_global, b_global, out_dtype, config=config, bias=bias)
    _ops._check_bias(bias, N)
    acc = torch.mm(a, b.t(), out_dtype=torch.float32)
    if SCALE_CAST and acc.is_cuda:
        return scale_cast(acc, a_global, b_global, out_dtype, bias)
    return _add_bias(acc.mul_(_f32_scalar(a_global) * _f32_scalar(b_global)), bias, out_dtype)


def scale_cast(acc: torch.Tensor, a_global, b_global, out_dtype=torch.bfloat16,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(acc * (a_global * b_global) + bias).to(out_dtype)`` for a contiguous FP32 GEMM product ``acc`` [M, N] in one
    Triton pass (:func:`_scale_cast_kernel`; CUDA, or CPU under TRITON_INTERPRET=1): the values of the torch ops
    (FP32 products, the FP32 add, one rounding)."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous():
        raise ValueError(f"scale_cast takes a contiguous 2-D FP32 product, got {acc.dtype} {tuple(acc.shape)}")
    M, N = acc.shape
    _ops._check_bias(bias, N)
    out = torch.empty((M, N), device=acc.device, dtype=out_dtype)
    if acc.numel():
        block = 4096 if acc.is_cuda else 64
        opts = {"enable_fp_fusion": False} if acc.is_cuda else {}
        launch(_scale_cast_kernel, (cdiv(acc.numel(), block),), acc, _f32_scalar(a_global), _f32_scalar(b_global),
               _bias_arg(bias, N, acc), out, N, acc.numel(), BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
               **opts)
    return out


def _gemm_dequantized_cuda(a, a_global, b, b_global, out_dtype=torch.bfloat16, bias=None):
    return gemm_dequantized(a, a_global, b, b_global, out_dtype, bias)


_ops.register_cuda("gemm_dequantized", _gemm_dequantized_cuda)


def _dequantize_blocks_cuda(codes, scales):
    if codes.dim() != 2 or scales.dim() != 2 or codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("fp4compile::dequantize_blocks takes 2D uint8 codes [R, K/2] and scale bytes [R, K/16]")
    return dequantize_bf16(codes.contiguous(), scales.contiguous())


_ops.register_cuda("dequantize_blocks", _dequantize_blocks_cuda)


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
