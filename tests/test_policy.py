import warnings

import pytest

from fp4compile.policy import BF16, NVFP4, ROLES, Policy, Rule


def test_from_options_accepts_policy_preset_and_default():
    p = Policy.quartet2()
    assert Policy.from_options({"policy": p}) is p
    assert Policy.from_options("nvidia") == Policy.nvidia()
    assert Policy.from_options({"policy": "bf16"}) == Policy.bf16()
    assert Policy.from_options({}) == Policy.full_stack()
    assert Policy.from_options(None) == Policy.full_stack()


def test_from_options_errors_are_clear():
    with pytest.raises(ValueError, match="unknown policy preset 'fp8'.*presets are"):
        Policy.from_options({"policy": "fp8"})
    with pytest.raises(TypeError, match="must be a fp4compile.Policy or a preset name"):
        Policy.from_options({"policy": 3})


def test_unknown_role_and_bad_spec():
    with pytest.raises(ValueError, match="unknown role 'linear.fwd'"):
        Policy.bf16().override("*", BF16, role="linear.fwd")
    with pytest.raises(ValueError, match="unknown role"):
        Policy.bf16().resolve("a", "attn.qkv")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Policy.bf16().override("*", "fp8")
    with pytest.raises(TypeError, match="override spec"):
        Policy.bf16().override("*", 4)


def test_hand_built_policies_and_rules_are_validated():
    """A Policy built directly (not through override/presets) fails at construction on a wrong shape, not at
    the first lookup inside a compile; a list of rules is kept as the hashable tuple."""
    with pytest.raises(TypeError, match="Policy rules must be a tuple .* got dict"):
        Policy({"*": NVFP4()})
    with pytest.raises(TypeError, match="Policy rule 1 is not a fp4compile.policy.Rule: tuple"):
        Policy((Rule("*", None, BF16), ("*", None, BF16)))
    with pytest.raises(TypeError, match="Policy name must be a string"):
        Policy((), name=3)
    with pytest.raises(ValueError, match="unknown role 'linear.fwd'"):
        Rule("*", "linear.fwd", BF16)
    with pytest.raises(TypeError, match="rule pattern must be a glob string"):
        Rule(3, None, BF16)
    assert Rule("", None, BF16).matches("", "linear.fprop")           # the root module's path
    with pytest.raises(TypeError, match="rule spec must be"):
        Rule("*", None, "bf16")
    p = Policy([Rule("*", "linear.fprop", NVFP4())], name="mine")
    assert isinstance(p.rules, tuple) and hash(p) == hash(Policy((Rule("*", "linear.fprop", NVFP4()),), "mine"))
    assert p.resolve("blocks.0.mlp", "linear.fprop") == NVFP4() and p.resolve("x", "linear.dgrad") is BF16


def test_specs_and_policies_are_frozen_and_hashable():
    p = Policy.full_stack().override("lm_head", "bf16")
    assert hash(p) == hash(Policy.full_stack().override("lm_head", "bf16"))
    assert p != Policy.full_stack()
    with pytest.raises(Exception):
        p.rules = ()
    assert len({NVFP4(), NVFP4(), NVFP4("sr")}) == 2


def test_override_is_last_match_wins_and_returns_new_policy():
    base = Policy.quartet2()
    p = base.override("h.1.*", "bf16").override("h.1.mlp.c_fc", NVFP4("rtn"), role="linear.wgrad")
    assert base.resolve("h.1.attn.c_proj", "linear.fprop") == NVFP4("rtn", four_over_six=True)
    assert p.resolve("h.1.attn.c_proj", "linear.fprop") is BF16
    assert p.resolve("h.1.mlp.c_fc", "linear.wgrad") == NVFP4("rtn")
    assert p.resolve("h.1.mlp.c_fc", "linear.dgrad") is BF16


def test_presets_keep_their_meaning():
    q = Policy.quartet2()
    assert q.resolve("h.0.mlp.c_fc", "linear.fprop") == NVFP4("rtn", four_over_six=True)
    assert q.resolve("h.0.mlp.c_fc", "linear.dgrad") == NVFP4("ms_eden", hadamard=128)
    assert q.resolve("h.0.mlp.c_fc", "linear.wgrad") == NVFP4("ms_eden", hadamard=128)
    assert q.resolve("h.0.attn", "attn.qk") is BF16
    f = Policy.full_stack()
    assert f.resolve("h.0.attn", "attn.qk").name == "nvfp4" and f.resolve("h.0.attn", "attn.pv") is BF16
    assert f.resolve("lm_head", "linear.fprop") is BF16
    n = Policy.nvidia(n_layers=12)
    assert n.resolve("h.0.mlp.c_fc", "linear.fprop").block == (16, 16)
    assert n.resolve("h.0.mlp.c_fc", "linear.dgrad").rounding == "sr"
    assert n.resolve("h.0.mlp.c_fc", "linear.wgrad") == NVFP4("sr", hadamard=16)
    assert n.resolve("h.11.mlp.c_fc", "linear.fprop") is BF16 and n.resolve("h.9.mlp.c_fc", "linear.fprop") != BF16
    assert all(Policy.bf16().resolve("x", r) is BF16 for r in ROLES)


def test_warns_only_for_user_globs_that_match_nothing():
    p = Policy.full_stack().override("h.7.*", "bf16").override("h.0.*", "bf16")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p.warn_unmatched(["h.0.mlp.c_fc", "h.1.mlp.c_fc"])
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "'h.7.*'" in msgs[0] and "matches no GEMM site" in msgs[0]


@pytest.mark.parametrize("preset", ["quartet2", "full_stack", "nvidia"])
def test_presets_keep_head_embeddings_and_lora_factors_bf16(preset):
    from fp4compile.nn import LORA_BF16_GLOB

    p = Policy.preset(preset)
    for role in ("linear.fprop", "linear.dgrad", "linear.wgrad"):
        assert p.resolve("lm_head", role) is BF16
        assert p.resolve("transformer.wte", role) is BF16
        assert p.resolve("h.0.mlp.c_fc.lora_a", role) is BF16
        assert p.resolve("h.0.mlp.c_fc.lora_b", role) is BF16
        assert p.resolve("h.0.mlp.c_fc", role).name == "nvfp4"
    assert LORA_BF16_GLOB == "*.lora_[ab]"
