"""Rank layout against Megatron-LM's convention (order tp-cp-ep-dp-pp) and real process groups."""

import pytest
import torch
import torch.distributed as dist

from megalm import parallel_state as ps
from tests.distributed_harness import run_distributed


def test_layout_world8_tp2_pp2_matches_megatron():
    layout = ps.compute_layout(8, tp=2, pp=2)
    assert layout["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["position_embedding"] == [[0], [1], [2], [3]]


def test_layout_world8_tp2_pp1_ep2_expert_groups():
    layout = ps.compute_layout(8, tp=2, ep=2)
    assert layout["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["expert_tensor_expert"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_layout_world8_ep4_and_pp2_ep2():
    layout = ps.compute_layout(8, ep=4)
    assert layout["expert"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = ps.compute_layout(8, pp=2, ep=2)
    assert layout["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["expert"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["expert_data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_expert_tensor_parallel_layout_is_megatrons_etp_ep_edp():
    """ETP > 1: the stage's ranks split as etp-ep-edp (ETP fastest), independent of TP."""
    layout = ps.compute_layout(8, tp=1, ep=2, etp=2)
    assert layout["expert_tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["expert_tensor_expert"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    layout = ps.compute_layout(8, tp=2, pp=2, etp=2)  # ETP = TP: the TP groups
    assert layout["expert_tensor"] == layout["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["expert_data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["expert_model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    layout = ps.compute_layout(8, tp=2, etp=4)  # ETP > TP: two TP groups
    assert layout["expert_tensor"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = ps.compute_layout(8, tp=4, ep=2, etp=2)  # ETP < TP, EP inside one TP group
    assert layout["expert_tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # ETP 1 (experts whole): single ranks, and the groups of before (tp-ep-edp).
    layout = ps.compute_layout(8, tp=2, ep=2, etp=1)
    assert layout["expert_tensor"] == [[r] for r in range(8)]
    assert layout["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", [(8, 2, 1, 1, 2, 2), (8, 1, 2, 2, 2, 2), (16, 2, 2, 1, 1, 4)])
def test_expert_layout_sizes_follow_megatrons_formula(world, tp, pp, cp, ep, etp):
    """Expert DP = world / (PP x ETP x EP); every rank in exactly one group of each expert kind; the
    expert-model group (ETP x EP x PP) meets each expert-DP group in one rank."""
    layout = ps.compute_layout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    sizes = {"expert_tensor": etp, "expert": ep, "expert_data": world // (pp * etp * ep), "expert_model": etp * ep * pp}
    for kind, size in sizes.items():
        assert {len(g) for g in layout[kind]} == {size}, kind
        assert sorted(r for g in layout[kind] for r in g) == list(range(world)), kind
    for model in layout["expert_model"]:
        assert all(len(set(model) & set(data)) == 1 for data in layout["expert_data"])
    assert layout["pipeline"] == ps.compute_layout(world, tp=tp, pp=pp, cp=cp)["pipeline"]


def test_layout_world4():
    layout = ps.compute_layout(4, tp=2)
    assert layout["tensor"] == [[0, 1], [2, 3]]
    assert layout["data"] == [[0, 2], [1, 3]]
    assert layout["pipeline"] == [[0], [1], [2], [3]]
    layout = ps.compute_layout(4, pp=4)
    assert layout["pipeline"] == [[0, 1, 2, 3]]
    assert layout["embedding"] == [[0, 3]]
    layout = ps.compute_layout(4, tp=2, cp=2)
    assert layout["context"] == [[0, 2], [1, 3]]
    assert layout["tensor_context"] == [[0, 1, 2, 3]]


def test_every_rank_in_exactly_one_group_of_each_kind():
    for world, tp, pp, ep in [(8, 2, 2, 1), (8, 1, 2, 2), (8, 2, 1, 4), (4, 1, 1, 4)]:
        for name, groups in ps.compute_layout(world, tp=tp, pp=pp, ep=ep).items():
            flat = sorted(r for g in groups for r in g)
            if name not in ("embedding", "position_embedding"):
                assert flat == list(range(world)), (name, groups)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, tensor_model_parallel_size=4), "world size 6 is not divisible by tensor \\(4\\)"),
        (dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=3), "pipeline \\(3\\)"),
        (dict(world_size=4, expert_model_parallel_size=3), "expert_model_parallel_size 3 must divide"),
        (
            dict(world_size=8, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
            | dict(expert_tensor_parallel_size=4),
            "expert_tensor_parallel_size 4 x expert_model_parallel_size 2 = 8 must divide the ranks of a pipeline "
            "stage: tensor \\(1\\) x context \\(1\\) x data \\(4\\) = 4",
        ),
        (dict(world_size=4, expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be >= 1, got 0"),
        (dict(world_size=4, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2), "need"),
    ],
)
def test_layout_errors_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ps.validate_layout(**kwargs)


def _check_real_groups(tp, pp, ep):
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    rank = dist.get_rank()
    out = {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
        "edp": ps.get_expert_data_parallel_world_size(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "embedding": ps.is_rank_in_embedding_group(),
    }
    # A collective in each group sums the global ranks of its members.
    for key, group in [
        ("tp_sum", ps.get_tensor_model_parallel_group()),
        ("dp_sum", ps.get_data_parallel_group()),
        ("pp_sum", ps.get_pipeline_model_parallel_group()),
        ("ep_sum", ps.get_expert_model_parallel_group()),
        ("edp_sum", ps.get_expert_data_parallel_group()),
        ("mp_sum", ps.get_model_parallel_group()),
    ]:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[key] = t.item()
    ps.destroy_model_parallel()
    return out


def test_real_process_groups_world4():
    results = run_distributed(_check_real_groups, 4, args=(2, 2, 1), timeout=90)
    # tp2 pp2 dp1: tensor [0,1],[2,3]; pipeline [0,2],[1,3]
    assert [r["tp"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["pp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["dp"] for r in results] == [(0, 1)] * 4
    assert [r["first"] for r in results] == [True, True, False, False]
    assert [r["last"] for r in results] == [False, False, True, True]
    assert [r["tp_sum"] for r in results] == [1, 1, 5, 5]
    assert [r["pp_sum"] for r in results] == [2, 4, 2, 4]
    assert [r["mp_sum"] for r in results] == [6, 6, 6, 6]
    assert all(r["embedding"] for r in results)
