"""Counted collectives: every gradient / optimizer collective in megalm goes through here.

Each wrapper records the call in the :class:`CommStats` its caller hands it (``stats=``; ``None``:
not counted) and then calls ``torch.distributed`` (looked up at call time, so tests may patch it).
The Trainer creates one :class:`CommStats` and passes it to whatever it builds that communicates
(DDP, the optimizer, ``finalize_model_grads``, local SGD, the loss checks); benchmarks and tests
create their own and read it.

Byte counts kept per operation kind:

* ``tensor_bytes``: size of the tensor handed to the collective (for all-gather the output).
* ``wire_bytes``: bytes each rank sends under the ring model, for a buffer of ``B`` bytes over
  ``K`` ranks: all-reduce ``2 (K-1)/K B``; reduce-scatter and all-gather ``(K-1)/K B`` of the
  full (unsharded) buffer; broadcast ``B`` (upper bound).
* ``sent_bytes``: what the backend really sends: ``wire_bytes``, except for gloo's reduce-scatter,
  which is an all-reduce of the whole input of which each rank keeps its shard (torch's
  ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``; measured: ``bench/collective_wire_bytes.py``),
  so ``2 (K-1)/K B`` (NCCL's reduce-scatter follows the ring).

* ``inter_node_bytes``: of ``sent_bytes``, those sent over a link between two nodes.  Under the
  ring model a rank sends everything to its successor in the group (group-rank order, wrapping
  around), so the count is ``sent_bytes`` when that successor is on another node and 0 otherwise
  (node of a global rank: ``rank // ranks_per_node``, the layout's value the :class:`CommStats` was
  built with, else torchrun's ``LOCAL_WORLD_SIZE``).  A flat
  all-reduce of ``B`` bytes over ``n`` nodes of ``L`` consecutive ranks thus sends ``2 (nL-1)/(nL) B``
  per node across nodes; the hierarchical one (:mod:`megalm.distributed.hierarchical`)
  ``2 (n-1)/n B``.  :func:`inter_node_bytes_per_node` sums them per node for the log line.
  All-to-all is not a ring: a rank sends block ``j`` of its input straight to group rank ``j``, so
  ``wire_bytes`` (= ``sent_bytes``) is ``(K-1)/K`` of its input and ``inter_node_bytes`` the blocks whose destination
  is on another node.

Groups of size 1 are not communicated over: the wrappers return at once and count nothing.
``group=None`` means torch's default (world) group here, as in ``torch.distributed``; callers
holding a :class:`megalm.parallel_state.ProcessGroups` field that is ``None`` (this rank alone)
do not call these wrappers at all.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megalm.tensor_parallel.utils import all_gather_flat, reduce_scatter_flat


@dataclass
class CollectiveStats:
    calls: int = 0
    tensor_bytes: int = 0
    wire_bytes: float = 0.0
    sent_bytes: float = 0.0
    inter_node_bytes: float = 0.0


def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def ranks_per_node(layout_value: Optional[int] = None) -> int:
    """Consecutive global ranks per node: ``layout_value`` (the layout's,
    :func:`megalm.parallel_state.get_ranks_per_node`, read by the entry point), else ``LOCAL_WORLD_SIZE``,
    else the world."""
    if layout_value is not None:
        return layout_value
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def sends_across_nodes(group_ranks, rank: int, per_node: int) -> bool:
    """Whether ``rank``'s ring successor in ``group_ranks`` (group-rank order) is on another node."""
    members = list(group_ranks)
    successor = members[(members.index(rank) + 1) % len(members)]
    return successor // per_node != rank // per_node


def _members(group) -> list:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


class CommStats:
    """Calls and bytes per collective kind (``{kind: CollectiveStats}``), counted by the wrappers of this
    module that are handed it.  Thread-safe (the bucket hooks of the backward pass record from autograd's
    threads).  ``ranks_per_node``: the layout's consecutive global ranks per node (None: ``LOCAL_WORLD_SIZE``,
    else the world), which decides the inter-node bytes."""

    def __init__(self, ranks_per_node: Optional[int] = None):
        self.layout_ranks_per_node = ranks_per_node
        self._lock = threading.Lock()
        self._kinds: Dict[str, CollectiveStats] = {}

    def record(
        self, kind: str, nbytes: int, wire: float, group, inter: Optional[float] = None, sent: Optional[float] = None
    ) -> None:
        """Count one call; ``sent``: the bytes sent when not ``wire``; ``inter``: its inter-node bytes when not
        the ring model's."""
        sent = wire if sent is None else sent
        if inter is None:
            across = sends_across_nodes(_members(group), dist.get_rank(), self.ranks_per_node())
            inter = float(sent) if across else 0.0
        with self._lock:
            s = self._kinds.setdefault(kind, CollectiveStats())
            s.calls += 1
            s.tensor_bytes += int(nbytes)
            s.wire_bytes += float(wire)
            s.sent_bytes += float(sent)
            s.inter_node_bytes += float(inter)

    def ranks_per_node(self) -> int:
        return ranks_per_node(self.layout_ranks_per_node)

    def get(self) -> Dict[str, dict]:
        """``{kind: {"calls", "tensor_bytes", "wire_bytes", "sent_bytes", "inter_node_bytes"}}`` since the last
        reset (a copy)."""
        with self._lock:
            return {k: asdict(v) for k, v in self._kinds.items()}

    def total_calls(self) -> int:
        with self._lock:
            return sum(v.calls for v in self._kinds.values())

    def reset(self) -> None:
        with self._lock:
            self._kinds.clear()

    def take_inter_node_bytes(self) -> float:
        """This rank's ``inter_node_bytes`` over every kind since the last call (then zeroed)."""
        with self._lock:
            mine = sum(v.inter_node_bytes for v in self._kinds.values())
            for v in self._kinds.values():
                v.inter_node_bytes = 0.0
        return mine


def _record(stats: Optional[CommStats], *args, **kwargs) -> None:
    if stats is not None:
        stats.record(*args, **kwargs)


def inter_node_bytes_per_node(stats: CommStats) -> List[float]:
    """Bytes each node's ranks sent over inter-node links (index: node) since the last call, read from
    ``stats`` (whose ``inter_node_bytes`` are zeroed: the log line's interval).

    Collective over the world when there are several nodes (one SUM-all-reduce of ``nodes``
    float64 values, not counted): every rank calls it at the same point (the log line)."""
    mine = stats.take_inter_node_bytes()
    if not dist.is_available() or not dist.is_initialized():
        return [mine]
    per_node, world = stats.ranks_per_node(), dist.get_world_size()
    if per_node >= world:
        return [mine]
    counts = torch.zeros(world // per_node, dtype=torch.float64)
    counts[dist.get_rank() // per_node] = mine
    dist.all_reduce(counts)
    return counts.tolist()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor,
    op=dist.ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    kind: str = "all_reduce",
    *,
    stats: Optional[CommStats],
):
    """In-place all-reduce over ``group``; returns a work handle when ``async_op`` (else None)."""
    k = _group_size(group)
    if k == 1:
        return None
    b = _nbytes(tensor)
    _record(stats, kind, b, 2.0 * (k - 1) / k * b, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op=dist.ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    kind: str = "reduce_scatter",
    *,
    stats: Optional[CommStats],
):
    """``output`` (1/K of ``input``) receives this rank's shard of the reduced ``input``."""
    k = _group_size(group)
    if k == 1:
        output.copy_(input)
        return None
    b = _nbytes(input)
    ring = (k - 1) / k * b
    _record(stats, kind, b, ring, group, sent=reduce_scatter_sends(group) * ring)
    return reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op)


def reduce_scatter_sends(group) -> int:
    """What a reduce-scatter over ``group`` sends, in units of the ring's ``(K-1)/K B``: 2 on gloo (an
    all-reduce of the whole input, see the module docstring), else 1."""
    return 2 if dist.get_backend(group) == "gloo" else 1


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    kind: str = "all_gather",
    *,
    stats: Optional[CommStats],
):
    """``output`` (K x ``input``) receives every rank's ``input`` in rank order."""
    k = _group_size(group)
    if k == 1:
        output.copy_(input)
        return None
    b = _nbytes(output)
    _record(stats, kind, b, (k - 1) / k * b, group)
    return all_gather_flat(output, input, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group=None,
    async_op: bool = False,
    kind: str = "broadcast",
    *,
    stats: Optional[CommStats],
):
    """Broadcast from global rank ``src`` to ``group``."""
    k = _group_size(group)
    if k == 1:
        return None
    b = _nbytes(tensor)
    _record(stats, kind, b, b, group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    async_op: bool = False,
    kind: str = "all_to_all",
    *,
    stats: Optional[CommStats],
):
    """``output`` block ``j`` (of ``K`` equal blocks) receives block ``r`` of group rank ``j``'s ``input``
    (``r``: this rank).  Sends ``(K-1)/K`` of ``input``; across nodes the blocks for other nodes' ranks."""
    k = _group_size(group)
    if k == 1:
        output.copy_(input)
        return None
    if stats is not None:
        b, per_node, me = _nbytes(input), stats.ranks_per_node(), dist.get_rank()
        away = sum(1 for r in _members(group) if r // per_node != me // per_node)
        stats.record(kind, b, (k - 1) / k * b, group, inter=away / k * b)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)
