"""Precision policies: which GEMM, by module path and role, runs in which precision.

A policy is an ordered list of rules ``(module-path glob, role or None) -> spec``; the *last* matching rule
wins, so ``override`` appends. Specs are frozen, hashable dataclasses (Dynamo guards them as constants and
the backend hashes ``repr(policy)`` into the compile-cache key).

    >>> p = Policy.full_stack().override("lm_head", BF16)
    >>> p.resolve("transformer.h.0.mlp.c_fc", "linear.dgrad")
    NVFP4(rounding='ms_eden', four_over_six=False, hadamard=128, block=16)
"""
from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from typing import Any, Iterable, Mapping, Optional, Tuple, Union

#: every GEMM role the backend, reports and kernels know
ROLES = (
    "linear.fprop", "linear.dgrad", "linear.wgrad",
    "attn.qk", "attn.pv", "attn.dov", "attn.pdo", "attn.dsk", "attn.dsq",
    "optim.ns",
)


#: NVFP4.operands values: which operands of a ``linear.fprop`` GEMM are quantized
OPERANDS = ("both", "weight", "activation")


@dataclasses.dataclass(frozen=True)
class NVFP4:
    """NVFP4 for one GEMM operand pair: both operands quantized along the contraction dim.

    rounding: "rtn" | "sr" | "ms_eden"; four_over_six: adaptive 4/6 block scaling; hadamard: None or RHT
    size (16..128) applied to both operands along K with one shared random sign vector; block: 16 or
    (16, 16) (2D blocks, used for weights: transpose-invariant).

    How the backend applies a spec to the two operands of a linear GEMM (``fp4compile.passes.linear``):
    - ``rounding`` is the rounding of the *gradient* operand in dgrad/wgrad and of both operands in fprop;
      the other backward operand (W in dgrad, X in wgrad) uses RTN, except with ``"ms_eden"`` (Quartet II
      quantizes all four backward operands with MS-EDEN). SR on weights/activations diverges (NVIDIA).
    - ``block=(16, 16)`` applies to the *weight* operand only; activations and gradients use 1x16 blocks.
    - ``hadamard``: both operands rotated along the contraction dim with one sign vector, drawn fresh each
      step inside the compiled graph.
    - ``four_over_six`` applies to the RTN-rounded operands.
    - ``operands`` (``linear.fprop`` only): "both" (default), "weight" (W in NVFP4, X in BF16) or "activation"
      (X in NVFP4, W in BF16). The quantized operand is dequantized (inverse RHT included) to the GEMM's
      dtype, one rounding of q·S·global, and multiplied with the other operand by the original BF16 GEMM.
      For ablations (which operand's quantization costs the loss), and W4A16-style training. Any other role
      with a value other than "both" is a configuration error.
    """

    rounding: str = "rtn"
    four_over_six: bool = False
    hadamard: Optional[int] = None
    block: Union[int, Tuple[int, int]] = 16
    operands: str = "both"

    def __post_init__(self):
        from .formats.nvfp4 import HADAMARD_SIZES, ROUNDINGS

        if self.rounding not in ROUNDINGS:
            raise ValueError(f"NVFP4.rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.hadamard is not None and self.hadamard not in HADAMARD_SIZES:
            raise ValueError(f"NVFP4.hadamard must be None or one of {HADAMARD_SIZES}, got {self.hadamard!r}")
        if isinstance(self.block, list):
            object.__setattr__(self, "block", tuple(self.block))
        if self.block not in (16, (16, 16)):
            raise ValueError(f"NVFP4.block must be 16 or (16, 16), got {self.block!r}")
        if self.operands not in OPERANDS:
            raise ValueError(f"NVFP4.operands must be one of {OPERANDS}, got {self.operands!r}")

    @property
    def name(self) -> str:
        """Always "nvfp4" (the precision's name in records and reports)."""
        return "nvfp4"

    def __str__(self):
        parts = [self.rounding]
        if self.four_over_six:
            parts.append("4/6")
        if self.hadamard:
            parts.append(f"rht{self.hadamard}")
        if self.block != 16:
            parts.append("2d")
        if self.operands != "both":
            parts.append(f"{self.operands}-only")
        return "nvfp4(" + ",".join(parts) + ")"


@dataclasses.dataclass(frozen=True)
class _BF16:
    """Keep the GEMM in BF16 (the model's own precision)."""

    @property
    def name(self) -> str:
        return "bf16"

    def __str__(self):
        return "bf16"

    def __repr__(self):
        return "BF16"


BF16 = _BF16()
Precision = Union[NVFP4, _BF16]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One ``(module-path glob, role or None) -> spec`` rule. ``user`` is False for a preset's own rules
    (only user rules are reported when their glob matches no site)."""

    pattern: str
    role: Optional[str]
    spec: Precision
    user: bool = dataclasses.field(default=True, compare=True)

    def __post_init__(self):
        # an empty pattern is legal: it matches the root module's path "" (the per-module rules of
        # fp4compile.train.distributed use it); Policy.override, the user-facing builder, asks for a non-empty glob
        if not isinstance(self.pattern, str):
            raise TypeError(f"rule pattern must be a glob string, got {self.pattern!r}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; roles are {ROLES}")
        if not isinstance(self.spec, (NVFP4, _BF16)):
            raise TypeError(f"rule spec must be NVFP4(...) or BF16, got {self.spec!r}")

    def matches(self, path: str, role: str) -> bool:
        """Whether this rule applies to ``role`` at module ``path``: same role (or rule role None) and ``path``
        matches the glob (``fnmatch``, case-sensitive)."""
        return (self.role is None or self.role == role) and fnmatch.fnmatchcase(path, self.pattern)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Ordered rules; the last match wins; no match means BF16."""

    rules: Tuple[Rule, ...] = ()
    name: str = "custom"

    def __post_init__(self):
        # a list of rules is taken as the tuple (policies are hashable: Dynamo guards on them); anything else that
        # is not a sequence of Rule fails here, not at the first lookup inside a compile
        if isinstance(self.rules, list):
            object.__setattr__(self, "rules", tuple(self.rules))
        if not isinstance(self.rules, tuple):
            raise TypeError(f"Policy rules must be a tuple of fp4compile.policy.Rule (build them with "
                            f"Policy.override), got {type(self.rules).__name__}: {self.rules!r}")
        bad = [(i, r) for i, r in enumerate(self.rules) if not isinstance(r, Rule)]
        if bad:
            i, r = bad[0]
            raise TypeError(f"Policy rule {i} is not a fp4compile.policy.Rule: {type(r).__name__} {r!r}")
        if not isinstance(self.name, str):
            raise TypeError(f"Policy name must be a string, got {self.name!r}")

    def resolve(self, module_path: str, role: str) -> Precision:
        """The spec of ``role`` at ``module_path``: the last matching rule's, or BF16 when none matches. Raises
        ``ValueError`` for a role not in :data:`ROLES`."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        for rule in reversed(self.rules):
            if rule.matches(module_path, role):
                return rule.spec
        return BF16

    def override(self, pattern: str, spec: Union[Precision, str], role: Optional[str] = None) -> "Policy":
        """A new policy with one more rule (it takes precedence over the earlier ones).

        ``pattern`` is an fnmatch glob over module paths as written by ``model.named_modules()``
        (e.g. ``"transformer.h.11.*"``, ``"*lm_head"``); ``spec`` a precision spec or ``"bf16"``/``"nvfp4"``;
        ``role`` one of :data:`ROLES` or None for every role.
        """
        if role is not None and role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"override pattern must be a non-empty glob string, got {pattern!r}")
        if isinstance(spec, str):
            spec = _spec_from_str(spec)
        if not isinstance(spec, (NVFP4, _BF16)):
            raise TypeError(f"override spec must be NVFP4(...), BF16, 'bf16' or 'nvfp4', got {spec!r}")
        return dataclasses.replace(self, rules=self.rules + (Rule(pattern, role, spec),))

    @classmethod
    def from_options(cls, options: Union["Policy", str, Mapping[str, Any], None]) -> "Policy":
        """The policy named by backend options: a ``Policy``, a preset name, or a mapping whose ``"policy"``
        entry is one of those (missing/None -> :meth:`full_stack`). Raises ``ValueError``/``TypeError``
        with the accepted values otherwise."""
        if isinstance(options, Mapping):
            options = options.get("policy")
        if options is None:
            return cls.full_stack()
        if isinstance(options, Policy):
            return options
        if isinstance(options, str):
            return cls.preset(options)
        raise TypeError(f"policy must be a fp4compile.Policy or a preset name {sorted(_PRESETS)}, "
                        f"got {type(options).__name__}: {options!r}")

    def unmatched_rules(self, paths: Iterable[str]) -> Tuple[Rule, ...]:
        """The user rules whose glob matches none of ``paths`` (module paths of the GEMM sites)."""
        paths = tuple(paths)
        return tuple(r for r in self.rules
                     if r.user and not any(fnmatch.fnmatchcase(p, r.pattern) for p in paths))

    def warn_unmatched(self, paths: Iterable[str], where: str = "this compiled graph") -> None:
        """Warn (one line per rule) about user rules whose glob matches no GEMM site."""
        for r in self.unmatched_rules(paths):
            warnings.warn(f"fp4compile: policy rule {r.pattern!r} (role {r.role or '*'}) -> {r.spec} matches "
                          f"no GEMM site in {where}", stacklevel=2)

    def __str__(self):
        lines = [f"Policy {self.name!r} (last matching rule wins; unmatched -> bf16):"]
        for r in self.rules:
            lines.append(f"  {r.pattern:<28} {r.role or '*':<14} -> {r.spec}")
        return "\n".join(lines)

    # presets ---------------------------------------------------------------------------------
    @classmethod
    def bf16(cls) -> "Policy":
        """The all-BF16 preset: no rules, every GEMM resolves to BF16."""
        return cls((), "bf16")

    @classmethod
    def quartet2(cls) -> "Policy":
        """Quartet II linear scheme: fprop RTN + 4/6; dgrad/wgrad RHT-128 + MS-EDEN; attention BF16; the LM
        head, embeddings and LoRA-SVD factors BF16."""
        bwd = NVFP4("ms_eden", hadamard=128)
        return cls(_linear_rules(NVFP4("rtn", four_over_six=True), bwd, bwd) + _bf16_edges(), "quartet2")

    @classmethod
    def full_stack(cls) -> "Policy":
        """The Full-Stack FP4 paper: Quartet II linears, Q-Attn split, Newton-Schulz in NVFP4."""
        bwd = NVFP4("ms_eden", hadamard=128)
        rules = _linear_rules(NVFP4("rtn", four_over_six=True), bwd, bwd)
        rules += tuple(Rule("*", r, NVFP4("rtn"), user=False) for r in ("attn.qk", "attn.dsk", "attn.dsq", "optim.ns"))
        return cls(rules + _bf16_edges(), "full_stack")

    @classmethod
    def nvidia(cls, n_layers: Optional[int] = None, layer_glob: str = "*.{i}.*") -> "Policy":
        """NVIDIA's recipe: 2D 16x16 weights (RTN), SR gradients, RHT-16 on the wgrad operands, the last
        ~15 % of blocks (when ``n_layers`` is given) and the LM head in BF16."""
        fprop = NVFP4("rtn", block=(16, 16))
        dgrad = NVFP4("sr", block=(16, 16))      # W_bprop is the same 2D-quantized W as in fprop
        wgrad = NVFP4("sr", hadamard=16)
        rules = _linear_rules(fprop, dgrad, wgrad)
        if n_layers:
            keep = max(1, round(0.15 * n_layers))
            rules += tuple(Rule(layer_glob.format(i=i), None, BF16, user=False)
                           for i in range(n_layers - keep, n_layers))
        return cls(rules + _bf16_edges(), "nvidia")

    @classmethod
    def preset(cls, name: str) -> "Policy":
        """The preset called ``name`` (one of ``full_stack``, ``quartet2``, ``nvidia``, ``bf16``)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown policy preset {name!r}; presets are {sorted(_PRESETS)}")
        return getattr(cls, _PRESETS[name])()


_PRESETS = {"full_stack": "full_stack", "quartet2": "quartet2", "nvidia": "nvidia", "bf16": "bf16"}


def _linear_rules(fprop, dgrad, wgrad):
    return (Rule("*", "linear.fprop", fprop, user=False), Rule("*", "linear.dgrad", dgrad, user=False),
            Rule("*", "linear.wgrad", wgrad, user=False))


def _bf16_edges():
    """Embeddings, norms, the LM head and the LoRA-SVD low-rank factors (``fp4compile.nn.LORA_BF16_GLOB``)
    stay BF16 (embeddings/norms are not GEMM sites anyway)."""
    return (Rule("*lm_head*", None, BF16, user=False), Rule("*embed*", None, BF16, user=False),
            Rule("*wte*", None, BF16, user=False), Rule("*.lora_[ab]", None, BF16, user=False))


def _spec_from_str(s: str) -> Precision:
    if s == "bf16":
        return BF16
    if s == "nvfp4":
        return NVFP4()
    raise ValueError(f"unknown precision {s!r}: use 'bf16', 'nvfp4' or an NVFP4(...) spec")
