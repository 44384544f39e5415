"""Bytes per parameter of weights, gradients, main weights and optimizer state on this rank.

Measured on the live tensors (no communication) and set against the usual formula, with ``d``
the data-parallel size the optimizer state is sharded over (``d = 1`` without the distributed
optimizer, which gives the plain numbers 16 / 18 / 20):

================================  ==========================  ==================
parameters / gradient buffers     formula (distributed)       plain optimizer
================================  ==========================  ==================
fp32 / fp32                       4 + 4 + (8) / d = 8 + 8/d   16
bf16 or fp16 / fp32 (default)     2 + 4 + (4 + 8) / d         18
bf16 or fp16 / same half dtype    2 + 2 + (4 + 4 + 8) / d     20
================================  ==========================  ==================

(main weights 4 B and, for half-precision gradients, an fp32 main-gradient copy 4 B; AdamW
``exp_avg`` + ``exp_avg_sq`` 8 B.)  With sharded gradients (ZeRO-2,
``--data-parallel-sharding-strategy optim_grads``) the gradient buffer moves under the ``/ d`` too:
``4 + 12/d`` (fp32), ``2 + 16/d`` (half params, fp32 grads), ``2 + 18/d`` (half grads); the gradient
bytes are then measured on the buffers (this rank's shard plus any bucket whose full storage is live,
none between iterations).  With sharded parameters too (ZeRO-3, ``optim_grads_params``) everything is
divided: ``16/d`` (fp32), ``18/d`` (half params, fp32 grads), ``20/d`` (half grads), the weights measured
as this rank's shard plus the buckets gathered now (a tied embedding's bucket always is).
megalm accumulates gradients in fp32 by default
(``--accumulate-allreduce-grads-in-fp32``), so fp16 models are on the ``6 + 12/d`` line unless
that is turned off.  Bucket padding (< d elements per bucket) makes measured values differ
slightly from the formula; the formula ignores the few bytes of ``step`` counters.  With MoE expert parameters
the formula is the parameter-weighted mean of the dense one over ``d`` and the experts' over ``d_e``, the
expert-data-parallel size (their buffers' group; ``d_e = d`` when they do not differ).
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from megalm.distributed.finalize_model_grads import unwrap_model
from megalm.tensor_parallel.param_info import param_info

HALF = (torch.float16, torch.bfloat16)


def formula_bytes_per_param(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, d: int, grads_sharded: bool = False, params_sharded: bool = False
) -> tuple:
    """``(bytes per parameter, text of the formula)`` for these dtypes and sharding ``d``;
    ``grads_sharded``: the gradients are sharded over the same ``d`` ranks (ZeRO-2);
    ``params_sharded``: the weights too (ZeRO-3)."""
    weights = 2 if param_dtype in HALF else 4
    grads = 4 if grad_dtype == torch.float32 else 2
    # fp32 main weights (a copy for half params), an fp32 gradient copy for half grads, Adam moments
    sharded = (4 if weights == 2 else 0) + (4 if grads == 2 else 0) + 8
    name = "fp32" if weights == 4 else ("bf16" if param_dtype == torch.bfloat16 else "fp16")
    what = f"{name} params and grads" if weights == grads else f"{name} params, fp32 grads"
    if params_sharded:
        return (weights + grads + sharded) / d, f"{weights + grads + sharded}/d ({what}, all sharded)"
    if grads_sharded:
        return weights + (grads + sharded) / d, f"{weights} + {grads + sharded}/d ({what}, grads sharded)"
    return weights + grads + sharded / d, f"{weights + grads} + {sharded}/d ({what})"


def optimizer_memory(optimizer, model_chunks: Sequence[torch.nn.Module]) -> Dict[str, object]:
    """This rank's bytes by kind, bytes per parameter, and the formula that applies.

    Keys: ``params`` (elements of trainable parameters on this rank), ``weights``,
    ``grads``, ``main_params``, ``main_grads``, ``optimizer_state`` (bytes), ``total``,
    ``per_param`` (``{kind: bytes / params}``), ``d``, ``distributed``, ``formula``,
    ``formula_text``.
    """
    params = [p for c in model_chunks for p in unwrap_model(c).parameters() if p.requires_grad]
    params = list({id(p): p for p in params}.values())
    n = sum(p.numel() for p in params)
    grads = [getattr(p, "main_grad", None) for p in params]
    buffers = [b for c in model_chunks if getattr(c, "shard_grads", False) for b in c.all_buffers]
    params_sharded = any(getattr(c, "shard_params", False) for c in model_chunks)
    out = {
        "params": n,
        "weights": sum(b.param_bytes() for b in buffers)
        if params_sharded
        else sum(p.numel() * p.element_size() for p in params),
        "grads": sum(b.grad_bytes() for b in buffers)
        if buffers
        else sum(
            (g.numel() * g.element_size()) if g is not None else p.numel() * p.element_size()
            for p, g in zip(params, grads)
        ),
    }
    out.update(optimizer.memory_breakdown())
    kinds = ("weights", "grads", "main_params", "main_grads", "optimizer_state")
    out["total"] = sum(out[k] for k in kinds)
    out["per_param"] = {k: out[k] / max(n, 1) for k in kinds + ("total",)}
    distributed = optimizer.grads_sharded
    d = optimizer.data_parallel_size
    param_dtype = params[0].dtype if params else torch.float32
    grad_dtype = grads[0].dtype if params and grads[0] is not None else param_dtype
    if buffers:
        grad_dtype = buffers[0].grad_dtype
    formula, text = formula_bytes_per_param(
        param_dtype, grad_dtype, d, grads_sharded=bool(buffers), params_sharded=params_sharded
    )
    experts = sum(p.numel() for p in params if param_info(p).expert)
    d_e = optimizer.expert_data_parallel_size if experts and distributed else d
    if d_e != d:  # MoE: the expert parameters' shares are over the expert-data-parallel group
        expert_formula, _ = formula_bytes_per_param(
            param_dtype, grad_dtype, d_e, grads_sharded=bool(buffers), params_sharded=params_sharded
        )
        formula = (formula * (n - experts) + expert_formula * experts) / n
        text = f"{text} for the dense parameters, d_e={d_e} for the {experts:,} expert ones"
    out.update(d=d, d_e=d_e, distributed=distributed, grads_sharded=bool(buffers), params_sharded=params_sharded)
    out.update(formula=formula, formula_text=text)
    return out


def format_memory_report(mem: Dict[str, object]) -> str:
    """One log line: measured bytes per parameter by kind against the formula."""
    pp = mem["per_param"]
    which = f"distributed optimizer, d={mem['d']}" if mem["distributed"] else "optimizer not sharded, d=1"
    if mem.get("grads_sharded"):
        which = f"distributed optimizer and gradients (ZeRO-2), d={mem['d']}"
    if mem.get("params_sharded"):
        which = f"optimizer, gradients and parameters sharded (ZeRO-3), d={mem['d']}"
    return (
        f"[megalm] optimizer memory on this rank ({which}): weights {pp['weights']:.2f} + grads "
        f"{pp['grads']:.2f} + main weights {pp['main_params']:.2f} + main grads {pp['main_grads']:.2f} + "
        f"optimizer state {pp['optimizer_state']:.2f} = {pp['total']:.2f} B/param over "
        f"{mem['params']:,} params ({mem['total'] / 2**20:.1f} MiB); formula {mem['formula_text']} = "
        f"{mem['formula']:.2f} B/param"
        + (f"; offloaded to the host: {mem['host'] / 2**20:.1f} MiB" if mem.get("host") else "")
    )
