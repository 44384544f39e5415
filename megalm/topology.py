"""Which process groups of a layout stay inside one node and which cross nodes (pure functions).

torchrun gives every node ``procs_per_node`` consecutive global ranks (node ``n`` holds ranks
``n * procs_per_node ... (n + 1) * procs_per_node - 1``), and Megatron's layout order
``tp-cp-ep-dp-pp`` (:func:`megalm.parallel_layout.compute_layout`) makes TP the fastest varying
dimension, so TP (then CP, EP) groups fall inside a node when they fit.  A group that crosses
nodes sends its collectives over the slow inter-node links::

    >>> topology_report(4, 2, tp=2)
    'topology: 2 nodes x 2 ranks (TP 2, CP 1, EP 1, DP 2, PP 1): DP group spans 2 nodes, TP group inside one node'

Nothing here communicates: it reads only the rank layout.  ``tools/estimate.py --procs-per-node``
prints the report; the training start-up log prints :func:`run_topology_report` (ranks per node
from torchrun's ``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from megalm.errors import MegalmError
from megalm.parallel_layout import compute_layout

# (report name, compute_layout kind): the groups a user chooses a layout by.
REPORTED_GROUPS = (
    ("TP", "tensor"),
    ("CP", "context"),
    ("expert-TP", "expert_tensor"),
    ("EP", "expert"),
    ("DP", "data"),
    ("expert-DP", "expert_data"),
    ("PP", "pipeline"),
)


class TopologyError(MegalmError):
    """The node shape does not fit the world (e.g. ranks per node does not divide the world size)."""


@dataclass
class TopologyOptions:
    """Flags of tools/estimate.py for the node layout."""

    procs_per_node: Optional[int] = field(
        default=None,
        metadata={
            "help": "Ranks per node (torchrun --nproc-per-node, GPUS_PER_NODE): also print which process groups "
            "stay inside one node and which span several nodes."
        },
    )


@dataclass(frozen=True)
class GroupSpan:
    """How the groups of one kind lie over nodes."""

    name: str  # report name ("TP", "DP", ...)
    size: int  # ranks per group
    max_nodes: int  # the most nodes any one group of this kind touches
    crossing: int  # how many groups of this kind touch more than one node
    count: int  # how many groups of this kind there are

    def describe(self) -> str:
        if self.max_nodes == 1:
            return f"{self.name} group inside one node"
        if self.crossing == self.count:
            return f"{self.name} group spans {self.max_nodes} nodes"
        return (
            f"{self.name} group spans up to {self.max_nodes} nodes ({self.crossing} of {self.count} groups cross nodes)"
        )


def node_of(rank: int, procs_per_node: int) -> int:
    """The node holding global ``rank`` (torchrun's consecutive ranks per node)."""
    return rank // procs_per_node


def nodes_of(ranks: Sequence[int], procs_per_node: int) -> List[int]:
    """The distinct nodes ``ranks`` live on, sorted."""
    return sorted({node_of(r, procs_per_node) for r in ranks})


def _check(world_size: int, procs_per_node: int) -> None:
    if procs_per_node < 1:
        raise TopologyError(f"ranks per node must be >= 1, got {procs_per_node}")
    if world_size % procs_per_node != 0:
        raise TopologyError(f"ranks per node ({procs_per_node}) does not divide the world size ({world_size})")


def group_spans(
    world_size: int, procs_per_node: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1
) -> Dict[str, GroupSpan]:
    """``{report name: GroupSpan}`` for every reported kind whose groups have more than one rank.

    Raises :class:`TopologyError` for a node shape that does not fit, and the layout's own
    ``ValueError`` (from :func:`compute_layout`) for a layout that does not fit the world."""
    _check(world_size, procs_per_node)
    layout = compute_layout(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    spans = {}
    for name, kind in REPORTED_GROUPS:
        groups = layout[kind]
        if len(groups[0]) < 2 or (kind == "expert_data" and ep == etp == 1):  # then it is the DP x CP group
            continue
        touched = [len(nodes_of(g, procs_per_node)) for g in groups]
        spans[name] = GroupSpan(name, len(groups[0]), max(touched), sum(n > 1 for n in touched), len(groups))
    return spans


def topology_report(
    world_size: int, procs_per_node: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1
) -> str:
    """One line: the node shape, the layout, then the groups that cross nodes followed by the
    node-local ones (each kind in the order TP, CP, expert-TP, EP, DP, expert-DP, PP)."""
    spans = group_spans(world_size, procs_per_node, tp, pp, cp, ep, etp)
    nodes = world_size // procs_per_node
    dp = world_size // (tp * pp * cp)
    plural = lambda n, word: f"{n} {word}{'s' if n > 1 else ''}"  # noqa: E731
    head = (
        f"topology: {plural(nodes, 'node')} x {plural(procs_per_node, 'rank')}"
        f" (TP {tp}, CP {cp}, EP {ep}{f', ETP {etp}' if etp > 1 else ''}, DP {dp}, PP {pp})"
    )
    ordered = [s for s in spans.values() if s.max_nodes > 1] + [s for s in spans.values() if s.max_nodes == 1]
    if not ordered:
        return f"{head}: a single rank, no process group"
    return f"{head}: " + ", ".join(s.describe() for s in ordered)


def run_topology_report(parallel, world_size: int, environ: Optional[Mapping[str, str]] = None) -> str:
    """:func:`topology_report` of a launched run with ``parallel`` (a ``ParallelConfig``): ranks
    per node from torchrun's ``LOCAL_WORLD_SIZE`` in ``environ`` (default ``os.environ``); without
    it (a single process, ``torch.multiprocessing.spawn``) the world is one node."""
    env = os.environ if environ is None else environ
    per_node = int(env.get("LOCAL_WORLD_SIZE", world_size))
    return topology_report(
        world_size,
        per_node,
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size or 1,
    )
