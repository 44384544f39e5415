"""Straggler mitigation by re-splitting micro-batches (issue #32, item 4).

Unit: :func:`plan_shares` gives the split whose slowest replica finishes first (brute force agrees);
:class:`ShareSampler` gives the replicas
disjoint slots whose union is each global batch, in order, for any shares.

Real ranks (``torchrun``, 2 ranks, --calculate-per-token-loss, 4 micro-batches each): the same
training twice, balanced, and with ``--straggler-rebalance-interval 2`` while rank 1 sleeps 0.1 s
per micro-batch: the split moves micro-batches to rank 0, and every iteration's loss and gradient
norm equal the balanced run's up to summation order.

Run as a script (``torchrun tests/test_straggler_rebalance.py ARGS``) this file is the training
entry point: ``pretrain_gpt.main`` with ``MEGALM_TEST_SLOW_RANK=RANK`` (that rank sleeps 0.1 s in
every forward step).
"""

import itertools
import json
import os
import subprocess
import sys

import pytest

from tests.training_runs import sleep_on_rank, tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
ITERS = 8


def test_plan_shares_follows_speed():
    from megalm.training.rebalance import plan_shares

    assert plan_shares([1.0, 1.0], 8) == [4, 4]
    assert plan_shares([1.0, 3.0], 8) == [6, 2]  # speeds 3:1 of the 6 spare, one each first
    # the bench's quiet measurement: proportional rounding gave [5, 3] (34.8 ms), the best split is [6, 2] (25.2 ms)
    assert plan_shares([0.0042, 0.0116], 8) == [6, 2]
    for seconds, total in (([0.3, 0.7, 1.1, 0.2], 37), ([0.5, 0.9, 0.9], 11), ([2.0, 1.0], 5)):
        best = min(  # every split with at least one each, by brute force
            (max(n * t for n, t in zip(split, seconds)), split)
            for split in itertools.product(range(1, total), repeat=len(seconds))
            if sum(split) == total
        )[0]
        assert max(n * t for n, t in zip(plan_shares(seconds, total), seconds)) == best, (seconds, total)
    assert plan_shares([0.01, 10.0], 8) == [7, 1]  # at least one each
    assert plan_shares([0.0, 2.0, 2.0], 6) == [2, 2, 2]  # unmeasured counts as the fastest
    assert sum(plan_shares([0.3, 0.7, 1.1, 0.2], 37)) == 37
    with pytest.raises(ValueError, match="cannot give each"):
        plan_shares([1.0, 1.0, 1.0], 2)


def test_share_sampler_covers_each_global_batch_in_order():
    from megalm.data.samplers import ShareSampler

    for shares in ([4, 4], [7, 1], [1, 2, 5]):
        samplers = [ShareSampler(200, 16, 2, r, shares) for r in range(len(shares))]
        per_rank = [list(s) for s in samplers]
        g = 2 * sum(shares)
        for k in range(3):  # global batches after the 16 consumed samples
            got = []
            for r, batches in enumerate(per_rank):
                got += [i for b in batches[k * shares[r] : (k + 1) * shares[r]] for i in b]
            assert got == list(range(16 + k * g, 16 + (k + 1) * g)), (shares, k)
        assert [len(s) for s in samplers] == [(200 - 16) // g * n for n in shares]


def _torchrun(*args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        os.path.abspath(__file__),
        *args,
    ]


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_rebalanced_microbatches_give_the_balanced_losses(tmp_path):
    flags = tiny_flags(
        hidden_size="32",
        seq_length="16",
        vocab_size="128",
        micro_batch_size="1",
        global_batch_size="8",
        calculate_per_token_loss=True,
        train_iters=str(ITERS),
    )
    runs = {}
    for name, extra, env in (
        ("balanced", [], {}),
        ("rebalanced", ["--straggler-rebalance-interval", "2"], {"MEGALM_TEST_SLOW_RANK": "1"}),
    ):
        metrics = tmp_path / f"{name}.jsonl"
        runs[name] = (
            metrics,
            subprocess.Popen(
                _torchrun(*flags, *extra, "--metrics-file", str(metrics)),
                env=dict(ENV, **env),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
    outs = {}
    try:
        for name, (_, proc) in runs.items():
            outs[name] = proc.communicate(timeout=240)[0]
    finally:
        for _, proc in runs.values():
            proc.kill()
    for name, (_, proc) in runs.items():
        assert proc.returncode == 0, outs[name][-3000:]
    moves = [line for line in outs["rebalanced"].splitlines() if "straggler rebalance" in line]
    assert moves and "[4, 4] -> [" in moves[0], outs["rebalanced"][-3000:]
    first = json.loads(moves[0].split("-> ")[1].split(" (")[0])
    assert first[0] > first[1], moves  # the slow rank 1 got fewer
    balanced = {r["iteration"]: r for r in _rows(runs["balanced"][0]) if "lm_loss" in r}
    rebalanced = {r["iteration"]: r for r in _rows(runs["rebalanced"][0]) if "lm_loss" in r}
    assert sorted(balanced) == sorted(rebalanced) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        b, r = balanced[it], rebalanced[it]
        assert r["consumed_samples"] == b["consumed_samples"] == 8 * it
        assert abs(r["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(b["lm_loss"]), (it, r["lm_loss"], b["lm_loss"])
        assert abs(r["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (it, r, b)


if __name__ == "__main__":
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    # Test hook: global rank MEGALM_TEST_SLOW_RANK is 0.1 s slower at each forward step.
    pretrain_gpt.main(sys.argv[1:], sleep_on_rank(pretrain_gpt.forward_step, "MEGALM_TEST_SLOW_RANK", 0.1))
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank
