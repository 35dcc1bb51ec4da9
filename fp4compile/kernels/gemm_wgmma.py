"""NVFP4 x NVFP4 GEMM for sm_90 written in Gluon: dequantization in the main loop, overlapped with async wgmma.

**Status: correct. The kernels that decode both operands in the loop are slower than the default lowering and are
kept as ``impl="wgmma"`` (never chosen by ``"auto"``) as the measured answer to "what does in-loop dequantization cost
on Hopper". The mixed kernel's 128 x 256 ``SPLIT`` tile (its ``HALVES`` loop in two partitions) is
``impl="mixed"``, which ``"auto"`` runs on many-row, narrow-output shapes (``kernels.gemm.mixed_wins``; sessions 73,
74).** H200, session 25 (docs/BENCHMARKS.md): 0.47-0.55x cuBLAS BF16 on the 124M fprop/dgrad shapes and the
4096^3 / 8192^3 squares, 0.15-0.37x on the 124M wgrad shapes, against 0.64-0.95x for ``"dq_triton"``
(dequantize each operand once, then a BF16 TMA GEMM). The warp-specialized variant (:data:`WS_CONFIGS`,
:func:`_nvfp4_ws_kernel`, session 71) measured the same on an H100: 0.48x at 8192^3, 0.40-0.47x on the 124M
fprop/dgrad shapes. Its eight decode warps (all the register file leaves
beside the wgmma warpgroup's 128 x 128 accumulator) decode 2.8 G elements per millisecond on the whole GPU, 30 % of
what the SM's issue rate allows at full occupancy (``bench/decode_rate.py``: 9.1), where full speed at 128 x 128
tiles needs 6.2. The register-A variant (:data:`RS_CONFIGS`, :func:`_nvfp4_rs_kernel`, session 72) decodes A straight
into the wgmma's register fragment, so only B crosses shared memory: 0.54-0.63x cuBLAS on an H100 on the squares and
the 124M fprop/dgrad shapes, 7-15 % faster than the software-pipelined kernel in the same runs. Nsight Compute:
39-40 % tensor-pipe use at 34-36 % issue; each of its 8 warps issues once per 5.6-5.9 cycles (latency-bound decode
chains at 248-255 registers). Its timing diagnostics bound the design: with no decode at all (the wgmmas, the code
staging and the synchronization only) it reaches 0.79-0.89x, with A's decode but not B's 0.72-0.85x. The mixed
variant (:data:`MIXED_CONFIGS`, :func:`nvfp4_gemm_mixed`, session 72) keeps A's register decode and takes B as bf16
(:func:`prepare_b`: dequantized once) through TMA: no shared-memory store, proxy fence or CTA-wide barrier. Its kernel
reaches 0.71-0.81x on those shapes, 0.60-0.72x with B's preparation; ``"auto"`` stays faster except on the dgrad
shapes, where the mixed GEMM is 2-3 % faster.

Register operands of an async wgmma (both register-A kernels): ptxas copies the loop-carried A fragment into the
HGMMA's operand registers at the top of the loop and treats that copy as dead once the HGMMA is issued. A wgmma left
in flight across the loop's back edge (``warpgroup_mma_wait(1)``, the usual pipelining) can then have its operand
overwritten by the next iteration's copy: the mixed kernel at 128 x 256 lost 1,752 of 65,024 exact-check values on an
H100 that way (the RS kernel's long decode hid it). Both kernels therefore retire each tile's wgmma before the loop
turns, with the fragment being read and the one being decoded in the wait's ``deps`` (without the first, ptxas
reuses its registers for the decode and serializes the HGMMAs: "non wgmma instructions defining input registers of
a wgmma"). That costs the mixed kernel 8-17 % of its time against the racy form.

The ``HALVES`` mixed configs (session 73) keep a wgmma in flight without that race: each K-tile is two 32-deep
wgmmas on two separate A fragments (in :func:`_fragment_order`, word j of every scale block fills exactly the 16-deep
steps 2 j and 2 j + 1, so half j is decoded from word j alone, :func:`_a_decode_half`). Each wait retires the wgmma
that last read the half about to be decoded and leaves the other in flight; ptxas's loop-top copy then writes only
the registers of a retired wgmma (``offline.wgmma_register_hazards`` passes, two ``DEPBAR.LE gsb0, 1`` per tile).
The 64-row ``HALVES`` configs run one warpgroup per CTA under a register cap (``maxnreg``) so that two or three CTAs
share an SM, and no CTA-wide barrier couples two warpgroups.

The ``SPLIT`` configs (session 74) keep the 128-row tile (one B ring for both warpgroups, so B crosses L2 once per
tile) but make each warpgroup its own warp-specialized partition: each releases a B slot by its own arrival on the
slot's ``empty`` barrier (initialized to count two), so the loop has no CTA-wide barrier (the default form has three
per K-tile: the one before the release and two that Triton's shared-memory analysis puts around the mbarrier
operations), only 128-thread named barriers inside each warpgroup. The first partition also issues B's TMA loads (a
slot is refilled once both warpgroups have released it) instead of a separate loader warp: with a loader warp the
kernel has 384 threads (the loader's warp is padded to a warpgroup), ptxas compiles it under 65,536 / 384 = 168
registers, and an epilogue inside a partition then makes ptxas serialize the wgmmas ("insufficient register
resources"); with two partitions of 128 threads it compiles under 256 (255 used, no spills).

What the in-loop decode costs (sessions 74-75, H100): the same kernels with A's decode taken out of the loop (timing
diagnostic ``DIAG`` 1) run at 0.83-1.08x cuBLAS BF16 on the 124M fprop/dgrad shapes and the squares, so the loop's
structure (TMA ring, mbarriers, waits, barriers) is not what separates this kernel from cuBLAS. Nsight Compute put
long-scoreboard waits first among the stalls: ptxas hoisted each K-tile's code-word loads and then had to move the
loaded registers down the three-tile prefetch chain at the bottom of the same trip, waiting for the load. The
``HALVES`` loop is therefore unrolled by three K-tiles (:func:`_halves_tile` called three times, so the chain is a
renaming; a one-tile loop takes the remainder): 140 instead of 195 instructions per K-tile and warp, and 4-9 % off
the two long-K dgrad shapes' time (two runs).

Session 75 found that ``DIAG`` 1 also drops A's code loads (nothing reads them, so the compiler removes them: no
``LDG`` in its loop) and split the gap with two more diagnostics (:func:`_keep`): the decode done off the wgmmas'
path (2) and the code loads alone (3). Over the 144 GEMMs of a 124M step (kernel only, two runs) the ``SPLIT`` tile
takes 17.9-18.2 ms, 2 17.8-17.9, 3 17.6, 1 16.0-16.1 (cuBLAS 12.3): the code words' global loads in the loop make
75-96 % of the gap to ``DIAG`` 1 (in the one-partition tile too), the decode's arithmetic the rest. Two ways to take
the loads off the path were timed and dropped (``docs/bench_logs/session75_words_stage_probe.diff.txt``): each word
loaded into the register its tile slot frees, so no copy of a just-loaded register waits (no gain for the default
tile; by its SASS ptxas still puts loads of different ages on one scoreboard, so a reader can wait for the youngest),
and the words staged in a shared-memory ring by cp.async (17 % slower: its loop is not unrolled and holds one or two
more barriers per K-tile).

Session 76 built the third way (``A_TMA``, :func:`_mixed_tma_partition`; ``impl="mixed"``'s tile since session 78,
:data:`MIXED_SPLIT_ATMA`): A's code bytes ([128, 32] a K-tile) and scale words arrive by TMA in the same ring
slot as B's tile, each of the three loads counted on its own mbarrier (session 77: one mbarrier for all three made
Triton put a warpgroup barrier between every two of them), so their arrival is tracked exactly and the loop holds no
global load (each warpgroup reads its rows by ``LDS.64`` after the slot's waits). A TMA box row must be a whole
16-byte piece and, found on an H100, must start 16-byte aligned (an unaligned innermost coordinate is an illegal
instruction): each slot therefore gets the row's 16 scale bytes of the four K-tiles from ``kt // 4 * 4`` on, the loop
is unrolled by four so that the word to keep (``kt % 4``) is known at compile time, and A takes this path only when its
rows are whole 16-byte pieces (:func:`a_tma_ok`: K % 256 == 0 for contiguous operands; otherwise the same tile runs
with global loads). Static SASS, per K-tile and warp: the second warpgroup's loop 131 instructions and 2 named
barriers (157 and 2 with global loads; 129 and 3 with one mbarrier), the first's 183 and 5 (185 and 4; 178 and 7),
which also gets one ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S`` per K-tile (Triton fences the async proxy before a
TMA write into a slot that was read by ``LDS``). Session 78 ran it on an H100: exact, and over the 144 GEMMs of a
124M step (kernel only) 17.72 ms against the global-load tile's 17.93 (cuBLAS 12.19); as ``impl="mixed"``'s tile the
linear-only 124M step took 0.17 ms less (47.36 against 47.51 ms, 95 % CI [-0.20, -0.14], ``bench/step_ab.py``). With
Triton's proxy-fence pass off (``bench/gemm_wgmma.py --no-proxy-fence``, a diagnostic) it took 17.37 against 18.04 in
one run: the fence may cost ~2 %, not yet confirmed.

A one-warp loader partition issuing every slot's loads, so that both warpgroups only consume, does not fit Triton
3.6: the CTA then has three warpgroups (384 threads), ptxas compiles every partition under 65536 / 384 = 168
registers despite the consumers' ``setmaxnreg`` of 232 (also with ``.maxntid`` and ``.minnctapersm 1`` instead of
``.maxnreg`` in the PTX), and at 168 registers it retires every wgmma at once (``WARPGROUP.DEPBAR.LE gsb0, 0x0``;
session 77, ``docs/bench_logs/session77_loader_probe.diff.txt``).

Same product as :func:`fp4compile.kernels.gemm.nvfp4_gemm` (``C = (A @ B^T) * a_global * b_global``, TN, codes
``[R, K/2]``, E4M3 scale bytes ``[R, K/16]``, one FP32 accumulation, one rounding to the output dtype), with the
same exact BF16 operand values ``q * S * 2^-8`` (the shift/mask PTX of :mod:`fp4compile.kernels.dequant`), so the
result equals the other implementations' up to the FP32 summation order of the wgmma.

Why Gluon: Triton's ``tl`` cannot overlap the dequantization of K-tile k+1 with the tensor cores' work on K-tile
k inside one program. An operand produced in registers and stored with ``local_alloc`` is single buffered, so every
K-tile ends with ``wgmma.wait_group 0`` (docs/BENCHMARKS.md, ## GEMM, "Why"). Gluon (``triton.experimental.gluon``,
Triton 3.6) exposes the shared-memory buffers, the async wgmma and its wait, so this kernel pipelines by hand:

* a 3-stage cp.async ring holds the NVFP4 code words (16 bytes per thread) and scale words (4 scale bytes of a
  row = one int32) of the next K-tiles;
* two BF16 shared-memory buffers per operand (128-byte swizzle); iteration k issues the wgmma on buffer k % 2
  *asynchronously*, then reads tile k+1's codes from the ring, dequantizes them (8 codes per ``prmt`` +
  shift/mask group, one ``mul.rn.bf16x2`` per two codes), waits for the wgmma of k-1 (the last reader of the other
  buffer), stores, fences (generic -> async proxy) and refills the ring after the fence;
* the 8 codes of a word land in shared memory in the order (0, 2), (4, 6), (1, 3), (5, 7): a GEMM may permute K
  inside a scale block when both operands get the same permutation, and this one needs no re-pairing instruction;
* the epilogue multiplies the FP32 accumulator by ``2^16 * a_global * b_global``, rounds once, stores coalesced.

What the measurements say (``bench/gemm_wgmma.py``'s timing-only diagnostics): without the MMA the kernel still
takes 1.5x cuBLAS's time at 8192^3 (dequantization, shared-memory stores, barriers), and without the decode ALU
work 1.8x. In-loop dequantization decodes every A tile once per N-tile and every B tile once per M-tile,
MNK (1/BLOCK_M + 1/BLOCK_N) elements: at 128 x 256 tiles ~1.2 % of the MACs, i.e. ~22 decoded elements per
cycle and SM at full wgmma rate, which at ~2.6 integer-pipe instructions each is the whole integer throughput of
the SM; the decoded bytes then cross shared memory once more than with TMA-fed operands. Dequantizing once
(memory-bound, 2.56 bytes per element) and running a BF16 GEMM is cheaper on Hopper. Two earlier versions of this
kernel (codes loaded into registers one and two tiles ahead) measured the same or slower; ptxas turns the proxy
fence into ``MEMBAR.ALL.CTA``, which waits for loads in flight, and spreads register-only decode work between the
HGMMAs of a tile unless that work depends on a shared-memory read placed after a barrier (both are why the
codes go through the cp.async ring; ``tests/test_gemm_wgmma.py`` checks the second property on the SASS).

Shapes: K % 64 == 0 (whole 64-wide K-tiles, :func:`supports`); M, N any (row tails wrap in the loads and are
masked in the store). No BF16 copy of either operand exists in global memory.

Register-A variant: a wgmma may read A from registers (only B must be in shared memory). Each thread of a warpgroup
holds, for its rows g and g + 8, the K pairs 2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4) of every 16-deep step; the
kernel loads each thread the two code words of scale block t of its rows (8 bytes per row from the cp.async ring)
and, by :func:`_fragment_order`, fills the fragment's slots with exactly those 16 elements. K is thereby permuted
inside the 64-deep tile, and B's decoded tile is stored to shared memory with the same permutation (the exact-decode
check against an identity B proves both agree). Every operation from the loaded code words to the fragment is a
register relabelling (``convert_layout(..., assert_trivial=True)`` checks it at compile time).

Public names: :func:`nvfp4_gemm_wgmma`, :func:`supports`, :func:`available`, :func:`offline_cubin`,
:data:`WGMMA_CONFIGS`, :data:`WS_CONFIGS`, :data:`RS_CONFIGS`, :func:`nvfp4_gemm_mixed`, :func:`prepare_b`,
:func:`fragment_permutation`, :func:`offline_cubin_mixed`, :data:`MIXED_CONFIGS`, :data:`MIXED_SPLIT_LDG`,
:data:`MIXED_SPLIT_ATMA`, :func:`a_tma_ok`. Imports
cleanly without CUDA or without Gluon (:func:`available` is then False).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .launch import cdiv, launch, stable_cache_keys

try:
    import triton
    import triton.language as tl
    from .dequant import DEFAULT_DEQUANT, _dequant_tile
except ImportError:  # pragma: no cover - CPU wheels without Triton
    triton = None

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from .dequant import _DEQUANT_ASM
except ImportError:  # pragma: no cover - CPU wheels without Triton, or a Triton without Gluon
    gluon = None

__all__ = ["nvfp4_gemm_wgmma", "available", "supports", "offline_cubin", "WGMMA_CONFIGS", "WS_CONFIGS",
           "RS_CONFIGS", "MIXED_CONFIGS", "nvfp4_gemm_mixed", "prepare_b", "fragment_permutation",
           "offline_cubin_mixed", "a_tma_ok", "MIXED_SPLIT_LDG", "MIXED_SPLIT_ATMA"]

#: tile configurations (BLOCK_M, BLOCK_N, BLOCK_K = 64, num_warps); the first is the default
WGMMA_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4),
]


#: warp-specialized configurations (``WS``: :func:`_nvfp4_ws_kernel`): the default partition (``num_warps``, the wgmma)
#: and two decode partitions of ``DECODE_WARPS`` warps at ``DECODE_REGS`` registers, a ring of ``WS_STAGES`` BF16 tiles.
#: The register file sets the shape: ptxas compiles the whole kernel under one register cap, 65536 / threads, and the
#: 128 x 128 FP32 accumulator of one warpgroup needs ~154, so 12 warps at most (4 wgmma + 2 x 4 decode). A 128 x 256
#: tile (8 wgmma warps) leaves room for 2 x 2 decode warps only: 2.3x slower (session 71), not kept.
WS_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, WS=True, WS_STAGES=3, DECODE_WARPS=4, DECODE_REGS=96),
]

#: register-A configurations (``RS``: :func:`_nvfp4_rs_kernel`): BLOCK_M = 16 * num_warps (each warp's 16 rows of
#: A decoded into its own wgmma fragment). A 128 x 128 tile ran at 0.74-0.82x of this one's speed on the square and
#: 124M fprop/dgrad shapes (faster on two 124M wgrad shapes, still under 0.4x cuBLAS there; session 72), not kept.
RS_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, RS=True),
]


#: mixed configurations (:func:`nvfp4_gemm_mixed`, :func:`_nvfp4_mixed_kernel`): A decoded into registers by
#: ``num_warps`` wgmma warps (BLOCK_M = 16 * num_warps), B a bf16 TMA ring of ``B_STAGES`` tiles fed by one loader warp.
#: The 128 x 128 tile is slower than the 128 x 256 one except on the 124M wgrad shapes (session 72). ``HALVES``: two
#: 32-deep wgmmas per K-tile with one always in flight (see the module docstring; session 73); ``maxnreg``: the
#: register cap per thread the kernel is compiled under (so that several one-warpgroup CTAs fit an SM). ``SPLIT``
#: (``HALVES`` only; BLOCK_M = 32 * num_warps): the two warpgroups of a 128-row tile as two partitions that share the B
#: ring with no CTA-wide barrier, the first one also loading B (module docstring; session 74). ``A_TMA`` (``SPLIT``
#: only): A's code bytes and scale words come by TMA in B's ring slots (session 76; measured in session 78).
#: ``NO_PROXY_FENCE`` (``A_TMA`` only): compiled without Triton's proxy fences (:func:`_without_proxy_fences`;
#: session 78, opt-in, timed only as ``bench/gemm_wgmma.py --no-proxy-fence``).
MIXED_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, MIXED=True, B_STAGES=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, MIXED=True, B_STAGES=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, MIXED=True, B_STAGES=3, HALVES=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, MIXED=True, B_STAGES=4, HALVES=True),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=3, HALVES=True, maxnreg=168),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=4, HALVES=True, maxnreg=128),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=3, HALVES=True, SPLIT=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=4, HALVES=True, SPLIT=True,
         A_TMA=False),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=4, HALVES=True, SPLIT=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=4, HALVES=True, SPLIT=True,
         A_TMA=True, NO_PROXY_FENCE=False),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=4, MIXED=True, B_STAGES=4, HALVES=True, SPLIT=True,
         A_TMA=True, NO_PROXY_FENCE=True),
]
#: the 128 x 256 ``SPLIT`` tile with a 4-slot B ring and A's code words by global loads: ``impl="mixed"``'s tile until
#: session 78, and the one the timing diagnostics and scheduling checks examine. Its ``A_TMA`` key is written out
#: (False) to show it is the global-load form.
MIXED_SPLIT_LDG = next(c for c in MIXED_CONFIGS if c.get("SPLIT") and c["BLOCK_N"] == 256 and c["B_STAGES"] == 4
                       and c.get("A_TMA") is False)
#: the same tile with A's code bytes and scale words by TMA (``A_TMA``; global loads where :func:`a_tma_ok` says no):
#: ``impl="mixed"``'s tile (:data:`fp4compile.kernels.gemm.MIXED_DEFAULT`) since session 78. An A/B against the
#: global-load form switches it in place (its ``NO_PROXY_FENCE`` key is written out, False, for the same reason):
#: ``bench/step_ab.py --arm 'ldg:fp4compile.kernels.gemm.MIXED_DEFAULT[A_TMA]=false'``.
MIXED_SPLIT_ATMA = next(c for c in MIXED_CONFIGS if c.get("SPLIT") and c["BLOCK_N"] == 256 and c["B_STAGES"] == 4
                        and c.get("A_TMA") is True and not c.get("NO_PROXY_FENCE"))


def supports(M: int, N: int, K: int) -> bool:
    """The kernel takes this shape: whole 64-wide K-tiles (M, N: any)."""
    return K > 0 and K % 64 == 0


def available() -> bool:
    """Gluon is importable (the kernel itself needs an sm_90 GPU)."""
    return gluon is not None


if gluon is not None:
    STAGES = gl.constexpr(3)  # K-tiles of NVFP4 codes in flight (cp.async ring)
    # 8 codes (one 32-bit word of 4 code bytes, all in one 16-element block) -> four bf16x2 words of q * S * 2^-8:
    # the PTX of kernels/dequant.py with one scale register ($5 = the block's scale as bf16x2) for all four words.
    # The output words hold the codes in the order (0, 2), (4, 6), (1, 3), (5, 7). A GEMM may permute K freely if
    # both operands get the same permutation inside each scale block, so the tiles go to shared memory in that
    # order and no instruction re-pairs them.
    _ASM = gl.constexpr(_DEQUANT_ASM.replace("$6", "$5"))

    @gluon.jit
    def _issue_tile(c_ptr, s_ptr, c_buf, s_buf, row0, R, k0, stride_w, stride_s,
                    ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
        """cp.async of one K-tile's code words [ROWS, BLOCK_K/8] (16 bytes per thread) and scale bytes
        [ROWS, BLOCK_K/16] (4 bytes per thread) of rows row0.. (wrapped mod R) into shared memory."""
        LC: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [gl.num_warps(), 1], [1, 0])
        rw = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LC))) % R
        kw = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, LC))
        wp = c_ptr.to(gl.pointer_type(gl.int32))
        async_copy.async_copy_global_to_shared(
            c_buf, wp + gl.expand_dims(rw.to(gl.int64), 1) * stride_w + (k0 // 8 + gl.expand_dims(kw, 0)))
        # the tile's 4 scale bytes of a row are one aligned int32 word (BLOCK_K = 64, K % 64 == 0)
        LSC: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [gl.num_warps(), 1], [1, 0])
        rs = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LSC))) % R
        ks = gl.arange(0, 1, layout=gl.SliceLayout(0, LSC))
        sp = s_ptr.to(gl.pointer_type(gl.int32))
        async_copy.async_copy_global_to_shared(
            s_buf, sp + gl.expand_dims(rs.to(gl.int64), 1) * stride_s + (k0 // 64 + gl.expand_dims(ks, 0)))

    @gluon.jit
    def _code_ring(a_c, a_s, b_c, b_s, off_m, off_n, M, N, num_k, stride_aw, stride_as, stride_bw, stride_bs,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """The NVFP4 staging ring (cp.async) of both operands, STAGES K-tiles of code words and scale words, with
        tiles 0 .. STAGES-1 issued and tile 0 arrived (tile indices past the end wrap to valid ones whose values are
        never read: no branch in the loops). Returns (A codes, B codes, A scales, B scales)."""
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        ac_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, BLOCK_K // 8], plain)
        bc_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], plain)
        as_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_M, 1], plain)
        bs_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 1], plain)
        for t in gl.static_range(STAGES):
            kt = (t % num_k) * BLOCK_K
            _issue_tile(a_c, a_s, ac_buf.index(t), as_buf.index(t), off_m, M, kt, stride_aw, stride_as,
                        BLOCK_M, BLOCK_K)
            _issue_tile(b_c, b_s, bc_buf.index(t), bs_buf.index(t), off_n, N, kt, stride_bw, stride_bs,
                        BLOCK_N, BLOCK_K)
            async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        return ac_buf, bc_buf, as_buf, bs_buf

    @gluon.jit
    def _read_tile(c_buf, s_buf, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, L3: gl.constexpr,
                   ROW_THREAD: gl.constexpr = False):
        """The staged code words as [ROWS, BLOCK_K/16, 2] in L3 and scale bytes [ROWS, BLOCK_K/16] in its slice
        (``ROW_THREAD``: L3 gives each thread a whole row of the tile, else half a row)."""
        if ROW_THREAD:
            LC: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [gl.num_warps(), 1], [1, 0])
        else:
            LC: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [gl.num_warps(), 1], [1, 0])
        c = c_buf.load(LC)
        c = gl.convert_layout(gl.reshape(c, (ROWS, BLOCK_K // 16, 2)), L3, assert_trivial=True)
        LS: gl.constexpr = gl.SliceLayout(2, L3)
        w = s_buf.load(LS).broadcast_to(ROWS, BLOCK_K // 16)
        sh = gl.expand_dims(gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, LS)), 0) * 8
        return c, ((w >> sh) & 0xFF).to(gl.uint8)

    @gluon.jit
    def _dequant_words(c, s, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, DIAG: gl.constexpr = 0):
        """[ROWS, BLOCK_K/16, 2] code words + [ROWS, BLOCK_K/16] E4M3 bytes -> int32 [ROWS, BLOCK_K/16, 2, 2, 2]:
        the bf16x2 words of q*S*2^-8 of each code word, its codes in the order (0, 2), (4, 6), (1, 3), (5, 7)."""
        sw = gl.expand_dims(_scale_word(s), 2).broadcast_to(ROWS, BLOCK_K // 16, 2)
        if DIAG == 1:  # timing diagnostic: no decode ALU work (the code words themselves are stored)
            return gl.join(gl.join(c, c | sw), gl.join(c, c))
        return _decode_words(c, sw)                                     # [ROWS, BLK, 2, 2, 2]

    @gluon.jit
    def _scale_word(s):
        """E4M3 scale bytes -> int32 words holding bf16(S * 2^118) twice: the bf16x2 multiplier that turns the decode
        PTX's bit-placed codes (each value times a fixed power of two, see _ASM) into q * S * 2^-8."""
        sf = s.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 332306998946228968225951765070086144.0
        sh = sf.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return sh | (sh << 16)

    @gluon.jit
    def _decode_parts(c, sw):
        """Code words (8 codes each) and their scale words (:func:`_scale_word`, same shape) -> the four bf16x2 words
        of q * S * 2^-8 of each code word, each of ``c``'s shape: codes (0, 2), (4, 6), (1, 3), (5, 7) in that order
        after :func:`_decode_words`' joins (the decode PTX's outputs $0, $2, $1, $3)."""
        return gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r", [c, sw],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _decode_words(c, sw):
        """Code words (8 codes each) and their scale words (:func:`_scale_word`, same shape) -> the bf16x2 words of
        q * S * 2^-8, as ``c.shape + [2, 2]``: its codes in the order (0, 2), (4, 6), (1, 3), (5, 7)."""
        o0, o1, o2, o3 = _decode_parts(c, sw)
        return gl.join(gl.join(o0, o2), gl.join(o1, o3))

    @gluon.jit
    def _bf16_operand(w, a_op: gl.constexpr, ROWS: gl.constexpr, K: gl.constexpr):
        """int32 [ROWS, K/2] bf16x2 words -> the bf16 [ROWS, K] wgmma register operand (layout ``a_op``), each word's
        low half first; the layouts line up, so no data moves."""
        lo = (w & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (w >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(gl.reshape(gl.join(lo, hi), (ROWS, K)), a_op, assert_trivial=True)

    @gluon.jit
    def _dequant(c, s, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, DIAG: gl.constexpr = 0):
        """[ROWS, BLOCK_K/16, 2] code words + [ROWS, BLOCK_K/16] E4M3 bytes -> int32 [ROWS, BLOCK_K/2]: bf16x2
        words of q*S*2^-8, K permuted inside each 8-code word (see _ASM)."""
        return gl.reshape(_dequant_words(c, s, ROWS, BLOCK_K, DIAG), (ROWS, BLOCK_K // 2))

    @gluon.jit
    def _fragment_order(w, ROWS: gl.constexpr):
        """:func:`_dequant_words`' [ROWS, 4 (block t), 2 (word), 2, 2] bf16x2 words of a 64-deep K-tile, rearranged to
        int32 [ROWS, 32] such that word q = 16 word + 8 i1 + 4 i0 + t: each thread of a wgmma A fragment (which holds
        the bf16 pairs q = t (mod 4) of its rows) then holds exactly the words of one 16-element scale block."""
        return gl.reshape(gl.permute(w, (0, 2, 4, 3, 1)), (ROWS, 32))

    @gluon.jit
    def _tile_offsets(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """(off_m, off_n) of this program's output tile, programs grouped GROUP_M tile rows at a time (L2 reuse)."""
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        gsize = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % gsize
        pid_n = (pid % group) // gsize
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @gluon.jit
    def _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, OUT_FP32: gl.constexpr, num_warps: gl.constexpr,
                  UNSCALE: gl.constexpr = 65536.0):
        """The FP32 accumulator times ``UNSCALE`` * a_global * b_global (2^16 undoes both operands' q*S*2^-8),
        rounded once to the output dtype and stored with coalesced stores (each warp writes whole 16-byte pieces of
        output rows)."""
        res = acc * (gl.load(ag_ptr) * gl.load(bg_ptr) * UNSCALE)
        EPI: gl.constexpr = _epilogue_layout(BLOCK_N, OUT_FP32, num_warps)
        if OUT_FP32:
            val = gl.convert_layout(res, EPI)
        else:
            val = gl.convert_layout(res.to(gl.bfloat16), EPI)
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, EPI))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, EPI))
        offs = gl.expand_dims(rm.to(gl.int64), 1) * stride_om + gl.expand_dims(rn, 0)
        mask = (gl.expand_dims(rm, 1) < M) & (gl.expand_dims(rn, 0) < N)
        gl.store(out_ptr + offs, val, mask=mask)

    @gluon.jit
    def _nvfp4_wgmma_kernel(a_c, a_s, b_c, b_s, ag_ptr, bg_ptr, out_ptr, M, N, K,
                            stride_aw, stride_as, stride_bw, stride_bs, stride_om,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            GROUP_M: gl.constexpr, OUT_FP32: gl.constexpr, DIAG: gl.constexpr,
                            num_warps: gl.constexpr):
        off_m, off_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)

        # register layout of a code tile: 16 consecutive bytes (two scale blocks) per thread
        L3: gl.constexpr = gl.BlockedLayout([1, 2, 2], [16, 2, 1], [num_warps, 1, 1], [2, 1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        # BF16 operand tiles, double buffered, wgmma's swizzled layout
        a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_K], a_sl)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_K], b_sl)
        # the same bytes as bf16x2 words: the swizzle of an NVMMA layout is defined on bytes
        w_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        a_wds = a_smem._reinterpret(gl.int32, [2, BLOCK_M, BLOCK_K // 2], w_sl)
        b_wds = b_smem._reinterpret(gl.int32, [2, BLOCK_N, BLOCK_K // 2], w_sl)
        num_k = K // BLOCK_K
        ac_buf, bc_buf, as_buf, bs_buf = _code_ring(a_c, a_s, b_c, b_s, off_m, off_n, M, N, num_k, stride_aw,
                                                    stride_as, stride_bw, stride_bs, BLOCK_M, BLOCK_N, BLOCK_K)
        ca, sa = _read_tile(ac_buf.index(0), as_buf.index(0), BLOCK_M, BLOCK_K, L3)
        cb, sb = _read_tile(bc_buf.index(0), bs_buf.index(0), BLOCK_N, BLOCK_K, L3)
        a_wds.index(0).store(_dequant(ca, sa, BLOCK_M, BLOCK_K, DIAG))
        b_wds.index(0).store(_dequant(cb, sb, BLOCK_N, BLOCK_K, DIAG))
        fence_async_shared()
        gl.thread_barrier()

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for ki in range(num_k):
            buf = ki % 2
            if DIAG != 2:  # DIAG 2, timing diagnostic: no MMA
                acc = warpgroup_mma(a_smem.index(buf), b_smem.index(buf).permute((1, 0)), acc, is_async=True)
            # tile ki + 1's codes are in the ring (tile ki + 2 may still be in flight). The shared-memory reads
            # below cannot move above this barrier, so neither can the dequantization that uses them: the four
            # HGMMAs of tile ki issue back to back (else ptxas spreads the ALU work between them and the tensor
            # cores idle)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            st = (ki + 1) % STAGES
            ca, sa = _read_tile(ac_buf.index(st), as_buf.index(st), BLOCK_M, BLOCK_K, L3)
            cb, sb = _read_tile(bc_buf.index(st), bs_buf.index(st), BLOCK_N, BLOCK_K, L3)
            ta = _dequant(ca, sa, BLOCK_M, BLOCK_K, DIAG)       # tile ki + 1, overlapping the wgmma of tile ki
            tb = _dequant(cb, sb, BLOCK_N, BLOCK_K, DIAG)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            gl.thread_barrier()                      # both warpgroups are done reading buffer 1 - buf
            a_wds.index(1 - buf).store(ta)
            b_wds.index(1 - buf).store(tb)
            fence_async_shared()
            gl.thread_barrier()
            # refill the ring slot of tile ki (read two iterations ago) with tile ki + STAGES, issued after the
            # fence: ptxas makes the fence a MEMBAR.ALL.CTA, which would wait for copies issued before it
            sl = ki % STAGES
            kt = ((ki + STAGES) % num_k) * BLOCK_K
            _issue_tile(a_c, a_s, ac_buf.index(sl), as_buf.index(sl), off_m, M, kt, stride_aw, stride_as,
                        BLOCK_M, BLOCK_K)
            _issue_tile(b_c, b_s, bc_buf.index(sl), bs_buf.index(sl), off_n, N, kt, stride_bw, stride_bs,
                        BLOCK_N, BLOCK_K)
            async_copy.commit_group()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        async_copy.wait_group(0)

        _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, OUT_FP32, num_warps)

    # ------------------------------------------------------------------------------------------------------------
    # Warp-specialized variant (``WS`` configs): decode partitions fill a ring of BF16 operand tiles, the default
    # partition (one warpgroup) only waits, issues the async wgmma and releases the ring slot it has finished with.
    @gluon.jit
    def _ws_decode_partition(c_ptr, s_ptr, bufs, ready, empty, row0, R, num_k, stride_w, stride_s,
                             ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WS_STAGES: gl.constexpr, nw: gl.constexpr):
        """Producer of one operand: K-tile ki's code words and scale word loaded from global memory three tiles ahead,
        decoded in registers (:func:`_dequant`), stored into ring slot ki % WS_STAGES once the MMA has released it
        (``empty``), then fenced (generic -> async proxy) and signalled (``ready``)."""
        LC: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [nw, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 2, 2], [16, 2, 1], [nw, 1, 1], [2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, L3)
        rw = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LC))) % R
        kw = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, LC))
        cp = c_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(rw.to(gl.int64), 1) * stride_w + gl.expand_dims(kw, 0)
        rs = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LS))) % R
        sp = s_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(rs.to(gl.int64), 1) * stride_s
        sh = gl.expand_dims(gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, LS)), 0) * 8
        # three K-tiles of code and scale words in flight in registers (global-load latency is ~3 tiles of decode)
        c0 = gl.load(cp)
        s0 = gl.load(sp)
        c1 = gl.load(cp + (1 % num_k) * (BLOCK_K // 8))
        s1 = gl.load(sp + 1 % num_k)
        c2 = gl.load(cp + (2 % num_k) * (BLOCK_K // 8))
        s2 = gl.load(sp + 2 % num_k)
        for ki in range(num_k):
            kn = (ki + 3) % num_k                      # tiles past the end wrap: loaded, never used
            c3 = gl.load(cp + kn * (BLOCK_K // 8))
            s3 = gl.load(sp + kn)
            cc = gl.convert_layout(gl.reshape(c0, (ROWS, BLOCK_K // 16, 2)), L3, assert_trivial=True)
            sb = ((s0.broadcast_to(ROWS, BLOCK_K // 16) >> sh) & 0xFF).to(gl.uint8)
            words = _dequant(cc, sb, ROWS, BLOCK_K)
            slot = ki % WS_STAGES
            mbarrier.wait(empty.index(slot), ((ki // WS_STAGES) & 1) ^ 1)
            bufs.index(slot).store(words)
            fence_async_shared()
            mbarrier.arrive(ready.index(slot), count=1)
            c0, c1, c2 = c1, c2, c3
            s0, s1, s2 = s1, s2, s3

    @gluon.jit
    def _ws_mma_partition(a_smem, b_smem, ready_a, ready_b, empty, num_k, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, WS_STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Consumer: per K-tile wait for both operands, issue the async wgmma, and once the previous tile's wgmma
        is complete (one left in flight) release that tile's ring slot. Returns the FP32 accumulator."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for ki in range(num_k):
            slot = ki % WS_STAGES
            ph = (ki // WS_STAGES) & 1
            mbarrier.wait(ready_a.index(slot), ph)
            mbarrier.wait(ready_b.index(slot), ph)
            acc = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((ki + WS_STAGES - 1) % WS_STAGES), count=1, pred=ki > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return (acc,)  # a partition returns a tuple of tensors

    @gluon.jit
    def _nvfp4_ws_kernel(a_c, a_s, b_c, b_s, ag_ptr, bg_ptr, out_ptr, M, N, K,
                         stride_aw, stride_as, stride_bw, stride_bs, stride_om,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, OUT_FP32: gl.constexpr, WS_STAGES: gl.constexpr,
                         DECODE_WARPS: gl.constexpr, DECODE_REGS: gl.constexpr, num_warps: gl.constexpr):
        """:func:`_nvfp4_wgmma_kernel`'s product with warp specialization: two decode partitions (A and B, each
        ``DECODE_WARPS`` warps at ``DECODE_REGS`` registers) and the wgmma in the default partition."""
        off_m, off_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        num_k = K // BLOCK_K

        a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
        b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [WS_STAGES, BLOCK_M, BLOCK_K], a_sl)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [WS_STAGES, BLOCK_N, BLOCK_K], b_sl)
        w_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        a_wds = a_smem._reinterpret(gl.int32, [WS_STAGES, BLOCK_M, BLOCK_K // 2], w_sl)
        b_wds = b_smem._reinterpret(gl.int32, [WS_STAGES, BLOCK_N, BLOCK_K // 2], w_sl)
        ready_a = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(WS_STAGES):
            mbarrier.init(ready_a.index(i), count=1)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)

        # the argument tuples are written out in the call: a tuple assigned to a name first turns its constexprs
        # into runtime values, which the partitions' layouts cannot take
        res = gl.warp_specialize([
            (_ws_mma_partition, (a_smem, b_smem, ready_a, ready_b, empty, num_k, BLOCK_M, BLOCK_N, WS_STAGES,
                                 num_warps)),
            (_ws_decode_partition, (a_c, a_s, a_wds, ready_a, empty, off_m, M, num_k, stride_aw, stride_as,
                                    BLOCK_M, BLOCK_K, WS_STAGES, DECODE_WARPS)),
            (_ws_decode_partition, (b_c, b_s, b_wds, ready_b, empty, off_n, N, num_k, stride_bw, stride_bs,
                                    BLOCK_N, BLOCK_K, WS_STAGES, DECODE_WARPS)),
        ], [DECODE_WARPS, DECODE_WARPS], [DECODE_REGS, DECODE_REGS])
        acc = res[0]

        _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, OUT_FP32, num_warps)

    # ------------------------------------------------------------------------------------------------------------
    # Register-A variant (``RS`` configs): A is decoded straight into the wgmma's register fragment (never stored to
    # shared memory); only B goes through shared memory. Both operands' K order inside a 64-deep tile is
    # :func:`_fragment_order`'s, so the product is unchanged.
    @gluon.constexpr_function
    def _a_code_layout(num_warps):
        """int32 [16 * num_warps, 4, 2] code words of an A K-tile: thread (warp w, lane 4 g + t) holds rows
        16 w + g and 16 w + g + 8, both words of scale block t: the rows and K pairs of its wgmma A fragment."""
        warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [8, 0, 0]],
                                          lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                          warp_bases=warps, block_bases=[], shape=[16 * num_warps, 4, 2])

    @gluon.constexpr_function
    def _a_scale_word_layout(num_warps):
        """int32 [16 * num_warps, 4] scale words (four K-tiles) of an A row block: thread (warp w, lane 4 g + t) holds
        all four words of rows 16 w + g and 16 w + g + 8 (the rows of :func:`_a_code_layout`; the four threads of a
        row read the same words)."""
        warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                          lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warps, block_bases=[], shape=[16 * num_warps, 4])

    @gluon.jit
    def _a_fragment(c_buf, s_buf, a_op: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
        """A K-tile's staged code words and scale bytes -> its bf16 [BLOCK_M, 64] wgmma operand in registers
        (layout ``a_op``), K in :func:`_fragment_order`."""
        LA: gl.constexpr = _a_code_layout(num_warps)
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        c = c_buf._reinterpret(gl.int32, [BLOCK_M, 4, 2], plain3).load(LA)
        s = s_buf._reinterpret(gl.uint8, [BLOCK_M, 4], plain2).load(gl.SliceLayout(2, LA))
        return _a_decode(c, s, a_op, BLOCK_M)

    @gluon.jit
    def _a_decode(c, s, a_op: gl.constexpr, BLOCK_M: gl.constexpr):
        """Code words [BLOCK_M, 4, 2] (layout :func:`_a_code_layout`) and scale bytes [BLOCK_M, 4] (its slice) of a
        64-deep A tile -> the bf16 wgmma operand in registers (layout ``a_op``), K in :func:`_fragment_order`."""
        return _bf16_operand(_fragment_order(_dequant_words(c, s, BLOCK_M, 64), BLOCK_M), a_op, BLOCK_M, 64)

    @gluon.jit
    def _a_decode_half(c, s, a_op: gl.constexpr, BLOCK_M: gl.constexpr):
        """Code word j [BLOCK_M, 4] of each scale block (a slice of :func:`_a_code_layout`) and its scale bytes
        [BLOCK_M, 4] -> the bf16 [BLOCK_M, 32] wgmma operand of K half j of a 64-deep tile (layout ``a_op`` of a
        32-deep product): in :func:`_fragment_order`, word j of every block fills exactly 16-deep steps 2 j, 2 j + 1,
        so half j of the fragment is :func:`_a_decode`'s fragment sliced at K 32 j."""
        w = _decode_words(c, _scale_word(s))                             # [BLOCK_M, 4 (t), 2 (i0), 2 (i1)]
        w = gl.reshape(gl.permute(w, (0, 3, 2, 1)), (BLOCK_M, 16))     # word q = 8 i1 + 4 i0 + t
        return _bf16_operand(w, a_op, BLOCK_M, 32)

    @gluon.jit
    def _nvfp4_rs_kernel(a_c, a_s, b_c, b_s, ag_ptr, bg_ptr, out_ptr, M, N, K,
                         stride_aw, stride_as, stride_bw, stride_bs, stride_om,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, OUT_FP32: gl.constexpr, DIAG: gl.constexpr,
                         num_warps: gl.constexpr):
        """:func:`_nvfp4_wgmma_kernel`'s product with A in registers: the wgmma reads A from the fragment that the
        decode writes, B from a double-buffered shared-memory tile; codes staged by the same cp.async ring."""
        off_m, off_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # a whole B row per thread: 16-byte shared-memory stores of the decoded words (half a row per thread, with
        # 8-byte stores, measured ~5 % slower in session 72)
        L3: gl.constexpr = gl.BlockedLayout([1, 4, 2], [32, 1, 1], [num_warps, 1, 1], [2, 1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_K], b_sl)
        w_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        b_wds = b_smem._reinterpret(gl.int32, [2, BLOCK_N, BLOCK_K // 2], w_sl)
        num_k = K // BLOCK_K
        ac_buf, bc_buf, as_buf, bs_buf = _code_ring(a_c, a_s, b_c, b_s, off_m, off_n, M, N, num_k, stride_aw,
                                                    stride_as, stride_bw, stride_bs, BLOCK_M, BLOCK_N, BLOCK_K)
        a_cur = _a_fragment(ac_buf.index(0), as_buf.index(0), a_op, BLOCK_M, num_warps)
        cb, sb = _read_tile(bc_buf.index(0), bs_buf.index(0), BLOCK_N, BLOCK_K, L3, True)
        b_wds.index(0).store(_fragment_order(_dequant_words(cb, sb, BLOCK_N, BLOCK_K), BLOCK_N))
        fence_async_shared()
        gl.thread_barrier()

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        # ring slot of tile ki and the tile index refilled into it, carried instead of computed with % (no division)
        ki_zero = num_k * 0
        sl = ki_zero
        kn = STAGES % num_k
        for ki in range(num_k):
            buf = ki % 2
            # timing diagnostics (results invalid): 2 no MMA, 3 no proxy fence, 4 no B decode/store, 5 no decode at all
            if DIAG != 2:
                acc = warpgroup_mma(a_cur, b_smem.index(buf).permute((1, 0)), acc, is_async=True)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            st = gl.where(sl == STAGES - 1, ki_zero, sl + 1)
            if DIAG == 5:
                a_next = a_cur
            else:
                a_next = _a_fragment(ac_buf.index(st), as_buf.index(st), a_op, BLOCK_M, num_warps)
            if DIAG < 4:
                cb, sb = _read_tile(bc_buf.index(st), bs_buf.index(st), BLOCK_N, BLOCK_K, L3, True)
                b_wds.index(1 - buf).store(_fragment_order(_dequant_words(cb, sb, BLOCK_N, BLOCK_K), BLOCK_N))
            if DIAG != 3:
                fence_async_shared()
            gl.thread_barrier()
            kt = kn * BLOCK_K
            _issue_tile(a_c, a_s, ac_buf.index(sl), as_buf.index(sl), off_m, M, kt, stride_aw, stride_as,
                        BLOCK_M, BLOCK_K)
            _issue_tile(b_c, b_s, bc_buf.index(sl), bs_buf.index(sl), off_n, N, kt, stride_bw, stride_bs,
                        BLOCK_N, BLOCK_K)
            async_copy.commit_group()
            # retire tile ki's wgmma before the loop turns (see _mixed_mma_partition: ptxas copies the carried A
            # fragment into the HGMMA's operand registers at the loop top); B buffer 1 - buf, written above, was last
            # read by tile ki - 1's wgmma, retired at the end of the previous iteration by every warpgroup before
            # the barrier that follows the ring wait
            acc, a_next, a_cur = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_next, a_cur))
            sl = st
            kn = gl.where(kn == num_k - 1, ki_zero, kn + 1)
            a_cur = a_next
        async_copy.wait_group(0)

        _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, OUT_FP32, num_warps)

    # ------------------------------------------------------------------------------------------------------------
    # Mixed variant (``MIXED`` configs): A (NVFP4) decoded into the wgmma's register fragment as in the RS kernel, its
    # code words loaded from global memory straight into registers three K-tiles ahead; B already BF16 in global
    # memory (dequantized once, K in :func:`_fragment_order`: :func:`prepare_b`), brought in by TMA from a one-warp
    # loader partition through an mbarrier ring. No shared-memory store, no proxy fence and no CTA-wide barrier.
    @gluon.jit
    def _mixed_load_partition(b_desc, b_smem, ready, empty, off_n, num_k, BLOCK_K: gl.constexpr,
                              B_STAGES: gl.constexpr):
        """TMA loader: B's K-tile ki into ring slot ki % B_STAGES once the MMA partition has released it."""
        for ki in range(num_k):
            s = ki % B_STAGES
            mbarrier.wait(empty.index(s), ((ki // B_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [off_n, ki * BLOCK_K], ready.index(s), b_smem.index(s))

    @gluon.jit
    def _keep(c, s, cp, M, DIAG: gl.constexpr):
        """Timing diagnostics 2 and 3 of the ``HALVES`` loop: one code word of each scale block of a K-tile (``c``) and
        its scale bytes, decoded (2: :func:`_decode_words`, the four outputs XOR-folded) or not (3), stored under a
        mask the compiler cannot decide (``M < 0``: never; a bound of the trip count would be decided), so the
        decode's instructions, or only the loads, stay in the loop without feeding the wgmmas and without a
        loop-carried value (an XOR-folded one made ptxas serialize the wgmmas)."""
        if DIAG == 2:
            o0, o1, o2, o3 = _decode_parts(c, _scale_word(s))
            x = o0 ^ o1 ^ o2 ^ o3
        else:
            x = c ^ s.to(gl.int32)
        gl.store(gl.split(cp)[0], x, mask=M < 0)

    @gluon.jit
    def _ring_load(kt, slot, b_desc, b_smem, ready, off_n, pred, a_ring, off_m, A_TMA: gl.constexpr):
        """The TMA loads of K-tile ``kt`` (64 deep) into ring slot ``slot``: B's tile, counted on ``ready[slot]``, and,
        with ``A_TMA`` (``a_ring`` = A's code and scale descriptors, their rings and their mbarriers), A's code bytes
        of the whole row block and each row's 16 scale bytes of the four tiles from ``kt // 4 * 4`` on (a TMA box row
        is a whole 16-byte piece starting 16-byte aligned; the reader keeps tile ``kt``'s 4 bytes, zeros past K),
        each counted on its own mbarrier: Triton's shared-memory analysis puts a barrier of the warpgroup between
        two TMA loads counted on one."""
        mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes, pred=pred)
        if A_TMA:       # every expect before the first load: then one barrier precedes the three loads
            a_desc, s_desc, a_smem, s_smem, ready_a, ready_s = a_ring
            mbarrier.expect(ready_a.index(slot), a_desc.block_type.nbytes, pred=pred)
            mbarrier.expect(ready_s.index(slot), s_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, kt * 32], ready_a.index(slot), a_smem.index(slot),
                                            pred=pred)
            # a box must start 16-byte aligned in its row (an unaligned start is an illegal instruction on an H100)
            tma.async_copy_global_to_shared(s_desc, [off_m, kt // 4 * 4], ready_s.index(slot), s_smem.index(slot),
                                            pred=pred)
        tma.async_copy_global_to_shared(b_desc, [off_n, kt * 64], ready.index(slot), b_smem.index(slot), pred=pred)

    @gluon.jit
    def _b_ring_start(b_desc, b_smem, ready, off_n, num_k, a_ring, off_m, B_STAGES: gl.constexpr,
                      A_TMA: gl.constexpr):
        """``PRODUCE``: the TMA loads of the first ``B_STAGES`` K-tiles (64 deep) into the ring (:func:`_ring_load`)."""
        for i in gl.static_range(B_STAGES):
            _ring_load(i, i, b_desc, b_smem, ready, off_n, i < num_k, a_ring, off_m, A_TMA)

    @gluon.jit
    def _halves_first(ki, acc, a0, a1, b_smem, ready, empty, B_STAGES: gl.constexpr):
        """The start of K-tile ``ki`` of a ``HALVES`` loop: wait for B's tile, issue its first 32-deep wgmma on ``a0``,
        retire the previous tile's second one (``a1``'s registers and that tile's B slot are then free) and release
        that slot."""
        s = ki % B_STAGES
        mbarrier.wait(ready.index(s), (ki // B_STAGES) & 1)
        acc = warpgroup_mma(a0, b_smem.index(s).slice(0, 32, dim=1).permute((1, 0)), acc, is_async=True)
        acc, a0, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0, a1))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((ki + B_STAGES - 1) % B_STAGES), count=1, pred=ki > 0)
        return acc, a0, a1

    @gluon.jit
    def _halves_second(ki, acc, a0, a1, b_smem, B_STAGES: gl.constexpr):
        """K-tile ``ki``'s second 32-deep wgmma on ``a1``; retires its first one (``a0``'s registers are then free for
        the next tile's first half)."""
        acc = warpgroup_mma(a1, b_smem.index(ki % B_STAGES).slice(32, 32, dim=1).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0, a1))

    @gluon.jit
    def _halves_refill(ki, b_desc, b_smem, ready, empty, off_n, num_k, a_ring, off_m, B_STAGES: gl.constexpr,
                       A_TMA: gl.constexpr = False):
        """With ``PRODUCE``: refill the slot of tile ki - 1 with tile ki - 1 + B_STAGES once both warpgroups released
        it (each arrived in :func:`_halves_first`; the other one normally did so while this one decoded)."""
        sp_prev = (ki + B_STAGES - 1) % B_STAGES
        refill = (ki > 0) & (ki - 1 + B_STAGES < num_k)
        mbarrier.wait(empty.index(sp_prev), ((ki - 1) // B_STAGES) & 1, pred=refill)
        _ring_load(ki - 1 + B_STAGES, sp_prev, b_desc, b_smem, ready, off_n, refill, a_ring, off_m, A_TMA)

    @gluon.jit
    def _halves_tile(ki, acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn, cp, sp, b_desc, b_smem, ready, empty, off_n,
                     num_k, M, a_h: gl.constexpr, BLOCK_M: gl.constexpr, B_STAGES: gl.constexpr, DIAG: gl.constexpr,
                     PRODUCE: gl.constexpr):
        """K-tile ``ki`` of the ``HALVES`` loop of :func:`_mixed_mma_partition`: its two 32-deep wgmmas on ``a0``,
        ``a1`` (one always in flight), the decode of its half 1 and of the next tile's half 0 (from ``c1``), the
        release of the previous tile's B slot (and with ``PRODUCE`` its refill), and the load of tile ``kn``'s code
        words. Returns the carried state, code words moved down one tile. Timing diagnostics (results invalid): with
        ``DIAG`` 1 no decode feeds the wgmmas and the code words' loads are dead (the compiler drops them); 2 decodes
        the same words off the wgmmas' path and 3 only keeps their loads (:func:`_keep`)."""
        acc, a0, a1 = _halves_first(ki, acc, a0, a1, b_smem, ready, empty, B_STAGES)
        if DIAG == 0:
            a1 = _a_decode_half(hi, hs, a_h, BLOCK_M)
        if DIAG >= 2:
            _keep(hi, hs, cp, M, DIAG)
        acc, a0, a1 = _halves_second(ki, acc, a0, a1, b_smem, B_STAGES)
        n0, n1 = gl.split(c1)
        if DIAG == 0:
            a0 = _a_decode_half(n0, s1, a_h, BLOCK_M)
        if DIAG >= 2:
            _keep(n0, s1, cp, M, DIAG)
        if PRODUCE:
            _halves_refill(ki, b_desc, b_smem, ready, empty, off_n, num_k, None, 0, B_STAGES)
        hi = n1
        hs = s1
        c1 = c2
        s1 = s2
        c2 = c3
        s2 = s3
        c3 = gl.load(cp + kn * 8)
        s3 = gl.load(sp + kn * 4)
        kn = gl.where(kn == num_k - 1, 0, kn + 1)
        return acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn

    @gluon.jit
    def _a_tile_smem(kt, a_ring, num_k, ROW0: gl.constexpr, ROWS: gl.constexpr, B_STAGES: gl.constexpr,
                     num_warps: gl.constexpr):
        """``A_TMA``: wait for K-tile ``kt``'s A code bytes and scale words in their ring slot (not past the last
        tile), then read this warpgroup's code words [ROWS, 4, 2] (:func:`_a_code_layout`) and scale bytes [ROWS, 4]
        of it from shared memory."""
        _, _, a_words, s_bytes, ready_a, ready_s = a_ring
        slot = kt % B_STAGES
        mbarrier.wait(ready_a.index(slot), (kt // B_STAGES) & 1, pred=kt < num_k)
        mbarrier.wait(ready_s.index(slot), (kt // B_STAGES) & 1, pred=kt < num_k)
        LA: gl.constexpr = _a_code_layout(num_warps)
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        words = a_words.index(slot)._reinterpret(gl.int32, [2 * ROWS, 4, 2], plain3)
        c = words.slice(ROW0, ROWS, dim=0).load(LA)
        # the slot holds 16 scale bytes a row from tile kt // 4 * 4 on (a TMA box starts 16-byte aligned): every
        # thread keeps word kt % 4 of its rows (one LDS where the unrolled loop knows kt % 4, else LDS.128 and a
        # select), byte t
        LW: gl.constexpr = _a_scale_word_layout(num_warps)
        LS: gl.constexpr = gl.SliceLayout(2, LA)
        w4 = s_bytes.index(slot).slice(ROW0, ROWS, dim=0).load(LW)
        col = gl.arange(0, 4, layout=gl.SliceLayout(0, LW))
        w = gl.sum(gl.where(gl.expand_dims(col, 0) == kt % 4, w4, 0), axis=1)
        w = gl.convert_layout(w, gl.SliceLayout(1, LS), assert_trivial=True)
        shift = gl.arange(0, 4, layout=gl.SliceLayout(0, LS)) * 8
        s = ((gl.expand_dims(w, 1) >> gl.expand_dims(shift, 0)) & 0xFF).to(gl.uint8)
        return c, s

    @gluon.jit
    def _halves_tile_tma(ki, acc, a0, a1, hi, hs, a_ring, b_desc, b_smem, ready, empty, off_m, off_n, num_k,
                         a_h: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
                         B_STAGES: gl.constexpr, PRODUCE: gl.constexpr, num_warps: gl.constexpr):
        """K-tile ``ki`` of the ``A_TMA`` loop (:func:`_mixed_tma_partition`): :func:`_halves_tile`'s wgmmas, waits
        and decodes, with the next tile's code words and scales read from its ring slot (brought by TMA with B's tile)
        instead of carried in registers from global loads."""
        acc, a0, a1 = _halves_first(ki, acc, a0, a1, b_smem, ready, empty, B_STAGES)
        a1 = _a_decode_half(hi, hs, a_h, ROWS)
        acc, a0, a1 = _halves_second(ki, acc, a0, a1, b_smem, B_STAGES)
        c, s = _a_tile_smem(ki + 1, a_ring, num_k, ROW0, ROWS, B_STAGES, num_warps)
        n0, n1 = gl.split(c)
        a0 = _a_decode_half(n0, s, a_h, ROWS)
        if PRODUCE:
            _halves_refill(ki, b_desc, b_smem, ready, empty, off_n, num_k, a_ring, off_m, B_STAGES, True)
        return acc, a0, a1, n1, s

    @gluon.jit
    def _mixed_tma_partition(a_ring, b_desc, b_smem, ready, empty, off_m, off_n, num_k, ROW0: gl.constexpr,
                             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, B_STAGES: gl.constexpr,
                             num_warps: gl.constexpr, PRODUCE: gl.constexpr):
        """One warpgroup of an ``A_TMA`` ``SPLIT`` tile (rows ``ROW0`` to ``ROW0 + ROWS`` of the block at ``off_m``):
        the ``HALVES`` loop of :func:`_mixed_mma_partition` with A's code bytes and scale bytes in the ring slots
        beside B's tile (:func:`_ring_load`; the first partition, ``PRODUCE``, issues all of a slot's loads), so
        mbarriers track their arrival and no global load sits in the loop. Returns the FP32 accumulator."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        a_h: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        if PRODUCE:
            _b_ring_start(b_desc, b_smem, ready, off_n, num_k, a_ring, off_m, B_STAGES, True)
        c0, s0 = _a_tile_smem(0, a_ring, num_k, ROW0, ROWS, B_STAGES, num_warps)
        w0, w1 = gl.split(c0)
        a0 = _a_decode_half(w0, s0, a_h, ROWS)
        a1 = _a_decode_half(w1, s0, a_h, ROWS)
        hi = w1
        hs = s0
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma)
        # unrolled by 4 K-tiles: a slot's scale words then come from a known column (kt % 4 is the unrolled step)
        for kb in range(num_k // 4):
            for u in gl.static_range(4):
                acc, a0, a1, hi, hs = _halves_tile_tma(kb * 4 + u, acc, a0, a1, hi, hs, a_ring, b_desc, b_smem,
                                                       ready, empty, off_m, off_n, num_k, a_h, ROW0, ROWS, B_STAGES,
                                                       PRODUCE, num_warps)
        for ki in range(num_k // 4 * 4, num_k):
            acc, a0, a1, hi, hs = _halves_tile_tma(ki, acc, a0, a1, hi, hs, a_ring, b_desc, b_smem, ready, empty,
                                                   off_m, off_n, num_k, a_h, ROW0, ROWS, B_STAGES, PRODUCE, num_warps)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))[0]
        return (acc,)

    @gluon.jit
    def _mixed_tma_consumer(a_ring, b_desc, b_smem, ready, empty, ag_ptr, bg_ptr, out_ptr, off_m, off_n, M, N, num_k,
                            stride_om, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, B_STAGES: gl.constexpr,
                            OUT_FP32: gl.constexpr, num_warps: gl.constexpr):
        """The second warpgroup of an ``A_TMA`` tile: its K loop (rows ``ROWS`` on) and its own epilogue."""
        acc = _mixed_tma_partition(a_ring, b_desc, b_smem, ready, empty, off_m, off_n, num_k, ROWS, ROWS, BLOCK_N,
                                   B_STAGES, num_warps, False)[0]
        _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m + ROWS, off_n, stride_om, ROWS, BLOCK_N, OUT_FP32,
                  num_warps, 256.0)

    @gluon.jit
    def _mixed_mma_partition(a_c, a_s, b_desc, b_smem, ready, empty, off_m, off_n, M, num_k, stride_aw, stride_as,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_STAGES: gl.constexpr,
                             HALVES: gl.constexpr, num_warps: gl.constexpr, DIAG: gl.constexpr = 0,
                             PRODUCE: gl.constexpr = False):
        """A's decode and the wgmma: per K-tile wait for B, issue the wgmma on the decoded A fragment, decode the next
        A tile (code words loaded three tiles ahead) while it runs, retire it and release its B slot. Returns the FP32
        accumulator. ``PRODUCE`` (``SPLIT``): this partition also loads B by TMA (K-tiles 64 deep), the ring's first
        ``B_STAGES`` tiles before the loop and, in iteration ki, tile ki - 1 + B_STAGES into tile ki - 1's slot once
        every partition has released it. ``DIAG`` 1 (``HALVES`` only): timing only, no A decode in the loop (results
        invalid)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        LA: gl.constexpr = _a_code_layout(num_warps)
        LS: gl.constexpr = gl.SliceLayout(2, LA)
        # code-word pointers [BLOCK_M, 4 (block t), 2 (word)] of tile 0 (rows past M wrap: loaded, never stored)
        rows = (off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LS))) % M
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
        jj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA)))
        row_w = gl.expand_dims(gl.expand_dims(rows.to(gl.int64) * stride_aw, 1), 2)
        word = gl.expand_dims(gl.expand_dims(t, 0), 2) * 2 + gl.expand_dims(gl.expand_dims(jj, 0), 1)
        cp = a_c.to(gl.pointer_type(gl.int32)) + row_w + word
        sp = a_s + gl.expand_dims(rows.to(gl.int64) * stride_as, 1) + gl.expand_dims(t, 0)
        c0 = gl.load(cp)
        s0 = gl.load(sp)
        c1 = gl.load(cp + (1 % num_k) * 8)
        s1 = gl.load(sp + (1 % num_k) * 4)
        c2 = gl.load(cp + (2 % num_k) * 8)
        s2 = gl.load(sp + (2 % num_k) * 4)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        if HALVES:
            # each K-tile as two 32-deep wgmmas on two fragments, one always in flight while the other half is
            # decoded: the decode of a half waits only for the wgmma that last read that half's registers
            a_h: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            w0, w1 = gl.split(c0)
            a0 = _a_decode_half(w0, s0, a_h, BLOCK_M)
            a1 = _a_decode_half(w1, s0, a_h, BLOCK_M)
            hi = w1                         # word 1 of the current tile (its half 1 is decoded in the loop)
            hs = s0
            # tiles 1-3's code words in flight; each K-tile loads tile ki + 4's after its words moved down one tile
            c3 = gl.load(cp + (3 % num_k) * 8)
            s3 = gl.load(sp + (3 % num_k) * 4)
            kn = 4 % num_k
            if PRODUCE:                     # this partition also loads B: the ring's first tiles
                _b_ring_start(b_desc, b_smem, ready, off_n, num_k, None, 0, B_STAGES, False)
            # unrolled by 3, the code words' prefetch depth: c1 <- c2 <- c3 <- load is then a renaming, not moves
            # that ptxas put after a hoisted load and that waited for it (long-scoreboard stalls, session 74)
            for kb in range(num_k // 3):
                for u in gl.static_range(3):
                    acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn = _halves_tile(
                        kb * 3 + u, acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn, cp, sp, b_desc, b_smem, ready,
                        empty, off_n, num_k, M, a_h, BLOCK_M, B_STAGES, DIAG, PRODUCE)
            for ki in range(num_k // 3 * 3, num_k):
                acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn = _halves_tile(
                    ki, acc, a0, a1, hi, hs, c1, s1, c2, s2, c3, s3, kn, cp, sp, b_desc, b_smem, ready, empty, off_n,
                    num_k, M, a_h, BLOCK_M, B_STAGES, DIAG, PRODUCE)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))[0]
            gl.thread_barrier()
            mbarrier.arrive(empty.index((num_k - 1) % B_STAGES), count=1)
            return (acc,)
        zero = num_k * 0
        kn = 3 % num_k                      # the tile whose codes this iteration loads (wrapping past the end)
        a_cur = _a_decode(c0, s0, a_op, BLOCK_M)
        for ki in range(num_k):
            c3 = gl.load(cp + kn * 8)
            s3 = gl.load(sp + kn * 4)
            s = ki % B_STAGES
            mbarrier.wait(ready.index(s), (ki // B_STAGES) & 1)
            acc = warpgroup_mma(a_cur, b_smem.index(s).permute((1, 0)), acc, is_async=True)
            a_next = _a_decode(c1, s1, a_op, BLOCK_M)     # overlaps the wgmma
            # retire this tile's wgmma before the loop turns: ptxas copies the carried A fragment into the HGMMA's
            # operand registers at the top of the loop, so those registers must not be in use by a wgmma then
            # (with one wgmma left in flight across the back edge, this kernel's first form, 128 x 256 tiles lost
            # 1,752 of 65,024 exact-check values on an H100, session 72). a_next in the deps keeps its decode above
            # the wait; a_cur keeps the registers the wgmma reads live until it is done, so the decode cannot reuse
            # them (ptxas would then serialize the HGMMAs: "non wgmma instructions defining input registers of a
            # wgmma").
            acc, a_next, a_cur = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_next, a_cur))
            gl.thread_barrier()             # every warpgroup has retired tile ki: its B slot is free
            mbarrier.arrive(empty.index(s), count=1)
            c1 = c2
            s1 = s2
            c2 = c3
            s2 = s3
            kn = gl.where(kn == num_k - 1, zero, kn + 1)
            a_cur = a_next
        return (acc,)

    @gluon.jit
    def _mixed_consumer(a_c, a_s, b_desc, b_smem, ready, empty, ag_ptr, bg_ptr, out_ptr, off_m, off_n, M, N, num_k,
                        stride_aw, stride_as, stride_om, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                        B_STAGES: gl.constexpr, OUT_FP32: gl.constexpr, DIAG: gl.constexpr, num_warps: gl.constexpr):
        """One warpgroup's ``ROWS`` x ``BLOCK_N`` part of a ``SPLIT`` tile: its K loop on the shared B ring
        (:func:`_mixed_mma_partition`, ``HALVES``) and its own epilogue."""
        acc = _mixed_mma_partition(a_c, a_s, b_desc, b_smem, ready, empty, off_m, off_n, M, num_k, stride_aw,
                                   stride_as, ROWS, BLOCK_N, B_STAGES, True, num_warps, DIAG)[0]
        _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, ROWS, BLOCK_N, OUT_FP32, num_warps,
                  256.0)

    @gluon.jit
    def _nvfp4_mixed_kernel(a_c, a_s, b_desc, ag_ptr, bg_ptr, out_ptr, M, N, K, stride_aw, stride_as, stride_om,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            GROUP_M: gl.constexpr, OUT_FP32: gl.constexpr, B_STAGES: gl.constexpr,
                            HALVES: gl.constexpr, num_warps: gl.constexpr, SPLIT: gl.constexpr = False,
                            CONSUMER_REGS: gl.constexpr = 256, DIAG: gl.constexpr = 0, A_TMA: gl.constexpr = False,
                            NO_PROXY_FENCE: gl.constexpr = False):
        """``C = (A @ B^T) * a_global * b_global`` with A as NVFP4 codes decoded in registers and B as the exact
        bf16 values ``q * S`` (K in :func:`_fragment_order`) behind a TMA descriptor. ``SPLIT``: the tile's two
        halves of rows are two partitions of ``num_warps`` warps (one warpgroup each) that share the B ring and
        release its slots independently (``empty`` counts two arrivals), so no barrier spans both warpgroups.
        ``NO_PROXY_FENCE`` is not read here: it keys the compile made under :func:`_without_proxy_fences`
        (``A_TMA`` only)."""
        off_m, off_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        num_k = K // BLOCK_K
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [B_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(B_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2 if SPLIT else 1)
        if A_TMA:
            # A's code bytes [BLOCK_M, 32] and 16 scale bytes a row (4 used) per ring slot, beside B's tile, each
            # with its own mbarrier (Triton puts a barrier of the warpgroup between two TMA loads counted on one)
            ROWS: gl.constexpr = BLOCK_M // 2
            a_smem = gl.allocate_shared_memory(gl.uint8, [B_STAGES, BLOCK_M, 32], a_c.layout)
            s_smem = gl.allocate_shared_memory(gl.int32, [B_STAGES, BLOCK_M, 4], a_s.layout)
            ready_a = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
            ready_s = gl.allocate_shared_memory(gl.int64, [B_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(B_STAGES):
                mbarrier.init(ready_a.index(i), count=1)
                mbarrier.init(ready_s.index(i), count=1)
            a_ring = (a_c, a_s, a_smem, s_smem, ready_a, ready_s)
            res = gl.warp_specialize([
                (_mixed_tma_partition, (a_ring, b_desc, b_smem, ready, empty, off_m, off_n, num_k, 0, ROWS, BLOCK_N,
                                        B_STAGES, num_warps, True)),
                (_mixed_tma_consumer, (a_ring, b_desc, b_smem, ready, empty, ag_ptr, bg_ptr, out_ptr, off_m, off_n, M,
                                       N, num_k, stride_om, ROWS, BLOCK_N, B_STAGES, OUT_FP32, num_warps)),
            ], [num_warps], [CONSUMER_REGS])
            _epilogue(res[0], ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, ROWS, BLOCK_N, OUT_FP32,
                      num_warps, 256.0)
        elif SPLIT:
            ROWS: gl.constexpr = BLOCK_M // 2
            res = gl.warp_specialize([
                (_mixed_mma_partition, (a_c, a_s, b_desc, b_smem, ready, empty, off_m, off_n, M, num_k, stride_aw,
                                        stride_as, ROWS, BLOCK_N, B_STAGES, True, num_warps, DIAG, True)),
                (_mixed_consumer, (a_c, a_s, b_desc, b_smem, ready, empty, ag_ptr, bg_ptr, out_ptr, off_m + ROWS,
                                   off_n, M, N, num_k, stride_aw, stride_as, stride_om, ROWS, BLOCK_N, B_STAGES,
                                   OUT_FP32, DIAG, num_warps)),
            ], [num_warps], [CONSUMER_REGS])
            _epilogue(res[0], ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, ROWS, BLOCK_N, OUT_FP32,
                      num_warps, 256.0)
        else:
            res = gl.warp_specialize([
                (_mixed_mma_partition, (a_c, a_s, b_desc, b_smem, ready, empty, off_m, off_n, M, num_k, stride_aw,
                                        stride_as, BLOCK_M, BLOCK_N, B_STAGES, HALVES, num_warps, DIAG)),
                (_mixed_load_partition, (b_desc, b_smem, ready, empty, off_n, num_k, BLOCK_K, B_STAGES)),
            ], [1], [40])
            acc = res[0]
            # A's values are q * S * 2^-8, B's q * S: 2^8 undoes the one power of two
            _epilogue(acc, ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, OUT_FP32,
                      num_warps, 256.0)

    @gluon.constexpr_function
    def _epilogue_layout(block_n, out_fp32, num_warps):
        vec = 4 if out_fp32 else 8                      # 16 bytes per thread
        tn = min(32, block_n // vec)
        return gl.BlockedLayout([1, vec], [32 // tn, tn], [num_warps, 1], [1, 0])


def _variant_constexprs(cfg: dict, diag: int = 0) -> dict:
    """The kernel-specific constexprs of a config: the warp-specialized kernel's ring and partitions, or the
    software-pipelined and register-A kernels' timing diagnostic."""
    if cfg.get("WS"):
        return dict(WS_STAGES=cfg["WS_STAGES"], DECODE_WARPS=cfg["DECODE_WARPS"], DECODE_REGS=cfg["DECODE_REGS"])
    return dict(DIAG=diag)


def _check_config(cfg: dict) -> None:
    """A config's tile: 64 deep in K (one scale word per row and tile); a register-A kernel (``RS`` or ``MIXED``)
    gives each warp 16 rows of A, so BLOCK_M = 16 * num_warps."""
    bm, bk, nw = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["num_warps"]
    if bk != 64:
        raise ValueError(f"impl='wgmma' tiles are 64 deep in K (one scale word per row and tile), got BLOCK_K={bk}")
    parts = 2 if cfg.get("SPLIT") else 1
    if (cfg.get("RS") or cfg.get("MIXED")) and bm != 16 * nw * parts:
        raise ValueError(f"a register-A config needs BLOCK_M = 16 * num_warps (16 rows per warp; twice that for "
                         f"SPLIT), got {bm} rows and {nw} warps")
    if cfg.get("SPLIT") and not (cfg.get("MIXED") and cfg.get("HALVES")):
        raise ValueError("SPLIT is an option of the MIXED HALVES configs")
    if cfg.get("A_TMA") and (cfg.get("DIAG", 0) or not cfg.get("SPLIT")):
        raise ValueError(f"A_TMA is an option of the SPLIT configs, without timing diagnostics, got {cfg}")
    if cfg.get("NO_PROXY_FENCE") and not cfg.get("A_TMA"):
        raise ValueError(f"NO_PROXY_FENCE is an option of the A_TMA configs, got {cfg}")
    if cfg.get("MIXED") and cfg.get("DIAG", 0) and not (cfg.get("HALVES") and cfg["DIAG"] in (1, 2, 3)):
        raise ValueError(f"the mixed kernel's timing diagnostics are DIAG 1, 2, 3 of a HALVES config, got {cfg}")


def _kernel_of(cfg: dict):
    """The kernel a config runs."""
    return _nvfp4_ws_kernel if cfg.get("WS") else _nvfp4_rs_kernel if cfg.get("RS") else _nvfp4_wgmma_kernel


def offline_cubin(config: Optional[dict] = None, out_fp32: bool = False, diag: int = 0) -> bytes:
    """The sm_90 cubin of :func:`_nvfp4_wgmma_kernel` (or, for a ``WS`` config, :func:`_nvfp4_ws_kernel`; for an
    ``RS`` config, :func:`_nvfp4_rs_kernel`; a ``MIXED`` one: :func:`offline_cubin_mixed`) for ``config``, compiled
    on any machine (no GPU needed;
    :func:`fp4compile.kernels.offline.compile_offline`), specialized as a launch on contiguous operands with
    K % 128 == 0 would be (code-row strides of K/8 words divisible by 16). For tests and SASS inspection."""
    from .offline import compile_offline

    cfg = dict(config or WGMMA_CONFIGS[0])
    sig = dict(a_c="*u8", a_s="*u8", b_c="*u8", b_s="*u8", ag_ptr="*fp32", bg_ptr="*fp32",
               out_ptr="*fp32" if out_fp32 else "*bf16", M="i32", N="i32", K="i32", stride_aw="i32",
               stride_as="i32", stride_bw="i32", stride_bs="i32", stride_om="i32")
    const = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=8,
                 OUT_FP32=out_fp32, num_warps=cfg["num_warps"], **_variant_constexprs(cfg, diag))
    return compile_offline(_kernel_of(cfg), sig, const,
                           cfg["num_warps"], upto="cubin",
                           divisible_by_16=["a_c", "a_s", "b_c", "b_s", "out_ptr", "K", "stride_aw", "stride_bw",
                                            "stride_om"])


def nvfp4_gemm_wgmma(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16, *,
                     config: Optional[dict] = None):
    """``C = (A @ B^T) * a_global * b_global`` by :func:`_nvfp4_wgmma_kernel`, or by the kernel of a ``WS`` or
    ``RS`` config, or for a ``MIXED`` config by :func:`prepare_b` then :func:`nvfp4_gemm_mixed` (sm_90 only).
    Arguments as for :func:`fp4compile.kernels.gemm.nvfp4_gemm` (validated there); ``config``: one of
    :data:`WGMMA_CONFIGS`, :data:`WS_CONFIGS`, :data:`RS_CONFIGS` or :data:`MIXED_CONFIGS` (default the first of
    ``WGMMA_CONFIGS``; ``BLOCK_K`` must be 64). A ``"DIAG"`` key gives the timing-only diagnostics of
    ``bench/gemm_wgmma.py``, whose results are not the product: for the software-pipelined kernel 1 (no decode ALU
    work) or 2 (no MMA); for an ``RS`` config 2 (no MMA), 3 (no proxy fence), 4 (no B decode) or 5 (no decode); a
    ``WS`` config has none."""
    if gluon is None:
        raise RuntimeError("impl='wgmma' needs Triton's Gluon (triton.experimental.gluon)")
    cfg = dict(config or WGMMA_CONFIGS[0])
    _check_config(cfg)
    bm, bn, bk, nw = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if not a_codes.is_cuda:
        raise RuntimeError("impl='wgmma' runs on CUDA (sm_90) only")
    if cfg.get("MIXED"):
        return nvfp4_gemm_mixed(a_codes, a_scales, a_global, prepare_b(b_codes, b_scales), b_global, out_dtype,
                                config=cfg)
    M, N, K = a_codes.shape[0], b_codes.shape[0], 2 * a_codes.shape[1]
    if not supports(M, N, K):
        raise ValueError(f"impl='wgmma' needs K % 64 == 0 (whole 64-wide K-tiles), got K={K}")
    for t, align in ((a_codes, 16), (a_scales, 4), (b_codes, 16), (b_scales, 4)):
        if t.stride(-1) != 1 or t.stride(0) % 4 or t.data_ptr() % align:
            raise ValueError("impl='wgmma' needs contiguous rows, row strides of whole 4-byte words, 16-byte aligned "
                             "codes and 4-byte aligned scales")
    out = torch.empty((M, N), device=a_codes.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    ag = a_global.reshape(1).to(torch.float32)
    bg = b_global.reshape(1).to(torch.float32)
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    kernel = _kernel_of(cfg)
    kernel[grid](a_codes, a_scales, b_codes, b_scales, ag, bg, out, M, N, K,
                 a_codes.stride(0) // 4, a_scales.stride(0) // 4, b_codes.stride(0) // 4, b_scales.stride(0) // 4,
                 out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, OUT_FP32=out_dtype == torch.float32,
                 num_warps=nw, **_variant_constexprs(cfg, cfg.get("DIAG", 0)))
    return out


def fragment_permutation() -> torch.Tensor:
    """The K order of a 64-deep tile in the register-A kernels: entry p is the logical K index (0..63) that position p
    holds. Position p = 2 q + e is element e of bf16x2 word q = 16 j + 8 i1 + 4 i0 + t (:func:`_fragment_order`),
    which holds codes ``pairs[2 i0 + i1][e]`` of code word j of scale block t (:func:`_dequant_words`' order)."""
    pairs = ((0, 2), (4, 6), (1, 3), (5, 7))
    perm = []
    for p in range(64):
        q, e = divmod(p, 2)
        j, i1, i0, t = q // 16, (q // 8) % 2, (q // 4) % 2, q % 4
        perm.append(16 * t + 8 * j + pairs[2 * i0 + i1][e])
    return torch.tensor(perm, dtype=torch.long)


_PERM_ON: dict = {}   # device -> fragment_permutation() on it


if triton is not None:
    @triton.jit
    def _prepare_b_kernel(c_ptr, s_ptr, o_ptr, R, KH, BLOCK_R: tl.constexpr, DEQUANT_ASM: tl.constexpr):
        """One [BLOCK_R, 64] tile of :func:`prepare_b`: the exact bf16 ``q * S`` of the codes (the dequantize pass's
        own tile math), K permuted in registers into :func:`fragment_permutation`'s order and stored contiguously."""
        rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        kb = tl.program_id(1) * 32 + tl.arange(0, 32)
        ks = tl.program_id(1) * 4 + tl.arange(0, 4)
        rmask = rr[:, None] < R
        row = rr.to(tl.int64)[:, None]
        codes = tl.load(c_ptr + row * KH + kb[None, :], mask=rmask, other=0)
        scales = tl.load(s_ptr + row * (KH // 8) + ks[None, :], mask=rmask, other=0)
        v = _dequant_tile(codes, scales, BLOCK_R, 64, DEQUANT_ASM).to(tl.float32) * 256.0
        # logical k = 16 t + 8 j + 4 i1 + 2 e + i0 goes to position p = 32 j + 16 i1 + 8 i0 + 2 t + e
        v = tl.reshape(tl.permute(tl.reshape(v, (BLOCK_R, 4, 2, 2, 2, 2)), (0, 2, 3, 5, 1, 4)), (BLOCK_R, 64))
        ko = tl.program_id(1) * 64 + tl.arange(0, 64)
        tl.store(o_ptr + row * (2 * KH) + ko[None, :], v.to(tl.bfloat16), mask=rmask)


def prepare_b(b_codes, b_scales, *, fused: bool = True) -> torch.Tensor:
    """B for :func:`nvfp4_gemm_mixed`: the exact bf16 values ``q * S`` of NVFP4 codes ``[N, K/2]`` and E4M3 scale
    bytes ``[N, K/16]`` (no global scale), K permuted inside every 64-deep tile by :func:`fragment_permutation` (the
    order the kernel gives A's register fragment); K % 64 == 0. ``fused`` (default): one Triton pass that dequantizes
    and permutes in registers; ``fused=False``: the dequantize pass, then a gather (session 72's form, the tests'
    second statement of the same result)."""
    from .gemm import dequantize_bf16

    N, K = b_codes.shape[0], 2 * b_codes.shape[1]
    if K % 64:
        raise ValueError(f"prepare_b needs K % 64 == 0, got K={K}")
    if b_codes.dtype != torch.uint8 or b_scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"prepare_b takes uint8 codes and E4M3 scale bytes, got {b_codes.dtype}, {b_scales.dtype}")
    if b_scales.shape != (N, K // 16):
        raise ValueError(f"scales must be [N, K/16] = {(N, K // 16)}, got {tuple(b_scales.shape)}")
    if not fused:
        b = dequantize_bf16(b_codes, b_scales)
        idx = _PERM_ON.get(b.device)
        if idx is None:             # made once per device, outside any CUDA-graph capture that calls this later
            idx = _PERM_ON[b.device] = fragment_permutation().to(b.device)
        return b.view(N, K // 64, 64).index_select(2, idx).view(N, K)
    codes = b_codes.contiguous()
    scales = b_scales.contiguous().view(torch.uint8)
    out = torch.empty((N, K), device=b_codes.device, dtype=torch.bfloat16)
    br = 64 if b_codes.is_cuda else 16
    asm = b_codes.is_cuda and DEFAULT_DEQUANT == "asm"
    launch(_prepare_b_kernel, (cdiv(N, br), K // 64), codes, scales, out, N, K // 2, BLOCK_R=br, DEQUANT_ASM=asm,
           num_warps=4)
    return out


def _mixed_constexprs(cfg: dict) -> dict:
    """The mixed kernel's optional constexprs of a config: ``SPLIT`` (and its consumers' register count), the
    timing diagnostic ``DIAG``, ``A_TMA`` and ``NO_PROXY_FENCE``."""
    return dict(SPLIT=bool(cfg.get("SPLIT")), CONSUMER_REGS=cfg.get("CONSUMER_REGS", 256), DIAG=cfg.get("DIAG", 0),
                A_TMA=bool(cfg.get("A_TMA")), NO_PROXY_FENCE=bool(cfg.get("NO_PROXY_FENCE")))


@contextlib.contextmanager
def _without_proxy_fences():
    """Compiles inside this block run without Triton's proxy-fence insertion pass: an ``A_TMA`` slot read by ``LDS``
    is then refilled by TMA after the consumers' mbarrier arrivals alone, with no ``fence.proxy.async`` before the
    load (as CUTLASS's sm90 mixed-input mainloop releases its slots). The pass is put back on exit. A kernel already
    compiled is not recompiled, and the cache key does not see the pass: a kernel compiled here needs a key of its own
    (the ``NO_PROXY_FENCE`` constexpr; ``bench/gemm_wgmma.py --no-proxy-fence`` uses a fresh cache directory)."""
    from triton._C.libtriton import nvidia
    mod = nvidia.passes.ttnvgpuir
    saved = mod.add_proxy_fence_insertion
    mod.add_proxy_fence_insertion = lambda pm, *args: None
    try:
        yield
    finally:
        mod.add_proxy_fence_insertion = saved


def _fences_of(cfg: dict):
    """The context a config's kernel is compiled in: :func:`_without_proxy_fences` for ``NO_PROXY_FENCE``, else
    nothing (a ``nullcontext``: no generator on every launch)."""
    return _without_proxy_fences() if cfg.get("NO_PROXY_FENCE") else contextlib.nullcontext()


def _a_tma_layouts():
    """The unswizzled shared layouts of an ``A_TMA`` ring slot: code bytes [BLOCK_M, 32] and scale words
    [BLOCK_M, 4] (int32)."""
    return (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def a_tma_ok(a_codes, a_scales) -> bool:
    """Whether an ``A_TMA`` config can take A by TMA: 16-byte aligned bases and rows of whole 16-byte pieces (codes
    K/2 bytes, scales K/16 bytes a row: K % 256 == 0 for contiguous operands); otherwise :func:`nvfp4_gemm_mixed`
    runs the same tile with A's words loaded into registers."""
    return (a_codes.data_ptr() % 16 == 0 and a_scales.data_ptr() % 16 == 0 and a_codes.stride(0) % 16 == 0
            and a_scales.stride(0) % 16 == 0 and a_codes.stride(-1) == 1 and a_scales.stride(-1) == 1)


def nvfp4_gemm_mixed(a_codes, a_scales, a_global, b16, b_global, out_dtype=torch.bfloat16, *,
                     config: Optional[dict] = None):
    """``C = (A @ B^T) * a_global * b_global`` with A as NVFP4 (codes ``[M, K/2]``, E4M3 bytes ``[M, K/16]``) decoded
    in registers and B given as :func:`prepare_b`'s bf16 ``[N, K]`` (sm_90 only; K % 64 == 0). ``config``: one of
    :data:`MIXED_CONFIGS` (default the first); a ``"DIAG"`` key on a ``HALVES`` config times the kernel with no decode
    feeding the wgmmas (``bench/gemm_wgmma.py``'s ``diag_mixed``; the result is not the product): 1 without A's decode
    and code loads, 2 with both off the wgmmas' path, 3 with the loads only (:func:`_halves_tile`). An ``A_TMA``
    config takes A by TMA when :func:`a_tma_ok` allows, else runs the same tile with A's words loaded by each
    thread."""
    if gluon is None:
        raise RuntimeError("the mixed GEMM needs Triton's Gluon (triton.experimental.gluon)")
    cfg = dict(config or MIXED_CONFIGS[0])
    if not cfg.get("MIXED"):
        raise ValueError(f"nvfp4_gemm_mixed takes one of MIXED_CONFIGS, got {cfg}")
    _check_config(cfg)
    bm, bn, bk, nw = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if not a_codes.is_cuda:
        raise RuntimeError("the mixed GEMM runs on CUDA (sm_90) only")
    M, N, K = a_codes.shape[0], b16.shape[0], 2 * a_codes.shape[1]
    if b16.dtype != torch.bfloat16 or b16.shape[1] != K or not b16.is_contiguous():
        raise ValueError(f"B must be prepare_b's contiguous bf16 [N, {K}], got {b16.dtype} {tuple(b16.shape)}")
    if not supports(M, N, K):
        raise ValueError(f"the mixed GEMM needs K % 64 == 0, got K={K}")
    if a_codes.stride(-1) != 1 or a_codes.stride(0) % 4 or a_codes.data_ptr() % 16 or a_scales.stride(-1) != 1:
        raise ValueError("the mixed GEMM needs contiguous A rows of whole 4-byte words, 16-byte aligned")
    out = torch.empty((M, N), device=a_codes.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    b_desc = TensorDescriptor(b16, [N, K], [K, 1], [bn, bk], layout)
    ag = a_global.reshape(1).to(torch.float32)
    bg = b_global.reshape(1).to(torch.float32)
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    a_arg, s_arg = a_codes, a_scales
    if cfg.get("A_TMA"):
        if a_tma_ok(a_codes, a_scales):
            la, ls = _a_tma_layouts()
            a_arg = TensorDescriptor(a_codes, [M, K // 2], [a_codes.stride(0), 1], [bm, 32], la)
            s_arg = TensorDescriptor(a_scales.view(torch.int32), [M, K // 64], [a_scales.stride(0) // 4, 1], [bm, 4],
                                     ls)
        else:
            cfg.pop("A_TMA")
            cfg.pop("NO_PROXY_FENCE", None)
    with _fences_of(cfg):
        _nvfp4_mixed_kernel[grid](a_arg, s_arg, b_desc, ag, bg, out, M, N, K, a_codes.stride(0) // 4,
                                  a_scales.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                  OUT_FP32=out_dtype == torch.float32, B_STAGES=cfg["B_STAGES"],
                                  HALVES=bool(cfg.get("HALVES")), num_warps=nw, **_mixed_constexprs(cfg),
                                  **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    return out


def offline_cubin_mixed(config: Optional[dict] = None, out_fp32: bool = False) -> bytes:
    """The sm_90 cubin of :func:`_nvfp4_mixed_kernel` for ``config`` (default the first of :data:`MIXED_CONFIGS`),
    compiled on any machine, specialized as :func:`offline_cubin`'s kernels are."""
    from .offline import compile_offline

    cfg = dict(config or MIXED_CONFIGS[0])
    layout = gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_N"], cfg["BLOCK_K"]], gl.bfloat16)
    desc = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}],{layout!r}>"
    a_c, a_s = "*u8", "*u8"
    if cfg.get("A_TMA"):
        la, ls = _a_tma_layouts()
        a_c = f"tensordesc<u8[{cfg['BLOCK_M']}, 32],{la!r}>"
        a_s = f"tensordesc<i32[{cfg['BLOCK_M']}, 4],{ls!r}>"
    sig = dict(a_c=a_c, a_s=a_s, b_desc=desc, ag_ptr="*fp32", bg_ptr="*fp32",
               out_ptr="*fp32" if out_fp32 else "*bf16", M="i32", N="i32", K="i32", stride_aw="i32", stride_as="i32",
               stride_om="i32")
    const = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=8,
                 OUT_FP32=out_fp32, B_STAGES=cfg["B_STAGES"], HALVES=bool(cfg.get("HALVES")),
                 num_warps=cfg["num_warps"], **_mixed_constexprs(cfg))
    extra = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    with _fences_of(cfg):
        return compile_offline(_nvfp4_mixed_kernel, sig, const, cfg["num_warps"], upto="cubin",
                               divisible_by_16=(["out_ptr"] if cfg.get("A_TMA") else ["a_c", "a_s", "out_ptr"])
                               + ["K", "stride_aw", "stride_as", "stride_om"],
                               **extra)


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
