import os, sys, torch
sys.path.insert(0, os.getcwd())
from fp4compile.kernels import gemm_wgmma as W
from fp4compile.formats import nvfp4
cfg = W.MIXED_CONFIGS[-1]
M, N, K = [int(x) for x in sys.argv[1:4]]
g = torch.Generator(device="cuda").manual_seed(0)
qa = nvfp4.quantize(torch.randn(M, K, device="cuda", generator=g))
qb = nvfp4.quantize(torch.randn(N, K, device="cuda", generator=g))
b16 = W.prepare_b(qb.codes, qb.scales.view(torch.uint8))
ref = W.nvfp4_gemm_mixed(qa.codes, qa.scales.view(torch.uint8), qa.global_scale, b16, qb.global_scale, torch.float32,
                         config={k: v for k, v in cfg.items() if k != "A_TMA"})
out = W.nvfp4_gemm_mixed(qa.codes, qa.scales.view(torch.uint8), qa.global_scale, b16, qb.global_scale, torch.float32,
                         config=cfg)
torch.cuda.synchronize()
print(M, N, K, "max diff", (out - ref).abs().max().item(), "ref max", ref.abs().max().item())
