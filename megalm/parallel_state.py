"""Process-group state: builds the :class:`ProcessGroups` bundle once, and the Megatron-named getters.

Which ranks form each group is computed by :mod:`megalm.parallel_layout` (pure functions,
re-exported here); :func:`initialize_model_parallel` creates the groups (``dist.new_group``,
collective over the world, once) and :func:`get_process_groups` returns this rank's bundle.

Who reads this module: the entry points only (``pretrain_gpt.py``, ``tools/``, and the
:class:`megalm.training.Trainer`'s set-up, which builds the bundle and passes it down).  Nothing
below them looks a group up: every layer, schedule, optimizer, DDP wrapper and data function takes
the groups it uses as a required argument (Megatron-core's ``pg_collection`` direction).  The
Megatron-named getters (``get_tensor_model_parallel_rank()``, ``is_pipeline_first_stage()``, ...)
stay for users and tools that know Megatron-LM; megalm's own code does not call them.  In
particular megalm never sets the virtual pipeline rank: a model chunk knows whether it is the first
or last stage (``pre_process`` / ``post_process``), and the interleaved schedule passes each chunk
its own data iterator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Dict, List, Optional

import torch.distributed as dist

from megalm.parallel_layout import (  # noqa: F401  (re-exported: parallel_state.compute_layout etc.)
    INSTANCE_FIELDS,
    NODE_FIELDS,
    NodeLayoutError,
    compute_layout,
    instance_layout,
    node_layout,
    node_split,
    rank_groups,
    validate_layout,
)
from megalm.process_groups import ProcessGroups, group_rank, group_size  # noqa: F401  (re-exported)

DEFAULT_TIMEOUT = timedelta(minutes=10)


def _ranks_per_node(world: int, ranks_per_node: Optional[int]) -> int:
    """Explicit value, else torchrun's ``LOCAL_WORLD_SIZE``, else one node."""
    value = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if value < 1 or world % value != 0:
        raise NodeLayoutError(f"ranks per node ({value}) must be >= 1 and divide the world size ({world})")
    return value


# compute_layout name -> ProcessGroups field
_FIELD_OF_LAYOUT = {
    "tensor": "tp",
    "context": "cp",
    "data": "dp",
    "data_context": "dp_cp",
    "pipeline": "pp",
    "model": "mp",
    "tensor_context": "tp_cp",
    "tensor_data_context": "tp_dp_cp",
    "expert": "ep",
    "expert_tensor": "etp",
    "expert_data": "expt_dp",
    "expert_tensor_expert": "tp_ep",
    "expert_model": "tp_ep_pp",
    "embedding": "embd",
    "position_embedding": "pos_embd",
}


# Kinds whose single-rank groups are None (this rank alone) rather than a process group of one.
_SINGLE_AS_NONE = frozenset(NODE_FIELDS) | frozenset(INSTANCE_FIELDS) | {"expert_tensor"}


@dataclass
class _State:
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    etp: int
    vpp: Optional[int]
    rank: int
    world: int
    groups: Dict[str, object]  # name -> ProcessGroup containing this rank
    ranks: Dict[str, List[int]]  # name -> ranks of that group (global ids)
    process_groups: ProcessGroups
    ranks_per_node: int
    virtual_pipeline_rank: Optional[int] = None


_STATE: Optional[_State] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    timeout: timedelta = DEFAULT_TIMEOUT,
    ranks_per_node: Optional[int] = None,
    expert_tensor_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
) -> None:
    """Create every process group of the layout.  ``torch.distributed`` must be initialized.

    ``expert_tensor_parallel_size`` (ETP): > 1 splits every expert over ETP adjacent ranks (Megatron's
    ``etp-ep-edp`` expert layout, :mod:`megalm.parallel_layout`); 1 keeps experts whole.

    ``ranks_per_node``: consecutive global ranks per node (default torchrun's ``LOCAL_WORLD_SIZE``,
    else one node); it places the intra-/inter-node halves of the data-parallel groups
    (:func:`node_split`) and the inter-node byte count of :mod:`megalm.distributed.comm`.

    ``num_distributed_optimizer_instances`` N > 1: also the instance groups of the distributed optimizer
    (:func:`instance_layout`: ``dp_cp_instance``, ``dp_cp_across_instances``)."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call megalm.initialize.initialize_distributed first")
    if _STATE is not None:
        raise RuntimeError("model parallel state is already initialized; call destroy_model_parallel() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = expert_tensor_parallel_size
    dp = validate_layout(world, tp, pp, cp, ep, virtual_pipeline_model_parallel_size, etp)
    per_node = _ranks_per_node(world, ranks_per_node)
    layout = compute_layout(world, tp, pp, cp, ep, etp)
    layout.update(node_layout(layout, per_node))
    layout.update(instance_layout(layout, num_distributed_optimizer_instances))
    groups, ranks = {}, {}
    for name, group_list in layout.items():
        for members in group_list:
            # new_group is collective: every rank creates every group, in the same order.
            if len(members) == 1 and name in _SINGLE_AS_NONE:
                pg = None  # this rank alone (only ever read through ProcessGroups)
            else:
                pg = dist.new_group(members, timeout=timeout) if len(members) < world else dist.group.WORLD
            if rank in members:
                groups[name], ranks[name] = pg, members
    vpp = virtual_pipeline_model_parallel_size
    field_of = {**_FIELD_OF_LAYOUT, **{n: n for n in NODE_FIELDS + INSTANCE_FIELDS}}
    bundle = ProcessGroups(
        **{field_of[name]: pg for name, pg in groups.items()},
        ranks=MappingProxyType({field_of[name]: tuple(members) for name, members in ranks.items()}),
    )
    _STATE = _State(
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        dp=dp,
        etp=etp,
        vpp=vpp,
        rank=rank,
        world=world,
        groups=groups,
        ranks=ranks,
        process_groups=bundle,
        ranks_per_node=per_node,
        virtual_pipeline_rank=0 if vpp else None,
    )


def get_process_groups() -> ProcessGroups:
    """This rank's :class:`ProcessGroups`; :meth:`ProcessGroups.single` before
    :func:`initialize_model_parallel` (a single process)."""
    return _STATE.process_groups if _STATE is not None else ProcessGroups.single()


def get_ranks_per_node() -> Optional[int]:
    """Consecutive global ranks per node given to :func:`initialize_model_parallel`; None before it."""
    return _STATE.ranks_per_node if _STATE is not None else None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the layout (process groups are released with the default group)."""
    global _STATE
    _STATE = None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("model parallel state is not initialized; call initialize_model_parallel first")
    return _STATE


def _group_rank(name: str) -> int:
    s = _state()
    return s.ranks[name].index(s.rank)


# --- tensor parallel -------------------------------------------------------------------


def get_tensor_model_parallel_group():
    return _state().groups["tensor"]


def get_tensor_model_parallel_world_size() -> int:
    return _state().tp if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _group_rank("tensor") if _STATE is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's tensor group (source of data broadcasts)."""
    return _state().ranks["tensor"][0]


def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_state().ranks["tensor"])


# --- pipeline parallel -----------------------------------------------------------------


def get_pipeline_model_parallel_group():
    return _state().groups["pipeline"]


def get_pipeline_model_parallel_world_size() -> int:
    return _state().pp if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return _group_rank("pipeline") if _STATE is not None else 0


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(_state().ranks["pipeline"])


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state().ranks["pipeline"]
    return ranks[(ranks.index(_state().rank) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state().ranks["pipeline"]
    return ranks[(ranks.index(_state().rank) - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _state().vpp if _STATE is not None else None


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _state().virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _state().virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage that owns the embedding (and, with virtual stages, chunk 0)."""
    if _STATE is None:
        return True
    if not ignore_virtual and _STATE.vpp and _STATE.virtual_pipeline_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage that owns the output layer and loss (with virtual stages, the last chunk)."""
    if _STATE is None:
        return True
    if not ignore_virtual and _STATE.vpp and _STATE.virtual_pipeline_rank != _STATE.vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == _STATE.pp - 1


# --- data / context parallel -----------------------------------------------------------


def get_data_parallel_group(with_context_parallel: bool = False):
    return _state().groups["data_context" if with_context_parallel else "data"]


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if _STATE is None:
        return 1
    return _STATE.dp * (_STATE.cp if with_context_parallel else 1)


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    if _STATE is None:
        return 0
    return _group_rank("data_context" if with_context_parallel else "data")


def get_data_parallel_ranks(with_context_parallel: bool = False) -> List[int]:
    return list(_state().ranks["data_context" if with_context_parallel else "data"])


def get_context_parallel_group():
    return _state().groups["context"]


def get_context_parallel_world_size() -> int:
    return _state().cp if _STATE is not None else 1


def get_context_parallel_rank() -> int:
    return _group_rank("context") if _STATE is not None else 0


def get_model_parallel_group():
    """Tensor x pipeline ranks holding one full model replica (used for found-inf and grad norm)."""
    return _state().groups["model"]


def get_model_parallel_world_size() -> int:
    return len(_state().ranks["model"]) if _STATE is not None else 1


def get_tensor_and_context_parallel_group():
    return _state().groups["tensor_context"]


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    """All ranks of one pipeline stage."""
    return _state().groups["tensor_data_context"]


# --- expert parallel -------------------------------------------------------------------


def get_expert_model_parallel_group():
    return _state().groups["expert"]


def get_expert_model_parallel_world_size() -> int:
    return _state().ep if _STATE is not None else 1


def get_expert_model_parallel_rank() -> int:
    return _group_rank("expert") if _STATE is not None else 0


def get_expert_tensor_parallel_group():
    """Ranks an expert's weights are split over (``--expert-tensor-parallel-size`` > 1); None when experts are
    whole (this rank alone)."""
    return _state().groups["expert_tensor"]


def get_expert_tensor_parallel_world_size() -> int:
    return _state().etp if _STATE is not None else 1


def get_expert_tensor_parallel_rank() -> int:
    return _group_rank("expert_tensor") if _STATE is not None else 0


def get_expert_data_parallel_group():
    """Ranks holding the same experts: expert gradients are reduced here."""
    return _state().groups["expert_data"]


def get_expert_data_parallel_world_size() -> int:
    return len(_state().ranks["expert_data"]) if _STATE is not None else 1


def get_expert_data_parallel_rank() -> int:
    return _group_rank("expert_data") if _STATE is not None else 0


def get_expert_tensor_and_model_parallel_group():
    """Tensor x expert ranks of one pipeline stage (the ranks an MoE layer's tokens travel between)."""
    return _state().groups["expert_tensor_expert"]


def get_expert_tensor_model_pipeline_parallel_group():
    """Tensor x expert x pipeline ranks: one full set of experts (the expert part of the grad norm)."""
    return _state().groups["expert_model"]


# --- embedding groups ------------------------------------------------------------------


def get_embedding_group():
    """First and last pipeline stage: tied word-embedding gradients are all-reduced here."""
    return _state().groups.get("embedding")


def get_embedding_ranks() -> List[int]:
    return list(_state().ranks.get("embedding", []))


def is_rank_in_embedding_group(ignore_virtual: bool = True) -> bool:
    s = _state()
    if s.rank not in s.ranks.get("embedding", []):
        return False
    if ignore_virtual:
        return True
    return is_pipeline_first_stage() or is_pipeline_last_stage()


def get_position_embedding_group():
    return _state().groups.get("position_embedding")


# --- checkpoint I/O ------------------------------------------------------------------------


def get_checkpoint_io_group():
    """A gloo group over the whole world for checkpoint writes in a background thread
    (``--async-save``): its collectives never interleave with the training's on other groups.

    Created on the first call, which is collective: every rank calls it at the same point (the
    Trainer's set-up, which gives it to its :class:`megalm.checkpoint.async_writer.AsyncCheckpointWriter`)."""
    s = _state()
    if "checkpoint_io" not in s.groups:
        members = list(range(s.world))
        s.groups["checkpoint_io"] = dist.new_group(members, backend="gloo", timeout=DEFAULT_TIMEOUT)
        s.ranks["checkpoint_io"] = members
    return s.groups["checkpoint_io"]


def get_all_group_ranks() -> Dict[str, List[int]]:
    """This rank's groups by name (for logging and tests)."""
    return {k: list(v) for k, v in _state().ranks.items()}
