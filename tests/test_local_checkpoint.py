"""Local checkpoints replicated to another node (issue #32): ``--non-persistent-ckpt-type local
--replication`` (:mod:`megalm.checkpoint.local`).

One spawned group of 3 ranks, each its own "node" (``MEGALM_NODE_NAME``, a node directory each),
``--replication-factor 3`` (every node holds every shard):

1. a run saves local checkpoints every 2 iterations and disk checkpoints every 3, and crashes in
   iteration 7 (local and disk both hold iteration 6);
2. nodes 1 and 2 lose their RAM (their node directories are removed: with 2 copies, rank 1's
   shard would be lost with them), and a run whose ``--load`` is empty restores iteration 6 from
   the local checkpoints: ranks 1 and 2 receive their shards from rank 0, whose node holds their
   replicas (the log names the bytes and the rank);
3. a run loads the disk checkpoint of the same iteration (``--ckpt-step 6``).

The runs of 2 and 3 log iterations 7 and 8 with the same losses and gradient norms, bit for bit
(dropout on: the RNG is restored too), and the same consumed samples.  A fourth run with both ranks
on one node and ``--replication`` stops before training, naming the problem.
"""

import logging
import os
import shutil

import pytest
import torch

from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.local import Held, choose_restore, fill_blocks, shard_file_name
from megalm.config import parse_config
from megalm.errors import TrainingStopped
from megalm.param_layout import ShardedTensorSpec
from tests.distributed_harness import run_distributed
from tests.training_runs import records, run_trainings, tiny_flags

TINY = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="128",
    micro_batch_size="2",
    global_batch_size="6",
    hidden_dropout="0.1",
    use_distributed_optimizer=True,
    seed="3",
)
RUN_ID = "local-ckpt-test"


def _crash_at(n):
    import pretrain_gpt

    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == n:
            raise TrainingStopped("simulated crash", exit_code=3)
        return pretrain_gpt.forward_step(data_iterator, model)

    return step


def _scenario(tmp):
    import torch.distributed as dist

    import pretrain_gpt

    rank = dist.get_rank()
    os.environ["TORCHELASTIC_RUN_ID"] = RUN_ID
    os.environ["MEGALM_NODE_NAME"] = f"node{rank}"
    shm = os.path.join(tmp, "shm")
    local = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", shm]
    local += ["--non-persistent-save-interval", "2", "--replication", "--replication-factor", "3"]
    disk = os.path.join(tmp, "disk")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    for name in ("megalm.checkpoint.local", "megalm.training.training"):  # restores; the save lines
        logging.getLogger(name).addHandler(handler)
    codes = []
    first = [*TINY, *local, "--train-iters", "8", "--save", disk, "--save-interval", "3"]
    try:
        pretrain_gpt.main(first, _crash_at(7))
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code)
    from megalm import parallel_state

    parallel_state.destroy_model_parallel()
    held = sorted(os.listdir(os.path.join(shm, RUN_ID, f"node{rank}")))
    dist.barrier()
    if rank > 0:
        shutil.rmtree(os.path.join(shm, RUN_ID, f"node{rank}"))  # nodes 1 and 2 are lost with their RAM
    dist.barrier()
    empty = os.path.join(tmp, "empty")
    restored = [*TINY, *local, "--train-iters", "8", "--save", empty, "--load", empty]
    restored += ["--metrics-file", os.path.join(tmp, "local.jsonl")]
    from_disk = [*TINY, "--train-iters", "8", "--load", disk, "--ckpt-step", "6"]
    from_disk += ["--metrics-file", os.path.join(tmp, "disk.jsonl")]
    codes += run_trainings([restored, from_disk])
    os.environ["MEGALM_NODE_NAME"] = "one-node"  # all ranks on one node: no replica can survive it
    codes += run_trainings([[*TINY, *local, "--train-iters", "2"]])
    dist.barrier()
    left = sorted(os.listdir(os.path.join(shm, RUN_ID, f"node{rank}")))
    return {"codes": codes, "held": held, "lines": lines, "left": left}


def test_local_checkpoint_restores_from_the_peer_node_as_the_disk_checkpoint(tmp_path):
    results = run_distributed(_scenario, 3, args=(str(tmp_path),), timeout=400)
    for rank, r in enumerate(results):
        assert r["codes"][:3] == [3, 0, 0], r
        assert "--replication" in str(r["codes"][3]) and "not 3 different nodes" in str(r["codes"][3]), r["codes"]
        # Each node holds its rank's shard and the other ranks' replicas of the newest local checkpoint.
        assert r["held"] == [shard_file_name(o, 3, 6) for o in range(3)], r["held"]
        assert r["left"] == [], r["left"]  # a finished run removes its copies
    for rank in (1, 2):
        restored = [line for line in results[rank]["lines"] if line.startswith("restored iteration 6")]
        assert len(restored) == 1 and "bytes from rank 0 (node 'node0')" in restored[0], results[rank]["lines"]
    sent = [line for line in results[1]["lines"] if line.startswith("local checkpoint at iteration 6")]
    assert sent and "sent to rank 2 (node 'node2'), rank 0 (node 'node0')" in sent[0], results[1]["lines"]
    mine = [line for line in results[0]["lines"] if line.startswith("restored iteration 6")]
    assert mine and "read on this node" in mine[0], results[0]["lines"]
    local, disk = records(tmp_path, "local"), records(tmp_path, "disk")
    assert [r["iteration"] for r in local] == [r["iteration"] for r in disk] == [7, 8]
    for a, b in zip(local, disk):
        assert (a["lm_loss"], a["grad_norm"], a["consumed_samples"]) == (
            b["lm_loss"],
            b["grad_norm"],
            b["consumed_samples"],
        )
        assert a["consumed_samples"] == a["iteration"] * 6


def test_replicas_go_to_as_many_other_nodes():
    from megalm.checkpoint.local import replica_ranks

    nodes = ["a", "a", "b", "b", "c", "c"]  # 3 nodes of 2 ranks
    assert replica_ranks(nodes, 2, 2) == [[2], [3], [4], [5], [0], [1]]
    assert replica_ranks(nodes, 2, 3) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    with pytest.raises(CheckpointError, match=r"rank 0's 2 copies would go to ranks \[0, 1\] on nodes \['a', 'a'\]"):
        replica_ranks(nodes, 1, 2)  # the next rank is on the same node
    with pytest.raises(CheckpointError, match="not 4 different nodes"):
        replica_ranks(nodes, 2, 4)  # only 3 nodes
    with pytest.raises(CheckpointError, match="at least 2"):
        replica_ranks(nodes, 2, 1)


def _held(owner, it, world=2, nbytes=10):
    return Held(owner, world, it, nbytes)


def test_the_newest_iteration_every_shard_has_is_restored_from_the_nearest_copy():
    # Node A (rank 0) holds its shards of 4 and 6 and rank 1's replica of 4 and 6; node B was replaced (empty).
    holdings = [("a", [_held(0, 4), _held(1, 4), _held(0, 6), _held(1, 6, nbytes=7)]), ("b", [])]
    assert choose_restore(holdings, 2, None) == (6, {0: (0, 10), 1: (0, 7)})
    assert choose_restore(holdings, 2, 6) == (6, {0: (0, 10), 1: (0, 7)})  # as new as the disk one: local wins
    assert choose_restore(holdings, 2, 7) is None  # the disk checkpoint is newer
    # Rank 1's shard of 6 only on its own node: read there; of iteration 8 only rank 0's: not complete.
    holdings = [("a", [_held(0, 6), _held(0, 8)]), ("b", [_held(1, 6)])]
    assert choose_restore(holdings, 2, None) == (6, {0: (0, 10), 1: (1, 10)})
    assert choose_restore(holdings, 3, None) is None  # saved by world 2
    assert choose_restore([("a", [_held(0, 6, world=1)])], 1, None) == (6, {0: (0, 10)})


def test_blocks_fill_the_overlap_and_refuse_another_layout():
    full = torch.arange(24.0).reshape(4, 6)
    saved = {"w": [{"offsets": [0, 0], "global_shape": [4, 6], "data": full[:2]}]}
    saved["w"].append({"offsets": [2, 0], "global_shape": [4, 6], "data": full[2:]})
    target = torch.zeros(2, 3)
    fill_blocks({"w": ShardedTensorSpec(target, (4, 6), (1, 2))}, saved)
    assert torch.equal(target, full[1:3, 2:5])
    with pytest.raises(CheckpointError, match="holds 0 of the 6 values of v"):
        fill_blocks({"v": ShardedTensorSpec(torch.zeros(2, 3), (4, 6), (1, 2))}, saved)
    with pytest.raises(CheckpointError, match=r"has shape \(4, 6\), the model's \(4, 8\)"):
        fill_blocks({"w": ShardedTensorSpec(torch.zeros(2, 3), (4, 8), (1, 2))}, saved)
    half = {"w": saved["w"][:1]}
    with pytest.raises(CheckpointError, match="holds 3 of the 6"):
        fill_blocks({"w": ShardedTensorSpec(torch.zeros(2, 3), (4, 6), (1, 2))}, half)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "2"],
            "needs --non-persistent-local",
        ),
        (
            ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/dev/shm/x"],
            "needs --non-persistent-save-interval",
        ),
        (["--replication"], "--replication needs --non-persistent-ckpt-type local"),
        (["--replication-factor", "1"], "at least 2"),
    ],
)
def test_local_checkpoint_flags_are_checked(flags, message):
    with pytest.raises(Exception, match=message):
        parse_config([*TINY, "--train-iters", "2", *flags], world_size=3)


def test_a_shard_of_another_run_or_world_is_refused():
    from megalm.checkpoint import local

    now = {"data_parallel_size": 2}
    config = parse_config([*TINY, "--train-iters", "8"], world_size=3).to_dict()
    common = {"world_size": 2, "layout": {"data_parallel_size": 2}, "config": config}
    assert local._mismatch(common, config, 2, now) is None
    assert local._mismatch(common, config, 1, now) == "saved by world 2, now 1"
    longer = parse_config([*TINY, "--train-iters", "20", "--save", "/x", "--log-interval", "5"], world_size=3)
    assert local._mismatch(common, longer.to_dict(), 2, now) is None  # paths, logging, length may change
    other = parse_config([*TINY, "--train-iters", "8", "--seed", "4"], world_size=3).to_dict()
    assert local._mismatch(common, other, 2, now) == "saved by another run (training.seed: 3, now 4)"
    assert "saved with layout" in local._mismatch(common, config, 2, {"data_parallel_size": 1})
