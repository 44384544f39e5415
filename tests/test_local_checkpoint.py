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
(dropout on: the RNG is restored too), and the same consumed samples.  A fourth run with ranks 0 and
1 on one node and ``--replication-jump 1`` (rank 0's replica on its own node) stops before training,
naming the problem.

Then an elastic resize (world 3 -> 2): a 2-rank group on nodes 1 and 2, node 1 holding the world-3
copies of ranks 0 and 1, node 2 rank 2's, restores iteration 6 from them, resharded (the distributed
optimizer's ranges of 3 ranks cut into 2), and logs iterations 7 and 8 as the disk checkpoint of
iteration 6 loaded at world 2 does, bit for bit; the old world's copies are gone at the end.  It asks
for 3 copies on its 2 nodes (as an elastic job left with fewer nodes would): 2, with a warning.
Before it, a run whose nodes hold no copy of rank 2's shard logs why the copies are not used and
loads the disk checkpoint (its iteration 7 is the disk run's).
"""

import logging
import os
import shutil

import pytest
import torch

from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.local import Held, choose_restore, fill_blocks, shard_file_name
from megalm.checkpoint.local_reshard import choose_reshard, cut_pieces, sources, target_index
from megalm.config import parse_config
from megalm.errors import TrainingStopped
from megalm.param_layout import ShardedTensorSpec
from tests.distributed_harness import run_distributed
from tests.training_runs import records, run_trainings, tiny_flags

TINY = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="128",
    micro_batch_size="1",
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
        pretrain_gpt.main(first, _crash_at(13))
        codes.append(0)
    except SystemExit as e:
        codes.append(e.code)
    from megalm import parallel_state

    parallel_state.destroy_model_parallel()
    held = sorted(os.listdir(os.path.join(shm, RUN_ID, f"node{rank}")))
    dist.barrier()
    if rank == 0:  # for the resize: node 1 keeps the copies of ranks 0 and 1, node 2 rank 2's
        # (and for a refusal, "shm3lost": rank 2's copy on no node)
        for node, owners, where in (("node1", (0, 1), "shm3"), ("node2", (2,), "shm3"), ("node1", (0, 1), "shm3lost")):
            os.makedirs(os.path.join(tmp, where, RUN_ID, node))
            for o in owners:
                name = shard_file_name(o, 3, 6)
                shutil.copy(os.path.join(shm, RUN_ID, "node0", name), os.path.join(tmp, where, RUN_ID, node, name))
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
    # Ranks 0 and 1 on one node, replicas to the next rank (--replication-jump 1): rank 0's would not survive it.
    os.environ["MEGALM_NODE_NAME"] = "node-a" if rank < 2 else "node-b"
    bad = [*TINY, *local[:-2], "--replication-jump", "1", "--train-iters", "2"]
    codes += run_trainings([bad])
    dist.barrier()
    left = sorted(os.listdir(os.path.join(shm, RUN_ID, f"node{rank}")))
    return {"codes": codes, "held": held, "lines": lines, "left": left}


def _resized(tmp):
    """World 2 on nodes 1 and 2 restores the world-3 copies (see the module docstring) and the disk checkpoint."""
    import torch.distributed as dist

    rank = dist.get_rank()
    os.environ["TORCHELASTIC_RUN_ID"] = RUN_ID
    os.environ["MEGALM_NODE_NAME"] = f"node{rank + 1}"
    shm = os.path.join(tmp, "shm3")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    for name in ("megalm.checkpoint.local_reshard", "megalm.checkpoint.local"):
        logging.getLogger(name).addHandler(handler)
    empty = os.path.join(tmp, "empty2")
    restored = [*TINY, "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", shm]
    restored += ["--non-persistent-save-interval", "2", "--replication", "--replication-factor", "3"]
    restored += ["--train-iters", "8"]
    restored += ["--save", empty, "--load", empty, "--metrics-file", os.path.join(tmp, "resized_local.jsonl")]
    from_disk = [*TINY, "--train-iters", "8", "--load", os.path.join(tmp, "disk"), "--ckpt-step", "6"]
    from_disk += ["--metrics-file", os.path.join(tmp, "resized_disk.jsonl")]
    lost = [
        *TINY,
        "--non-persistent-ckpt-type",
        "local",
        "--non-persistent-local-ckpt-dir",
        os.path.join(tmp, "shm3lost"),
    ]
    lost += ["--non-persistent-save-interval", "2", "--load", os.path.join(tmp, "disk"), "--train-iters", "8"]
    lost += ["--exit-interval", "7"]  # one iteration: the loss of iteration 7
    lost += ["--metrics-file", os.path.join(tmp, "resized_lost.jsonl")]
    codes = run_trainings([lost, restored, from_disk])
    dist.barrier()
    left = sorted(os.listdir(os.path.join(shm, RUN_ID, f"node{rank + 1}")))
    return {"codes": codes, "lines": lines, "left": left}


def _same_iterations_7_and_8(tmp_path, restored, from_disk):
    """Run ``restored`` trained iterations 7 and 8 with the losses, grad norms and consumed samples of run
    ``from_disk``, bit for bit; returns its records."""
    local, disk = records(tmp_path, restored), records(tmp_path, from_disk)
    assert [r["iteration"] for r in local] == [r["iteration"] for r in disk] == [7, 8]
    for a, b in zip(local, disk):
        assert (a["lm_loss"], a["grad_norm"], a["consumed_samples"]) == (
            b["lm_loss"],
            b["grad_norm"],
            b["consumed_samples"],
        )
    return local


def test_local_checkpoint_restores_from_the_peer_node_as_the_disk_checkpoint(tmp_path):
    results = run_distributed(_scenario, 3, args=(str(tmp_path),), timeout=400)
    resized = run_distributed(_resized, 2, args=(str(tmp_path),), timeout=300)
    for rank, r in enumerate(results):
        assert r["codes"][:3] == [3, 0, 0], r
        assert "--replication" in str(r["codes"][3]) and "not 2 different nodes" in str(r["codes"][3]), r["codes"]
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
    local = _same_iterations_7_and_8(tmp_path, "local", "disk")
    assert all(a["consumed_samples"] == a["iteration"] * 6 for a in local)
    # The resize: both ranks restored iteration 6 from the world-3 copies; rank 1 received its blocks of
    # rank 1's copy (read by rank 0) and the model's (the lowest old rank's, read by rank 0).
    for rank, r in enumerate(resized):
        assert r["codes"] == [0, 0, 0], r
        line = [
            x for x in r["lines"] if x.startswith("restored iteration 6 from the local checkpoint saved by world 3")
        ]
        assert len(line) == 1 and "resharded to world 2" in line[0] and "read by ranks [0, 1]" in line[0], r["lines"]
        received = int(line[0].split(": ")[1].split(" bytes")[0])
        assert (received > 0) == (rank == 1), line
        # The old world's copies went at the new run's save, the new ones at its end.
        assert r["left"] == [], r["left"]
        if rank == 0:  # 3 copies asked for on 2 nodes (an elastic job that lost one): 2
            assert "--replication-factor 3 on 2 node(s): 2 copies" in r["lines"], r["lines"]
    # Rank 2's copy on no node: not used, the reason logged, and the disk checkpoint loads (iteration 7 as from disk).
    why = "the copies of iteration 6 saved by world 3 miss rank(s) [2]: no surviving node holds them"
    lines = resized[0]["lines"]
    assert any(line.startswith("no complete local checkpoint for world 2") and why in line for line in lines), lines
    lost, disk = records(tmp_path, "resized_lost"), records(tmp_path, "resized_disk")
    assert [(r["iteration"], r["lm_loss"]) for r in lost] == [(7, disk[0]["lm_loss"])], lost
    _same_iterations_7_and_8(tmp_path, "resized_local", "resized_disk")


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


def test_the_newest_copies_of_another_world_are_resharded_unless_a_rank_is_lost():
    # World 4's copies of iteration 6: node A (new rank 0) holds ranks 0, 1 and the replicas of 2, 3;
    # node B (new rank 1) ranks 2 and 3.  Each old copy is read by the new rank with the fewest bytes so far.
    a = [_held(o, 6, world=4, nbytes=10) for o in range(4)]
    b = [_held(2, 6, world=4, nbytes=10), _held(3, 6, world=4, nbytes=10)]
    assert choose_reshard([("a", a), ("b", b)], 2, None) == (
        (4, 6, {0: (0, 10), 1: (0, 10), 2: (1, 10), 3: (1, 10)}),
        "",
    )
    assert choose_reshard([("a", a), ("b", b)], 4, None) == (None, "")  # the same world: not a reshard
    assert choose_reshard([("a", a), ("b", [])], 2, 7) == (None, "")  # the disk checkpoint is newer
    # Rank 3's copy lost with its nodes: refused, naming it; an older complete one is taken instead.
    lost = [("a", a[:3]), ("b", [])]
    assert choose_reshard(lost, 2, None) == (
        None,
        "the copies of iteration 6 saved by world 4 miss rank(s) [3]: no surviving node holds them",
    )
    older = [_held(o, 4, world=4) for o in range(4)]
    assert choose_reshard([("a", a[:3] + older), ("b", [])], 2, None)[0][:2] == (4, 4)
    assert choose_reshard([("a", a[:3] + older), ("b", [])], 2, 5)[0] is None


def test_resharded_blocks_cover_every_target_once():
    # A 4x6 weight in every old rank's copy (replicated), and its optimizer state in 3 flat ranges (3 old
    # data-parallel ranks: 8 values each); 2 new ranks each want the weight and half the state (12 values).
    from megalm.param_layout import flat_range_blocks

    weight, state = torch.randn(4, 6), torch.randn(4, 6)

    def blocks(tensor, start, end):
        flat = tensor.flatten()
        return [
            {"offsets": list(off), "global_shape": [4, 6], "data": flat[fs : fs + size[0] * size[1]].view(size)}
            for fs, off, size in flat_range_blocks((4, 6), start, end)
        ]

    copies = {o: {"w": blocks(weight, 0, 24), "s": blocks(state, 8 * o, 8 * o + 8)} for o in range(3)}
    index = {
        o: {k: [(tuple(b["offsets"]), tuple(b["data"].shape)) for b in v] for k, v in c.items()}
        for o, c in copies.items()
    }
    chosen = sources(index)
    assert set(chosen.values()) == {0, 1, 2} and chosen[("w", (0, 0), (4, 6))] == 0  # the weight: old rank 0's
    for new in range(2):
        targets = {"w": ShardedTensorSpec(torch.zeros(4, 6), (4, 6), (0, 0))}
        targets["s"] = [
            ShardedTensorSpec(torch.zeros(size), (4, 6), off)
            for _, off, size in flat_range_blocks((4, 6), 12 * new, 12 * new + 12)
        ]
        wanted = target_index(targets)
        pieces = {}
        for holder in ({0, 1}, {2}):  # two holders, as two nodes would be
            for key, v in cut_pieces({o: copies[o] for o in holder}, chosen, wanted).items():
                pieces.setdefault(key, []).extend(v)
        fill_blocks(targets, pieces)  # raises unless every value is covered exactly once
        assert torch.equal(targets["w"].local, weight)
        got = torch.cat([t.local.flatten() for t in targets["s"]])
        assert torch.equal(got, state.flatten()[12 * new : 12 * new + 12])
    assert (
        sum(p["data"].numel() for p in cut_pieces({1: copies[1]}, chosen, wanted)["s"]) == 4
    )  # rank 1's 8..16 ∩ 12..24


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
    # Resharding: another world and layout are expected; another run is still refused.
    assert local._mismatch(common, config, 1, {"data_parallel_size": 1}, reshard=True) is None
    assert "training.seed: 3, now 4" in local._mismatch(common, other, 1, {"data_parallel_size": 1}, reshard=True)
