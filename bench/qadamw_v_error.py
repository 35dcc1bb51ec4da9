"""Q-AdamW's second-moment transform against direct NVFP4 storage of v, on real AdamW states, pooled relative MSE:
every combination of the rounding (RTN, SR), 4/6 in the transform (Q-AdamW's ``v_four_over_six``) and 4/6 on the
direct side (``study.v_error_pooled``: tile 32, RHT-16, one encode), for two tiny-GPT state sets
(``study.tiny_gpt_states``: the numerics test's 1-layer/25-step set and docs/OPTIM.md's 2-layer/40-step set).
What v's 4/6 buys (issue 5's >= 60 % target; its kernel cost is ~28 SASS instructions per element,
``bench/qadamw_sass.py '{"V_FOS": false}'``). CPU, ~5 s.

    python bench/qadamw_v_error.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.optim.study import tiny_gpt_states, v_error_pooled  # noqa: E402

#: (steps, d, layers) of the state sets
SETS = ((25, 64, 1), (40, 64, 2))


def main() -> int:
    print("| states (steps, d, layers) | rounding | transform 4/6 | reduction vs direct | vs direct with 4/6 "
          "| transform's squared error |")
    print("|---|---|---|---|---|---|")
    for steps, d, layers in SETS:
        states = tiny_gpt_states(steps=steps, d=d, layers=layers, seed=0)
        for rounding in ("rtn", "sr"):
            for fos in (True, False):
                r0, ours, _ = v_error_pooled(states, rounding=rounding, four_over_six=fos)
                r1, _, _ = v_error_pooled(states, rounding=rounding, four_over_six=fos, direct_four_over_six=True)
                print(f"| {steps}, {d}, {layers} | {rounding} | {'on' if fos else 'off'} | {100 * r0:.1f} % "
                      f"| {100 * r1:.1f} % | {ours:.4g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
