"""gpt-oss (sliding window on alternate layers, learnable sinks, clamped quick-GEGLU experts with biases,
YaRN) trained under TP2 + SP, CP2 (a2a and allgather), EP2 and PP2 on 4 real ranks: the losses and
gradient norms of 4 steps equal one process's.  One spawned group of 4 runs the parallel layouts in turn."""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import assert_close, records, run_trainings, tiny_flags

GPTOSS = tiny_flags(
    num_layers="4",
    hidden_size="32",
    group_query_attention=True,
    num_query_groups="2",
    position_embedding_type="yarn",
    rotary_scaling_factor="4",
    yarn_original_max_position_embeddings="16",
    normalization="RMSNorm",
    window_size="5,0",
    window_attn_skip_freq="2",
    softmax_type="learnable",
    quick_geglu=True,
    glu_linear_offset="1.0",
    activation_func_clamp_value="1.0",
    num_experts="4",
    moe_router_topk="2",
    moe_ffn_hidden_size="32",
    moe_aux_loss_coeff="1e-2",
    moe_token_dispatcher_type="alltoall",
    untie_embeddings_and_output_weights=True,
    init_method_std="0.2",
    micro_batch_size="2",
    global_batch_size="4",
    train_iters="4",
    no_log_memory=True,
)
LAYOUTS = {
    "tp2_sp_dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2_a2a_ep2": ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2"],
    "cp2_allgather_tp2": [
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "allgather",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gptoss"))

    def run(name, *extra):
        return GPTOSS + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")] + list(extra)

    codes = (
        run_distributed(run_trainings, 4, args=([run(n, *f) for n, f in LAYOUTS.items()],), timeout=400),
        run_distributed(run_trainings, 1, args=([run("one")],), timeout=200),
    )
    return {"tmp": tmp, "codes": codes}


def test_runs_exit_cleanly(runs):
    assert runs["codes"] == ([[0] * len(LAYOUTS)] * 4, [[0]]), runs["codes"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layouts_equal_one_process(runs, name):
    ref, got = records(runs["tmp"], "one"), records(runs["tmp"], name)
    assert len(got) == len(ref) == 4
    assert_close([r["lm_loss"] for r in got], [r["lm_loss"] for r in ref], rel=1e-5)
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rel=1e-5)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]  # it trains
