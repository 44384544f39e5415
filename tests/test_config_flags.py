"""No dead flags: every command-line flag's value is read by the code that acts on it, or is a
documented Megatron-LM no-op that warns when given."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from megalm.config import ConfigError, build_parser, config_from_args, parse_config, validate_config
from megalm.config.sections import SECTIONS
from megalm.config.validation import MEGATRON_NO_OPS
from tests.configs import MODEL_FLAGS
from tests.logs import megalm_logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = list(MODEL_FLAGS)

# The files that check the config (each section's module with its validate(), the cross-section
# checks, the order): reading a flag there checks it, it does not act on it.
VALIDATION_FILES = {
    f"megalm/config/{name}.py"
    for name in (
        "sections",
        "validation",
        "cross",
        "model",
        "model_checks",
        "moe",
        "parallel",
        "training",
        "lr_schedule",
        "data",
        "checkpoint",
        "logs",
    )
}

# Flags whose value the config's validation itself acts on (read nowhere else by design).
CONSUMED_BY_VALIDATION = {
    "use_flash_attn": "becomes --attention-backend flash",
    "add_position_embedding": "--no-position-embedding becomes --position-embedding-type none",
    "recompute_activations": "becomes --recompute-granularity selective",
    "replication_factor": "only 2 (the default: a rank's own copy and one replica) is built; others refused",
    "recompute_modules": "core_attn is megalm's selective recompute; the rest refused",
    "cpu_offloading_weights": "refused: weight offloading is not built (--cpu-offloading moves activations)",
    "grad_reduce_in_bf16": "turns --accumulate-allreduce-grads-in-fp32 off (bf16 gradient buffers)",
    "lr_warmup_iters": "lr_schedule_samples",
    "lr_warmup_fraction": "lr_schedule_samples",
    "lr_decay_iters": "lr_schedule_samples",
    "lr_decay_samples": "lr_schedule_samples",
    "lr_warmup_samples": "lr_schedule_samples",
    "lr_wsd_decay_samples": "lr_schedule_samples",
    "lr_wsd_decay_iters": "lr_schedule_samples",
    "step_batch_size_schedule": "step_schedule (the trainer's microbatch calculator calls it)",
    "apply_query_key_layer_scaling": "Megatron no-op: warns",
    "log_throughput": "Megatron no-op: warns",
    "log_validation_ppl_to_tensorboard": "Megatron no-op: warns",
}


def _attributes_read(skip) -> set:
    """Names read as ``x.<name>`` (or ``getattr(x, "<name>")``) in megalm/ and pretrain_gpt.py, outside
    the files in ``skip``."""
    paths = [os.path.join(ROOT, "pretrain_gpt.py")]
    for folder, _, files in os.walk(os.path.join(ROOT, "megalm")):
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    names = set()
    for path in paths:
        if os.path.relpath(path, ROOT) in skip:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                names.add(n.attr)
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "getattr"
                and len(n.args) >= 2
                and isinstance(n.args[1], ast.Constant)
            ):
                names.add(n.args[1].value)
    return names


def test_every_flag_is_read_by_the_code_that_acts_on_it():
    read = _attributes_read(VALIDATION_FILES)
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    unread = sorted(fields - read - set(CONSUMED_BY_VALIDATION))
    assert not unread, f"flags accepted but never read (implement, refuse, or list as a Megatron no-op): {unread}"
    assert set(CONSUMED_BY_VALIDATION) <= fields
    in_validation = _attributes_read(_all_py() - VALIDATION_FILES)
    assert set(CONSUMED_BY_VALIDATION) <= in_validation


def _all_py() -> set:
    out = {"pretrain_gpt.py"}
    for folder, _, files in os.walk(os.path.join(ROOT, "megalm")):
        out |= {os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")}
    return out


# How each no-op flag appears in a Megatron-LM launch script.
NO_OP_ARGV = {
    "--manual-gc-interval": ["--manual-gc-interval", "10"],
    "--empty-unused-memory-level": ["--empty-unused-memory-level", "1"],
    "--dist-ckpt-strictness": ["--dist-ckpt-strictness", "log_all"],
    "--distributed-backend": ["--distributed-backend", "gloo"],
    "--tiktoken-pattern": ["--tiktoken-pattern", "v2"],
    "--moe-flex-dispatcher-backend": ["--moe-flex-dispatcher-backend", "hybridep"],
}


@pytest.mark.parametrize("flag", sorted(MEGATRON_NO_OPS))
def test_megatron_no_op_flags_warn_naming_the_flag(flag, capsys):
    with megalm_logs("stderr"):
        validate_config(config_from_args(build_parser().parse_args(BASE + NO_OP_ARGV.get(flag, [flag]))))
    err = capsys.readouterr().err
    assert f"[megalm] WARNING: Megatron-LM flags with no effect in megalm: {flag} ({MEGATRON_NO_OPS[flag]})" in err
    assert err.count("no effect") == 1


def test_every_no_op_flag_given_makes_one_warning_line(capsys):
    argv = [a for flag in sorted(MEGATRON_NO_OPS) for a in NO_OP_ARGV.get(flag, [flag])]
    with megalm_logs("stderr"):
        validate_config(config_from_args(build_parser().parse_args(BASE + argv)))
    lines = [line for line in capsys.readouterr().err.splitlines() if "no effect" in line]
    assert len(lines) == 1 and all(f"{flag} (" in lines[0] for flag in MEGATRON_NO_OPS), lines


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ckpt-format", "torch"], "--ckpt-format torch is not supported: megalm reads and writes torch_dist"),
        (["--ckpt-format", "zarr"], "--ckpt-format zarr is not supported"),
        (["--distributed-backend", "nccl"], "--distributed-backend nccl does not match the backend megalm uses"),
        (["--fp8-param-gather"], "--fp8-param-gather is not supported by megalm: fp8 parameter all-gather"),
        (["--multi-latent-attention"], "--multi-latent-attention needs --position-embedding-type rope"),
        (["--mtp-num-layers", "0"], "--mtp-num-layers must be >= 1"),
        (["--window-size", "4096,2"], "--window-size right must be 0"),
    ],
)
def test_megatron_flags_megalm_cannot_honour_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(config_from_args(build_parser().parse_args(BASE + argv)))


def test_megatron_script_forms_parse_as_megatron():
    """--split with the literal quotes Megatron's example scripts pass; --moe-router-pre-softmax with
    sigmoid scores is ignored (Megatron ignores it), not refused; W&B's directory defaults to <save>/wandb."""
    cfg = validate_config(config_from_args(build_parser().parse_args(BASE + ["--split", "'99,1,0'"])))
    assert [float(x) for x in cfg.data.split.strip("'").split(",")] == [99, 1, 0]
    from megalm.data.builder import parse_split

    assert parse_split(cfg.data.split) == [0.99, 0.01, 0.0]
    moe = ["--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"]
    cfg = validate_config(config_from_args(build_parser().parse_args(BASE + moe)))
    assert cfg.model.moe_router_pre_softmax is False
    wandb = ["--wandb-project", "p", "--save", "/tmp/run"]
    assert validate_config(config_from_args(build_parser().parse_args(BASE + wandb))).logging.wandb_save_dir == (
        "/tmp/run/wandb"
    )
    both = wandb + ["--wandb-save-dir", "/tmp/elsewhere"]
    assert validate_config(config_from_args(build_parser().parse_args(BASE + both))).logging.wandb_save_dir == (
        "/tmp/elsewhere"
    )


def test_no_warning_without_the_no_op_flags(capsys):
    with megalm_logs("stderr"):
        validate_config(config_from_args(build_parser().parse_args(BASE)))
    assert "no effect" not in capsys.readouterr().err


def test_megatron_spellings_of_model_flags():
    assert parse_config([*BASE, "--no-position-embedding"]).model.position_embedding_type == "none"
    assert (
        parse_config(
            [*BASE, "--no-position-embedding", "--position-embedding-type", "rope"]
        ).model.position_embedding_type
        == "rope"
    )
    assert (
        parse_config([*BASE, "--position-embedding-type", "learned_absolute"]).model.position_embedding_type
        == "learned_absolute"
    )
    assert parse_config([*BASE, "--recompute-activations"]).model.recompute_granularity == "selective"
    assert parse_config(
        [*BASE, "--recompute-activations", "--recompute-modules", "core_attn"]
    ).model.recompute_modules == ["core_attn"]
    modules = parse_config(
        [*BASE, "--recompute-activations", "--recompute-modules", "core_attn", "mlp", "moe"]
    ).model.recompute_modules
    assert modules == ["core_attn", "mlp", "moe"]
    with pytest.raises(ConfigError, match="--recompute-modules attn is not a recomputable module"):
        parse_config([*BASE, "--recompute-activations", "--recompute-modules", "core_attn", "attn"])
    assert parse_config([*BASE, "--bf16", "--grad-reduce-in-bf16"]).parallel.accumulate_allreduce_grads_in_fp32 is False
    assert parse_config([*BASE, "--bf16"]).parallel.accumulate_allreduce_grads_in_fp32 is True
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16 needs --bf16"):
        parse_config([*BASE, "--grad-reduce-in-bf16"])
    moe = ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert parse_config([*BASE, *moe, "--expert-tensor-parallel-size", "1"]).parallel.expert_tensor_parallel_size == 1
    assert parse_config([*BASE, *moe, "--expert-tensor-parallel-size", "2"]).parallel.expert_tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 2 is not supported with --optimizer muon"):
        parse_config([*BASE, *moe, "--expert-tensor-parallel-size", "2", "--optimizer", "muon"])
    with pytest.raises(ConfigError, match="--recompute-activations means --recompute-granularity selective, not full"):
        parse_config(
            [*BASE, "--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "uniform"]
        )
