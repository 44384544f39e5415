"""ZeRO-2 / ZeRO-3 (``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``) with expert
parallelism: a DeepSeek-style MoE (MLA, sigmoid routing with expert bias, shared expert, 8 experts) at EP 2 on 4
real ranks (DP 4, expert DP 2) trains to the single-process run's losses and grad norms within 1e-5 relative
(ZeRO-3 built on the meta device; ZeRO-3 at CP 2 x DP 2 with the grouped experts and prefetch; ZeRO-3 at TP 2 x
DP 2 with two microbatches, prefetch and the MoE blocks recomputed; ZeRO-2), and with forced load balancing to ZeRO-1's.
ZeRO-3 shards the expert weights over the expert-data-parallel group: after the build a rank holds
``dense / 4 + expert / 2`` weights and gradients (counted on the buffers, against the planner's parameter
counts), no expert weight whole; the start-up log's formula (16/d dense, 16/d_e experts) equals every byte of
model state, Adam's moments included.  A ZeRO-3 checkpoint saved at EP 2 x DP 4 resumes under ZeRO-3 at EP 1 x DP 4
(experts sharded over 4 ranks) to the straight run's third iteration."""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import MLA_MOE_FLAGS, assert_close, metrics_argv, records, run_trainings, tiny_flags

MOE = tiny_flags(
    **MLA_MOE_FLAGS,
    v_head_dim="8",
    num_experts="8",
    expert_model_parallel_size="2",
    ddp_bucket_size="2000",
)
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
EP1 = ["--expert-model-parallel-size", "1"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
RECOMPUTE_MOE = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
CKPT = "ckpt_zero3_ep2"
RUNS = {  # name: (flags, reference); the reference "one" is the single-process run
    "zero3": ([*ZERO3, "--init-model-with-meta-device", "--save", CKPT, "--save-interval", "2"], "one"),
    # CP 2 x DP 2 (expert DP 2), the grouped GEMM, prefetch
    "zero3_cp2_prefetch_grouped": ([*ZERO3, *CP2, "--overlap-param-gather", "--moe-grouped-gemm"], "one"),
    "zero2": (["--data-parallel-sharding-strategy", "optim_grads"], "one"),
    # TP 2 x DP 2 (expert DP 2): two microbatches per step; the MoE blocks recomputed in backward (their replay
    # gathers the experts again)
    "zero3_tp2_two_micro_recompute": ([*ZERO3, *TP2, *RECOMPUTE_MOE, "--overlap-param-gather"], "one"),
    "zero3_forced": ([*ZERO3, "--moe-router-force-load-balancing"], "zero1_forced"),
    "zero1_forced": (["--use-distributed-optimizer", "--moe-router-force-load-balancing"], None),
    # the EP 2 checkpoint of iteration 2 resumed by ZeRO-3 at EP 1 (expert DP 4): iteration 3
    "zero3_ep1_resumed": ([*ZERO3, *EP1, "--load", CKPT, "--ckpt-step", "2"], None),
}
SINGLE = {"one": EP1}


def _in(tmp, flags):
    """``flags`` with the checkpoint placeholder put under ``tmp``."""
    return [os.path.join(tmp, f) if f == CKPT else f for f in flags]


def _model_state(argv):
    """ZeRO-3 at EP 2 on 4 ranks built on the meta device: this rank's weight and gradient bytes on DDP's
    buffers, the planner's dense / expert parameter counts of the rank, the buckets, the bytes of expert
    parameters whose storage is whole."""
    import pretrain_gpt
    from megalm import parallel_state
    from megalm.config import build_parser, config_from_args, validate_config, with_vocab_size
    from megalm.estimate.parameters import stage_parameters
    from megalm.optimizer import build_optimizer
    from megalm.optimizer.memory_accounting import optimizer_memory
    from megalm.tensor_parallel.param_info import param_info
    from megalm.training.build import build_model_chunks, wrap_data_parallel
    from megalm.training.initialize import set_random_seed

    cfg = validate_config(config_from_args(build_parser().parse_args(argv)), world_size=4)
    cfg = with_vocab_size(cfg, cfg.model.vocab_size)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        groups = parallel_state.get_process_groups()
        tracker = set_random_seed(cfg.training.seed, groups)
        (ddp,) = wrap_data_parallel(cfg, build_model_chunks(cfg, pretrain_gpt.model_provider, groups, tracker), groups)
        st = stage_parameters(cfg, 0)
        buckets = [b for buf in ddp.all_buffers for b in buf.buckets]
        mem = optimizer_memory(build_optimizer(cfg, [ddp], report_memory=False, process_groups=groups), [ddp])
        return {
            "total": mem["total"],
            "formula_total": mem["formula"] * mem["params"],
            "d_e": mem["d_e"],
            "formula_text": mem["formula_text"],
            "weights": sum(buf.param_bytes() for buf in ddp.all_buffers),
            "grads": sum(buf.grad_bytes() for buf in ddp.all_buffers),
            "dense": st.dense,
            "expert": st.expert,
            "embedding": cfg.model.padded_vocab_size * cfg.model.hidden_size,
            "buckets": len(buckets),
            "pinned": [b.numel for b in buckets if b.pinned],
            "expert_buffers": [(buf.data_parallel_world_size, buf.numel) for buf in ddp.expert_buffers],
            "whole_expert_bytes": sum(
                p.untyped_storage().nbytes() for p in ddp.module.parameters() if param_info(p).expert
            ),
            "expert_elements": sum(p.numel() for p in ddp.module.parameters() if param_info(p).expert),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _four_ranks(argvs, memory_argv):
    return run_trainings(argvs), _model_state(memory_argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3_ep"))
    argvs = [metrics_argv(MOE, tmp, n, *_in(tmp, f)) for n, (f, _) in RUNS.items()]
    memory_argv = MOE + ZERO3 + ["--init-model-with-meta-device"]
    four = run_distributed(_four_ranks, 4, args=(argvs, memory_argv), timeout=500)
    single = [metrics_argv(MOE, tmp, n, *_in(tmp, f)) for n, f in SINGLE.items()]
    one = run_distributed(run_trainings, 1, args=(single,), timeout=300)
    return {"tmp": tmp, "codes": [c for c, _ in four] + one, "memory": [m for _, m in four]}


def test_all_runs_exit_cleanly(runs):
    assert runs["codes"] == [[0] * len(RUNS)] * 4 + [[0] * len(SINGLE)], runs["codes"]


@pytest.mark.parametrize("name", [n for n, (_, ref) in RUNS.items() if ref])
def test_sharded_strategies_equal_the_reference(runs, name):
    ref, got = records(runs["tmp"], RUNS[name][1]), records(runs["tmp"], name)
    assert len(got) == len(ref) == 3
    for key in ("lm_loss", "grad_norm"):
        assert_close([r[key] for r in got], [r[key] for r in ref], rel=1e-5)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]


def test_zero3_checkpoint_resumes_under_other_layouts(runs):
    straight = records(runs["tmp"], "zero3")
    assert sorted(os.listdir(os.path.join(runs["tmp"], CKPT))) == [
        "iter_0000002",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]
    resumed = records(runs["tmp"], "zero3_ep1_resumed")
    assert [r["iteration"] for r in resumed] == [3]
    for key in ("lm_loss", "grad_norm"):
        assert_close([resumed[0][key]], [straight[2][key]], rel=1e-5)


def test_zero3_shards_expert_weights_over_the_expert_data_parallel_group(runs):
    """Per rank after the meta-device build: weights = 4 B x (dense / DP + expert / EDP) plus the tied embedding's
    bucket (pinned: gathered whole), gradients = 4 B x (dense / DP + expert / EDP), up to the padding of each
    bucket to a multiple of its group (< group size elements); no expert parameter holds its whole storage."""
    dp, edp = 4, 2
    for rank, mem in enumerate(runs["memory"]):
        assert mem["expert_buffers"] and all(k == edp for k, _ in mem["expert_buffers"]), mem
        assert 0 <= sum(n for _, n in mem["expert_buffers"]) - mem["expert"] < edp * mem["buckets"], mem
        assert mem["expert"] == mem["expert_elements"], mem  # the planner counts this rank's experts
        assert mem["whole_expert_bytes"] == 0, mem  # sharded; before: 4 B x every expert parameter
        assert mem["pinned"] and min(mem["pinned"]) >= mem["embedding"], mem
        shards = 4 * (mem["dense"] / dp + mem["expert"] / edp)
        pad = 4 * dp * mem["buckets"]
        assert shards <= mem["grads"] <= shards + pad, (rank, mem, shards)
        held = shards + 4 * sum(mem["pinned"])
        assert held <= mem["weights"] <= held + pad, (rank, mem, held)
        # the start-up log's formula (fp32 Adam, ZeRO-3: 16/d dense, 16/d_e experts) against every byte of model
        # state (weights, gradients, Adam moments), the pinned embedding whole
        assert mem["d_e"] == edp and "d_e=2" in mem["formula_text"], mem
        state = 16 * (mem["dense"] / dp + mem["expert"] / edp)
        assert mem["formula_total"] == pytest.approx(state), mem
        assert state + 4 * sum(mem["pinned"]) <= mem["total"] <= state + 4 * sum(mem["pinned"]) + 4 * pad, mem
