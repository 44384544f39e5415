"""LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks"), torch.optim style.

Per parameter ``w`` with gradient ``g`` (SGD with momentum and a per-tensor local learning rate)::

    r = eta ||w|| / (||g|| + wd ||w||)     (1 when ||w|| or ||g|| is 0, and for groups with
                                           trust_ratio False)
    buf = mu buf + r (g + wd w)
    w = w - lr buf

``eta`` is ``--lars-trust-coefficient``, ``mu`` ``--sgd-momentum``, ``wd`` the group's weight
decay (L2, inside the trust ratio as in the paper).  The global learning rate multiplies the
buffer at the update (torch SGD's convention), the same as the paper's ``lr`` inside the buffer
while ``lr`` is constant.  ``||.||`` are L2 norms of the FULL tensor (:attr:`Lars.tensor_norms`,
:mod:`megalm.optimizer.tensor_norms`: one SUM all-reduce of a small table per step over the
ranks that cut the tensors).  ``trust_ratio`` False: megalm's ``no_decay`` group (biases and norm
weights, excluded in the paper), plain SGD with momentum.

State per parameter: ``momentum_buffer`` (SGD's key).
"""

from __future__ import annotations

import torch

from megalm.optimizer.tensor_norms import LocalTensorNorms


class Lars(torch.optim.Optimizer):
    """LARS; see the module docstring.  ``tensor_norms`` is set by the megalm wrapper."""

    def __init__(self, params, lr=1e-3, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_ratio=True)
        super().__init__(params, defaults)
        self.trust_coefficient = trust_coefficient
        self.tensor_norms = LocalTensorNorms()

    def init_param_state(self, p: torch.Tensor, group: dict) -> None:
        self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS step over every group (one norm reduction for all of them)."""
        self.apply_step(self.prepare_step())
        return None

    @torch.no_grad()
    def prepare_step(self) -> list:
        """The full-tensor norms (the one reduction) and trust ratios of every parameter with a
        gradient; returns ``[(p, g, group, r)]`` for :meth:`apply_step` (the two halves let the CPU
        offload apply the update bucket by bucket after one norm reduction over all of them)."""
        params, grads, groups = [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.init_param_state(p, group)
                params.append(p)
                grads.append(p.grad)
                groups.append(group)
        w_sq, g_sq = self.tensor_norms(params, params, grads)
        ratios = self._ratios(w_sq, g_sq, groups).tolist()
        return list(zip(params, grads, groups, ratios))

    @torch.no_grad()
    def apply_step(self, entries: list) -> None:
        """``buf = mu buf + r (g + wd w); w = w - lr buf`` for the entries given (no communication)."""
        for p, g, group, r in entries:
            wd = group["weight_decay"]
            d = g.add(p, alpha=wd) if wd != 0 else g
            buf = self.state[p]["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(d, alpha=r)
            p.add_(buf, alpha=-group["lr"])

    def _ratios(self, w_sq: torch.Tensor, g_sq: torch.Tensor, groups) -> torch.Tensor:
        """``eta ||w|| / (||g|| + wd ||w||)`` per parameter; 1 where a norm is 0 or the group is excluded."""
        w, g = w_sq.sqrt(), g_sq.sqrt()
        wd = torch.tensor([grp["weight_decay"] for grp in groups], dtype=w.dtype, device=w.device)
        adapt = torch.tensor([bool(grp["trust_ratio"]) for grp in groups], device=w.device)
        ok = adapt & (w > 0) & (g > 0)
        denom = torch.where(ok, g + wd * w, torch.ones_like(w))
        return torch.where(ok, self.trust_coefficient * w / denom, torch.ones_like(w))
