"""Compile a ``@triton.jit`` kernel for an NVIDIA target on a machine without a GPU.

Triton's own stages (ttir -> ttgir -> llir -> ptx -> cubin, the cubin with the ptxas bundled in the Triton wheel)
run on any machine, so the code a kernel becomes on the H200 (sm_90) can be inspected on the CPU: instruction
counts (:func:`sass_stats`, on the text of :func:`disassemble`; ``bench/qadamw_sass.py``,
``bench/quantize_sass.py``), the order of memory operations and synchronization
(``tests/test_quantize_kernels.py``: the PDL variant's ``griddepcontrol.wait``), writes to the registers an
in-flight register-A wgmma reads (:func:`loop_lines`, :func:`wgmma_register_hazards`; ``tests/test_gemm_wgmma.py``),
or the scheduling bits that make an instruction wait for a load (:func:`control_bits`,
:func:`load_scoreboard_waits`; ``bench/gemm_wgmma_sass.py``).
Built on Triton 3.6's compiler internals (``ASTSource``, the CUDA backend's stages): a tool for benchmarks and
tests, not for the runtime path.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Optional

STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


def compile_offline(fn, signature: dict, constexprs: dict, num_warps: int = 4, upto: str = "ptx", arch: int = 90,
                    divisible_by_16=(), metadata: Optional[dict] = None, **options):
    """The ``upto`` stage (``"ptx"``: text, ``"cubin"``: bytes) of ``fn`` compiled for ``sm_<arch>``.

    ``signature`` gives the runtime arguments' Triton types (``{"x_ptr": "*bf16", "n": "i32"}``); every name in
    ``constexprs`` is added to it as a constexpr. ``divisible_by_16``: the arguments that a real launch would
    specialize as 16-divisible (16-byte-aligned pointers, ints that are multiples of 16), which decides e.g.
    whether loads vectorize. ``options``: further backend options (``enable_fp_fusion`` is False unless given, as
    fp4compile launches its kernels). ``metadata``: a dict that receives the compiler's metadata (e.g. ``"shared"``:
    bytes of shared memory per program, known from the ``"llir"`` stage on)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    if upto not in STAGES:
        raise ValueError(f"upto must be one of {STAGES}, got {upto!r}")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible_by_16}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit kernel (triton.experimental.gluon)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, dict(signature, **{k: "constexpr" for k in constexprs}), constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options({"num_warps": num_warps, "enable_fp_fusion": False, **options})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
    stages, meta = {}, {}
    backend.add_stages(stages, opts, src.language)
    for name in STAGES[:STAGES.index(upto) + 1]:
        if name in stages:  # a Gluon kernel starts at ttgir
            mod = stages[name](mod, meta)
    if metadata is not None:
        metadata.update(meta)
    return mod


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run_on_cubin(cubin: bytes, *argv: str) -> str:
    """stdout of a CUDA binary tool bundled in the Triton wheel (``argv[0]``) run on ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([_tool(argv[0]), *argv[1:], f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin as text (``nvdisasm -c``), labels (``.L_x_N:``) included."""
    return _run_on_cubin(cubin, "nvdisasm", "-c")


#: one SASS instruction line of :func:`disassemble`'s text: (predicate, opcode with its modifiers, operands)
_INSTR = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")


def opcode(line: str) -> str:
    """The opcode of a SASS instruction line, with its modifiers (``HMUL2.BF16_V2``)."""
    return _INSTR.match(line).group(2)


def sass_stats(cubin: bytes):
    """(SASS instruction count, ``Counter`` of opcodes, registers per thread, local-memory bytes) of a cubin, read
    with the ``nvdisasm`` and ``cuobjdump`` bundled in the Triton wheel."""
    sass = disassemble(cubin)
    res = _run_on_cubin(cubin, "cuobjdump", "-res-usage")
    ops = collections.Counter(opcode(line).split(".")[0] for line in sass.splitlines() if _INSTR.match(line))
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    return sum(ops.values()), ops, int(regs.group(1)) if regs else -1, int(local.group(1)) if local else -1




def loop_lines(sass: str, containing: str = "HGMMA") -> list:
    """The instruction lines (text) of the first loop in ``sass`` (:func:`disassemble`'s text) whose body holds an
    opcode starting with ``containing``: from a label to the backward branch that targets it."""
    body = {}  # label -> instruction lines since it
    for ln in sass.splitlines():
        label = re.match(r"(\.L_x_\d+):", ln)
        if label:
            body[label.group(1)] = []
            continue
        m = _INSTR.match(ln)
        if not m:
            continue
        for lines in body.values():
            lines.append(ln)
        target = re.search(r"BRA `?\((\.L_x_\d+)\)", ln)
        if target and target.group(1) in body and any(opcode(x).startswith(containing) for x in body[target.group(1)]):
            return body[target.group(1)]
    raise ValueError(f"no loop containing {containing} found")


def all_loop_lines(sass: str, containing: str = "HGMMA") -> list:
    """:func:`loop_lines` of every loop in ``sass`` holding an opcode starting with ``containing``, in code order: each
    search starts after the previous loop's backward branch (e.g. one main loop per warp-specialized partition)."""
    loops, rest = [], sass
    while True:
        try:
            body = loop_lines(rest, containing)
        except ValueError:
            return loops
        loops.append(body)
        rest = rest[rest.index(body[-1]) + len(body[-1]):]


def _written_registers(opcode: str, operands: str) -> list:
    """General registers an instruction writes: its first operand when that is one (stores, branches, barriers and
    predicate-only results write none), 2 or 4 of them for 64-/128-bit and wide results."""
    m = re.fullmatch(r"R(\d+)", operands.split(",")[0].strip())
    if not m:
        return []
    width = 1
    if ".128" in opcode or re.fullmatch(r"LDSM\..*\.4", opcode):
        width = 4
    elif ".64" in opcode or ".WIDE" in opcode or re.fullmatch(r"LDSM\..*\.2", opcode):
        width = 2
    r = int(m.group(1))
    return list(range(r, r + width))


def control_bits(cubin: bytes) -> dict:
    """{instruction address: (stall cycles, written scoreboard, read scoreboard, waited scoreboards)} of a cubin, from
    the scheduling bits of each 128-bit sm_90 instruction (``nvdisasm -hex``'s second word, bits 41-61 of it = bits
    105-125 of the instruction): 105-108 the stall count, 110-112 the dependency scoreboard its variable-latency
    result releases when written (None: 7, no scoreboard), 113-115 the one released once its sources are read,
    116-121 the mask of scoreboards it waits for before it issues (a set of indices 0-5)."""
    text = _run_on_cubin(cubin, "nvdisasm", "-hex", "-c").splitlines()
    out = {}
    for i, ln in enumerate(text[:-1]):
        m = re.search(r"/\*([0-9a-f]+)\*/.*;\s*/\*\s*0x[0-9a-f]+\s*\*/", ln)
        hi = re.fullmatch(r"\s*/\*\s*(0x[0-9a-f]+)\s*\*/", text[i + 1])
        if not (m and hi):
            continue
        c = int(hi.group(1), 16) >> 41
        wb, rb = (c >> 5) & 7, (c >> 8) & 7
        out[int(m.group(1), 16)] = (c & 0xF, None if wb == 7 else wb, None if rb == 7 else rb,
                                    {b for b in range(6) if (c >> 11) >> b & 1})
    return out


def instruction_records(lines: list, control: dict) -> list:
    """(opcode, operands, :func:`control_bits` entry, registers written, registers read) of each instruction line of a
    loop body (:func:`loop_lines`), ``control`` being :func:`control_bits` of its cubin."""
    recs = []
    for ln in lines:
        m = _INSTR.match(ln)
        op, operands = m.group(2), m.group(3)
        written = _written_registers(op, operands)
        read = {int(r) for r in re.findall(r"\bR(\d+)\b", operands)} - set(written)
        recs.append((op, operands, control[int(re.match(r"\s*/\*([0-9a-f]+)\*/", ln).group(1), 16)], written, read))
    return recs


def load_scoreboard_waits(lines: list, control: dict) -> dict:
    """How a loop body (:func:`loop_lines`, with :func:`control_bits` of its cubin) waits for its global loads
    (``LDG``), walked twice so that waits across the back edge count once each: ``waits``, the instructions that wait
    for a scoreboard whose latest setter is a load; ``aliased``, those among them whose loaded source register came
    from an older load than that latest one, so they wait for a younger load than their own (a scoreboard counts
    every load on it); ``min_distance``, the fewest instructions from a waited-for load to the wait (None: no
    wait)."""
    recs = instruction_records(lines, control)
    setter, loaded = {}, {}          # scoreboard -> (position, is a load's result); register -> loading position
    waits = aliased = 0
    dist = []
    n = len(recs)
    for p in range(2 * n):
        op, _, (_, wb, rb, wait), written, sources = recs[p % n]
        if p >= n:
            for b in wait:
                pos, is_load = setter.get(b, (None, False))
                if not is_load:
                    continue
                waits += 1
                dist.append(p - pos)
                mine = [loaded[r] for r in sources if r in loaded]
                if mine and max(mine) < pos:
                    aliased += 1
        for r in written:
            if op.startswith("LDG"):
                loaded[r] = p
            else:
                loaded.pop(r, None)
        if rb is not None:
            setter[rb] = (p, False)
        if wb is not None:
            setter[wb] = (p, op.startswith("LDG"))
    return dict(waits=waits, aliased=aliased, min_distance=min(dist) if dist else None)


def wgmma_register_hazards(lines: list) -> list:
    """Instructions of a loop body (:func:`loop_lines`) that write an A-operand register of a register-A HGMMA
    while that HGMMA may still read it. An HGMMA ``Rd, Ra, gdesc...`` reads Ra .. Ra+3 (a 64 x 16 bf16 A fragment per
    thread) asynchronously; its group is committed by the ``gsb0`` HGMMA and retired by ``WARPGROUP.DEPBAR.LE gsb0,
    N`` (at most N groups left in flight). The body is walked twice, so a write after the loop's back edge to the
    registers of a wgmma still in flight from the previous iteration is found. Returns the offending lines."""
    groups, open_group, hazards = [], set(), []
    for walk in range(2):
        for ln in lines:
            m = _INSTR.match(ln)
            opcode, operands = m.group(2), m.group(3)
            if opcode.startswith("HGMMA"):
                a = operands.split(",")[1].strip()
                if re.fullmatch(r"R\d+", a):
                    open_group |= set(range(int(a[1:]), int(a[1:]) + 4))
                if "gsb0" in operands:
                    groups.append(open_group)
                    open_group = set()
                continue
            if opcode.startswith("WARPGROUP.DEPBAR"):
                left = int(re.search(r"0x([0-9a-f]+)", operands).group(1), 16)
                groups = groups[len(groups) - left:] if left else []
                continue
            if any(r in open_group or any(r in g for g in groups) for r in _written_registers(opcode, operands)):
                hazards.append(ln.strip())
    return hazards
