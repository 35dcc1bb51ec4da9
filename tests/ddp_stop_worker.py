"""Worker for tests/test_distributed.py: ``fp4compile.train`` under ``torchrun --nproc-per-node 2`` (DDP, CPU, gloo)
with a skewed clock: only rank 1 finds itself out of time, from its third step on. The ranks must still stop at
the same step (the next log step) with status "time_budget" and a checkpoint, instead of rank 1 checkpointing
while rank 0 trains on into a collective that never completes. Usage: ddp_stop_worker.py OUT_DIR"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.train import loop as L  # noqa: E402


def main(out_dir: str) -> int:
    rank = int(os.environ["RANK"])
    L.out_of_time = (lambda elapsed, step_times, max_seconds, ahead=3, reserve=30.0:
                     rank == 1 and len(step_times) >= 3)
    cfg = L.TrainConfig(model="tiny", seq_len=32, batch_size=2, steps=12, warmup_steps=2, log_interval=4,
                        eval_batches=1, val_data="", backend="none", parallel="ddp", device="cpu",
                        max_seconds=1e6, progress=False, out_dir=out_dir)
    result = L.train(cfg)
    print(f"[rank {rank}] {result.summary['status']} at step {result.summary['step']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
