"""Parallel layout arithmetic: which global ranks form each group (pure functions, no state).

Rank layout follows Megatron-LM's default order ``tp-cp-ep-dp-pp``: tensor-parallel
ranks are adjacent (fastest varying), pipeline stages are outermost.  Dense layers use
the ``tp-cp-dp-pp`` decomposition of the world; expert (MoE) layers re-split the ranks
of one pipeline stage (``tp * cp * dp`` of them) as ``etp-ep-edp`` (Megatron's expert order), so an
expert-data-parallel group holds the ranks that own the same expert shards:

* ``--expert-tensor-parallel-size`` ETP > 1: Megatron's expert layout with an expert-tensor group of
  ETP adjacent ranks, over which every expert's weights are split (``expert_tensor`` groups);
  ``edp = tp * cp * dp / (ETP * EP)``.
* ETP 1 (megalm's default): experts are whole on every rank, and the stage's ranks are split as
  ``tp-ep-edp``: the expert-parallel group joins ranks with the same tensor-parallel rank (the
  groups of Megatron's ETP = TP) and each TP rank runs whole experts on its own sequence slice
  (expert gradients are summed over TP, then over expert-DP, ``edp = cp * dp / EP``);
  ``expert_tensor`` groups are single ranks.

Example, world 8, tp 2, pp 2 (dp 2)::

    tensor groups:   [0,1] [2,3] [4,5] [6,7]
    data groups:     [0,2] [1,3] [4,6] [5,7]
    pipeline groups: [0,4] [1,5] [2,6] [3,7]

No communication: :mod:`megalm.parallel_state` creates the process groups from these lists
(and re-exports every name here, so ``parallel_state.compute_layout`` keeps working).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from megalm.errors import MegalmError


class NodeLayoutError(MegalmError, ValueError):
    """The ranks per node do not fit the world, or a group does not split evenly over nodes."""


class LayoutError(MegalmError, ValueError):
    """Parallel sizes that do not fit the world size (the flags ``--tensor-model-parallel-size`` ...
    named by their config field)."""


def node_split(members: Sequence[int], ranks_per_node: int) -> Tuple[List[List[int]], List[List[int]]]:
    """Split one group (global ranks, sorted) into its intra-node and inter-node groups.

    Node ``n`` holds global ranks ``n * ranks_per_node ... (n + 1) * ranks_per_node - 1`` (torchrun).
    Returns ``(intra, inter)``: ``intra[j]`` the members on the group's ``j``-th node, ``inter[i]``
    the ``i``-th member of every node.  With ``L`` members per node a member's group rank is
    ``j * L + i``.  Raises :class:`NodeLayoutError` when the nodes hold different numbers of members
    (hierarchical reduction needs equal shards on every node).
    """
    by_node: Dict[int, List[int]] = {}
    for r in sorted(members):
        by_node.setdefault(r // ranks_per_node, []).append(r)
    intra = [by_node[n] for n in sorted(by_node)]
    counts = {len(g) for g in intra}
    if len(counts) != 1:
        raise NodeLayoutError(
            f"group {list(members)} does not split evenly over nodes of {ranks_per_node} ranks "
            f"(members per node: {[len(g) for g in intra]}): hierarchical reduction needs the same number "
            f"of its ranks on every node; change the layout or drop --hierarchical-grad-reduce"
        )
    per_node = counts.pop()
    return intra, [[g[i] for g in intra] for i in range(per_node)]


def rank_groups(sizes: Dict[str, int], order: Sequence[str], group_dims: Sequence[str]) -> List[List[int]]:
    """All groups of ranks that vary only along ``group_dims``.

    ``order`` lists dimensions from fastest to slowest varying; a rank's coordinate along
    dimension ``order[i]`` is ``(rank // prod(sizes[order[:i]])) % sizes[order[i]]``.
    Within a group, ranks are listed with the first dimension of ``group_dims`` (by
    ``order``) varying fastest, as Megatron does.
    """
    strides, stride = {}, 1
    for name in order:
        strides[name] = stride
        stride *= sizes[name]
    inner = [d for d in order if d in group_dims]
    outer = [d for d in order if d not in group_dims]
    groups = []
    for outer_idx in itertools.product(*[range(sizes[d]) for d in reversed(outer)]):
        base = sum(i * strides[d] for i, d in zip(outer_idx, reversed(outer)))
        members = []
        for inner_idx in itertools.product(*[range(sizes[d]) for d in reversed(inner)]):
            members.append(base + sum(i * strides[d] for i, d in zip(inner_idx, reversed(inner))))
        groups.append(sorted(members))
    return groups


def validate_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    expert_tensor_parallel_size: int = 1,
) -> int:
    """Check that the layout fits ``world_size``; return the data-parallel size."""
    tp, pp, cp, ep, etp = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
    )
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ):
        if value < 1:
            raise LayoutError(f"{name} must be >= 1, got {value}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise LayoutError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel size = {model_parallel}"
        )
    dp = world_size // model_parallel
    if etp == 1 and (dp * cp) % ep != 0:
        raise LayoutError(
            f"expert_model_parallel_size {ep} must divide data ({dp}) x context ({cp}) parallel size "
            f"= {dp * cp} (world size {world_size}, tp {tp}, pp {pp})"
        )
    if etp > 1 and (tp * cp * dp) % (etp * ep) != 0:
        raise LayoutError(
            f"expert_tensor_parallel_size {etp} x expert_model_parallel_size {ep} = {etp * ep} must divide the "
            f"ranks of a pipeline stage: tensor ({tp}) x context ({cp}) x data ({dp}) = {tp * cp * dp} "
            f"(world size {world_size}, pp {pp})"
        )
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise LayoutError("virtual_pipeline_model_parallel_size must be >= 1")
        if pp < 2 and virtual_pipeline_model_parallel_size > 1:
            raise LayoutError("virtual pipeline stages need pipeline_model_parallel_size >= 2")
    return dp


def expert_sizes(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1) -> Dict[str, int]:
    """Sizes of the ``etp-ep-edp-pp`` decomposition of the expert layers (see the module docstring):
    ``etp`` is ETP when > 1, else TP (megalm's whole experts keep the TP ranks innermost)."""
    dp = validate_layout(world_size, tp, pp, cp, ep, expert_tensor_parallel_size=etp)
    return {"etp": etp if etp > 1 else tp, "ep": ep, "edp": expert_data_parallel_size(tp, cp, dp, ep, etp), "pp": pp}


def expert_data_parallel_size(tp: int, cp: int, dp: int, ep: int, etp: int = 1) -> int:
    """The stage's ranks (TP x CP x DP) / (ETP x EP); whole experts (ETP 1) keep the TP ranks innermost, so
    their expert-DP size is CP x DP / EP (the same experts, state replicated, on every TP rank)."""
    return tp * cp * dp // ((etp if etp > 1 else tp) * ep)


def compute_layout(
    world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1
) -> Dict[str, List[List[int]]]:
    """Every group of every kind, as lists of global ranks (pure function, no process group)."""
    dp = validate_layout(world_size, tp, pp, cp, ep, expert_tensor_parallel_size=etp)
    dense = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    order = ["tp", "cp", "dp", "pp"]
    layout = {
        "tensor": rank_groups(dense, order, ["tp"]),
        "context": rank_groups(dense, order, ["cp"]),
        "data": rank_groups(dense, order, ["dp"]),
        "data_context": rank_groups(dense, order, ["cp", "dp"]),
        "pipeline": rank_groups(dense, order, ["pp"]),
        "model": rank_groups(dense, order, ["tp", "pp"]),
        "tensor_context": rank_groups(dense, order, ["tp", "cp"]),
        "tensor_data_context": rank_groups(dense, order, ["tp", "cp", "dp"]),
    }
    expert = expert_sizes(world_size, tp, pp, cp, ep, etp)
    e_order = ["etp", "ep", "edp", "pp"]
    # The ranks an expert's weights are split over: single ranks when experts are whole (ETP 1).
    layout["expert_tensor"] = rank_groups(expert, e_order, ["etp"]) if etp > 1 else [[r] for r in range(world_size)]
    layout["expert"] = rank_groups(expert, e_order, ["ep"])
    layout["expert_data"] = rank_groups(expert, e_order, ["edp"])
    layout["expert_tensor_expert"] = rank_groups(expert, e_order, ["etp", "ep"])
    layout["expert_model"] = rank_groups(expert, e_order, ["etp", "ep", "pp"])
    # Embedding group: first and last stage of each pipeline (shares tied embeddings).
    layout["embedding"] = [sorted({g[0], g[-1]}) for g in layout["pipeline"]]
    layout["position_embedding"] = [[g[0]] for g in layout["pipeline"]]
    return layout


# ProcessGroups field -> the compute_layout kind it splits over nodes
NODE_SPLIT = {"dp_cp": "data_context", "expt_dp": "expert_data"}
NODE_FIELDS = tuple(f"{f}_{half}" for f in NODE_SPLIT for half in ("intra", "inter"))


def node_layout(layout: Dict[str, List[List[int]]], ranks_per_node: int) -> Dict[str, List[List[int]]]:
    """``{"dp_cp_intra": [...], "dp_cp_inter": [...], "expt_dp_*": ...}`` over every group that
    splits evenly over nodes (:func:`node_split`); the groups that do not are left out (their
    ranks get no node halves, and --hierarchical-grad-reduce refuses them)."""
    out: Dict[str, List[List[int]]] = {}
    for fld, kind in NODE_SPLIT.items():
        intra_all, inter_all = [], []
        for members in layout[kind]:
            try:
                intra, inter = node_split(members, ranks_per_node)
            except NodeLayoutError:
                continue
            intra_all += intra
            inter_all += inter
        out[f"{fld}_intra"], out[f"{fld}_inter"] = intra_all, inter_all
    return out


# ProcessGroups fields of --num-distributed-optimizer-instances (Megatron-core's intra / inter distributed
# optimizer instance groups)
INSTANCE_FIELDS = ("dp_cp_instance", "dp_cp_across_instances")


def instance_layout(layout: Dict[str, List[List[int]]], instances: int) -> Dict[str, List[List[int]]]:
    """``{"dp_cp_instance": [...], "dp_cp_across_instances": [...]}`` for ``--num-distributed-optimizer-instances
    N``: each data (x context) parallel group of ``K`` ranks (in group-rank order) cut into ``N`` instances of
    ``K / N`` consecutive members (a node when ``K / N`` is the ranks per node), and the ``N`` members with the
    same index in every instance.  A member of instance ``j`` at index ``i`` has group rank ``j K/N + i``.
    Empty for ``N == 1``.  Raises :class:`NodeLayoutError` when ``N`` does not divide ``K``."""
    if instances == 1:
        return {}
    within, across = [], []
    for members in layout["data_context"]:
        k = len(members)
        if instances < 1 or k % instances:
            raise NodeLayoutError(
                f"--num-distributed-optimizer-instances {instances} must divide the data-parallel (x context) size {k}"
            )
        per = k // instances
        chunks = [list(members[j * per : (j + 1) * per]) for j in range(instances)]
        within += chunks
        across += [[c[i] for c in chunks] for i in range(per)]
    return {"dp_cp_instance": within, "dp_cp_across_instances": across}
