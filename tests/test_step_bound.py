"""bench/step_bound.py, the bandwidth lower bound of NVFP4's cost in a step: its operand count against a count by
hand for GPT-124M, and the policy deciding which operands exist."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import step_bound  # noqa: E402
from bench.train_step import GPT, policy_for  # noqa: E402
from fp4compile.policy import NVFP4, Policy  # noqa: E402

T = 16 * 1024
D, L = 768, 12
# per block: c_attn 768 -> 2304, c_proj 768 -> 768, c_fc 768 -> 3072, mlp_proj 3072 -> 768
K_SUM, N_SUM = 768 + 768 + 768 + 3072, 2304 + 768 + 3072 + 768
W_SUM = 768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768


def _model():
    with torch.device("meta"):
        return GPT()


def _attn(model):
    return {f"h.{i}": D for i in range(len(model.h))}


def test_full_stack_operands_and_bytes_match_a_count_by_hand():
    rows = step_bound.operand_elements(_model(), policy_for("full_stack"), T, _attn(_model()))
    # 48 block linears x 6 copies (the LM head is BF16) + Q and K of 12 layers
    assert len(rows) == 48 * 6 + 24
    t = step_bound.traffic(rows, step_bound.IDEAL)
    assert t["X"][:2] == (L * T * K_SUM, 2 * L * T * K_SUM)
    assert t["dY"][:2] == (L * T * N_SUM, 2 * L * T * N_SUM)
    assert t["W"][:2] == (L * W_SUM, 2 * L * W_SUM)
    assert t["Q/K"][:2] == (2 * L * T * D, 2 * L * T * D)
    src = L * (T * (K_SUM + N_SUM + 2 * D) + W_SUM)
    copies = 2 * L * (T * (K_SUM + N_SUM) + W_SUM) + 2 * L * T * D
    assert sum(v[2] for v in t.values()) == pytest.approx(2 * src + 0.5625 * copies)
    hi = step_bound.traffic(rows, step_bound.BF16_TC)
    assert sum(v[2] for v in hi.values()) == pytest.approx(2 * src + 2 * copies)
    assert step_bound.bound_ms(4.223e9, 4223.0) == pytest.approx(1.0)


def test_the_policy_decides_which_operands_exist():
    m = _model()
    assert step_bound.operand_elements(m, Policy.bf16(), T, _attn(m)) == []
    # W4A16-style fprop and BF16 backward: only the weights' fprop copies
    pol = Policy.bf16().override("h.*", NVFP4("rtn", operands="weight"), role="linear.fprop")
    rows = step_bound.operand_elements(m, pol, T)
    assert {r[2] for r in rows} == {"W"} and len(rows) == 48
    # quartet2 has no attention rows even when asked for them
    assert not [r for r in step_bound.operand_elements(m, policy_for("quartet2"), T, _attn(m)) if r[1] == "attn.qk"]


def test_main_prints_the_bound(capsys):
    step_bound.main([])
    out = capsys.readouterr().out
    assert "| **total** | 2.803 | 5.304 | 2.03 | 3.84 |" in out
    assert "ideal 0.939×, bf16 tensor cores 0.890×" in out
