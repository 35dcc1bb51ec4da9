"""Static sm_90 SASS of the register-A Gluon GEMMs' main loops, on a machine without a GPU.

For every config of ``RS_CONFIGS`` and ``MIXED_CONFIGS`` (``fp4compile.kernels.gemm_wgmma``): registers per thread,
local-memory bytes (spills), the main loop's instructions per warp and K-tile, its HGMMAs, the wgmma waits
(``WARPGROUP.DEPBAR.LE gsb0, N``: N wgmma groups left in flight), its barriers per K-tile (``BAR.SYNC``: CTA-wide,
or with ``SPLIT`` 128-thread named barriers of one warpgroup), and the writes to an in-flight register-A wgmma's
operand registers (``offline.wgmma_register_hazards``: must be 0), and how the loop waits for A's code-word loads
(``offline.load_scoreboard_waits``, from the instructions' scheduling bits): the waits per trip on a scoreboard a load
set, how many of them wait for a younger load than the one their register came from (scoreboards are shared), and
the fewest instructions between a waited-for load and its wait (session 75; an ``A_TMA`` loop has no global load: A
comes through the ring's shared memory). One row per main loop: a ``HALVES`` loop is unrolled by three K-tiles (four
with ``A_TMA``) and followed by a one-tile remainder loop, and a ``SPLIT`` config has both per partition.

    python bench/gemm_wgmma_sass.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.kernels import gemm_wgmma as W  # noqa: E402
from fp4compile.kernels.offline import (all_loop_lines, control_bits, disassemble, load_scoreboard_waits,  # noqa: E402
                                        opcode, sass_stats, wgmma_register_hazards)


def name(c: dict) -> str:
    """A config's label: tile, warps, family and options."""
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']}" + (" rs" if c.get("RS") else " mixed")
            + (" halves" if c.get("HALVES") else "") + (f" split b{c['B_STAGES']}" if c.get("SPLIT") else "")
            + (" atma" if c.get("A_TMA") else "") + (" nofence" if c.get("NO_PROXY_FENCE") else "")
            + (f" maxnreg {c['maxnreg']}" if c.get("maxnreg") else ""))


def loop_rows(cubin: bytes) -> list:
    """The static facts of each main loop of one cubin (every loop holding HGMMAs: one, or one per partition of a
    ``SPLIT`` config, the first of which also issues B's TMA loads)."""
    _, _, regs, local = sass_stats(cubin)
    control = control_bits(cubin)
    rows = []
    for body in all_loop_lines(disassemble(cubin)):
        ops = [opcode(ln) for ln in body]
        waits = [ln.split("gsb0,")[1].strip(" ;") for ln in body if "WARPGROUP.DEPBAR" in ln][:2]
        hgmma = sum(o.startswith("HGMMA") for o in ops)
        tiles = max(1, hgmma // 4)            # 64-deep K-tiles per loop trip (a HALVES loop is unrolled by 3 or 4)
        rows.append(dict(regs=regs, local=local, instructions=len(body) // tiles, hgmma=hgmma // tiles, tiles=tiles,
                         waits=",".join(str(int(w, 16)) for w in waits),
                         bars=sum(o.startswith("BAR.SYNC") for o in ops), hazards=len(wgmma_register_hazards(body)),
                         tma=any(o.startswith("UTMALDG") for o in ops), loads=load_scoreboard_waits(body, control)))
    return rows


def main() -> int:
    if not W.available():
        print("needs Triton's Gluon (triton.experimental.gluon)")
        return 1
    print("| config | registers | local bytes | loop instructions per warp and K-tile | HGMMA | waits (groups left "
          "in flight) | BAR.SYNC | hazards | load waits per trip (for a younger load) | fewest instructions load -> "
          "wait |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in W.RS_CONFIGS + W.MIXED_CONFIGS:
        rows = loop_rows(W.offline_cubin_mixed(c) if c.get("MIXED") else W.offline_cubin(c))
        for r in rows:
            part = ((" (with B's TMA loads)" if r["tma"] else " (the other warpgroup)") if c.get("SPLIT") else "")
            part += (f", {r['tiles']} K-tile{'s' if r['tiles'] > 1 else ''} a trip") if c.get("HALVES") else ""
            print(f"| {name(c)}{part} | {r['regs']} | {r['local']} | {r['instructions']} | {r['hgmma']} | "
                  f"{r['waits']} | {r['bars'] / r['tiles']:.3g} | {r['hazards']} | {r['loads']['waits']} "
                  f"({r['loads']['aliased']}) | {r['loads']['min_distance'] or '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
