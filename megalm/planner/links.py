"""Time of one collective over the links its process groups cross (pure functions of the rank layout).

Ring model, as :mod:`megalm.distributed.comm` counts bytes: over a group of ``K`` ranks each rank sends
``2 (K-1)/K B`` for an all-reduce of ``B`` bytes, ``(K-1)/K B`` for an all-gather or reduce-scatter of the
full buffer (on gloo a reduce-scatter is an all-reduce on the wire: ``bench/collective_wire_bytes.py``), all
of it to its ring successor; an all-to-all sends block ``j`` of its input straight to group rank ``j``.

Every group of one kind communicates at the same time (all TP groups reduce together), so the node link is
shared by every ring hop that leaves the node: a rank whose successor sits on another node sends over it.
With ``c`` such hops leaving the busiest node, a ring runs at ``min(intra, inter / c)`` bytes/s (the
slowest hop sets the pace), and pays ``steps x latency`` (``2 (K-1)`` steps for an all-reduce, ``K-1``
otherwise) at the inter-node latency when it crosses nodes.  Every call (ring, all-to-all, send) also pays
``collective_call_us`` once: the launch and, on gloo under load, the blocked wait that wakes the process.
An all-to-all's time is the larger of its intra-node part over the device link and the busiest node's
outgoing bytes over the node link.

A node link shaped by a token bucket (the simulated cluster's ``tc tbf``: ``inter_node_burst_bytes``, 0 on
real links) passes the first ``burst`` bytes of a call at the device link's rate when the bucket is full, so a
call's bytes leaving the node cost ``max(0, bytes - burst) / rate``; the bucket refills at the link's rate
between calls, which :func:`megalm.planner.cost.step_cost` bounds for the whole step (a step cannot send more
than ``burst + rate x step`` bytes over the node link).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

from megalm.parallel_layout import compute_layout

RING_FACTOR = {"all_reduce": lambda k: 2 * (k - 1) / k, "all_gather": lambda k: (k - 1) / k}
RING_FACTOR["reduce_scatter"] = RING_FACTOR["all_gather"]


@dataclass(frozen=True)
class GroupLinks:
    """How the groups of one kind lie on nodes."""

    size: int  # ranks per group
    crosses: bool  # some group touches more than one node
    ring_senders: int  # ring hops leaving the busiest node (all groups of the kind together)
    a2a_share: float  # sum over the busiest node's members of the share of their all-to-all input sent off-node
    per_node: int  # members of one group on one node (the first group's first node)
    nodes: int  # nodes one group touches (the most)


def _links(groups: List[List[int]], per_node: int) -> GroupLinks:
    k = len(groups[0])
    senders: Dict[int, int] = {}
    share: Dict[int, float] = {}
    spanned = 1
    for g in groups:
        nodes = [r // per_node for r in g]
        spanned = max(spanned, len(set(nodes)))
        for i, node in enumerate(nodes):
            if nodes[(i + 1) % k] != node:
                senders[node] = senders.get(node, 0) + 1
            share[node] = share.get(node, 0.0) + sum(n != node for n in nodes) / k
    first = [r // per_node for r in groups[0]]
    senders_max, share_max = max(senders.values(), default=0), max(share.values(), default=0.0)
    return GroupLinks(k, spanned > 1, senders_max, share_max, first.count(first[0]), spanned)


@lru_cache(maxsize=4096)
def layout_links(
    world: int, per_node: int, tp: int, pp: int, cp: int, ep: int, etp: int, instances: int = 1
) -> Dict[str, GroupLinks]:
    """``{kind: GroupLinks}`` for the kinds of :func:`megalm.parallel_layout.compute_layout` the cost model
    uses (tensor, context, data_context, expert, expert_data, expert_tensor, pipeline, embedding, data, model,
    expert_model) and ``world`` (one group of every rank); with ``instances`` N > 1
    (``--num-distributed-optimizer-instances``) also ``instance`` (the DP x CP / N consecutive ranks the
    distributed optimizer shards over) and ``across_instances`` (the N ranks holding the same shard), as
    :func:`megalm.parallel_layout.instance_layout` builds them."""
    from megalm.parallel_layout import instance_layout

    layout = compute_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    kinds = ("tensor", "context", "data_context", "expert", "expert_data", "expert_tensor", "pipeline", "embedding")
    kinds += ("data", "model", "expert_model")
    out = {kind: _links(layout[kind], min(per_node, world)) for kind in kinds}
    out["world"] = _links([list(range(world))], min(per_node, world))
    split = instance_layout(layout, instances)
    for kind, key in (("instance", "dp_cp_instance"), ("across_instances", "dp_cp_across_instances")):
        if key in split:
            out[kind] = _links(split[key], min(per_node, world))
    return out


def ring_time(cluster, links: GroupLinks, op: str, nbytes: float, wire_factor: float = 1.0) -> Tuple[float, float]:
    """``(seconds, inter-node bytes sent by the busiest node)`` of one ring collective of ``nbytes``
    (the full buffer) over groups lying as ``links``; ``wire_factor`` scales the bytes (gloo's
    reduce-scatter: 2)."""
    k = links.size
    if k <= 1 or nbytes <= 0:
        return 0.0, 0.0
    sent = RING_FACTOR[op](k) * nbytes * wire_factor
    steps = (2 if op == "all_reduce" else 1) * (k - 1) * (2 if wire_factor > 1 else 1)
    intra = cluster.intra_node_bandwidth_gbps * 1e9
    call = cluster.collective_call_us * 1e-6
    if not links.crosses:
        return sent / intra + steps * cluster.intra_node_latency_us * 1e-6 + call, 0.0
    node_bytes = sent * max(1, links.ring_senders)
    wire = max(sent / intra, node_link_s(cluster, node_bytes))
    return wire + steps * cluster.inter_node_latency_us * 1e-6 + call, sent * links.ring_senders


def node_link_s(cluster, node_bytes: float) -> float:
    """Seconds for ``node_bytes`` leaving one node in one call over its link (the token bucket's burst, when
    the link has one, passes at once)."""
    return max(0.0, node_bytes - cluster.inter_node_burst_bytes) / (cluster.inter_node_bandwidth_gbps * 1e9)


def a2a_time(cluster, links: GroupLinks, nbytes: float) -> Tuple[float, float]:
    """``(seconds, inter-node bytes of the busiest node)`` of one all-to-all of ``nbytes`` input per rank."""
    k = links.size
    if k <= 1 or nbytes <= 0:
        return 0.0, 0.0
    intra = (k - 1) / k * nbytes / (cluster.intra_node_bandwidth_gbps * 1e9)
    call = cluster.collective_call_us * 1e-6
    if not links.crosses:
        return intra + (k - 1) * cluster.intra_node_latency_us * 1e-6 + call, 0.0
    off_node = links.a2a_share * nbytes
    inter = node_link_s(cluster, off_node)
    return max(intra, inter) + (k - 1) * cluster.inter_node_latency_us * 1e-6 + call, off_node


def p2p_time(cluster, links: GroupLinks, nbytes: float) -> Tuple[float, float]:
    """``(seconds, inter-node bytes)`` of one pipeline send of ``nbytes`` (every pipeline group at once; a
    stage boundary that crosses nodes carries every TP/DP rank's send over the node link)."""
    if links.size <= 1 or nbytes <= 0:
        return 0.0, 0.0
    call = cluster.collective_call_us * 1e-6
    if not links.crosses:
        return nbytes / (cluster.intra_node_bandwidth_gbps * 1e9) + cluster.intra_node_latency_us * 1e-6 + call, 0.0
    senders = max(1, links.ring_senders)
    # A pipeline group's hops leave a node once per boundary; every group crossing there shares the link.
    wire = max(nbytes / (cluster.intra_node_bandwidth_gbps * 1e9), node_link_s(cluster, nbytes * senders))
    return wire + cluster.inter_node_latency_us * 1e-6 + call, nbytes * senders
