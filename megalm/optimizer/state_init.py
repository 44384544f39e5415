"""Eager creation of one parameter's optimizer state (zero moments, step 0), exactly as the torch
optimizers (AdamW, SGD) and megalm's (LAMB, LARS, Lion, Muon) create it lazily at their first step.
No communication."""

from __future__ import annotations

import torch


def init_param_state(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    """``optimizer.state[p]`` as the first step would create it (nothing when it exists or the optimizer
    keeps none for ``p``, e.g. SGD without momentum)."""
    state = optimizer.state[p]
    if state:
        return
    if isinstance(optimizer, torch.optim.AdamW):
        fused = bool(group.get("fused"))
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif hasattr(optimizer, "init_param_state"):  # megalm's LAMB, LARS, Lion, Muon
        optimizer.init_param_state(p, group)
