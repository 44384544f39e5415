"""Whole trainings through ``pretrain_gpt.main`` on 2 gloo ranks (DP 2) with gradient compression
and local SGD / DiLoCo.

* With the distributed optimizer (ZeRO-1, and int8 with ZeRO-3) compressed runs equal the DDP compressed runs.
* Compression state in checkpoints: a run resumed from a checkpoint reproduces the uninterrupted
  compressed run bit for bit (residuals, PowerSGD's Q and the stochastic-rounding generator
  restored); loaded under another layout (DP 2 -> DP 1 x TP 2) the pending update (the sum of the two
  ranks' residuals, saved per parameter and read into the TP 2 shards) is resharded (one INFO line, no
  warning): the one DP rank adds it to its first gradient, so the run leaves the uncompressed one there.
* Warm-ups (--grad-compression-warmup-iters, --local-sgd-warmup-iters): the first iterations are plain
  DP's bit for bit, the later ones are not; resumed inside the warm-up, exact.
* Local SGD with H = 1 and plain averaging equals synchronous data parallelism with SGD; H = 4 does
  not; DiLoCo resumed from a checkpoint taken between two syncs equals the uninterrupted run bit for
  bit (every replica's weights and optimizer state, and the outer state, restored)."""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import losses, metrics_argv, records, tiny_flags

# The tiny GPT at hidden 32 with dropout (its defaults), overlapped reduction in 3000-element buckets; untied:
# the distributed optimizer's buckets then match DDP's.
TINY = tiny_flags(
    hidden_size=32,
    seq_length=16,
    vocab_size=200,
    lr="3e-3",
    seed=5,
    hidden_dropout=None,
    attention_dropout=None,
    micro_batch_size=1,
    global_batch_size=4,
    overlap_grad_reduce=True,
    ddp_bucket_size=3000,
    untie_embeddings_and_output_weights=True,
)
METHODS = {
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", "2"],
    "int8": ["--grad-compression", "int8", "--int8-rounding", "stochastic", "--int8-chunk-size", "64"],
}

LOCAL_SGD = {"sync": [], "h1": ["--local-sgd-interval", "1"], "h4": ["--local-sgd-interval", "4"]}
DILOCO = ["--local-sgd-interval", "2", "--outer-lr", "0.7", "--outer-momentum", "0.9"]


def worker(tmp):
    import io
    import sys

    from tests.training_runs import run_trainings

    # first: the first training in a process starts from other numbers than the later ones (they all agree)
    runs = [metrics_argv(TINY, tmp, "plain", "--train-iters", "6")]
    for method, flags in METHODS.items():
        ckpt = os.path.join(tmp, f"ckpt_{method}")
        runs += [
            metrics_argv(
                TINY, tmp, f"{method}_base", *flags, "--save", ckpt, "--save-interval", "3", "--train-iters", "6"
            ),
            metrics_argv(
                TINY, tmp, f"{method}_resumed", *flags, "--load", ckpt, "--ckpt-step", "3", "--train-iters", "6"
            ),
        ]
    # the distributed optimizer: int8's all-to-all reduce-scatter, PowerSGD's all-reduce then the shard
    for method, flags in METHODS.items():
        runs.append(
            metrics_argv(TINY, tmp, f"{method}_distopt", *flags, "--use-distributed-optimizer", "--train-iters", "6")
        )
    # TP 2 on the 2 ranks: the DP 2 checkpoint loaded at data-parallel size 1 (another layout), with
    # compression (nothing to compress at DP 1) and without
    tp2 = ["--load", os.path.join(tmp, "ckpt_powersgd"), "--ckpt-step", "3", "--train-iters", "6",
           "--exit-interval", "5", "--tensor-model-parallel-size", "2"]  # fmt: skip
    runs += [metrics_argv(TINY, tmp, "tp2", *METHODS["powersgd"], *tp2), metrics_argv(TINY, tmp, "tp2_plain", *tp2)]
    fp16 = ["--fp16", "--initial-loss-scale", "1024", "--grad-compression", "topk", "--topk-ratio", "0.1"]
    fp16 = metrics_argv(TINY, tmp, "fp16_topk", *fp16, "--train-iters", "4")
    runs.append((fp16, {"inf_at_call": 3, "inf_rank": 1}))  # iteration 2, rank 1 only
    sgd = ["--optimizer", "sgd", "--clip-grad", "0", "--train-iters", "4"]  # clipping: per replica under local SGD
    runs += [metrics_argv(TINY, tmp, f"sgd_{name}", *sgd, *extra) for name, extra in LOCAL_SGD.items()]
    ckpt = os.path.join(tmp, "ckpt_diloco")
    runs += [
        metrics_argv(TINY, tmp, "diloco_base", *DILOCO, "--save", ckpt, "--save-interval", "3", "--train-iters", "6"),
        metrics_argv(TINY, tmp, "diloco_resumed", *DILOCO, "--load", ckpt, "--ckpt-step", "3", "--train-iters", "6"),
    ]
    ckpt, overlap = os.path.join(tmp, "ckpt_overlap"), [*DILOCO, "--local-sgd-overlap-steps", "2"]
    runs += [  # the sync of 2 is applied at 4: saved at 3 with the correction pending
        metrics_argv(TINY, tmp, "overlap_base", *overlap, "--save", ckpt, "--save-interval", "3", "--train-iters", "6"),
        metrics_argv(TINY, tmp, "overlap_resumed", *overlap, "--load", ckpt, "--ckpt-step", "3", "--train-iters", "6"),
    ]
    # warm-ups of exact / synchronous steps (3 of 6) resumed from iteration 2 (inside the warm-up), and
    # Streaming DiLoCo resumed at 2 with a fragment's correction in flight
    variants = {
        "powersgd_warm": [*METHODS["powersgd"], "--grad-compression-warmup-iters", "3"],
        "diloco_warm": [*DILOCO, "--local-sgd-warmup-iters", "3"],
        "streaming": [*DILOCO, "--local-sgd-fragments", "2", "--local-sgd-overlap-steps", "1"],
        "streaming_int8": [
            *DILOCO,
            "--local-sgd-fragments",
            "2",
            "--local-sgd-overlap-steps",
            "1",
            "--outer-grad-int8-chunk",
            "64",
        ],  # fmt: skip
    }
    for name, flags in variants.items():
        ckpt = os.path.join(tmp, f"ckpt_{name}")
        runs += [
            metrics_argv(
                TINY, tmp, f"{name}_base", *flags, "--save", ckpt, "--save-interval", "2", "--train-iters", "6"
            ),
            metrics_argv(
                TINY, tmp, f"{name}_resumed", *flags, "--load", ckpt, "--ckpt-step", "2", "--train-iters", "6"
            ),
        ]
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--train-iters", "6"]
    runs.append(
        metrics_argv(TINY, tmp, "int8_zero3", *METHODS["int8"], *zero3)
    )  # ZeRO-3: the all-to-all into the sharded gradient
    saved, sys.stdout = sys.stdout, io.StringIO()
    try:
        codes = run_trainings(runs)
        text = sys.stdout.getvalue()
    finally:
        sys.stdout = saved
    return codes, text


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("compress_resume"))
    return tmp, run_distributed(worker, 2, args=(tmp,), timeout=400)


def test_resume_is_exact_and_a_new_layout_reshards_the_residuals(world):
    tmp, ranks = world
    for codes, _ in ranks:
        assert codes == [0] * 26, codes
    plain = losses(tmp, "plain")
    for method in METHODS:
        base, resumed = losses(tmp, f"{method}_base"), losses(tmp, f"{method}_resumed")
        assert len(base) == 6 and resumed == base[3:], method  # bit for bit
        assert base != plain  # the compression changed the training
        path = os.path.join(tmp, f"ckpt_{method}", "iter_0000003", "grad_compression")
        assert sorted(os.listdir(path)) == ["rank_00000.pt", "rank_00001.pt"]
    for rank, (_, text) in enumerate(ranks):
        lines = [line for line in text.splitlines() if "gradient-compression state" in line]
        assert len(lines) == (1 if rank == 0 else 0), lines  # the compressed TP 2 run only, INFO on rank 0
        for line in lines:
            assert "resharded" in line and "'data_parallel_size': 2" in line and "'data_parallel_size': 1" in line
            assert "restarts from zero" not in line and "pending update of" in line
    # loaded at DP 1 (nothing compressed there) the pending update is added to iteration 4's gradient:
    # iteration 4's loss (the loaded weights) is the uncompressed TP 2 run's, iteration 5's is not
    tp2, plain = losses(tmp, "tp2"), losses(tmp, "tp2_plain")
    assert [r["iteration"] for r in records(tmp, "tp2")] == [4, 5] and all(abs(x) < 100 for x in tp2)
    assert tp2[0] == plain[0] and tp2[1] != plain[1]


def test_distributed_optimizer_with_compression_equals_the_ddp_compressed_run(world):
    """The same compressed gradients (int8 stochastic: bit for bit on the shard, through the
    all-to-all reduce-scatter; PowerSGD: its all-reduce, then the shard), the same AdamW; only the
    gradient norm for clipping is summed in another order.  ZeRO-3 (sharded gradients and weights)
    with int8 too."""
    tmp, _ = world
    for method in METHODS:
        base, distopt = losses(tmp, f"{method}_base"), losses(tmp, f"{method}_distopt")
        assert len(distopt) == 6 and distopt == pytest.approx(base, rel=1e-6, abs=0), method
    zero3 = losses(tmp, "int8_zero3")
    assert len(zero3) == 6 and zero3 == pytest.approx(losses(tmp, "int8_base"), rel=1e-6, abs=0)


def test_local_sgd_h1_is_synchronous_sgd_and_diloco_resumes_exactly_also_overlapped(world):
    tmp, _ = world
    sync, h1, h4 = (losses(tmp, f"sgd_{name}") for name in LOCAL_SGD)
    assert len(sync) == 4
    assert h1 == pytest.approx(sync, rel=1e-5, abs=0)  # averaging after every SGD step: the DP mean
    assert h4[0] == pytest.approx(sync[0], rel=1e-6) and h4[-1] != pytest.approx(sync[-1], rel=1e-5)
    base, resumed = losses(tmp, "diloco_base"), losses(tmp, "diloco_resumed")
    assert len(base) == 6 and resumed == base[3:]  # saved at 3, between the syncs at 2 and 4
    path = os.path.join(tmp, "ckpt_diloco", "iter_0000003", "local_sgd")
    assert sorted(os.listdir(path)) == ["rank_00000.pt", "rank_00001.pt"]
    # --local-sgd-overlap-steps 2: the same until the first correction is applied (iteration 4's loss
    # is of the weights after step 3), then another run; resumed bit for bit from the pending state
    overlap, resumed = losses(tmp, "overlap_base"), losses(tmp, "overlap_resumed")
    assert len(overlap) == 6 and resumed == overlap[3:]
    assert overlap[:2] == base[:2] and overlap[4] != base[4]


def test_fp16_overflow_on_one_rank_skips_the_compressed_step_everywhere(world):
    """The inf check runs on the reduced gradient: rank 1's overflow reaches rank 0 (which logs)
    through the compressed payload, the step is skipped (no gradient norm), and the residual
    left unchanged lets training continue with finite losses."""
    tmp, _ = world
    rows = records(tmp, "fp16_topk")
    assert [r["skipped_iterations"] for r in rows] == [0, 1, 0, 0]
    assert [r["grad_norm"] is None for r in rows] == [False, True, False, False]
    assert all(r["lm_loss"] is not None and abs(r["lm_loss"]) < 100 for r in rows[2:])


def test_warmups_are_the_synchronous_run_bit_for_bit_then_resume_exactly(world):
    """--grad-compression-warmup-iters 3 (PowerSGD) and --local-sgd-warmup-iters 3 (DiLoCo H = 2): the
    losses of iterations 1-4 (iteration 4's: the weights after step 3) are plain DP's bit for bit, the
    next ones are not (compression / local steps started at 4); resumed at 2, inside the warm-up, each
    run equals its uninterrupted one bit for bit (the phase follows the restored iteration)."""
    tmp, _ = world
    plain = losses(tmp, "plain")
    for name in ("powersgd_warm", "diloco_warm"):
        base, resumed = losses(tmp, f"{name}_base"), losses(tmp, f"{name}_resumed")
        assert len(base) == 6 and base[:4] == plain[:4] and base[4] != plain[4], name
        assert resumed == base[2:], name
    assert losses(tmp, "diloco_warm_base")[4:] != losses(tmp, "diloco_base")[4:]  # not DiLoCo from iteration 1


def test_streaming_diloco_trains_and_resumes_exactly_with_a_fragment_in_flight(world):
    """--local-sgd-fragments 2 (H = 2, overlap 1): a fragment is in flight after every iteration; the run
    saved at 2 resumes bit for bit, and it is another run than DiLoCo's (every parameter at once); with
    --outer-grad-int8-chunk the same, within 1% of the fp32 outer gradients' losses."""
    tmp, _ = world
    base, resumed = losses(tmp, "streaming_base"), losses(tmp, "streaming_resumed")
    assert len(base) == 6 and resumed == base[2:] and all(abs(x) < 100 for x in base)
    assert base[:2] == losses(tmp, "diloco_base")[:2] and base[2:] != losses(tmp, "diloco_base")[2:]
    # with 8-bit outer gradients: near the fp32 run (8 bits per value, scale per 64), not it; resumed exactly
    quantized, resumed = losses(tmp, "streaming_int8_base"), losses(tmp, "streaming_int8_resumed")
    assert len(quantized) == 6 and resumed == quantized[2:] and quantized[:2] == base[:2]
    assert quantized[2:] != base[2:] and quantized == pytest.approx(base, rel=1e-2)
