"""Config validation: every invalid combination fails before any process group or model exists."""

import json

import pytest

from megalm.config import ConfigError, MegalmConfig, parse_config

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
            2,
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--group-query-attention", "--num-query-groups", "3"], None, "not divisible by --num-query-groups 3"),
        (["--group-query-attention"], None, "needs --num-query-groups"),
        (
            ["--pipeline-model-parallel-size", "3"],
            3,
            "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3",
        ),
        (["--max-position-embeddings", "16"], None, "--seq-length 32 is longer than --max-position-embeddings 16"),
        (["--hidden-size", "66"], None, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
        (["--bf16", "--fp16"], None, "mutually exclusive"),
        (["--recompute-granularity", "full"], None, "needs --recompute-method"),
        (["--recompute-method", "uniform"], None, "needs --recompute-granularity full"),
        (
            ["--global-batch-size", "6", "--micro-batch-size", "2"],
            2,
            "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2",
        ),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
        (["--train-iters", "5", "--train-samples", "5"], None, "only one of --train-iters and --train-samples"),
        (["--mock-data", "--data-path", "x"], None, "--mock-data cannot be combined"),
        (["--tokenizer-type", "SentencePieceTokenizer"], None, "needs --tokenizer-model"),
        (["--tokenizer-type", "NullTokenizer"], None, "needs --vocab-size"),
        (["--tokenizer-type", "GPT2BPETokenizer"], None, "needs --vocab-file and --merge-file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], None, "needs --merge-file"),
        (["--tokenizer-type", "Llama2Tokenizer"], None, "needs --tokenizer-model"),
        (["--split", "a,b"], None, "--split"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            2,
            "not divisible by --num-layers-per-virtual-pipeline-stage 3",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "3",
            ],
            2,
            "microbatches \\(3\\) to be divisible by --pipeline-model-parallel-size 2",
        ),
        (
            ["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"],
            3,
            "cannot be split evenly",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--seq-length",
                "31",
                "--max-position-embeddings",
                "64",
            ],
            2,
            "--seq-length 31 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--min-lr", "1", "--lr", "0.1"], None, "--min-lr 1.0 is larger than --lr 0.1"),
        (
            ["--attention-backend", "blocked", "--attention-dropout", "0.1"],
            None,
            "--attention-backend blocked has no attention dropout: set --attention-dropout 0",
        ),
        (
            ["--use-flash-attn", "--attention-backend", "fused", "--bf16"],
            None,
            "--use-flash-attn contradicts --attention-backend fused",
        ),
        (["--use-flash-attn"], None, "--attention-backend flash needs --bf16 or --fp16"),
        (["--use-pytorch-profiler", "--tensorboard-dir", "tb"], None, "--use-pytorch-profiler needs --profile"),
        (["--profile", "--use-pytorch-profiler"], None, "writes its trace to --tensorboard-dir"),
        (
            ["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
            None,
            "--profile-step-start 5 must be >= 0 and before --profile-step-end 5",
        ),
        (
            ["--profile", "--profile-ranks", "0", "4"],
            4,
            "--profile-ranks \\[4\\] must be ranks of the world \\(size 4\\)",
        ),
        (
            ["--rampup-batch-size", "16", "4", "100", "--global-batch-size", "8", "--train-samples", "1000"],
            1,
            "--rampup-batch-size start 16 and increment 4 must step from 0 < start <= --global-batch-size 8",
        ),
        (
            ["--rampup-batch-size", "2", "4", "100", "--global-batch-size", "8", "--train-samples", "1000"],
            1,
            "in whole increments",
        ),
        (["--optimizer-offload-fraction", "0"], None, "--optimizer-offload-fraction must be in \\(0, 1\\], got 0.0"),
        (
            ["--overlap-cpu-optimizer-d2h-h2d", "--optimizer", "lamb"],
            None,
            "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload",
        ),
    ],
)
def test_invalid_combinations(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(BASE + argv, world_size=world)


def test_parse_config_exits_with_message(capsys):
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + ["--tensor-model-parallel-size", "3"])
    assert "not divisible by --tensor-model-parallel-size 3" in str(e.value)


def test_derived_values_and_megatron_flags():
    cfg = parse_config(
        BASE
        + [
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
            "--tensor-model-parallel-size",
            "2",
            "--vocab-size",
            "1000",
            "--micro-batch-size",
            "2",
            "--data-path",
            "0.3",
            "a",
            "0.7",
            "b",
            "--position-embedding-type",
            "rope",
        ],
        world_size=8,
    )
    assert cfg.model.ffn_hidden_size == 128  # int(4 * 64 * 2/3 / 64) * 64
    assert cfg.model.add_bias_linear is False
    assert cfg.model.untie_embeddings_and_output_weights is True
    assert cfg.model.padded_vocab_size == 1024
    assert cfg.parallel.data_parallel_size == 4
    assert cfg.training.global_batch_size == 8
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    cfg = parse_config(
        BASE
        + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt"]
    )
    assert (cfg.data.vocab_file, cfg.data.merge_file) == ("gpt2-vocab.json", "gpt2-merges.txt")
    cfg = parse_config(
        BASE
        + [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "2",
        ],
        world_size=2,
    )
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2


def test_fusion_flags_default_on_with_megatron_spelling_accepted():
    assert parse_config(BASE).model.cross_entropy_loss_fusion is True
    assert (
        parse_config(BASE + ["--cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion is True
    )  # Megatron's flag
    assert parse_config(BASE + ["--no-cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion is False
    assert parse_config(BASE + ["--no-bias-swiglu-fusion"]).model.bias_swiglu_fusion is False


def test_megatron_spellings_of_flash_attention_and_throughput():
    cfg = parse_config(BASE + ["--use-flash-attn", "--bf16", "--log-throughput"])
    assert cfg.model.attention_backend == "flash" and cfg.logging.log_throughput
    assert (
        parse_config(BASE + ["--use-flash-attn", "--attention-backend", "flash", "--fp16"]).model.attention_backend
        == "flash"
    )
    assert parse_config(BASE).model.attention_backend == "auto"


def test_round_trip_through_dict():
    cfg = parse_config(BASE + ["--bf16", "--lr", "3e-4"], world_size=1)
    again = MegalmConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_use_checkpoint_args(tmp_path, capsys):
    """Architecture and tokenizer flags come from the checkpoint unless given; the result builds a
    model whose parameters load from it and train (one --finetune step)."""
    from tests.checkpoint_fixtures import LLAMA, save_random_model
    from tests.configs import TINY_GPT, make_config
    from tests.distributed_harness import run_distributed
    from tests.training_runs import run_trainings

    saved = make_config(
        TINY_GPT, LLAMA, vocab_size=300, tokenizer_type="NullTokenizer"
    )  # as a --mock-data run saves it: 299 ids + EOD
    save_random_model(saved, tmp_path / "ckpt")
    run = ["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--mock-data", "--micro-batch-size", "2"]
    cfg = parse_config(run + ["--seq-length", "8", "--hidden-dropout", "0"])
    m, s = cfg.model, saved.model
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "rotary_base",
        "norm_epsilon",
        "add_bias_linear",
        "max_position_embeddings",
    ):
        assert getattr(m, name) == getattr(s, name), name
    assert m.seq_length == 8 and s.seq_length == 16  # given on the command line: kept
    assert m.hidden_dropout == 0.0 and cfg.data.tokenizer_type == "NullTokenizer" and m.vocab_size == 299
    assert parse_config(run + ["--num-layers", "4"]).model.num_layers == 4
    with pytest.raises(ConfigError) as e:
        parse_config(["--use-checkpoint-args", "--mock-data"])
    assert "--use-checkpoint-args needs --load" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config(["--use-checkpoint-args", "--load", str(tmp_path)])
    assert f"--use-checkpoint-args: no checkpoint in {tmp_path}" in str(e.value)
    train = run + [
        "--finetune",
        "--train-iters",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--log-interval",
        "1",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    ]
    assert run_distributed(run_trainings, 1, args=([train],), timeout=200) == [[0]]  # a fresh process
    record = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert record["iteration"] == 1 and 0 < record["lm_loss"] < 20


def test_checkpoint_args_copy_only_real_fields():
    """--use-checkpoint-args copies these names: each must be a field of its section."""
    import dataclasses

    from megalm.config.checkpoint_args import DATA_FIELDS, MODEL_FIELDS
    from megalm.config.sections import DataConfig, ModelConfig

    assert set(MODEL_FIELDS) <= {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(DATA_FIELDS) <= {f.name for f in dataclasses.fields(DataConfig)}
