"""Hierarchical (topology-aware) data-parallel collectives: ``--hierarchical-grad-reduce``.

A data-parallel group of ``K = n x L`` ranks on ``n`` nodes with ``L`` of its ranks each
(:func:`megalm.parallel_layout.node_split`) has an intra-node group (its ``L`` ranks on this node)
and an inter-node group (its ``n`` ranks with this rank's intra-node index ``i``, one per node);
a rank on the group's ``j``-th node has group rank ``r = j L + i``.  Each collective below is a
:class:`CollectiveChain` of asynchronous stages through the counted wrappers of
:mod:`megalm.distributed.comm`; only the inter-node stage crosses nodes.

All-reduce of a bucket of ``N`` elements (plain DDP), :func:`all_reduce`:

1. intra reduce-scatter: local rank ``i`` gets chunk ``i`` (``N/L``) summed over the node;
2. inter all-reduce of that chunk: ``2 (n-1)/n x N/L`` per rank over inter-node links
   (flat ring: ``2 (K-1)/K x N`` on the one link of each node that crosses);
3. intra all-gather of the chunks: every rank holds the whole reduced bucket.

Reduce-scatter to the flat shard (distributed optimizer), ``s = N/K``, :func:`reduce_scatter`:
the bucket viewed ``[n, L, s]`` is copied to a ``[L, n, s]`` scratch, so that chunk ``i`` holds
shard ``(j, i)`` of every node ``j``; (1) intra reduce-scatter of the scratch, (2) inter
reduce-scatter of chunk ``i`` (``(n-1)/n x N/L`` per rank across nodes; twice that on gloo, whose
reduce-scatter is an all-reduce: :mod:`megalm.distributed.comm`): rank ``(j, i)`` receives
exactly flat shard ``r`` of the bucket, as with the flat reduce-scatter.

All-gather from the flat shard (parameters), :func:`all_gather`: the inverse, (1) inter all-gather
of the shard into ``[n, s]``, (2) intra all-gather into ``[L, n, s]``, (3) copy back transposed.

Results equal the flat collectives up to the order of floating-point additions.

Distributed-optimizer instances (``--num-distributed-optimizer-instances``), :func:`instance_reduce`: the
bucket reduce-scattered inside the instance into this rank's shard, then the shard all-reduced across the
instances (the ranks holding the same shard); a chain of two stages as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from megalm.distributed import comm
from megalm.errors import MegalmError
from megalm.parallel_state import group_rank, group_size


class HierarchicalReduceError(MegalmError, ValueError):
    """The intra-/inter-node groups given do not factor the data-parallel group."""


@dataclass(frozen=True)
class NodeGroups:
    """The intra-node and inter-node halves of one data-parallel group (``None``: this rank alone)."""

    intra: Optional[object]
    inter: Optional[object]

    @property
    def local_size(self) -> int:  # L
        return group_size(self.intra)

    @property
    def num_nodes(self) -> int:  # n
        return group_size(self.inter)

    @property
    def local_rank(self) -> int:  # i
        return group_rank(self.intra)

    @property
    def node_rank(self) -> int:  # j
        return group_rank(self.inter)

    def check_factors(self, group, what: str) -> "NodeGroups":
        """Raise unless ``L x n`` is the size of ``group`` and ``j L + i`` this rank's rank in it."""
        size, rank = group_size(group), group_rank(group)
        if self.local_size * self.num_nodes != size or self.node_rank * self.local_size + self.local_rank != rank:
            raise HierarchicalReduceError(
                f"{what}: intra-node group of {self.local_size} x inter-node group of {self.num_nodes} ranks "
                f"(local index {self.local_rank}, node index {self.node_rank}) do not factor the data-parallel "
                f"group of {size} ranks (rank {rank}); build them with parallel_state.initialize_model_parallel"
            )
        return self


class CollectiveChain:
    """Dependent collectives run one stage after the other, each asynchronous.

    Every stage is a callable that launches one collective and returns its work handle (or does
    local work and returns None).  :meth:`advance` waits for the running stage and launches the
    next; :meth:`wait` runs the rest.  DDP advances earlier buckets' chains each time it launches a
    bucket (the same sequence on every rank, so every group sees its collectives in one order),
    which overlaps the later stages with the rest of the backward.
    """

    def __init__(self, stages: Sequence[Callable[[], object]]):
        self._stages: List[Callable[[], object]] = list(stages)
        self._work = None
        self.launched = 0

    @property
    def done(self) -> bool:
        return not self._stages and self._work is None

    def advance(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._stages:
            self._work = self._stages.pop(0)()
            self.launched += 1

    def advance_to(self, stage: int) -> None:
        """Launch stages until ``stage`` stages have been launched (or none is left)."""
        while self.launched < stage and self._stages:
            self.advance()

    def wait(self) -> None:
        while not self.done:
            self.advance()


def _skip():
    return None


def all_reduce(
    buf: torch.Tensor,
    nodes: NodeGroups,
    kind: str = "grad",
    inter: Optional[Callable[[torch.Tensor, int, int], List[Callable[[], object]]]] = None,
    *,
    stats: Optional[comm.CommStats],
) -> CollectiveChain:
    """SUM-all-reduce ``buf`` (numel divisible by L) in place; the first stage is launched.

    ``inter(chunk, lo, hi)`` (gradient compression): the stages that SUM-all-reduce ``chunk`` (``buf[lo:hi]``)
    over ``nodes.inter`` in place of the exact inter-node all-reduce (the intra-node legs stay exact)."""
    L, i = nodes.local_size, nodes.local_rank
    c = buf.numel() // L
    chunk = buf[i * c : (i + 1) * c]
    if inter is not None and nodes.inter is not None:
        across = inter(chunk, i * c, (i + 1) * c)
    else:
        across = [
            (
                lambda: comm.all_reduce(
                    chunk, group=nodes.inter, async_op=True, kind=f"{kind}_all_reduce_inter", stats=stats
                )
            )
            if nodes.inter is not None
            else _skip
        ]
    stages = [
        (
            lambda: comm.reduce_scatter_tensor(
                chunk, buf, group=nodes.intra, async_op=True, kind=f"{kind}_reduce_scatter_intra", stats=stats
            )
        )
        if nodes.intra is not None
        else _skip,
        *across,
        (
            lambda: comm.all_gather_into_tensor(
                buf, chunk, group=nodes.intra, async_op=True, kind=f"{kind}_all_gather_intra", stats=stats
            )
        )
        if nodes.intra is not None
        else _skip,
    ]
    chain = CollectiveChain(stages)
    chain.advance()
    return chain


def reduce_scatter(
    buf: torch.Tensor, shard: torch.Tensor, nodes: NodeGroups, kind: str = "grad", *, stats: Optional[comm.CommStats]
) -> CollectiveChain:
    """``shard`` (this rank's flat shard, numel/K) <- the SUM of ``buf`` over the group; first stage launched."""
    n, L, i = nodes.num_nodes, nodes.local_size, nodes.local_rank
    s = shard.numel()
    scratch = buf.view(n, L, s).transpose(0, 1).contiguous() if L > 1 else buf.view(1, n * s)
    mine = scratch[i].view(-1)  # n x s: shard (j, i) of every node j

    def inter():
        if nodes.inter is None:
            shard.copy_(mine)
            return None
        return comm.reduce_scatter_tensor(
            shard, mine, group=nodes.inter, async_op=True, kind=f"{kind}_reduce_scatter_inter", stats=stats
        )

    stages = [
        (
            lambda: comm.reduce_scatter_tensor(
                mine,
                scratch.view(-1),
                group=nodes.intra,
                async_op=True,
                kind=f"{kind}_reduce_scatter_intra",
                stats=stats,
            )
        )
        if nodes.intra is not None
        else _skip,
        inter,
    ]
    chain = CollectiveChain(stages)
    chain.advance()
    return chain


def all_gather(
    buf: torch.Tensor, shard: torch.Tensor, nodes: NodeGroups, kind: str = "param", *, stats: Optional[comm.CommStats]
) -> CollectiveChain:
    """``buf`` <- every rank's flat shard (``shard`` is this rank's, a view into ``buf``); first stage launched."""
    n, L = nodes.num_nodes, nodes.local_size
    s = shard.numel()
    across = torch.empty(n * s, dtype=buf.dtype, device=buf.device) if nodes.inter is not None else shard
    local = torch.empty(L * n * s, dtype=buf.dtype, device=buf.device) if nodes.intra is not None else across

    def copy_back():
        buf.view(n, L, s).copy_(local.view(L, n, s).transpose(0, 1))

    stages = [
        (
            lambda: comm.all_gather_into_tensor(
                across, shard, group=nodes.inter, async_op=True, kind=f"{kind}_all_gather_inter", stats=stats
            )
        )
        if nodes.inter is not None
        else _skip,
        (
            lambda: comm.all_gather_into_tensor(
                local, across, group=nodes.intra, async_op=True, kind=f"{kind}_all_gather_intra", stats=stats
            )
        )
        if nodes.intra is not None
        else _skip,
        copy_back,
    ]
    chain = CollectiveChain(stages)
    chain.advance()
    return chain


def instance_reduce(
    shard: torch.Tensor, full: torch.Tensor, group, across, *, stats: Optional[comm.CommStats]
) -> CollectiveChain:
    """``shard`` <- the SUM of ``full`` over ``group`` (one instance; None: a rank alone, whose ``shard``
    already holds its bucket), then SUM-all-reduced over ``across`` (the other instances); first stage launched."""
    stages = []
    if group is not None:
        stages.append(
            lambda: comm.reduce_scatter_tensor(
                shard, full, group=group, async_op=True, kind="grad_reduce_scatter", stats=stats
            )
        )
    stages.append(
        lambda: comm.all_reduce(
            shard, group=across, async_op=True, kind="grad_all_reduce_across_instances", stats=stats
        )
    )
    chain = CollectiveChain(stages)
    chain.advance()
    return chain
