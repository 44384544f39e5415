"""Numeric comparisons shared by the tests."""

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``b`` is the reference; a zero reference counts as 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)
