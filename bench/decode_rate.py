"""How fast can an sm_90 SM turn NVFP4 codes into 16-bit tensor-core operands? (issue 3)

Issue 3's GEMM target (>= 0.95x cuBLAS BF16) on a GPU without FP4 tensor cores needs a GEMM that decodes both NVFP4
operands inside its main loop, overlapped with the BF16 (or FP16) wgmma. Such a CTA decodes every A tile once per
N-tile and every B tile once per M-tile: MNK (1/BLOCK_M + 1/BLOCK_N) elements for MNK multiply-adds. At the largest
tile one CTA can hold (128 x 256 FP32 accumulators) that is ~1.2 % of the MACs, so running at cuBLAS's rate means
decoding ~1.2 % of cuBLAS's MAC rate in elements per second, besides everything else the kernel does. This script
measures the decode alone (no memory traffic, no shared memory, no MMA) and sets it against that demand, both in
the same run, so the ratio does not depend on the clock.

Decoders (8 codes = one 32-bit word in, four 32-bit words of 16-bit pairs out, the block scale applied):
  * ``bf16``: the project's decode (``kernels.dequant._DEQUANT_ASM``, used by every dequantize kernel and the Gluon
    GEMM): one ``prmt`` and per output word shift/mask/or, then ``mul.rn.bf16x2`` by the scale; q * S * 2^-8.
  * ``f16_cvt``: the E2M1 codes moved into E4M3 bytes by shifts and masks (an E2M1 code ``s e1 e0 m`` is the E4M3
    byte ``s 0 0 e1 e0 m 0 0`` times 2^6, subnormal 0.5 included), then ``cvt.rn.f16x2.e4m3x2`` (two per word of
    four bytes) and ``mul.rn.f16x2`` by the scale in FP16: q * S * 2^-6, exact in FP16 (at most 6 significant bits,
    magnitudes in [2^-16, 42]). An FP16 wgmma on two such operands is exact too (global scales in the epilogue).
  * ``none``: the loop with no decode (the per-iteration add and XOR fold that every variant carries), the
    harness's own cost.

Each thread keeps its code and scale words in registers and decodes them ``ITERS`` times (the word plus the
iteration index, so nothing can be hoisted), folding the outputs into one XOR word that is stored at the end.

Checks first: every code byte (256) under 127 E4M3 scale bytes, decoded once by each decoder on the GPU, must equal
the table value times the scale (times the decoder's power of two) bit for bit.

    python bench/decode_rate.py [--iters 1024] [--clock-ghz 1.98]

CPU (no GPU): ``tests/test_decode_rate.py`` checks the E2M1 -> E4M3 byte mapping against ``ml_dtypes`` and compiles
both decoders for sm_90 offline (their SASS: the conversion instruction, instructions per element).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4compile.formats.nvfp4 import _E2M1_SIGNED  # noqa: E402  (code -> value, sign in bit 3)
from fp4compile.kernels.dequant import _DEQUANT_ASM  # noqa: E402

#: the project's bf16 decode with one scale register ($5) for all four output words
ASM_BF16 = _DEQUANT_ASM.replace("$6", "$5")

#: E2M1 -> E4M3 bytes by shifts and masks, two FP8 -> FP16x2 conversions per word, the scale in FP16.
#: Output words: (code 0, code 2), (4, 6), (1, 3), (5, 7) -- low nibbles of bytes 0..3, then high nibbles.
ASM_F16_CVT = """
{
.reg .b32 t, u, a, b, r0, r1, r2, r3;
.reg .b16 a0, a1, b0, b1;
shl.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 u, $4, 4;
and.b32 u, u, 0x80808080;
or.b32 a, t, u;
shr.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $4, 0x80808080;
or.b32 b, t, u;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.rn.f16x2.e4m3x2 r0, a0;
cvt.rn.f16x2.e4m3x2 r1, a1;
cvt.rn.f16x2.e4m3x2 r2, b0;
cvt.rn.f16x2.e4m3x2 r3, b1;
mul.rn.f16x2 $0, r0, $5;
mul.rn.f16x2 $1, r1, $5;
mul.rn.f16x2 $2, r2, $5;
mul.rn.f16x2 $3, r3, $5;
}
"""

DECODERS = {"bf16": ASM_BF16, "f16_cvt": ASM_F16_CVT}
#: the code of each output 16-bit lane, in order (word 0 low, word 0 high, word 1 low, ...); both decoders emit this
#: order, the one ``kernels.gemm_wgmma`` stores its tiles in
LANE_CODES = (0, 2, 4, 6, 1, 3, 5, 7)
#: the power of two each decoder's values carry (q * S * 2^k)
POW2 = {"bf16": -8, "f16_cvt": -6}


def e4m3_bytes_of_codes(words: np.ndarray) -> np.ndarray:
    """The ``f16_cvt`` decoder's first step in numpy: uint32 code words -> uint32 [..., 2] words of four E4M3 bytes
    (low nibbles of the four code bytes, then the high nibbles), the same shifts and masks as the PTX."""
    w = words.astype(np.uint32)
    a = ((w << np.uint32(2)) & np.uint32(0x1C1C1C1C)) | ((w << np.uint32(4)) & np.uint32(0x80808080))
    b = ((w >> np.uint32(2)) & np.uint32(0x1C1C1C1C)) | (w & np.uint32(0x80808080))
    return np.stack([a, b], axis=-1)


def scale_word(scale_bytes: torch.Tensor, decoder: str) -> torch.Tensor:
    """E4M3 scale bytes -> the int32 scale register each decoder multiplies by: the scale in both 16-bit lanes
    (bf16: S * 2^118, the placement ``kernels.dequant`` uses; f16_cvt: S itself)."""
    s = scale_bytes.view(torch.float8_e4m3fn).float()
    if decoder == "bf16":
        h = (s * 2.0 ** 118).to(torch.bfloat16).view(torch.int16)
    else:
        h = s.to(torch.float16).view(torch.int16)
    h = h.to(torch.int32) & 0xFFFF
    return h | (h << 16)


def reference(words: torch.Tensor, scale_bytes: torch.Tensor, decoder: str) -> torch.Tensor:
    """float64 [N, 8] values of each output lane (see LANE_CODES) of ``words`` [N] under ``scale_bytes`` [N]."""
    table = torch.tensor(_E2M1_SIGNED, dtype=torch.float64)                       # code 8: -0.0
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * i)) & 0xF for i in LANE_CODES], dim=1)
    s = scale_bytes.view(torch.float8_e4m3fn).to(torch.float64)
    return table[codes] * s[:, None] * 2.0 ** POW2[decoder]


if triton is not None:
    @triton.jit
    def _decode_once_kernel(c_ptr, s_ptr, o_ptr, N, ASM: tl.constexpr, BLOCK: tl.constexpr):
        """Decode each word once: o [N, 4] int32 output words."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        c = tl.load(c_ptr + offs, mask=m, other=0)
        sw = tl.load(s_ptr + offs, mask=m, other=0)
        o0, o1, o2, o3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [c, sw],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=True, pack=1)
        tl.store(o_ptr + offs * 4, o0, mask=m)
        tl.store(o_ptr + offs * 4 + 1, o1, mask=m)
        tl.store(o_ptr + offs * 4 + 2, o2, mask=m)
        tl.store(o_ptr + offs * 4 + 3, o3, mask=m)

    @triton.jit
    def _decode_rate_kernel(c_ptr, s_ptr, o_ptr, ITERS: tl.constexpr, ASM: tl.constexpr, DECODE: tl.constexpr,
                            WORDS: tl.constexpr):
        """Each program decodes its WORDS code words ITERS times from registers (word + i, so nothing is hoisted)
        and XOR-folds the outputs into one word per input word."""
        offs = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
        c = tl.load(c_ptr + offs)
        sw = tl.load(s_ptr + offs)
        acc = tl.zeros_like(c)
        for i in range(ITERS):
            ci = c + i
            if DECODE:
                o0, o1, o2, o3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [ci, sw],
                                                           dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                           is_pure=True, pack=1)
                acc = acc ^ o0 ^ o1 ^ o2 ^ o3
            else:
                acc = acc ^ ci
        tl.store(o_ptr + offs, acc)


def rate_spec(decoder: str, iters: int = 64, words: int = 1024, num_warps: int = 4):
    """(kernel, signature, constexprs, num_warps) of the rate kernel for ``decoder`` (or ``"none"``), for
    :func:`fp4compile.kernels.offline.compile_offline`."""
    sig = dict(c_ptr="*i32", s_ptr="*i32", o_ptr="*i32")
    const = dict(ITERS=iters, ASM=DECODERS.get(decoder, ""), DECODE=decoder != "none", WORDS=words)
    return _decode_rate_kernel, sig, const, num_warps


def check(decoder: str) -> int:
    """Mismatching lanes of every code byte (as all four bytes of a word) under 127 scale bytes."""
    dev = "cuda"
    byte = torch.arange(256, dtype=torch.int64).repeat(127)
    sbytes = torch.arange(127, dtype=torch.uint8).repeat_interleave(256)
    words = (byte | (byte << 8) | (byte << 16) | (byte << 24)).to(torch.int64)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    sw = scale_word(sbytes, decoder)
    out = torch.empty(words.numel() * 4, dtype=torch.int32, device=dev)
    n = words.numel()
    _decode_once_kernel[(triton.cdiv(n, 1024),)](words.to(dev), sw.to(dev), out, n,
                                                ASM=DECODERS[decoder], BLOCK=1024)
    dt = torch.bfloat16 if decoder == "bf16" else torch.float16
    got = out.cpu().view(dt).view(n, 8).to(torch.float64)
    ref = reference(words, sbytes, decoder)
    same = (got == ref) & (torch.signbit(got) == torch.signbit(ref))
    return int((~same).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=1024)
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for the per-cycle column (max clock)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_rate.py needs a CUDA GPU (the CPU checks are tests/test_decode_rate.py)")
        return 2
    from triton.testing import do_bench

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"device {props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    bad = {d: check(d) for d in DECODERS}
    print("checks (mismatching lanes of 256 x 127 x 8):", bad, "PASS" if not any(bad.values()) else "FAIL")
    if any(bad.values()):
        return 1

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms_mm = do_bench(lambda: a @ b, rep=200)
    mac_s = n ** 3 / (ms_mm * 1e-3)
    print(f"cuBLAS BF16 {n}^3: {ms_mm:.3f} ms, {2 * mac_s / 1e12:.0f} TFLOP/s")

    words = 1024
    grid = sms * 16
    c = torch.randint(-2 ** 31, 2 ** 31 - 1, (grid * words,), dtype=torch.int32, device="cuda")
    s = scale_word(torch.full((grid * words,), 0x38, dtype=torch.uint8), "f16_cvt").cuda()
    o = torch.empty_like(c)
    elems = grid * words * 8 * args.iters
    rows = []
    for name in ("none", "bf16", "f16_cvt"):
        kern, _, const, nw = rate_spec(name, args.iters, words)
        ms = do_bench(lambda: kern[(grid,)](c, s, o, num_warps=nw, **const), rep=200)
        rows.append((name, ms, elems / (ms * 1e-3)))
    print(f"\n| decoder | ms ({elems / 1e9:.2f} G elements) | G elements/s | per SM per cycle at {args.clock_ghz} GHz |")
    print("|---|---|---|---|")
    for name, ms, rate in rows:
        print(f"| {name} | {ms:.3f} | {rate / 1e9:.0f} | {rate / sms / (args.clock_ghz * 1e9):.1f} |")
    print("\nFull-rate in-loop decoding of both operands at cuBLAS's measured MAC rate needs MAC/s x (1/BM + 1/BN) "
          "elements/s:")
    print("| CTA tile | decoded elements per MAC | needed G elements/s | share of bf16 decode | share of f16_cvt decode |")
    print("|---|---|---|---|---|")
    rate = {name: r for name, _, r in rows}
    for bm, bn in ((128, 128), (128, 256), (256, 256)):
        per = 1 / bm + 1 / bn
        need = mac_s * per
        print(f"| {bm}x{bn} | {per:.5f} | {need / 1e9:.0f} | {need / rate['bf16']:.2f} | "
              f"{need / rate['f16_cvt']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
