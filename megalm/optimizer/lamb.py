"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), a torch.optim-style optimizer.

Per parameter ``w`` with gradient ``g``, at step ``t`` (the Adam direction, then a per-tensor
trust ratio)::

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
    r = clamp(||w|| / ||u||, 0, max_trust_ratio)    (1 when ||w|| or ||u|| is 0,
                                                    and for groups with trust_ratio False)
    w = w - lr r u

``||.||`` are L2 norms of the FULL tensor: :attr:`Lamb.tensor_norms` computes them from this
rank's pieces (:mod:`megalm.optimizer.tensor_norms`: one SUM all-reduce of a small table over
the ranks that cut the tensors, once per step, every rank calling it).  Parameter groups with
``trust_ratio`` False (megalm's ``no_decay`` group: biases and norm weights, the paper's
exclusion list) take the plain Adam step ``w = w - lr u``.

State per parameter: ``step`` (0-dim fp32), ``exp_avg``, ``exp_avg_sq`` (Adam's keys, so the
checkpoint protocol saves and reshards them like Adam's).
"""

from __future__ import annotations

import torch

from megalm.optimizer.tensor_norms import LocalTensorNorms


def init_adam_state(state: dict, p: torch.Tensor) -> None:
    """Adam's state of ``p``: ``step`` 0, zero moments."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adam_direction(state: dict, g: torch.Tensor, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """Advance the moments by ``g`` and return ``m_hat / (sqrt(v_hat) + eps)`` (a new tensor)."""
    state["step"] += 1
    t = state["step"].item()
    state["exp_avg"].lerp_(g, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(eps)
    return (state["exp_avg"] / (1 - beta1**t)).div_(denom)


def trust_ratios(w_sq: torch.Tensor, u_sq: torch.Tensor, coefficient: float = 1.0, max_ratio=None) -> torch.Tensor:
    """``coefficient ||w|| / ||u||`` per entry (clamped to ``max_ratio``), 1 where a norm is 0."""
    w, u = w_sq.sqrt(), u_sq.sqrt()
    ratio = coefficient * w / torch.where(u > 0, u, torch.ones_like(u))
    if max_ratio is not None:
        ratio = ratio.clamp(max=max_ratio)
    return torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio))


class Lamb(torch.optim.Optimizer):
    """LAMB; see the module docstring.  ``tensor_norms`` is set by the megalm wrapper."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_trust_ratio=10.0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_ratio=True)
        super().__init__(params, defaults)
        self.max_trust_ratio = max_trust_ratio
        self.tensor_norms = LocalTensorNorms()

    def init_param_state(self, p: torch.Tensor, group: dict) -> None:
        init_adam_state(self.state[p], p)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step over every group (one norm reduction for all of them)."""
        self.apply_step(self.prepare_step())
        return None

    @torch.no_grad()
    def prepare_step(self) -> list:
        """Everything but the weight update, for every parameter with a gradient: advance the moments,
        the direction ``u``, the full-tensor norms (the one reduction) and the trust ratios; returns
        ``[(p, u, -lr r)]`` for :meth:`apply_step` (the two halves let the CPU offload apply the update
        bucket by bucket after one norm reduction over all of them)."""
        params, updates, adapt, lrs = [], [], [], []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.init_param_state(p, group)
                u = adam_direction(self.state[p], p.grad, b1, b2, group["eps"])
                if group["weight_decay"] != 0:
                    u.add_(p, alpha=group["weight_decay"])
                params.append(p)
                updates.append(u)
                adapt.append(bool(group["trust_ratio"]))
                lrs.append(group["lr"])
        w_sq, u_sq = self.tensor_norms(params, params, updates)
        ratios = trust_ratios(w_sq, u_sq, max_ratio=self.max_trust_ratio).tolist()
        return [(p, u, -lr * (r if a else 1.0)) for p, u, a, lr, r in zip(params, updates, adapt, lrs, ratios)]

    @torch.no_grad()
    def apply_step(self, entries: list) -> None:
        """``w = w - lr r u`` for the entries of :meth:`prepare_step` given (no communication)."""
        for p, u, alpha in entries:
            p.add_(u, alpha=alpha)
