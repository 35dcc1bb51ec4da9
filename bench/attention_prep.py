"""The Q-Attn backward's preparatory launch with and without QK_1X16's re-quantization (issue 4, session 52).

``_bwd_prep`` computes delta = rowsum(dO * O) and the bf16 code x scale of the saved Q and K copies; under
``QK_BLOCKS="1x16"`` it also writes each copy re-quantized in 16x16 tiles (the dS products' operands), from the same
read of its codes and scales (session 52; before, a second read in separate tasks). This times, per shape (CUDA graph
of 20 launches, ``triton.testing.do_bench_cudagraph``, median):

* ``tiles``: the launch as the default (16x16 copies) runs it;
* ``1x16``: the launch with both copies re-quantized (1x16 copies);
* ``copy``: a bf16 copy (``Tensor.copy_``) of as many bytes as the ``1x16`` launch reads and writes;

and prints each launch's time, its ratio to the ``tiles`` launch, and its bytes moved per second as a fraction of
the copy's. Both launches' outputs are checked against ``attention_ref`` first (code x scale, and
``requantize_tiles`` for the re-quantized tiles).

    python bench/attention_prep.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fp4compile.kernels import attention as A  # noqa: E402
from fp4compile.kernels import attention_ref as R  # noqa: E402

#: (B, H, T, D): the GPT-124M step's attention (16,384 tokens, 12 heads of 64) and the attention table's long ones
SHAPES = ((16, 12, 1024, 64), (4, 16, 4096, 64), (4, 16, 4096, 128))


def prep_bytes(B: int, H: int, T: int, D: int, requant: bool) -> int:
    """Bytes the prep launch moves for Q and K copies of [B, H, T, D]: dO and O read (bf16), delta written (fp32),
    each copy's codes and scales read (D/2 + D/16 bytes a row) and its code x scale written (bf16); with
    ``requant`` also each copy's tiles written (bf16)."""
    rows = B * H * T
    per_copy = rows * (D // 2 + D // 16) + rows * D * 2 * (2 if requant else 1)
    return 2 * rows * D * 2 + rows * 4 + 2 * per_copy


def inputs(B: int, H: int, T: int, D: int, device, seed: int = 0):
    """dO, O ([B, T, H, D]-strided views, as the op gets them) and the 16x16 and 1x16 NVFP4 copies of random Q, K."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).bfloat16()

    do, o = (rnd(B, T, H, D).transpose(1, 2) for _ in range(2))
    q, k = rnd(B, H, T, D), rnd(B, H, T, D)
    tiles = [A.quantize_2d(t, True)[:2] for t in (q, k)]
    rows = [A.quantize_2d(t, False)[:2] for t in (q, k)]
    return do, o, tiles, rows


def check(do, o, tiles, rows) -> None:
    """Both launches' outputs against the reference (exact)."""
    one = torch.ones((), device=do.device)
    for pairs, rq in ((tiles, [False, False]), (rows, [True, True])):
        delta, deqs, reqs = A._bwd_prep(do, o, pairs, rq)
        ref = (do.float() * o.float()).sum(-1)
        assert torch.allclose(delta, ref, rtol=1e-5, atol=1e-4), "delta != rowsum(dO * O)"
        for (c, s), d, z in zip(pairs, deqs, reqs):
            assert torch.equal(d, R.dequantize_2d(c, s, one, torch.bfloat16)), "code x scale != reference"
            assert (z is None) != rq[0], "re-quantized output where none was asked, or none where asked"
            if z is not None:
                assert torch.equal(z, R.requantize_tiles(c, s, one, torch.bfloat16)), "tiles != reference"


def main() -> int:
    from triton.testing import do_bench_cudagraph

    print(torch.__version__, torch.cuda.get_device_name())
    print("| shape (B, H, T, D) | launch | us | vs tiles | MB moved | of copy bandwidth |")
    print("|---|---|---|---|---|---|")
    for B, H, T, D in SHAPES:
        do, o, tiles, rows = inputs(B, H, T, D, "cuda")
        check(do, o, tiles, rows)
        nbytes = prep_bytes(B, H, T, D, True)
        src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")  # read + write = nbytes
        dst = torch.empty_like(src)

        def reps(fn, n=20):
            def run():
                for _ in range(n):
                    fn()
            return do_bench_cudagraph(run, rep=200) * 1e3 / n

        t = {"tiles": reps(lambda: A._bwd_prep(do, o, tiles, [False, False])),
             "1x16": reps(lambda: A._bwd_prep(do, o, rows, [True, True])),
             "copy": reps(lambda: dst.copy_(src))}
        bw_copy = nbytes / t["copy"]
        for name, us in t.items():
            moved = nbytes if name != "tiles" else prep_bytes(B, H, T, D, False)
            print(f"| {B}, {H}, {T}, {D} | {name} | {us:.1f} | {us / t['tiles']:.3f} | {moved / 1e6:.1f} "
                  f"| {moved / us / bw_copy:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
