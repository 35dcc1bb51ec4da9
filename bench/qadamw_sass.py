"""Static sm_90 SASS of the fused Q-AdamW kernels, on a machine without a GPU: compiles the kernel through
Triton's own stages (ttir -> ttgir -> llir -> ptx -> cubin with the bundled ptxas) and counts the SASS
instructions (nvdisasm), registers and spills (cuobjdump). A CPU-side proxy for the kernel's ALU cost (the
kernel is issue-bound: ~1 warp instruction per cycle per SM sub-partition), used to choose between exact
formulations before a GPU window.

    python bench/qadamw_sass.py                       # default configuration, kernels 2 and 1
    python bench/qadamw_sass.py '{"M_FOS": false, "V_FOS": false}' '{"MH": 0, "VH": 0}'   # options (kernel 2)
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.kernels.offline import compile_offline, sass_stats  # noqa: E402
from fp4compile.kernels.quantize import _MAGIC_PACK  # noqa: E402
from fp4compile.optim import fused as F  # noqa: E402

_SIG = {"qtab": "*i64", "ptab": "*i64", "coef": "*fp32", "coef_stride": "i32", "chunks": "*i32", "b1c": "fp32",
        "sb2": "fp32", "sb2c": "fp32", "eps": "fp32"}
#: the default QAdamW group (tile 32, RHT-16 on both moments, SR + 4/6 for m and for v since session 17, FP32
#: params); session 11's counts below the defaults of the day had RTN v ('{"V_SR": false}')
DEFAULT = dict(N=1024, NQ=12, TILE=32, MH=16, VH=16, MNORM=0.25, VNORM=0.25, M_SR=True, M_FOS=True, V_SR=True,
               V_FOS=True, P_KIND=0, G_KIND=0, MASTER=0, MAXIMIZE=False, SSE64=False)


def cubin(kernel=2, num_warps=None, **over):
    """The sm_90 cubin bytes of the Q-AdamW kernel (``kernel`` 2 or 1) for the given constexpr overrides."""
    const = dict(DEFAULT)
    if kernel == 2:
        const.update(REUSE=True, MAGIC_PACK=_MAGIC_PACK, PROF=0, SR_RP=F.SR_RP)
        fn = F._qadamw_kernel
        num_warps = num_warps or 2
    else:
        fn = F._qadamw_kernel_v1
        const.update(IMPL=1)
        num_warps = num_warps or 4
    const.update(over)
    return compile_offline(fn, _SIG, const, num_warps, upto="cubin"), num_warps


def report(kernel=2, num_warps=None, **over):
    blob, w = cubin(kernel, num_warps, **over)
    n, ops, regs, local = sass_stats(blob)
    per_thread = F.CH // (32 * w)
    print(f"kernel {kernel} warps {w} {over or ''}: {n} SASS instructions per thread of {per_thread} elements "
          f"({n / per_thread:.0f} per element), {regs} registers, {local} B local; top: "
          + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)), flush=True)
    return n, per_thread


def main(argv):
    if not argv:
        report(2)
        report(1)
    for spec in argv:
        kw = json.loads(spec)
        report(kw.pop("kernel", 2), kw.pop("num_warps", None), **kw)


if __name__ == "__main__":
    main(sys.argv[1:])
