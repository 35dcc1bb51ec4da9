"""bench/ncu_kernels.py: reading Nsight Compute's raw CSV page (a synthetic one in ncu's layout: its own messages,
the program's output, a header, a units row, one row per kernel), and its errors without a workload or CUDA."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import ncu_kernels as N  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
COLS = ["ID", "Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", STALL.format("long_scoreboard"),
        STALL.format("barrier"), STALL.format("long_scoreboard_not_issued"), STALL.format("wait")]


def _csv(rows):
    q = lambda vals: ",".join(f'"{v}"' for v in vals)  # noqa: E731
    return "\n".join(["==PROF== Connected to process 1", "# ncu_kernels: attn_paper profiled once", q(COLS),
                      q(["", "", "", "", "usecond", "%", "ratio", "ratio", "ratio", "ratio"])]
                     + [q(r) for r in rows] + ["==PROF== Disconnected from process 1"])


def test_parse_keeps_kernel_rows_and_units_only():
    units, rows = N.parse_raw_csv(_csv([["0", "_attn_bwd_dq_kernel", "(8, 192, 1)", "(128, 1, 1)", "201.4", "41.5",
                                          "3.2", "0.4", "9.9", "1.1"]]))
    assert units["gpu__time_duration.sum"] == "usecond"
    assert [r["Kernel Name"] for r in rows] == ["_attn_bwd_dq_kernel"]
    assert N.parse_raw_csv("==PROF== nothing profiled\n") == ({}, [])


def test_summary_orders_stalls_and_marks_missing_metrics():
    text = N.summarize(_csv([["0", "_attn_bwd_dq_kernel", "(8, 192, 1)", "(128, 1, 1)", "201.4", "41.5",
                              "3.2", "0.4", "9.9", "1,100.5"],
                             ["1", "_eden_pass1_kernel", "(64, 1, 1)", "(256, 1, 1)", "90", "88", "0.1", "0", "0",
                              "0.2"]]), stalls=2)
    dq, eden = text.split("### ")[1:]
    assert "| duration | 201.4 usecond |" in dq and "| issue slots busy % | 41.5 % |" in dq
    assert "| DRAM throughput % of peak | - |" in dq                       # not in this output
    stalls = [ln for ln in dq.splitlines() if ln.startswith("| stall:")]
    # the two largest, largest first (1,100.5 read with its thousands separator); *_not_issued is not a reason
    assert [s.split("stall: ")[1].split(" ")[0] for s in stalls] == ["wait", "long_scoreboard"]
    assert "1100.5" in stalls[0]
    assert "_eden_pass1_kernel" in eden and "stall: wait" in eden
    assert N.summarize("no csv here").startswith("no kernel rows")


def test_cli_needs_a_workload_or_a_csv(tmp_path, capsys):
    with pytest.raises(SystemExit):
        N.main([])
    f = tmp_path / "ncu.csv"
    f.write_text(_csv([["0", "k", "(1, 1, 1)", "(32, 1, 1)", "1", "2", "3", "4", "5", "6"]]))
    assert N.main(["--summarize", str(f)]) == 0
    assert "### k (ID 0" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_workload_without_cuda_says_so():
    with pytest.raises(SystemExit, match="need a CUDA device"):
        N.main(["rtn"])


def test_summary_takes_the_first_metric_name_the_output_holds():
    """ncu 2025's sections write DRAM throughput as gpu__dram_throughput (no dram__throughput): the summary reads it."""
    cols = ["ID", "Kernel Name", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", "launch__shared_mem_per_block",
            "launch__occupancy_limit_shared_mem"]
    q = lambda vals: ",".join(f'"{v}"' for v in vals)  # noqa: E731
    text = N.summarize("\n".join([q(cols), q(["", "", "%", "%", "byte", "block"]),
                                   q(["0", "k", "53.87", "12.5", "67,584", "3"])]))
    assert "| DRAM throughput % of peak | 53.87 % |" in text
    assert "| tensor pipe (HMMA/HGMMA) % of peak | 12.5 % |" in text
    assert "| shared memory per program | 67,584 byte |" in text
    assert "| programs per SM allowed by shared memory | 3 block |" in text
    assert "| ALU pipe % of peak | - |" in text
