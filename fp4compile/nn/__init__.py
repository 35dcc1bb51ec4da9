"""LoRA-SVD reparametrisation of linear layers (BF16 principal subspace + NVFP4 residual).

    handle = fp4compile.prepare(model, rank=64, beta=1.0, realign_every=2048)
    opt = torch.optim.AdamW(model.parameters())      # build the optimizer after prepare
    handle.attach(opt)                                # periodic randomized-SVD realignment + state remap
    ...
    fp4compile.merge(model)                           # fold back to plain nn.Linear

Policies keep the low-rank GEMMs BF16 with ``Rule(LORA_BF16_GLOB, None, BF16)`` (``"*.lora_[ab]"``).
Design and math: ``fp4compile/nn/lora_svd.py`` and ``docs/LORA.md``.
"""
from .lora_svd import (DEFAULT_BETA, DEFAULT_EXCLUDE, DEFAULT_RANK, LORA_BF16_GLOB, LoRASVDHandle, LoRASVDLinear,
                       cholesky_qr, merge, prepare, randomized_svd)

__all__ = ["prepare", "merge", "LoRASVDLinear", "LoRASVDHandle", "cholesky_qr", "randomized_svd",
           "LORA_BF16_GLOB", "DEFAULT_RANK", "DEFAULT_BETA", "DEFAULT_EXCLUDE"]
