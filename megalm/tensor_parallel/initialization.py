"""Layout-independent weight initialization.

Modules record *how* each parameter is initialized (``mark_init``) when they are built;
:func:`initialize_weights` then fills every parameter so that, for a given seed, the full
(gathered) weights are identical for every tensor/pipeline layout:

* each parameter's full fp32 tensor is drawn from a CPU generator seeded by a stable hash
  of ``(seed, global parameter name)`` (parameter names are global: ``decoder.layers.5...``,
  and canonical: a Transformer Engine model's fused norm weights use the local names, see
  :mod:`megalm.parameter_names`, so both implementations start from the same weights);
* this rank's shard is cut from it by the parameter's split (its
  :class:`~megalm.tensor_parallel.param_info.ParamInfo`; an expert parameter's split is over the
  expert-tensor-parallel group, any other over the tensor-parallel group) and copied in;
* vocabulary rows at or beyond ``vocab_unpadded`` are zero.

Only one full parameter exists at a time.  A parameter may carry ``init_name`` to be drawn
as another parameter (the last stage's copy of a tied word embedding).
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Iterable, Optional, Union

import torch
from torch import nn

from megalm.parallel_state import group_rank, group_size
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel.meta_init import DEFERRED_INIT, MetaInitError
from megalm.tensor_parallel.param_info import param_info
from megalm.tensor_parallel.utils import full_shape, shard_of_full

INIT_KINDS = ("normal", "zeros", "ones")


def mark_init(param: nn.Parameter, kind: str, std: Optional[float] = None) -> nn.Parameter:
    """Record the initialization rule: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``."""
    if kind not in INIT_KINDS:
        raise ValueError(f"unknown init kind {kind!r}; expected one of {INIT_KINDS}")
    if kind == "normal" and (std is None or std <= 0):
        raise ValueError(f"normal init needs a positive std, got {std}")
    param.init_kind = kind
    param.init_std = std
    return param


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``(seed, name)`` that is the same in every process."""
    key = f"{seed}:{name}".encode()
    return (zlib.crc32(key) << 31 | zlib.crc32(key[::-1])) & ((1 << 63) - 1)


def full_initial_value(param: torch.Tensor, name: str, seed: int, tp_size: int) -> torch.Tensor:
    """The full fp32 tensor this parameter (a shard of it) starts from."""
    shape = full_shape(param, tp_size)
    kind = getattr(param, "init_kind", None)
    if kind is None:
        raise ValueError(f"parameter {name} has no init rule (mark_init was not called)")
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(stable_seed(seed, getattr(param, "init_name", name)))
    full = torch.empty(shape, dtype=torch.float32).normal_(0.0, param.init_std, generator=generator)
    vocab = param_info(param).vocab_unpadded
    if vocab is not None:
        full[vocab:].zero_()
    return full


def _named_unique_parameters(model: Union[nn.Module, Iterable[nn.Module]]):
    modules = [model] if isinstance(model, nn.Module) else list(model)
    seen = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


def initial_shard(param: torch.Tensor, name: str, seed: int, group) -> torch.Tensor:
    """This rank's TP shard (over ``group``) of the parameter's full initial fp32 value."""
    info = param_info(param)
    size, rank = group_size(group), group_rank(group)
    full = full_initial_value(param, name, seed, size)
    if info.tensor_parallel and size > 1:
        full = shard_of_full(full, info.partition_dim, rank, size, info.partition_stride)
    if tuple(full.shape) != tuple(param.shape):
        raise RuntimeError(f"{name}: shard shape {tuple(full.shape)} != parameter shape {tuple(param.shape)}")
    return full


@torch.no_grad()
def initialize_weights(model: Union[nn.Module, Iterable[nn.Module]], seed: int, tp_group, etp_group) -> None:
    """Fill every parameter of ``model`` (or of each model chunk) by the layout-independent rule;
    split parameters get this rank's shard for ``tp_group``, split expert parameters for ``etp_group``
    (the model's ``process_groups.tp`` and ``.etp``; ``None``: this rank alone).
    No communication.  A parameter on the meta device (``--init-model-with-meta-device``) is not
    filled: its rule is recorded (:data:`megalm.tensor_parallel.meta_init.DEFERRED_INIT`) and run by
    whoever gives it storage, one parameter at a time."""
    for name, param in _named_unique_parameters(model):
        group = etp_group if param_info(param).expert else tp_group
        if param.is_meta:
            if getattr(param, "init_kind", None) is None:
                raise MetaInitError(f"parameter {name} has no init rule (mark_init was not called)")
            setattr(param, DEFERRED_INIT, partial(initial_shard, param, canonical_name(name), seed, group))
            continue
        param.copy_(initial_shard(param, canonical_name(name), seed, group))
