"""A small GPT in one readable file, in the spirit of nanoGPT — plain PyTorch, no FP4 code.

RoPE positions, RMSNorm, SwiGLU MLP, ``F.scaled_dot_product_attention``, tied or untied LM head. The
``fullstack_fp4`` backend finds the GEMM sites and does the quantization; this file only has to name its
modules so that policy globs read naturally::

    embed                      token embedding          (BF16 in every preset)
    blocks.{i}.attn.qkv        fused Q/K/V projection   (linear.* roles)
    blocks.{i}.attn.proj       attention output proj.
    blocks.{i}.attn            the SDPA call            (attn.* roles)
    blocks.{i}.mlp.fc          fused SwiGLU gate+up     (linear.* roles)
    blocks.{i}.mlp.proj        SwiGLU down projection
    lm_head                    output head              (BF16 in every preset)

All GEMM dimensions of the size presets (d_model, hidden, 3*d_model, 2*hidden) are multiples of 128, so the
Hadamard-128 transforms of the Quartet II backward apply without padding.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS", "config_from_preset"]


@dataclasses.dataclass
class GPTConfig:
    """Shape of the model. ``vocab_size`` is padded by the caller to a multiple of 128 (see data.py)."""

    vocab_size: int = 384
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 128
    hidden: int = 384              # SwiGLU inner width (the fc layer outputs 2*hidden: gate and up)
    max_seq_len: int = 1024
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head_dim={self.d_model // self.n_head} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """``d_model // n_head``."""
        return self.d_model // self.n_head

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count without building the model (matches ``GPT.num_params``)."""
        d, h, L, V = self.d_model, self.hidden, self.n_layer, self.vocab_size
        block = 3 * d * d + d * d + d * 2 * h + h * d + 2 * d          # qkv, proj, fc, proj, 2 norms
        n = L * block + d                                              # + final norm
        emb = V * d * (1 if self.tie_embeddings else 2)
        return n if non_embedding else n + emb


#: Size presets: every d_model and hidden a multiple of 128 (Hadamard-128), head_dim 64 or 128 (the Q-Attn
#: kernel sizes). Names give the total parameter count with the GPT-2 vocabulary (50304 padded, tied head),
#: except the CPU presets which are meant for byte-level tokens. ``"30m"`` has ~30M non-embedding params.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, d_model=128, hidden=128),         # unit tests (dims multiples of 128)
    "cpu": dict(n_layer=4, n_head=2, d_model=128, hidden=384),          # `fp4compile demo` on a CPU (~0.9M)
    "gpu-demo": dict(n_layer=6, n_head=6, d_model=384, hidden=1024),    # `fp4compile demo` on CUDA (~10M)
    "30m": dict(n_layer=6, n_head=10, d_model=640, hidden=1792),        # 30.5M non-embedding
    "124m": dict(n_layer=12, n_head=12, d_model=768, hidden=2048),      # 85M non-emb. + 38.6M embedding
    "350m": dict(n_layer=24, n_head=16, d_model=1024, hidden=2816),     # 308M non-emb. + 51.5M embedding
    "1b": dict(n_layer=18, n_head=16, d_model=2048, hidden=5632),       # 925M non-emb. + 103M embedding
}


def config_from_preset(name: str, **overrides) -> GPTConfig:
    """``GPTConfig`` of a named preset, with field overrides (e.g. ``vocab_size=``, ``max_seq_len=``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets are {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    bad = set(overrides) - fields
    if bad:
        raise ValueError(f"unknown GPTConfig fields {sorted(bad)}; fields are {sorted(fields)}")
    return GPTConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})


def _rope_tables(head_dim: int, max_seq_len: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)   # [T, head_dim/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x [B, H, T, head_dim] by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused ``qkv`` projection, RoPE on Q and K, SDPA (the call the backend's
    Q-Attn pass replaces), then the output ``proj``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)  # 3×[B,H,T,hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """SwiGLU: proj(silu(gate) * up), with gate and up computed by one fused ``fc`` GEMM."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(RMSNorm(x))``, then ``x + mlp(RMSNorm(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None)`` returns logits, or the mean cross-entropy
    loss (fp32) when ``targets`` is given (the logits are then not returned, to save memory)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = _rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, 0.02); residual output projections scaled by 1/sqrt(2·n_layer)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)                      # RMSNorm weights
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights counted once); ``non_embedding`` leaves out the token embedding
        (and an untied LM head)."""
        n = sum(p.numel() for p in self.parameters())      # tied weights are counted once
        if non_embedding:
            n -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(x, targets)

    #: Methods that :func:`fp4compile.train.distributed.wrap_model` compiles as regions of their own under
    #: FSDP2 (which compiles per block): without this the LM head and the fp32 cross-entropy over the
    #: vocabulary would run eagerly and materialize several fp32 copies of the logits.
    fsdp_compile_regions = ("head",)

    def head(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final norm and LM head; with ``targets``, the mean cross-entropy in fp32 instead of the logits."""
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
