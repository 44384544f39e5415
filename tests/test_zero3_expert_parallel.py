"""ZeRO-2 / ZeRO-3 (``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``) with expert
parallelism: a DeepSeek-style MoE (MLA, sigmoid routing with expert bias, shared expert) at EP 2 x DP 2 on 4
real ranks trains to the distributed optimizer's (ZeRO-1) losses and grad norms within 1e-5 relative, with the
loop and the grouped experts, ZeRO-3's prefetch, and forced load balancing; expert buckets stay gathered
(pinned) under ZeRO-3 while their gradients and optimizer state are sharded over the expert-data-parallel group."""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import MLA_MOE_FLAGS, assert_close, records, run_trainings, tiny_flags

MOE = tiny_flags(
    **MLA_MOE_FLAGS,
    v_head_dim="8",
    num_experts="8",
    expert_model_parallel_size="2",
    ddp_bucket_size="2000",
)
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
RUNS = {  # name: (flags, reference)
    "zero1": (["--use-distributed-optimizer"], None),
    "zero2": (["--data-parallel-sharding-strategy", "optim_grads"], "zero1"),
    "zero3": (ZERO3, "zero1"),
    "zero3_prefetch_grouped": ([*ZERO3, "--overlap-param-gather", "--moe-grouped-gemm"], "zero1_grouped"),
    "zero1_grouped": (["--use-distributed-optimizer", "--moe-grouped-gemm"], None),
    "zero3_forced": ([*ZERO3, "--moe-router-force-load-balancing"], "zero1_forced"),
    "zero1_forced": (["--use-distributed-optimizer", "--moe-router-force-load-balancing"], None),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3_ep"))
    argvs = [MOE + list(f) + ["--metrics-file", os.path.join(tmp, f"{n}.jsonl")] for n, (f, _) in RUNS.items()]
    codes = run_distributed(run_trainings, 4, args=(argvs,), timeout=500)
    return {"tmp": tmp, "codes": codes}


def test_all_runs_exit_cleanly(runs):
    assert runs["codes"] == [[0] * len(RUNS)] * 4, runs["codes"]


@pytest.mark.parametrize("name", [n for n, (_, ref) in RUNS.items() if ref])
def test_sharded_strategies_equal_the_distributed_optimizer(runs, name):
    ref, got = records(runs["tmp"], RUNS[name][1]), records(runs["tmp"], name)
    assert len(got) == len(ref) == 3
    for key in ("lm_loss", "grad_norm"):
        assert_close([r[key] for r in got], [r[key] for r in ref], rel=1e-5)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]


def test_zero3_with_experts_is_accepted_and_pins_expert_buckets():
    from megalm.config import build_parser, config_from_args, validate_config
    from megalm.distributed.sharded_param_buffer import ShardedParamBucket

    p = validate_config(config_from_args(build_parser().parse_args(MOE + ZERO3)), world_size=4).parallel
    assert (p.data_parallel_sharding_strategy, p.expert_model_parallel_size) == ("optim_grads_params", 2)
    assert ShardedParamBucket.pinned is False  # dense buckets are freed; expert ones are pinned per bucket
