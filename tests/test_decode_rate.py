"""bench/decode_rate.py, the decode-throughput probe for issue 3's in-loop NVFP4 GEMM question: the E2M1 -> E4M3 byte
mapping of the ``f16_cvt`` decoder against ``ml_dtypes`` (an independent FP8 decoder), the float64 reference the GPU
check uses against the format library, and the sm_90 code of both decoders (compiled here, no GPU)."""
import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import decode_rate as D  # noqa: E402
from fp4compile.formats import nvfp4  # noqa: E402

SIGNED = np.array(list(nvfp4.E2M1_VALUES) + [-v for v in nvfp4.E2M1_VALUES])


def _every_code_byte():
    """(words, codes): each code byte 0..255 as all four bytes of a uint32 word, and each word's codes in the
    decoders' lane order [256, 8]."""
    b = np.arange(256, dtype=np.uint32)
    words = b | (b << 8) | (b << 16) | (b << 24)
    return words, np.array([[(int(w) >> (4 * i)) & 0xF for i in D.LANE_CODES] for w in words])


def test_e2m1_codes_become_e4m3_bytes_of_the_same_value_times_2_pow_minus_6():
    """Every code byte, as all four bytes of a word: the shifted and masked bytes, read by ml_dtypes as E4M3,
    are the E2M1 values (signed zero included) times 2^-6, in the lane order LANE_CODES gives."""
    words, codes = _every_code_byte()
    e4m3 = D.e4m3_bytes_of_codes(words).astype("<u4").view(np.uint8).reshape(256, 8)
    got = e4m3.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = SIGNED[codes] * 2.0 ** -6
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))   # code 8 is -0.0


def test_a_wrong_mask_is_caught():
    """The mapping test can fail: dropping the sign mask's bit changes the negative codes."""
    words, codes = _every_code_byte()
    e4m3 = D.e4m3_bytes_of_codes(words) & np.uint32(0x7F7F7F7F)
    got = e4m3.astype("<u4").view(np.uint8).reshape(256, 8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert not np.array_equal(got, SIGNED[codes] * 2.0 ** -6)


@pytest.mark.parametrize("decoder", ["bf16", "f16_cvt"])
def test_reference_is_the_format_librarys_dequantization(decoder):
    """reference(): per output lane, the code's value times the E4M3 scale times the decoder's power of two, the
    same numbers as nvfp4.NVFP4Tensor.dequantize for a one-block tensor with global scale 1."""
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (64,), generator=g, dtype=torch.int32)
    sbytes = torch.randint(0, 127, (64,), generator=g, dtype=torch.uint8)
    ref = D.reference(words, sbytes, decoder)
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([((w >> (8 * j)) & 0xFF) for j in range(4)], 1).to(torch.uint8)   # [64, 4] code bytes
    codes = torch.cat([codes, torch.zeros_like(codes)], 1)                                # a 16-element block
    t = nvfp4.NVFP4Tensor(codes, sbytes.view(torch.float8_e4m3fn)[:, None], torch.tensor(1.0), (64, 16))
    deq = t.dequantize(torch.float64)[:, :8]                                              # codes 0..7
    assert torch.equal(ref, deq[:, list(D.LANE_CODES)] * 2.0 ** D.POW2[decoder])


def _rate_kernel_sass_ops(name):
    from fp4compile.kernels.offline import compile_offline, disassemble

    kern, sig, const, nw = D.rate_spec(name, iters=64, words=256, num_warps=4)
    sass = disassemble(compile_offline(kern, sig, const, nw, upto="cubin", divisible_by_16=tuple(sig)))
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]


def test_sm90_code_of_the_two_decoders():
    """Compiled for sm_90 here (the compiler unrolls the loop, so counts are per decode of one word, which applies
    the scale in 4 packed multiplies): the f16_cvt decoder is 4 F2FP per word (one per two codes, no moves for the
    16-bit halves) and takes fewer instructions per word than the bf16 decoder, which uses PRMT and no F2FP."""
    per_word = {}
    for name in ("bf16", "f16_cvt"):
        ops = _rate_kernel_sass_ops(name)
        decodes = sum(o.startswith(("HMUL2", "HFMA2")) for o in ops) / 4
        assert decodes >= 2 and decodes == int(decodes)
        f2fp = sum(o.startswith("F2FP") for o in ops)
        if name == "f16_cvt":
            assert f2fp == 4 * decodes and not any(o.startswith("PRMT") for o in ops)
        else:
            assert f2fp == 0 and any(o.startswith("PRMT") for o in ops)
        per_word[name] = len(ops) / decodes
    assert per_word["f16_cvt"] < per_word["bf16"], per_word


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", ["bf16", "f16_cvt"])
def test_gpu_decoders_are_exact(decoder):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert D.check(decoder) == 0
