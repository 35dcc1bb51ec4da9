"""bench/attn_bound.py, the least-traffic bound on Q-Attn's core for issue 4's ≥ 1.0× SDPA: its FLOP count against
the TFLOP/s that bench/attention.py printed in the same log, its traffic against a count by hand, and what the bound
becomes with unlimited bandwidth."""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import attn_bound as B  # noqa: E402


def _log_text():
    with open(B.DEFAULT_LOG) as f:
        return f.read()


def test_reads_every_cuda_graph_row_of_session_64():
    rows = B.read_rows(_log_text())
    shapes = {(T, d) for T in (1024, 2048, 4096) for d in (64, 128)}
    for impl in ("sdpa", "qattn bf16", "qattn paper"):
        assert {(T, d) for (i, T, d) in rows if i == impl} == shapes, impl
    # the plain (not CUDA-graph) rows of the same table are not taken
    assert rows[("sdpa", 1024, 64)] == (0.040, 0.148)


def test_flops_match_the_tflops_bench_attention_printed():
    """bench/attention.py printed each row's TFLOP/s (rounded to an integer) beside its ms; the bound's FLOP count
    over the same ms must give the same number, forward and forward + backward."""
    checked = 0
    for line in _log_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not cells[0].endswith("(CUDA graph)"):
            continue
        T, d = int(cells[1]), int(cells[2])
        fwd_ms, fwd_tf = float(cells[3]), float(cells[4].split()[0])
        fb_ms, fb_tf = float(cells[6]), float(cells[7].split()[0])
        fl = B.causal_fwd_flops(64, T, d)
        # ms is printed to 3 decimals, so the ratio is known to +-0.0005 ms in the denominator
        for ms, tf, f in ((fwd_ms, fwd_tf, fl), (fb_ms, fb_tf, B.FB_FACTOR * fl)):
            lo, hi = f / (ms + 0.0005) / 1e9, f / max(ms - 0.0005, 1e-9) / 1e9
            assert lo - 0.5 <= tf <= hi + 0.5, (cells[0], T, d, ms, tf, lo, hi)
        checked += 1
    assert checked == 18


def test_traffic_counted_by_hand():
    # Q and K of [2, 16, 32]: 1024 elements each. Forward: amax read 2 B, encode read 2 B, codes 0.5 B, scales
    # one byte per 16 elements; backward: the 1x16 copy read and its tile copy written, 0.5625 B each way.
    n = 2 * 16 * 32
    fwd_bytes = 2 * (n * 2 + n * 2 + n // 2 + n // 16)
    bwd_bytes = 2 * 2 * (n // 2 + n // 16)
    f, fb = B.least_traffic_s(2, 16, 32, 1e9)
    assert math.isclose(f, fwd_bytes / 1e9, rel_tol=1e-12)
    assert math.isclose(fb, (fwd_bytes + bwd_bytes) / 1e9, rel_tol=1e-12)


def test_unlimited_bandwidth_asks_for_sdpas_own_rate_and_finite_asks_more():
    rows = B.read_rows(_log_text())
    free = B.bound_rows(rows, 64, math.inf, 790.0)
    real = B.bound_rows(rows, 64, 4223e9, 790.0)
    assert len(free) == len(real) == 6
    for a, b in zip(free, real):
        assert math.isclose(a["need_fwd"], a["sdpa_fwd"], rel_tol=1e-12)
        assert math.isclose(a["need_fb"], a["sdpa_fb"], rel_tol=1e-12)
        assert b["need_fwd"] > a["need_fwd"] and b["need_fb"] > a["need_fb"]
        assert math.isclose(b["need_fb_pct"], 100 * b["need_fb"] / 790.0)


def test_traffic_past_sdpas_time_needs_an_infinite_core():
    rows = {("sdpa", 1024, 64): (0.040, 0.148)}
    r = B.bound_rows(rows, 64, 1e9, 790.0)[0]  # 1 GB/s: the traffic alone takes milliseconds
    assert r["need_fwd"] == math.inf and r["need_fb"] == math.inf
