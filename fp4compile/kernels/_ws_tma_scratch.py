"""Scratch (session 71): the WS kernel with TMA-staged code tiles. Not imported by the package."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from fp4compile.kernels import gemm_wgmma as W


@gluon.jit
def _ws_tma_decode_partition(desc, s_ptr, stage, full, bufs, ready, empty, row0, R, num_k, stride_s,
                             ROWS: gl.constexpr, BLOCK_K: gl.constexpr, WS_STAGES: gl.constexpr,
                             CODE_STAGES: gl.constexpr, nw: gl.constexpr):
    LC: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [nw, 1], [1, 0])
    L3: gl.constexpr = gl.BlockedLayout([1, 2, 2], [16, 2, 1], [nw, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    plain: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    st_w = stage._reinterpret(gl.int32, [CODE_STAGES, ROWS, BLOCK_K // 8], plain)
    rs = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LS))) % R
    sp = s_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(rs.to(gl.int64), 1) * stride_s
    sh = gl.expand_dims(gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, LS)), 0) * 8
    NBYTES: gl.constexpr = ROWS * BLOCK_K // 2
    for p in gl.static_range(CODE_STAGES - 1):
        mbarrier.expect(full.index(p), NBYTES, pred=p < num_k)
        tma.async_copy_global_to_shared(desc, [row0, p * (BLOCK_K // 2)], full.index(p), stage.index(p),
                                        pred=p < num_k)
    s0 = gl.load(sp)
    s1 = gl.load(sp + 1 % num_k)
    s2 = gl.load(sp + 2 % num_k)
    for ki in range(num_k):
        t = ki + CODE_STAGES - 1
        ts = t % CODE_STAGES
        fence_async_shared()
        mbarrier.expect(full.index(ts), NBYTES, pred=t < num_k)
        tma.async_copy_global_to_shared(desc, [row0, t * (BLOCK_K // 2)], full.index(ts), stage.index(ts),
                                        pred=t < num_k)
        s3 = gl.load(sp + (ki + 3) % num_k)
        cs = ki % CODE_STAGES
        mbarrier.wait(full.index(cs), (ki // CODE_STAGES) & 1)
        c = st_w.index(cs).load(LC)
        cc = gl.convert_layout(gl.reshape(c, (ROWS, BLOCK_K // 16, 2)), L3, assert_trivial=True)
        sb = ((s0.broadcast_to(ROWS, BLOCK_K // 16) >> sh) & 0xFF).to(gl.uint8)
        words = W._dequant(cc, sb, ROWS, BLOCK_K)
        slot = ki % WS_STAGES
        mbarrier.wait(empty.index(slot), ((ki // WS_STAGES) & 1) ^ 1)
        bufs.index(slot).store(words)
        fence_async_shared()
        mbarrier.arrive(ready.index(slot), count=1)
        s0, s1, s2 = s1, s2, s3


@gluon.jit
def _nvfp4_ws_tma_kernel(a_desc, a_s, b_desc, b_s, ag_ptr, bg_ptr, out_ptr, M, N, K,
                         stride_as, stride_bs, stride_om,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, OUT_FP32: gl.constexpr, WS_STAGES: gl.constexpr,
                         CODE_STAGES: gl.constexpr, DECODE_WARPS: gl.constexpr, DECODE_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
    off_m, off_n = W._tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    num_k = K // BLOCK_K
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [WS_STAGES, BLOCK_M, BLOCK_K], a_sl)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [WS_STAGES, BLOCK_N, BLOCK_K], b_sl)
    w_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    a_wds = a_smem._reinterpret(gl.int32, [WS_STAGES, BLOCK_M, BLOCK_K // 2], w_sl)
    b_wds = b_smem._reinterpret(gl.int32, [WS_STAGES, BLOCK_N, BLOCK_K // 2], w_sl)
    a_stage = gl.allocate_shared_memory(gl.uint8, [CODE_STAGES, BLOCK_M, BLOCK_K // 2], a_desc.layout)
    b_stage = gl.allocate_shared_memory(gl.uint8, [CODE_STAGES, BLOCK_N, BLOCK_K // 2], b_desc.layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [WS_STAGES, 1], mbarrier.MBarrierLayout())
    full_a = gl.allocate_shared_memory(gl.int64, [CODE_STAGES, 1], mbarrier.MBarrierLayout())
    full_b = gl.allocate_shared_memory(gl.int64, [CODE_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WS_STAGES):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(CODE_STAGES):
        mbarrier.init(full_a.index(i), count=1)
        mbarrier.init(full_b.index(i), count=1)
    res = gl.warp_specialize([
        (W._ws_mma_partition, (a_smem, b_smem, ready_a, ready_b, empty, num_k, BLOCK_M, BLOCK_N, WS_STAGES,
                               num_warps)),
        (_ws_tma_decode_partition, (a_desc, a_s, a_stage, full_a, a_wds, ready_a, empty, off_m, M, num_k, stride_as,
                                    BLOCK_M, BLOCK_K, WS_STAGES, CODE_STAGES, DECODE_WARPS)),
        (_ws_tma_decode_partition, (b_desc, b_s, b_stage, full_b, b_wds, ready_b, empty, off_n, N, num_k, stride_bs,
                                    BLOCK_N, BLOCK_K, WS_STAGES, CODE_STAGES, DECODE_WARPS)),
    ], [DECODE_WARPS, DECODE_WARPS], [DECODE_REGS, DECODE_REGS])
    W._epilogue(res[0], ag_ptr, bg_ptr, out_ptr, M, N, off_m, off_n, stride_om, BLOCK_M, BLOCK_N, OUT_FP32, num_warps)


CODE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


def run(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, BM=128, BN=128, BK=64, WSS=3, CS=4,
        DW=4, DR=96):
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, N, K = a_codes.shape[0], b_codes.shape[0], 2 * a_codes.shape[1]
    out = torch.empty((M, N), device=a_codes.device, dtype=out_dtype)
    ad = TensorDescriptor.from_tensor(a_codes, [BM, BK // 2], CODE_LAYOUT)
    bd = TensorDescriptor.from_tensor(b_codes, [BN, BK // 2], CODE_LAYOUT)
    grid = (((M + BM - 1) // BM) * ((N + BN - 1) // BN),)
    _nvfp4_ws_tma_kernel[grid](ad, a_scales, bd, b_scales, a_global.reshape(1).float(), b_global.reshape(1).float(),
                               out, M, N, K, a_scales.stride(0) // 4, b_scales.stride(0) // 4, out.stride(0),
                               BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, OUT_FP32=out_dtype == torch.float32,
                               WS_STAGES=WSS, CODE_STAGES=CS, DECODE_WARPS=DW, DECODE_REGS=DR, num_warps=4)
    return out


def offline(upto="ptx"):
    from fp4compile.kernels.offline import compile_offline
    d = "tensordesc<u8[128, 32]," + repr(CODE_LAYOUT) + ">"
    sig = dict(a_desc=d, a_s="*u8", b_desc=d, b_s="*u8", ag_ptr="*fp32", bg_ptr="*fp32", out_ptr="*bf16", M="i32",
               N="i32", K="i32", stride_as="i32", stride_bs="i32", stride_om="i32")
    const = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, OUT_FP32=False, WS_STAGES=3, CODE_STAGES=4,
                 DECODE_WARPS=4, DECODE_REGS=96, num_warps=4)
    return compile_offline(_nvfp4_ws_tma_kernel, sig, const, 4, upto=upto,
                           divisible_by_16=["a_s", "b_s", "out_ptr", "K", "stride_om"])


def main():
    import torch
    import triton
    from fp4compile.formats import nvfp4
    torch.manual_seed(0)
    for (M, N, K) in ((256, 256, 128), (300, 200, 832), (1024, 1024, 1024), (129, 257, 4096)):
        a = nvfp4.quantize(torch.randn(M, K, device="cuda")); b = nvfp4.quantize(torch.randn(N, K, device="cuda"))
        ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T
        args = (a.codes, a.scales.view(torch.uint8), a.global_scale, b.codes, b.scales.view(torch.uint8), b.global_scale)
        out = run(*args, torch.float32)
        torch.cuda.synchronize()
        print("check", M, N, K, f"{((out.double() - ref).norm() / ref.norm()).item():.2e}", flush=True)
    for n in (4096, 8192):
        a = nvfp4.quantize(torch.randn(n, n, device="cuda")); b = nvfp4.quantize(torch.randn(n, n, device="cuda"))
        args = (a.codes, a.scales.view(torch.uint8), a.global_scale, b.codes, b.scales.view(torch.uint8), b.global_scale)
        a16, b16 = a.dequantize(), b.dequantize()
        t = {}
        t["cublas"] = triton.testing.do_bench_cudagraph(lambda: torch.mm(a16, b16.t()), rep=10)
        t["ws"] = triton.testing.do_bench_cudagraph(lambda: W.nvfp4_gemm_wgmma(*args, config=W.WS_CONFIGS[0]), rep=10)
        for cs in (3, 4, 6):
            t[f"ws_tma cs{cs}"] = triton.testing.do_bench_cudagraph(lambda: run(*args, torch.bfloat16, CS=cs), rep=10)
        print(n, {k: f"{v * 1e3:.0f} us ({t['cublas'] / v:.2f}x)" for k, v in t.items()}, flush=True)


if __name__ == "__main__":
    main()
