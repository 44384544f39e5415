"""megalm.topology: which process groups of a layout stay inside one node, asserted exactly for
several layouts, its errors, and the line ``tools/estimate.py --procs-per-node`` prints."""

import os
import subprocess
import sys

import pytest

from megalm.config.sections import ParallelConfig
from megalm.errors import MegalmError
from megalm.estimate.cli import main as estimate_main
from megalm.topology import GroupSpan, TopologyError, group_spans, nodes_of, run_topology_report, topology_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REPORTS = [
    # (world, ranks per node, tp, pp, cp, ep) -> the exact line
    (
        (4, 2, 2, 1, 1, 1),
        "topology: 2 nodes x 2 ranks (TP 2, CP 1, EP 1, DP 2, PP 1): DP group spans 2 nodes, TP group inside one node",
    ),
    ((4, 2, 1, 1, 1, 1), "topology: 2 nodes x 2 ranks (TP 1, CP 1, EP 1, DP 4, PP 1): DP group spans 2 nodes"),
    ((4, 4, 1, 1, 1, 1), "topology: 1 node x 4 ranks (TP 1, CP 1, EP 1, DP 4, PP 1): DP group inside one node"),
    (
        (4, 2, 2, 2, 1, 1),
        "topology: 2 nodes x 2 ranks (TP 2, CP 1, EP 1, DP 1, PP 2): PP group spans 2 nodes, TP group inside one node",
    ),
    (
        (8, 4, 2, 2, 1, 1),
        "topology: 2 nodes x 4 ranks (TP 2, CP 1, EP 1, DP 2, PP 2): "
        "PP group spans 2 nodes, TP group inside one node, DP group inside one node",
    ),
    (
        (8, 2, 2, 2, 1, 1),
        "topology: 4 nodes x 2 ranks (TP 2, CP 1, EP 1, DP 2, PP 2): "
        "DP group spans 2 nodes, PP group spans 2 nodes, TP group inside one node",
    ),
    (
        (8, 2, 2, 2, 2, 1),
        "topology: 4 nodes x 2 ranks (TP 2, CP 2, EP 1, DP 1, PP 2): "
        "CP group spans 2 nodes, PP group spans 2 nodes, TP group inside one node",
    ),
    # TP does not fit a 3-rank node: one TP group of three crosses (a layout to avoid).
    (
        (6, 3, 2, 1, 1, 1),
        "topology: 2 nodes x 3 ranks (TP 2, CP 1, EP 1, DP 3, PP 1): "
        "TP group spans up to 2 nodes (1 of 3 groups cross nodes), DP group spans 2 nodes",
    ),
    (
        (8, 4, 1, 1, 1, 4),
        "topology: 2 nodes x 4 ranks (TP 1, CP 1, EP 4, DP 8, PP 1): "
        "DP group spans 2 nodes, expert-DP group spans 2 nodes, EP group inside one node",
    ),
    ((16, 2, 1, 1, 1, 1), "topology: 8 nodes x 2 ranks (TP 1, CP 1, EP 1, DP 16, PP 1): DP group spans 8 nodes"),
    ((1, 1, 1, 1, 1, 1), "topology: 1 node x 1 rank (TP 1, CP 1, EP 1, DP 1, PP 1): a single rank, no process group"),
]


@pytest.mark.parametrize("shape, expected", REPORTS, ids=[str(s) for s, _ in REPORTS])
def test_report_text(shape, expected):
    world, per_node, tp, pp, cp, ep = shape
    assert topology_report(world, per_node, tp=tp, pp=pp, cp=cp, ep=ep) == expected


def test_spans_counts():
    spans = group_spans(6, 3, tp=2)
    assert spans == {"TP": GroupSpan("TP", 2, 2, 1, 3), "DP": GroupSpan("DP", 3, 2, 2, 2)}
    # Megatron's order keeps TP inside a node whenever TP divides the ranks per node.
    for world, per_node, tp, pp in ((8, 4, 2, 2), (16, 8, 8, 2), (16, 4, 4, 1), (32, 8, 2, 4)):
        assert group_spans(world, per_node, tp=tp, pp=pp)["TP"].max_nodes == 1
    assert nodes_of([1, 2, 5], 2) == [0, 1, 2]


def test_expert_tensor_parallel_groups_are_reported():
    """ETP 2 inside a node, expert DP (world / ETP) across nodes; ETP 4 x EP 2 at TP 2: expert-TP crosses."""
    assert topology_report(8, 4, etp=2) == (
        "topology: 2 nodes x 4 ranks (TP 1, CP 1, EP 1, ETP 2, DP 8, PP 1): "
        "DP group spans 2 nodes, expert-DP group spans 2 nodes, expert-TP group inside one node"
    )
    spans = group_spans(8, 2, tp=2, ep=2, etp=4)
    assert spans["expert-TP"] == GroupSpan("expert-TP", 4, 2, 2, 2) and "expert-DP" not in spans


def test_bad_shapes_raise():
    with pytest.raises(TopologyError, match=r"ranks per node \(3\) does not divide the world size \(8\)"):
        topology_report(8, 3)
    with pytest.raises(TopologyError, match="must be >= 1"):
        topology_report(8, 0)
    assert issubclass(TopologyError, MegalmError)
    with pytest.raises(ValueError, match="not divisible"):
        topology_report(6, 2, tp=4)


def test_run_report_reads_torchrun_local_world_size():
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert run_topology_report(parallel, 8, {"LOCAL_WORLD_SIZE": "4"}) == (
        "topology: 2 nodes x 4 ranks (TP 2, CP 1, EP 1, DP 2, PP 2): "
        "PP group spans 2 nodes, TP group inside one node, DP group inside one node"
    )
    assert run_topology_report(parallel, 8, {}) == (
        "topology: 1 node x 8 ranks (TP 2, CP 1, EP 1, DP 2, PP 2): "
        "TP group inside one node, DP group inside one node, PP group inside one node"
    )
    with pytest.raises(TopologyError):
        run_topology_report(parallel, 8, {"LOCAL_WORLD_SIZE": "3"})


def test_estimate_prints_topology(capsys):
    flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--micro-batch-size",
        "1",
        "--vocab-size",
        "128",
        "--tensor-model-parallel-size",
        "2",
        "--world-size",
        "8",
        "--device",
        "cpu",
    ]
    assert estimate_main(flags + ["--procs-per-node", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "topology: 2 nodes x 4 ranks (TP 2, CP 1, EP 1, DP 4, PP 1): DP group spans 2 nodes, TP group inside one node"
    )
    assert estimate_main(flags) == 0
    assert not any(line.startswith("topology:") for line in capsys.readouterr().out.splitlines())


def test_estimate_tool_refuses_bad_node_shape():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "estimate.py"),
            "--preset",
            "gpt_tiny_cpu",
            "--device",
            "cpu",
            "--procs-per-node",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "[megalm] error: ranks per node (3) does not divide the world size (4)"
