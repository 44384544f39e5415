"""The :class:`ProcessGroups` bundle a rank passes to whatever communicates, and :func:`group_size` /
:func:`group_rank` for any of its fields.  :mod:`megalm.parallel_state` builds it (and re-exports these names)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import List, Mapping, Optional, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank, built once and passed to whatever communicates.

    Layers, mappings, DDP, the optimizers, schedules and p2p take the group(s) they use as
    arguments (Megatron-core's ``tp_group=`` / ``ProcessGroupCollection`` direction) instead of
    reading globals.  A field that is ``None`` stands for a group holding this rank alone: its
    collectives are identities, so :meth:`single` serves a single process without
    ``torch.distributed``.  :func:`group_size` and :func:`group_rank` read any field.

    ``ranks`` maps each field name to the global ranks of that group, in group-rank order.
    ``embd`` and ``pos_embd`` are ``None`` on ranks outside them (middle pipeline stages):
    ``"embd" in ranks`` tells membership.
    """

    tp: Optional[object] = None  # tensor parallel
    cp: Optional[object] = None  # context parallel
    dp: Optional[object] = None  # data parallel (dense parameters)
    dp_cp: Optional[object] = None  # data x context parallel (dense gradient reduction)
    pp: Optional[object] = None  # pipeline stages of one model replica
    mp: Optional[object] = None  # tensor x pipeline: one model replica (grad norm, found-inf)
    tp_cp: Optional[object] = None  # tensor x context
    tp_dp_cp: Optional[object] = None  # every rank of one pipeline stage
    ep: Optional[object] = None  # expert parallel
    etp: Optional[object] = None  # expert tensor parallel: the ranks an expert's weights are split over (ETP > 1)
    expt_dp: Optional[object] = None  # expert data parallel (expert gradient reduction)
    tp_ep: Optional[object] = None  # expert-tensor (or, experts whole, tensor) x expert: an MoE layer's ranks
    tp_ep_pp: Optional[object] = None  # tp_ep x pipeline: one full set of experts (expert part of the grad norm)
    embd: Optional[object] = None  # first and last pipeline stage (tied embedding grads)
    pos_embd: Optional[object] = None  # first pipeline stage (position embedding)
    # Node-aware halves of dp_cp / expt_dp (--hierarchical-grad-reduce, see parallel_layout.node_split): the group's
    # ranks on this node, and its ranks with this rank's intra-node index on the other nodes.
    # Absent from ``ranks`` when the group does not split evenly over nodes.
    dp_cp_intra: Optional[object] = None
    dp_cp_inter: Optional[object] = None
    expt_dp_intra: Optional[object] = None
    expt_dp_inter: Optional[object] = None
    # --num-distributed-optimizer-instances N > 1 (parallel_layout.instance_layout): the DP x CP / N consecutive
    # ranks of dp_cp the distributed optimizer shards over (one instance), and the N ranks holding the same shard
    # (one per instance), over which the reduce-scattered gradient shard is all-reduced.  Absent from ``ranks``
    # when N is 1.
    dp_cp_instance: Optional[object] = None
    dp_cp_across_instances: Optional[object] = None
    ranks: Mapping[str, Tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def single(cls) -> "ProcessGroups":
        """Every group is this process alone (no ``torch.distributed`` needed)."""
        return cls()

    def __deepcopy__(self, memo) -> "ProcessGroups":
        """Immutable and naming this rank's groups: a deep-copied model shares them."""
        return self

    def group_names(self) -> List[str]:
        return [f.name for f in fields(self) if f.name != "ranks"]


def group_size(group) -> int:
    """Size of ``group``; 1 for ``None`` (this rank alone)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for ``None`` (this rank alone)."""
    return 0 if group is None else dist.get_rank(group)
