"""The Gluon NVFP4 GEMM (``fp4compile/kernels/gemm_wgmma.py``, ``impl="wgmma"``).

CPU: the kernel compiles for sm_90 on this machine (Triton's own ptxas), and its SASS has the structure the design
relies on: HGMMA (wgmma) instructions, no register spills, and in the main loop the four HGMMAs of a K-tile issued
before any of the next tile's decode work (HMUL2) -- the property whose absence halved the speed of the first
version (docs/BENCHMARKS.md, session 25); for the register-A kernels, no write to an in-flight wgmma's operand
registers and the wgmma waits each loop form needs. ``prepare_b``'s fused pass under the interpreter against an
oracle written here. The argument checks. GPU: exact decode of every code byte x every E4M3
scale byte through the GEMM, and float64-reference agreement on ragged shapes, for every config.
"""
from __future__ import annotations

import re

import pytest
import torch

from fp4compile.formats import nvfp4
from fp4compile.kernels import gemm_wgmma as W
from fp4compile.kernels.offline import (all_loop_lines, disassemble, loop_lines, opcode, sass_stats,
                                        wgmma_register_hazards)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_gluon = pytest.mark.skipif(not W.available(), reason="needs Triton's Gluon")


def _cfg_id(c: dict) -> str:
    """A config's test id: tile and warps, then ``ws`` (warp-specialized), ``rs`` (register-A) or ``mixed``."""
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}"
            + ("ws" if c.get("WS") else "rs" if c.get("RS") else "mixed" if c.get("MIXED") else "")
            + ("halves" if c.get("HALVES") else "") + ("split" if c.get("SPLIT") else "")
            + (f"b{c['B_STAGES']}" if c.get("SPLIT") else "") + ("atma" if c.get("A_TMA") else "")
            + ("nofence" if c.get("NO_PROXY_FENCE") else ""))


def _main_loop(sass: str) -> list:
    """Opcodes of the main K loop: the first loop that contains HGMMAs (:func:`offline.loop_lines`)."""
    return [opcode(ln) for ln in loop_lines(sass)]


@needs_gluon
@pytest.mark.parametrize("cfg", W.WGMMA_CONFIGS, ids=_cfg_id)
def test_sm90_sass_structure(cfg):
    cubin = W.offline_cubin(cfg)
    n, ops, regs, local = sass_stats(cubin)
    assert local == 0, f"register spills: {local} bytes of local memory"
    assert regs <= 255
    body = _main_loop(disassemble(cubin))
    hg = [i for i, o in enumerate(body) if o.startswith("HGMMA")]
    assert len(hg) >= cfg["BLOCK_K"] // 16                    # one HGMMA per 16-deep K step (and per M half)
    # the decode of the next tile (one HMUL2 per two codes) starts only after the last HGMMA of this tile
    hm = [i for i, o in enumerate(body) if o.startswith("HMUL2")]
    assert hm and min(hm) > max(hg), "ptxas interleaved the decode with the HGMMAs"
    assert "LDGSTS.E.BYPASS.128" in body, "code words are staged with 16-byte cp.async"


@needs_gluon
def test_fp32_output_variant_compiles():
    _, _, _, local = sass_stats(W.offline_cubin(W.WGMMA_CONFIGS[0], out_fp32=True))
    assert local == 0


def test_supports_and_argument_checks():
    assert W.supports(16384, 768, 768) and W.supports(1, 1, 64)
    assert not W.supports(128, 128, 784) and not W.supports(128, 128, 0)
    if not W.available():
        pytest.skip("needs Triton's Gluon")
    q = nvfp4.quantize(torch.randn(32, 128))
    with pytest.raises(RuntimeError, match="CUDA"):
        W.nvfp4_gemm_wgmma(q.codes, q.scales.view(torch.uint8), q.global_scale,
                           q.codes, q.scales.view(torch.uint8), q.global_scale)
    args = (q.codes, q.scales.view(torch.uint8), q.global_scale) * 2
    with pytest.raises(ValueError, match="16 \\* num_warps"):
        W.nvfp4_gemm_wgmma(*args, config=dict(W.RS_CONFIGS[0], num_warps=4))
    with pytest.raises(ValueError, match="64 deep"):
        W.nvfp4_gemm_wgmma(*args, config=dict(W.RS_CONFIGS[0], BLOCK_K=128))
    with pytest.raises(ValueError, match="16 \\* num_warps"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(W.MIXED_CONFIGS[0], num_warps=4))
    with pytest.raises(ValueError, match="MIXED_CONFIGS"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=W.RS_CONFIGS[0])
    split = next(c for c in W.MIXED_CONFIGS if c.get("SPLIT"))
    with pytest.raises(ValueError, match="twice that for SPLIT"):     # two warpgroups of 64 rows: 128 at 4 warps
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(split, num_warps=8))
    with pytest.raises(ValueError, match="SPLIT is an option of the MIXED HALVES"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(split, HALVES=False))
    with pytest.raises(RuntimeError, match="CUDA"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale)
    atma = next(c for c in W.MIXED_CONFIGS if c.get("A_TMA"))
    with pytest.raises(ValueError, match="A_TMA is an option of the SPLIT"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(atma, DIAG=1))
    # A by TMA needs rows of whole 16-byte pieces: scale rows of K/16 bytes, so K % 256 == 0 (or padded rows)
    for k, ok in ((512, True), (768, True), (832, False), (64, False)):
        qk = nvfp4.quantize(torch.randn(8, k))
        assert W.a_tma_ok(qk.codes, qk.scales.view(torch.uint8)) == ok
        moved = torch.zeros(qk.codes.numel() + 4, dtype=torch.uint8)[4:].view(qk.codes.shape)   # base 16 k + 4
        moved.copy_(qk.codes)
        assert not W.a_tma_ok(moved, qk.scales.view(torch.uint8))


def test_mixed_default_is_the_a_tma_form_of_the_global_load_tile():
    """``impl="mixed"``'s tile is the ``A_TMA`` config (session 78's step A/B) and differs from the global-load tile
    only in that key, so an A/B that flips ``MIXED_DEFAULT["A_TMA"]`` compares the two forms of one tile."""
    from fp4compile.kernels import gemm as G
    assert G.MIXED_DEFAULT is W.MIXED_SPLIT_ATMA and W.MIXED_SPLIT_ATMA in W.MIXED_CONFIGS
    assert W.MIXED_SPLIT_ATMA["A_TMA"] is True and W.MIXED_SPLIT_LDG["A_TMA"] is False
    assert dict(W.MIXED_SPLIT_LDG, A_TMA=True, NO_PROXY_FENCE=False) == W.MIXED_SPLIT_ATMA


@needs_gluon
def test_no_proxy_fence_drops_the_fences_for_its_compile_only():
    """``NO_PROXY_FENCE`` compiles the ``A_TMA`` tile without Triton's proxy fences and puts Triton's pass back
    afterwards (the default tile keeps its proxy fences). The option needs ``A_TMA``."""
    from triton._C.libtriton import nvidia

    nofence = next(c for c in W.MIXED_CONFIGS if c.get("NO_PROXY_FENCE"))
    assert dict(nofence, NO_PROXY_FENCE=False) == dict(W.MIXED_SPLIT_ATMA, NO_PROXY_FENCE=False)
    the_pass = nvidia.passes.ttnvgpuir.add_proxy_fence_insertion

    def fences(cfg):
        sass = disassemble(W.offline_cubin_mixed(cfg))
        return sum(ln.count("FENCE.VIEW.ASYNC.S") for lines in all_loop_lines(sass) for ln in lines)

    assert fences(nofence) == 0
    assert nvidia.passes.ttnvgpuir.add_proxy_fence_insertion is the_pass
    assert fences(W.MIXED_SPLIT_ATMA) > 0
    q = nvfp4.quantize(torch.randn(128, 256))
    with pytest.raises(ValueError, match="NO_PROXY_FENCE is an option of the A_TMA"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(W.MIXED_SPLIT_LDG, NO_PROXY_FENCE=True))


@needs_gluon
@pytest.mark.parametrize("cfg", W.WS_CONFIGS, ids=_cfg_id)
def test_sm90_sass_of_the_warp_specialized_kernel(cfg):
    """The warp-specialized variant compiles for sm_90 here: wgmma, mbarrier waits and arrivals, register
    reallocation between the partitions (setmaxnreg), no spills, and no software-pipelined cp.async staging."""
    cubin = W.offline_cubin(cfg)
    n, ops, regs, local = sass_stats(cubin)
    assert local == 0, f"register spills: {local} bytes of local memory"
    names = set(ops)
    assert any(o.startswith("HGMMA") for o in names)
    assert any(o.startswith("SYNCS") for o in names), "no mbarrier operations"
    assert any(o.startswith("USETMAXREG") for o in names), "no register reallocation between partitions"
    assert "LDGSTS" not in names
    assert sum(v for o, v in ops.items() if o.startswith("HMUL2")) > 0       # the decode


def _register_a_kernel(cubin: bytes):
    """(opcode counts, main-loop opcodes) of a register-A kernel's cubin, after checking it has no spills, that
    every HGMMA reads A from registers (``HGMMA ... Rd, Ra, gdesc``, not two descriptors), and that no instruction of
    the main loop writes an A register of a wgmma still in flight (:func:`offline.wgmma_register_hazards`; session
    72's first mixed kernel, exact on the GPU at 128 x 128 but not at 128 x 256, had 21-25 such writes)."""
    n, ops, regs, local = sass_stats(cubin)
    assert local == 0, f"register spills: {local} bytes of local memory"
    sass = disassemble(cubin)
    hgmma = re.findall(r"HGMMA\.\S+ (R\d+), (\S+), (\S+)", sass)
    assert hgmma and all(re.fullmatch(r"R\d+", a) and b.startswith("gdesc") for _, a, b in hgmma), hgmma
    assert wgmma_register_hazards(loop_lines(sass)) == []
    return ops, _main_loop(sass)


def _sass(*instructions: str) -> str:
    """A SASS text in nvdisasm's format: the instructions, one per line, then a branch back to the loop's label."""
    lines = [".L_x_7:"] + [f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(instructions)]
    return "\n".join(lines + [f"        /*{16 * len(instructions):04x}*/              @P0 BRA `(.L_x_7) ;"])


def test_wgmma_register_hazard_checker():
    """The SASS hazard check on hand-written loops: an HGMMA's A registers (Ra .. Ra+3) may be written only once the
    DEPBAR that retires its group has passed, including across the loop's back edge."""
    racy = _sass("IMAD.MOV.U32 R152, RZ, RZ, R172", "WARPGROUP.ARRIVE",
                 "HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR4], R24, gsb0",
                 "WARPGROUP.DEPBAR.LE gsb0, 0x1", "HMUL2.BF16_V2 R172, R180, R21")
    lines = loop_lines(racy)
    assert len(lines) == 6 and opcode(lines[-1]) == "BRA"
    # the copy at the loop top overwrites R152 while the previous iteration's wgmma may still read it
    found = [h.split(None, 1)[1].rstrip(" ;") for h in wgmma_register_hazards(lines)]
    assert found == ["IMAD.MOV.U32 R152, RZ, RZ, R172"]
    safe = racy.replace("gsb0, 0x1", "gsb0, 0x0")
    assert wgmma_register_hazards(loop_lines(safe)) == []
    # within a group: a 64-bit load into R154..R155 (the first HGMMA's registers) before the group is retired
    inside = _sass("WARPGROUP.ARRIVE", "HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR4], R24",
                   "LDG.E.64 R154, desc[UR12][R2.64]", "HGMMA.64x256x16.F32.BF16 R24, R156, gdesc[UR4], R24, gsb0",
                   "WARPGROUP.DEPBAR.LE gsb0, 0x0", "STS.128 [R152+0x10], R4")
    assert len(wgmma_register_hazards(loop_lines(inside))) == 2          # found on both walks; the store is a read
    assert wgmma_register_hazards(loop_lines(inside.replace("R154, desc", "R150, desc"))) == []


@needs_gluon
@pytest.mark.parametrize("cfg", W.RS_CONFIGS, ids=_cfg_id)
def test_sm90_sass_of_the_register_a_kernel(cfg):
    """The register-A variant: every HGMMA takes A from registers, the decode of the next tile follows the tile's
    last HGMMA, B's decoded words go to shared memory in 16-byte stores, no spills, and the main loop holds one proxy
    fence and no integer division (ring slots are carried counters)."""
    ops, body = _register_a_kernel(W.offline_cubin(cfg))
    hg = [i for i, o in enumerate(body) if o.startswith("HGMMA")]
    assert len(hg) == cfg["BLOCK_K"] // 16
    hm = [i for i, o in enumerate(body) if o.startswith("HMUL2")]
    assert hm and min(hm) > max(hg), "ptxas interleaved the decode with the HGMMAs"
    # one bf16x2 multiply per two decoded elements: A (BLOCK_M x 64) and B (BLOCK_N x 64) over the CTA's threads
    threads = 32 * cfg["num_warps"]
    assert len(hm) == (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] // 2 // threads
    assert "STS.128" in body and "STS.64" not in body
    assert body.count("MEMBAR.ALL.CTA") == 1
    assert not any(o.startswith(("I2F", "MUFU")) for o in body), "an integer division in the main loop"


@needs_gluon
@pytest.mark.parametrize("cfg", W.MIXED_CONFIGS, ids=_cfg_id)
def test_sm90_sass_of_the_mixed_kernel(cfg):
    """The mixed variant: A from registers in every HGMMA, B by TMA (UTMALDG) behind mbarriers, A's code words by
    8-byte global loads in the main loop, one A decode (one bf16x2 multiply per two elements of the warp's rows)
    per K-tile, and in the main loop no shared-memory store, no proxy fence, no spills."""
    cubin = W.offline_cubin_mixed(cfg)
    ops, _ = _register_a_kernel(cubin)
    assert "UTMALDG" in "".join(ops) and any(o.startswith("SYNCS") for o in ops)
    # one main loop per warpgroup partition (two with SPLIT, the first of which also issues B's TMA loads); a HALVES
    # loop is unrolled by 3 K-tiles (the code words' prefetch depth) and followed by a remainder loop of one K-tile
    loops = all_loop_lines(disassemble(cubin))
    parts = 2 if cfg.get("SPLIT") else 1
    unroll = 4 if cfg.get("A_TMA") else 3 if cfg.get("HALVES") else 1
    assert len(loops) == parts * (2 if cfg.get("HALVES") else 1)
    rows = cfg["BLOCK_M"] // parts
    tile_counts = []
    for lines in loops:
        body = [opcode(ln) for ln in lines]
        assert wgmma_register_hazards(lines) == []
        tiles = body.count("HGMMA.64") // (cfg["BLOCK_K"] // 16)
        tile_counts.append(tiles)
        assert body.count("HGMMA.64") == tiles * cfg["BLOCK_K"] // 16
        assert sum(o.startswith("HMUL2") for o in body) == tiles * rows * cfg["BLOCK_K"] // 2 // (32 * cfg["num_warps"])
        if cfg.get("A_TMA"):
            # A's code words and scale bytes come from the ring slot B's tile shares (the producer partition issues
            # all three TMA loads of a slot): shared-memory reads, no global load in the loop
            assert "LDS.64" in body and not any(o.startswith("LDG") for o in body), sorted(set(body))
            produce = body.count("UTMALDG.2D") == 3 * tiles
            assert produce or "UTMALDG.2D" not in body
            # Triton fences the async proxy before each refill (the slot was read by LDS): one membar and one proxy
            # fence per K-tile, in the producing partition only; none when compiled without the pass
            fences = tiles if produce and not cfg.get("NO_PROXY_FENCE") else 0
            assert body.count("MEMBAR.ALL.CTA") == fences and body.count("FENCE.VIEW.ASYNC.S") == fences
            # A's codes, A's scales and B each on their own mbarrier: Triton then puts one warpgroup barrier before a
            # slot's TMA loads instead of one between every two (5 per K-tile in the producing loop, 7 with one
            # mbarrier for all three; 2 in the other, 3 before)
            assert sum(o.startswith("BAR.SYNC") for o in body) == (5 if produce else 2) * tiles
            body = [o for o in body if o not in ("MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S")]
        else:
            assert "LDG.E.64" in body
        assert not any(o.startswith(("STS", "MEMBAR", "FENCE", "LDGSTS")) for o in body), sorted(set(body))
        waits = [ln.split(None, 1)[1].rstrip(" ;") for ln in lines if "WARPGROUP.DEPBAR" in ln]
        if cfg.get("HALVES"):
            # two 32-deep wgmmas per K-tile, each wait leaving the other in flight (and no hazard, checked above)
            assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] * 2 * tiles, waits
        else:
            assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x0"], waits
        if cfg.get("SPLIT"):
            # no barrier spans both warpgroups: only 128-thread named barriers in the loops
            bars = [ln.split("BAR.SYNC.DEFER_BLOCKING", 1)[1].strip(" ;") for ln in lines if "BAR.SYNC" in ln]
            assert bars and all(b.endswith("0x80") for b in bars), bars
    assert sorted(tile_counts) == sorted([unroll, 1] * parts if unroll > 1 else [1] * parts)


@needs_gluon
@pytest.mark.parametrize("diag", [1, 2, 3])
def test_sm90_sass_of_the_mixed_timing_diagnostics(diag):
    """What each timing diagnostic of the mixed kernel's HALVES loop keeps (impl="mixed"'s default tile): the wgmmas
    and their waits as in the kernel (one left in flight, never serialized) in every one; 1 without A's code loads
    (the compiler drops them once no decode reads them) or decode; 2 with both (the same bf16x2 multiplies per K-tile
    as the kernel) but off the wgmmas' path; 3 with the loads only."""

    loops = all_loop_lines(disassemble(W.offline_cubin_mixed(dict(W.MIXED_SPLIT_LDG, DIAG=diag))))
    real = all_loop_lines(disassemble(W.offline_cubin_mixed(W.MIXED_SPLIT_LDG)))
    assert len(loops) == len(real) == 4                      # two partitions: unrolled loop and remainder each
    for lines, ref in zip(loops, real):
        body, ref_body = [opcode(ln) for ln in lines], [opcode(ln) for ln in ref]
        tiles = body.count("HGMMA.64") // 4
        assert body.count("HGMMA.64") == ref_body.count("HGMMA.64")
        waits = [ln.split(None, 1)[1].rstrip(" ;") for ln in lines if "WARPGROUP.DEPBAR" in ln]
        assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x1"] * 2 * tiles, waits
        hmul = sum(o.startswith("HMUL2") for o in body)
        loads = sum(o.startswith("LDG") for o in body)
        assert loads == (0 if diag == 1 else sum(o.startswith("LDG") for o in ref_body))
        assert hmul == (sum(o.startswith("HMUL2") for o in ref_body) if diag == 2 else 0)
        # the kept words' never-taken stores: one per half-tile and each of a thread's two rows
        assert sum(o.startswith("STG") for o in body) == (0 if diag == 1 else 4 * tiles)
    q = nvfp4.quantize(torch.randn(32, 128))
    with pytest.raises(ValueError, match="DIAG 1, 2, 3 of a HALVES config"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(W.MIXED_SPLIT_LDG, DIAG=4))
    with pytest.raises(ValueError, match="DIAG 1, 2, 3 of a HALVES config"):
        W.nvfp4_gemm_mixed(q.codes, q.scales.view(torch.uint8), q.global_scale, q.dequantize(), q.global_scale,
                           config=dict(W.MIXED_CONFIGS[0], DIAG=1))


@needs_gluon
def test_control_bits_and_load_scoreboard_waits():
    """The scheduling bits read from the cubin are the ones the hardware acts on: every global load in the mixed
    kernel's loops releases a write scoreboard, and an instruction at or before the load's first reader (going round
    the back edge) waits for that scoreboard. ``load_scoreboard_waits`` then finds waits for loads in the real loop,
    none without loads (``DIAG`` 1), and never more aliased waits than waits."""
    from fp4compile.kernels.offline import control_bits, instruction_records, load_scoreboard_waits

    cubin = W.offline_cubin_mixed(W.MIXED_SPLIT_LDG)
    control = control_bits(cubin)
    loops = all_loop_lines(disassemble(cubin))
    checked = 0
    for lines in loops:
        recs = instruction_records(lines, control)
        n = len(recs)
        for i, (op, operands, (_, wb, _, _), dst, _) in enumerate(recs):
            if not op.startswith("LDG"):
                continue
            assert wb is not None, (op, operands)
            for d in range(1, n + 1):
                op2, operands2, (_, _, _, wait2), _, reads = recs[(i + d) % n]
                if wb in wait2:
                    break
                assert not (reads & set(dst)), \
                    f"{op2} {operands2} reads {op}'s result without waiting for scoreboard {wb}"
            checked += 1
        report = load_scoreboard_waits(lines, control)
        assert report["waits"] > 0 and 0 <= report["aliased"] <= report["waits"] and report["min_distance"] > 0
    assert checked > 0
    diag = W.offline_cubin_mixed(dict(W.MIXED_SPLIT_LDG, DIAG=1))
    for lines in all_loop_lines(disassemble(diag)):
        assert load_scoreboard_waits(lines, control_bits(diag)) == dict(waits=0, aliased=0, min_distance=None)


_PREPARE_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from fp4compile.kernels import gemm_wgmma as W
g = torch.Generator().manual_seed(3)
for N, K in [(37, 128), (64, 64), (5, 192)]:
    codes = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (N, K // 16), generator=g, dtype=torch.uint8)   # every finite E4M3 byte >= 0
    torch.save(dict(codes=codes, scales=scales, fused=W.prepare_b(codes, scales),
                    gather=W.prepare_b(codes, scales, fused=False)), os.path.join({tmp!r}, f"prep{{N}}x{{K}}.pt"))
print("ok")
"""


def test_prepare_b_fused_pass_under_interpreter(tmp_path):
    """:func:`prepare_b`'s one-pass Triton kernel (run under TRITON_INTERPRET=1) equals, bit for bit, both the
    dequantize-then-gather form and an oracle written here: E2M1 values from a table, E4M3 scales by torch's own
    float8 cast, product in float64 (exact), positions by :func:`fragment_permutation`."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _PREPARE_SCRIPT.format(root=root, tmp=str(tmp_path))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    perm = W.fragment_permutation()
    for N, K in [(37, 128), (64, 64), (5, 192)]:
        d = torch.load(tmp_path / f"prep{N}x{K}.pt")
        c = d["codes"].long()
        q = e2m1[torch.stack([c & 0xF, c >> 4], -1).reshape(N, K)]
        sc = d["scales"].view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
        ref = (q * sc).view(N, K // 64, 64)[:, :, perm].reshape(N, K)
        assert d["fused"].dtype == torch.bfloat16 and d["fused"].shape == (N, K)
        assert torch.equal(d["fused"].double(), ref), (N, K)
        assert torch.equal(d["fused"], d["gather"]), (N, K)


def test_prepare_b_argument_checks():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="K % 64"):
        W.prepare_b(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 codes"):
        W.prepare_b(codes.float(), torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[N, K/16\]"):
        W.prepare_b(codes, torch.zeros(4, 3, dtype=torch.uint8))


def test_fragment_permutation_keeps_each_thread_in_one_scale_block():
    """The K order of the register-A kernels (an independent statement of the wgmma A-fragment layout): position p
    of a 64-deep tile belongs to fragment lane t = (p mod 8) // 2 of 16-deep step p // 16; every lane t's 16
    positions must hold all of scale block t (logical K 16 t .. 16 t + 15), so a thread decodes exactly one block."""
    perm = W.fragment_permutation().tolist()
    assert sorted(perm) == list(range(64))
    for t in range(4):
        held = {perm[p] for p in range(64) if (p % 8) // 2 == t}
        assert held == set(range(16 * t, 16 * t + 16))


@pytest.mark.gpu
@cuda
@needs_gluon
@pytest.mark.parametrize("cfg", W.WGMMA_CONFIGS + W.WS_CONFIGS + W.RS_CONFIGS + W.MIXED_CONFIGS, ids=_cfg_id)
def test_gpu_exact_decode_and_reference(cfg):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    dev = "cuda"
    K = 512
    # A: every code byte in every row, each row one finite E4M3 scale byte; B: the identity in NVFP4 -> C = A exactly
    a_codes = torch.arange(256, dtype=torch.uint8, device=dev).repeat(127, 1)
    a_scales = torch.arange(127, dtype=torch.uint8, device=dev)[:, None].expand(127, K // 16).contiguous()
    e = torch.zeros(K, K, dtype=torch.uint8, device=dev)
    e[torch.arange(K), torch.arange(K)] = 2                       # E2M1 code of 1.0
    b_codes = (e[:, 0::2] | (e[:, 1::2] << 4)).contiguous()
    b_scales = torch.full((K, K // 16), 0x38, dtype=torch.uint8, device=dev)  # E4M3 1.0
    one = torch.ones((), device=dev)
    got = W.nvfp4_gemm_wgmma(a_codes, a_scales, one, b_codes, b_scales, one, torch.float32, config=cfg)
    ref = nvfp4.dequantize_codes(a_codes, a_scales.view(torch.float8_e4m3fn), one)
    assert torch.equal(got, ref)
    g = torch.Generator(device=dev).manual_seed(0)
    # (the last shape's contiguous operands also go through the op's launcher below)
    for M, N, K, pad in [(200, 136, 832, 12), (300, 200, 832, 0), (1000, 1000, 64, 0), (129, 257, 4096, 0),
                         (2304, 768, 2048, 0)]:
        qa = nvfp4.quantize(torch.randn(M, K, device=dev, generator=g))
        qb = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g))
        sa = qa.scales.view(torch.uint8)
        if pad:     # A's scale rows padded to 64 bytes: an A_TMA config takes them by TMA, 13 K-tiles (not 4 k)
            sa = torch.zeros(M, K // 16 + pad, dtype=torch.uint8, device=dev)[:, :K // 16]
            sa.copy_(qa.scales.view(torch.uint8))
        if cfg.get("A_TMA"):    # which path the A_TMA config takes (by TMA, or the same tile with global loads)
            assert W.a_tma_ok(qa.codes, sa) == (K % 256 == 0 or pad > 0)
        args = (qa.codes, sa, qa.global_scale, qb.codes, qb.scales.view(torch.uint8), qb.global_scale)
        ref = (qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t())
        out = W.nvfp4_gemm_wgmma(*args, torch.float32, config=cfg).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        out16 = W.nvfp4_gemm_wgmma(*args, torch.bfloat16, config=cfg).double()
        assert ((out16 - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6 * ref.abs().max()).all()
    # through the op's launcher: impl="wgmma" dispatches here, after the launcher's own argument checks
    from fp4compile.kernels import gemm as G

    assert torch.equal(G.nvfp4_gemm(*args, torch.float32, impl="wgmma", config=cfg),
                       W.nvfp4_gemm_wgmma(*args, torch.float32, config=cfg))
    with pytest.raises(ValueError, match="K % 64"):
        q = nvfp4.quantize(torch.randn(64, 80, device=dev))
        G.nvfp4_gemm(q.codes, q.scales.view(torch.uint8), q.global_scale, q.codes, q.scales.view(torch.uint8),
                     q.global_scale, impl="wgmma")
