"""Everything that must happen to gradients between the last backward and ``optimizer.step()``.

:func:`finalize_model_grads` (as Megatron's), in order:

1. ``finish_grad_sync()`` on every model chunk: the data-parallel mean of every gradient
   (all-reduce per bucket over DP; expert buffers over expert-DP).
2. Sequence-parallel norm parameters (``param_info(p).sequence_parallel``): each TP rank saw only its
   slice of the sequence, so their gradients are summed over the tensor-parallel group (one
   coalesced all-reduce).  With sharded gradients (ZeRO-2) only this rank's shard of them exists:
   the shards are summed instead (the TP ranks of one DP rank lay out their buffers alike).
3. Tied word embeddings with pipeline parallelism: the first stage's word embedding and the
   last stage's output-layer copy (``param_info(p).tied``) must receive the same update,
   so their gradients are summed over the embedding group (first + last stage) — one
   all-reduce of the weight's gradient.  With the distributed optimizer this runs after the
   reduce-scatter and is still right for the shard a rank owns, because the weight has a
   bucket of its own on both stages (the same shard ranges).

Finding the tied weight: the parameter of ``model_chunks[-1]`` (last stage) or
``model_chunks[0]`` (first stage) whose :func:`~megalm.tensor_parallel.param_info.param_info`
says ``tied`` (``GPTModel.tied_weights()``).  Whether embeddings are tied is agreed once (MAX of
"I know I am tied" over the embedding group: the last stage's tied weight or any chunk's
``share_embeddings_and_output_weights`` attribute) and cached on the first chunk.

Process groups: ``process_groups`` (required: the rank's bundle) gives the TP group of
step 2 and the embedding / pipeline groups of step 3.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalm.device import get_device
from megalm.distributed import comm
from megalm.parallel_state import ProcessGroups, group_size
from megalm.tensor_parallel.param_info import param_info
from megalm.timers import NULL_TIMERS


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip data-parallel / precision wrappers (anything exposing ``.module`` that says so)."""
    from megalm.distributed.data_parallel import DistributedDataParallel

    while isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)) or getattr(
        module, "is_megalm_wrapper", False
    ):
        module = module.module
    return module


def grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient a parameter accumulated: ``main_grad`` under DDP, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.float32)


def allreduce_sequence_parallel_grads(
    model_chunks: Sequence[torch.nn.Module], tp_group, comm_stats: Optional[comm.CommStats] = None
) -> None:
    """Sum gradients of ``sequence_parallel`` params over ``tp_group`` (one coalesced all-reduce)."""
    if group_size(tp_group) == 1:
        return
    grads = []
    for chunk in model_chunks:
        params = [p for p in chunk.parameters() if p.requires_grad and param_info(p).sequence_parallel]
        if getattr(chunk, "shard_grads", False):  # ZeRO-2: this rank's shard; TP ranks shard alike
            grads += [g for g in chunk.sharded_grad_views(params) if g.numel()]
        else:
            grads += [grad_of(p) if grad_of(p) is not None else _zeros(p) for p in params]
    if not grads:
        return
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype in sorted(by_dtype, key=str):  # same order on every TP rank
        group_grads = by_dtype[dtype]
        flat = _flatten_dense_tensors(group_grads)
        comm.all_reduce(flat, group=tp_group, kind="sp_grad_all_reduce", stats=comm_stats)
        for g, synced in zip(group_grads, _unflatten_dense_tensors(flat, group_grads)):
            g.copy_(synced)


def _find_shared_embedding(chunk: torch.nn.Module) -> Optional[torch.nn.Parameter]:
    """The parameter of ``chunk`` marked ``tied`` (at most one per chunk), or None."""
    tied = [p for p in unwrap_model(chunk).parameters() if param_info(p).tied]
    if len(tied) > 1:
        raise RuntimeError(f"a model chunk holds {len(tied)} parameters marked tied; expected at most one")
    return tied[0] if tied else None


def _embedding_stage(pg: ProcessGroups):
    """'first', 'last' or None (not in an embedding group of size > 1)."""
    if group_size(pg.pp) == 1 or pg.embd is None:
        return None
    stages, me = pg.ranks["pp"], dist.get_rank()
    if me == stages[0]:
        return "first"
    if me == stages[-1]:
        return "last"
    return None


def _tied(model_chunks: Sequence[torch.nn.Module], stage: str, weight, embd_group, comm_stats) -> bool:
    """Agree once over the embedding group whether embeddings are tied (cached on chunk 0)."""
    cached = getattr(model_chunks[0], "_megalm_tied_embeddings", None)
    if cached is not None:
        return cached
    knows = (stage == "last" and weight is not None) or any(
        getattr(unwrap_model(c), "share_embeddings_and_output_weights", False) for c in model_chunks
    )
    flag = torch.tensor([1.0 if knows else 0.0], device=get_device())
    comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=embd_group, kind="tie_flag", stats=comm_stats)
    tied = bool(flag.item() > 0)
    model_chunks[0]._megalm_tied_embeddings = tied
    return tied


def _check_own_bucket(chunk: torch.nn.Module, weight: torch.nn.Parameter) -> None:
    """With the distributed optimizer only the owned shard of a gradient is reduced, so the two
    stages must shard the tied weight alike: it must sit alone in its bucket (DDP puts a weight
    marked ``tied`` there)."""
    if not getattr(chunk, "use_distributed_optimizer", False):
        return
    for buf in chunk.all_buffers:
        if weight in buf.param_index_map and len(buf.bucket_of(weight).params) != 1:
            raise RuntimeError(
                "with the distributed optimizer the tied embedding weight needs a gradient bucket of "
                "its own: mark it with `set_param_info(param, tied=True)` on both pipeline stages"
            )


def allreduce_embedding_grads(
    model_chunks: Sequence[torch.nn.Module],
    tied: Optional[bool] = None,
    *,
    process_groups: ProcessGroups,
    comm_stats: Optional[comm.CommStats] = None,
) -> None:
    """Sum the tied word-embedding gradient over the embedding group (first + last stage)."""
    pg = process_groups
    stage = _embedding_stage(pg)
    if stage is None:
        return
    chunk = model_chunks[0] if stage == "first" else model_chunks[-1]
    weight = _find_shared_embedding(chunk)
    if tied is None:
        tied = _tied(model_chunks, stage, weight, pg.embd, comm_stats)
    if not tied:
        return
    if weight is None:
        raise RuntimeError(
            f"embeddings are tied but the {stage} pipeline stage has no tied embedding weight: mark it with "
            f"`megalm.tensor_parallel.param_info.set_param_info(param, tied=True)`"
        )
    _check_own_bucket(chunk, weight)
    grad = grad_of(weight)
    if grad is None:
        grad = weight.grad = torch.zeros_like(weight)  # unused this iteration: contribute zeros
    comm.all_reduce(grad, group=pg.embd, kind="embedding_grad_all_reduce", stats=comm_stats)


def finalize_model_grads(
    model_chunks: List[torch.nn.Module],
    tied_embeddings: Optional[bool] = None,
    timers=NULL_TIMERS,
    *,
    process_groups: ProcessGroups,
    comm_stats: Optional[comm.CommStats] = None,
) -> None:
    """DP sync, then sequence-parallel norm grads over TP, then tied embedding grads over the
    embedding group.  Call once per iteration, after the last backward, before ``optimizer.step()``.
    ``timers``: Megatron's level-1 ``all-grads-sync``, ``layernorm-grads-all-reduce`` and
    ``embedding-grads-all-reduce`` (:mod:`megalm.timers`).  ``comm_stats``: where the collectives made here are
    counted (the DP buckets count in their DDP's own); None: not counted."""
    pg = process_groups
    with timers("all-grads-sync"):
        for chunk in model_chunks:
            finish = getattr(chunk, "finish_grad_sync", None)
            if finish is not None:
                finish()
    with timers("layernorm-grads-all-reduce"):
        allreduce_sequence_parallel_grads(model_chunks, pg.tp, comm_stats)
    with timers("embedding-grads-all-reduce"):
        allreduce_embedding_grads(model_chunks, tied_embeddings, process_groups=pg, comm_stats=comm_stats)
    update_router_expert_biases(model_chunks, pg.tp_dp_cp, comm_stats)


def update_router_expert_biases(
    model_chunks: Sequence[torch.nn.Module], group, comm_stats: Optional[comm.CommStats] = None
) -> None:
    """``--moe-router-enable-expert-bias``: sum every router's token counts of this step over ``group``
    (TP x DP x CP: every rank that routes tokens of this stage; one all-reduce of layers x experts
    floats) and move each router's expert bias (``TopKRouter.update_expert_bias``)."""
    routers = [m for c in model_chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    if group_size(group) > 1:
        comm.all_reduce(counts, group=group, kind="expert_bias_counts", stats=comm_stats)
    for router, n in zip(routers, counts):
        router.update_expert_bias(n)
