"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), a torch.optim-style optimizer.

Per parameter ``w`` with gradient ``g``::

    c = b1 m + (1 - b1) g
    w = w - lr (sign(c) + wd w)        (decoupled weight decay)
    m = b2 m + (1 - b2) g

Element-wise: no norms, so no communication, under any layout (TP shards, the distributed
optimizer's flat ranges, pipeline stages) the update equals the single-process one.

State per parameter: ``exp_avg`` (``m``).
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion; see the module docstring."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def init_param_state(self, p: torch.Tensor, group: dict) -> None:
        self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.init_param_state(p, group)
                m = self.state[p]["exp_avg"]
                c = m.mul(b1).add_(p.grad, alpha=1 - b1)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(c.sign_(), alpha=-lr)
                m.lerp_(p.grad, 1 - b2)
        return None
