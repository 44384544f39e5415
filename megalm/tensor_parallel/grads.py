"""The gradient reduction that sequence parallelism needs after backward.

Under sequence parallelism the norm weights and biases and the row-parallel linear biases
see only this rank's slice of the sequence, so their gradients are partial sums: one
all-reduce over TP (all such grads flattened into one buffer per dtype) makes them the
full gradient.  Reads ``param.main_grad`` when the data-parallel wrapper provides it, else
``param.grad``; call after backward and before the optimizer step (the training loop's
``finalize_model_grads`` does the same reduction).
"""

from __future__ import annotations

from typing import Iterable, List, Union

import torch
import torch.distributed as dist
from torch import nn

from megalm.parallel_state import group_size
from megalm.tensor_parallel.param_info import param_info

Modules = Union[nn.Module, Iterable[nn.Module]]


def _grad_of(param: torch.Tensor):
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _unique_params(model: Modules) -> List[torch.nn.Parameter]:
    modules = [model] if isinstance(model, nn.Module) else list(model)
    seen, params = set(), []
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _all_reduce_coalesced(grads: List[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` with one all-reduce per dtype (flatten, reduce, copy back)."""
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for _, same_dtype in sorted(by_dtype.items(), key=lambda item: str(item[0])):  # same order on every rank
        flat = torch.cat([g.reshape(-1) for g in same_dtype])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same_dtype:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sequence_parallel_params(model: Modules) -> List[torch.nn.Parameter]:
    return [p for p in _unique_params(model) if param_info(p).sequence_parallel]


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: Modules, tp_group) -> None:
    """Sum over ``tp_group`` (``None``: this rank alone, nothing to do) the grads of parameters marked
    ``sequence_parallel`` (one all-reduce per dtype)."""
    if group_size(tp_group) == 1:
        return
    grads = [g for g in (_grad_of(p) for p in sequence_parallel_params(model)) if g is not None]
    if grads:
        _all_reduce_coalesced(grads, tp_group)
