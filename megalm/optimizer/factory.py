"""Building the optimizer from the config: parameter groups, the torch optimizer, the wrapper.

:func:`build_optimizer` picks the wrapper (no communication of its own at construction):

* ``--use-distributed-optimizer`` or ``--data-parallel-sharding-strategy optim`` / ``optim_grads``:
  :class:`megalm.optimizer.distrib_optimizer.DistributedOptimizer` over the chunks' DDP buffers;
* any bf16/fp16 parameter: :class:`megalm.optimizer.optimizer.MixedPrecisionOptimizer`;
* otherwise :class:`megalm.optimizer.optimizer.FP32Optimizer`.

This module imports both wrappers; neither imports it, nor each other beyond the distributed
optimizer subclassing the base class.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.distributed.finalize_model_grads import unwrap_model
from megalm.log import get_logger
from megalm.optimizer.distrib_optimizer import DistributedOptimizer
from megalm.optimizer.grad_scaler import build_grad_scaler
from megalm.optimizer.memory_accounting import format_memory_report, optimizer_memory
from megalm.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer, OptimizerError
from megalm.parallel_state import ProcessGroups
from megalm.parameter_names import canonical_name

logger = get_logger(__name__)


def get_param_groups(named_params: Sequence[Tuple[str, torch.nn.Parameter]], weight_decay: float) -> List[dict]:
    """Two groups: ``decay`` (ndim >= 2, ``weight_decay``) and ``no_decay`` (ndim <= 1, 0.0)."""
    decay = [(n, p) for n, p in named_params if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    groups = []
    for tag, members, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)):
        if members:
            groups.append(
                {
                    "name": tag,
                    "params": [p for _, p in members],
                    "names": [n for n, _ in members],
                    "weight_decay": wd,
                    "lr_mult": 1.0,
                }
            )
    return groups


def named_parameters_for_optimizer(model_chunks: Sequence[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    """``(global name, param)`` over all chunks.

    Name: ``module.global_parameter_name(local_name)`` when the (unwrapped) module defines it,
    otherwise ``named_parameters()``' name made canonical (the model names layers globally, as
    the checkpoint code assumes; :func:`megalm.parameter_names.canonical_name` gives a Transformer
    Engine model's fused norm weights their local names).  Names must be unique over the chunks.
    """
    out = []
    for chunk in model_chunks:
        module = unwrap_model(chunk)
        to_global = getattr(module, "global_parameter_name", None)
        for n, p in module.named_parameters():
            if not p.requires_grad:
                continue
            out.append((to_global(n) if callable(to_global) else canonical_name(n), p))
    return out


def make_torch_optimizer(t) -> Callable[[List[dict]], torch.optim.Optimizer]:
    """``groups -> torch optimizer`` for ``--optimizer`` (AdamW or SGD), fused kernels when available."""

    def make(groups: List[dict]) -> torch.optim.Optimizer:
        if t.optimizer == "adam":
            cls, kw = (
                torch.optim.AdamW,
                dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay),
            )
        elif t.optimizer == "sgd":
            cls, kw = torch.optim.SGD, dict(lr=t.lr, momentum=t.sgd_momentum, weight_decay=t.weight_decay)
        else:
            raise OptimizerError(f"unknown --optimizer {t.optimizer!r} (choose adam or sgd)")
        try:  # the fused kernels are ~5x faster on CPU and on GPU
            return cls(groups, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):
            return cls(groups, **kw)

    return make


def build_optimizer(
    cfg,
    model_chunks: Sequence[torch.nn.Module],
    log_num_zeros_in_grad: Optional[bool] = None,
    report_memory: bool = True,
    process_groups: Optional[ProcessGroups] = None,
) -> MegatronOptimizer:
    """Optimizer over every trainable parameter of ``model_chunks`` (DDP-wrapped or not).

    Mixed precision (fp32 main params) when any parameter is bf16/fp16; fp16 gets a dynamic
    (or ``--loss-scale`` constant) loss scaler.  ``--use-distributed-optimizer``: a
    :class:`DistributedOptimizer` over the chunks' DDP buffers (built with the same config).
    ``log_num_zeros_in_grad`` defaults to ``training.log_num_zeros_in_grad``.  ``process_groups``
    (default :func:`megalm.parallel_state.get_process_groups`, resolved once here): the groups
    of the gradient norm and the overflow check.  ``report_memory``: global rank 0 logs the bytes
    per parameter of weights, gradients, main weights and optimizer state against the formula
    (:mod:`megalm.optimizer.memory_accounting`).
    """
    t = cfg.training
    if log_num_zeros_in_grad is None:
        log_num_zeros_in_grad = bool(t.log_num_zeros_in_grad)
    if process_groups is None:
        process_groups = parallel_state.get_process_groups()
    named = named_parameters_for_optimizer(model_chunks)
    if not named:
        raise OptimizerError("build_optimizer: the model has no trainable parameters")
    groups = get_param_groups(named, t.weight_decay)
    common = dict(
        clip_grad=t.clip_grad,
        grad_scaler=build_grad_scaler(t),
        log_num_zeros_in_grad=log_num_zeros_in_grad,
        process_groups=process_groups,
        offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
    )
    sharded = cfg.parallel.data_parallel_sharding_strategy != "no_shard"
    if cfg.parallel.use_distributed_optimizer or sharded:
        optimizer = DistributedOptimizer(groups, make_torch_optimizer(t), model_chunks, **common)
    else:
        half = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in named)
        cls = MixedPrecisionOptimizer if half else FP32Optimizer
        optimizer = cls(groups, make_torch_optimizer(t), **common)
    if report_memory and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(format_memory_report(optimizer_memory(optimizer, model_chunks)))
    return optimizer
