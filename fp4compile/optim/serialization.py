"""Optimizer state dicts through safetensors (flat tensors + JSON metadata), bit-exact.

    save_safetensors_state(opt.state_dict(), "opt.safetensors")
    opt.load_state_dict(load_safetensors_state("opt.safetensors"))

Tensors become ``state.<param id>.<key>``; the param groups go to the metadata as JSON (a tensor ``lr``
is stored as the tensor ``param_groups.<i>.lr``).
"""
from __future__ import annotations

import json

import torch


def flatten_state_dict(sd: dict):
    """-> (tensors {name: tensor}, metadata {str: str}) for safetensors."""
    tensors, groups = {}, []
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state[{pid}][{k!r}] is not a tensor; safetensors stores tensors only")
            tensors[f"state.{pid}.{k}"] = v.detach().contiguous()
    for i, g in enumerate(sd["param_groups"]):
        g = dict(g)
        for k, v in list(g.items()):
            if isinstance(v, torch.Tensor):
                tensors[f"param_groups.{i}.{k}"] = v.detach().contiguous()
                g[k] = {"__tensor__": f"param_groups.{i}.{k}"}
        groups.append(g)
    return tensors, {"param_groups": json.dumps(groups), "format": "fp4compile.optim/1"}


def unflatten_state_dict(tensors: dict, metadata: dict) -> dict:
    """Inverse of :func:`flatten_state_dict`: the optimizer state dict (a ``betas`` list becomes a tuple again).
    Raises ``ValueError`` unless ``metadata`` has ``format`` "fp4compile.optim/1"."""
    if metadata.get("format") != "fp4compile.optim/1":
        raise ValueError("not an fp4compile optimizer checkpoint (missing/unknown 'format' metadata)")
    groups = json.loads(metadata["param_groups"])
    for g in groups:
        for k, v in list(g.items()):
            if isinstance(v, dict) and "__tensor__" in v:
                g[k] = tensors[v["__tensor__"]]
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
    state: dict = {}
    for name, t in tensors.items():
        if not name.startswith("state."):
            continue
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = t
    return {"state": state, "param_groups": groups}


def save_safetensors_state(sd: dict, path: str):
    """Write an optimizer state dict to the safetensors file ``path`` (every state value must be a tensor,
    else ``TypeError``)."""
    from safetensors.torch import save_file

    tensors, meta = flatten_state_dict(sd)
    save_file(tensors, path, metadata=meta)


def load_safetensors_state(path: str, device="cpu") -> dict:
    """The state dict that :func:`save_safetensors_state` wrote to ``path``, tensors loaded on ``device``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return unflatten_state_dict(tensors, meta)
