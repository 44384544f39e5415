"""A model with every fusion on trains to the same losses as with every fusion off (fp32,
TP 2 with sequence parallelism, so the fused pieces also run on sequence slices and
vocabulary shards), compiles once, and reports what it compiled."""

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import assert_close, losses, metrics_argv, records, run_trainings, tiny_flags

TINY = tiny_flags(
    seed="5",
    train_iters="5",
    micro_batch_size="4",
    global_batch_size="8",
    tensor_model_parallel_size="2",
    sequence_parallel=True,
)
LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
]
GPT = ["--attention-backend", "unfused"]  # LayerNorm, GeLU with biases, learned positions, tied
ALL_OFF = [
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion",
    "--no-norm-fusion",
    "--no-cross-entropy-loss-fusion",
]
ALL_ON = ["--cross-entropy-loss-fusion"]  # the default; Megatron's flag is still accepted


def _compiled_trainings(runs):
    import torch._dynamo

    torch._dynamo.config.disable = False  # the suite's default is off (tests/conftest.py)
    return run_trainings(runs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fusions"))

    plan = [
        metrics_argv(TINY, tmp, "llama_off", *LLAMA, *ALL_OFF),
        metrics_argv(TINY, tmp, "llama_on", *LLAMA, *ALL_ON),
        metrics_argv(TINY, tmp, "gpt_off", *GPT, *ALL_OFF),
        metrics_argv(TINY, tmp, "gpt_on", *GPT, *ALL_ON),
        metrics_argv(
            TINY, tmp, "gpt_on_dropout", *GPT, *ALL_ON, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"
        ),
    ]
    codes = run_distributed(_compiled_trainings, 2, args=(plan,), timeout=420, env={"TORCHDYNAMO_DISABLE": "0"})
    return tmp, codes


def test_runs_exit_cleanly(runs):
    _, codes = runs
    assert codes == [[0] * 5] * 2, codes


def test_all_fusions_on_train_like_all_off(runs):
    tmp, _ = runs
    for model in ("llama", "gpt"):
        assert_close(losses(tmp, f"{model}_on"), losses(tmp, f"{model}_off"), rel=2e-5)
    dropout = losses(tmp, "gpt_on_dropout")
    assert len(dropout) == 5 and all(0 < x < 10 for x in dropout)
    assert dropout != losses(tmp, "gpt_on")


def test_compilation_happens_in_the_first_iteration_only(runs):
    tmp, _ = runs
    for name in ("llama_on", "gpt_on"):
        rows = records(tmp, name)
        assert rows[0]["compiled_graphs"] >= 3 and rows[0]["compile_seconds"] > 0
        assert all("compiled_graphs" not in r for r in rows[1:]), rows  # fixed shapes: no recompiles
    assert all("compiled_graphs" not in r for r in records(tmp, "gpt_off")[1:])
