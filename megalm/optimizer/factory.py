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

from megalm.distributed.finalize_model_grads import unwrap_model
from megalm.log import get_logger
from megalm.optimizer.distrib_optimizer import DistributedOptimizer
from megalm.optimizer.grad_scaler import build_grad_scaler
from megalm.optimizer.lamb import Lamb
from megalm.optimizer.lars import Lars
from megalm.optimizer.lion import Lion
from megalm.optimizer.memory_accounting import format_memory_report, optimizer_memory
from megalm.optimizer.muon import Muon
from megalm.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer, OptimizerError
from megalm.parallel_state import ProcessGroups
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel.param_info import param_info

logger = get_logger(__name__)


def get_param_groups(
    named_params: Sequence[Tuple[str, torch.nn.Parameter]],
    weight_decay: float,
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
) -> List[dict]:
    """``decay`` (ndim >= 2, ``weight_decay``, ``wd_mult`` 1) and ``no_decay`` (ndim <= 1, 0.0, ``wd_mult``
    0); the scheduler sets each group's weight decay to its ``wd_mult`` x the scheduled value.

    ``decoupled_lr`` (Megatron's ``--decoupled-lr``): the word embedding and the output layer (the
    vocabulary-sized weights) form a group of their own whose schedule peaks at ``decoupled_lr`` and
    ends at ``decoupled_min_lr`` (the group's ``max_lr`` / ``min_lr``; Megatron's default: ``--min-lr``).
    """

    def decoupled(p) -> bool:
        return decoupled_lr is not None and param_info(p).vocab_unpadded is not None

    groups = []
    for tag, keep, wd in (
        ("decay", lambda p: p.ndim >= 2 and not decoupled(p), weight_decay),
        ("no_decay", lambda p: p.ndim < 2 and not decoupled(p), 0.0),
        ("decoupled_lr", decoupled, weight_decay),
    ):
        members = [(n, p) for n, p in named_params if keep(p)]
        if members:
            group = {
                "name": tag,
                "params": [p for _, p in members],
                "names": [n for n, _ in members],
                "weight_decay": wd,
                "wd_mult": 0.0 if tag == "no_decay" else 1.0,
                "lr_mult": 1.0,
            }
            if tag == "decoupled_lr":
                group.update(max_lr=decoupled_lr, min_lr=decoupled_min_lr)
            groups.append(group)
    return groups


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """A 2-D weight of a linear layer: Muon's; the embeddings and the output layer are not (Megatron's rule)."""
    return param.ndim == 2 and not name.startswith("embedding.") and not name.startswith("output_layer.")


def muon_param_groups(groups: List[dict]) -> List[dict]:
    """:func:`get_param_groups`' groups with each entry marked ``muon`` and the linear layers' matrices
    (:func:`is_muon_matrix`) moved from ``decay`` into their own ``muon`` group (first)."""
    out = []
    for g in groups:
        pairs = list(zip(g["names"], g["params"]))
        for tag, muon in (("muon", True), (g["name"], False)):
            members = [(n, p) for n, p in pairs if is_muon_matrix(n, p) == muon]
            if members:
                names, params = [n for n, _ in members], [p for _, p in members]
                out.append(g | {"name": tag, "names": names, "params": params, "muon": muon})
    return sorted(out, key=lambda g: not g["muon"])


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
    """``groups -> torch optimizer`` for ``--optimizer``: AdamW or SGD (fused kernels when available),
    megalm's LAMB, LARS, Lion or Muon (:mod:`megalm.optimizer.lamb`, ``lars``, ``lion``, ``muon``).  LAMB and LARS
    leave the ``no_decay`` group (biases, norm weights) out of the trust ratio, as their papers."""

    def make(groups: List[dict]) -> torch.optim.Optimizer:
        if t.optimizer in ("lamb", "lars"):
            groups = [g | {"trust_ratio": g.get("name") != "no_decay"} for g in groups]
        if t.optimizer == "lamb":
            betas = (t.adam_beta1, t.adam_beta2)
            return Lamb(groups, lr=t.lr, betas=betas, eps=t.adam_eps, weight_decay=t.weight_decay)
        if t.optimizer == "lars":
            return Lars(
                groups,
                lr=t.lr,
                momentum=t.sgd_momentum,
                weight_decay=t.weight_decay,
                trust_coefficient=t.lars_trust_coefficient,
            )
        if t.optimizer == "muon":
            if t.muon_scalar_optimizer != "adam":
                raise OptimizerError(f"--muon-scalar-optimizer {t.muon_scalar_optimizer!r}: only adam is built")
            return Muon(
                groups,
                lr=t.lr,
                momentum=t.muon_momentum,
                nesterov=t.muon_use_nesterov,
                num_ns_steps=t.muon_num_ns_steps,
                scale_mode=t.muon_scale_mode,
                extra_scale_factor=t.muon_extra_scale_factor,
                tp_mode=t.muon_tp_mode,
                split_qkv=t.muon_split_qkv,
                fp32_matmul_prec=t.muon_fp32_matmul_prec,
                coefficient_type=t.muon_coefficient_type,
                betas=(t.adam_beta1, t.adam_beta2),
                eps=t.adam_eps,
                weight_decay=t.weight_decay,
            )
        if t.optimizer == "lion":
            return Lion(groups, lr=t.lr, betas=(t.lion_beta1, t.lion_beta2), weight_decay=t.weight_decay)
        if t.optimizer == "adam":
            cls, kw = (
                torch.optim.AdamW,
                dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay),
            )
        elif t.optimizer == "sgd":
            cls, kw = torch.optim.SGD, dict(lr=t.lr, momentum=t.sgd_momentum, weight_decay=t.weight_decay)
        else:
            raise OptimizerError(f"unknown --optimizer {t.optimizer!r} (choose adam, sgd, lamb, lars, lion or muon)")
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
    *,
    process_groups: ProcessGroups,
    comm_stats=None,
) -> MegatronOptimizer:
    """Optimizer over every trainable parameter of ``model_chunks`` (DDP-wrapped or not).

    Mixed precision (fp32 main params) when any parameter is bf16/fp16; fp16 gets a dynamic
    (or ``--loss-scale`` constant) loss scaler.  ``--use-distributed-optimizer``: a
    :class:`DistributedOptimizer` over the chunks' DDP buffers (built with the same config).
    ``log_num_zeros_in_grad`` defaults to ``training.log_num_zeros_in_grad``.  ``process_groups``
    (required; the Trainer's bundle): the groups of the gradient norm and the overflow check.
    ``comm_stats``: the :class:`megalm.distributed.comm.CommStats` its collectives are counted in (the
    Trainer's; None: not counted).
    ``report_memory``: global rank 0 logs the bytes per parameter of weights, gradients, main
    weights and optimizer state against the formula
    (:mod:`megalm.optimizer.memory_accounting`).
    """
    t = cfg.training
    if log_num_zeros_in_grad is None:
        log_num_zeros_in_grad = bool(t.log_num_zeros_in_grad)
    named = named_parameters_for_optimizer(model_chunks)
    if not named:
        raise OptimizerError("build_optimizer: the model has no trainable parameters")
    decoupled_min_lr = t.decoupled_min_lr if t.decoupled_min_lr is not None else t.min_lr
    groups = get_param_groups(named, t.weight_decay, t.decoupled_lr, decoupled_min_lr)
    if t.optimizer == "muon":
        groups = muon_param_groups(groups)
    offloads = t.optimizer_cpu_offload or t.optimizer_offload_device == "nvme"  # nvme implies the host update
    common = dict(
        clip_grad=t.clip_grad,
        grad_scaler=build_grad_scaler(t),
        log_num_zeros_in_grad=log_num_zeros_in_grad,
        process_groups=process_groups,
        comm_stats=comm_stats,
        offload_fraction=t.optimizer_offload_fraction if offloads else 0.0,
        offload_overlap=t.overlap_cpu_optimizer_d2h_h2d,
        offload_path=t.offload_path if t.optimizer_offload_device == "nvme" else None,
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
