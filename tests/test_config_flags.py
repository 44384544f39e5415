"""No dead flags: every command-line flag's value is read by the code that acts on it, or is a
documented Megatron-LM no-op that warns when given."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from megalm.config import build_parser, config_from_args, validate_config
from megalm.config.sections import SECTIONS
from megalm.config.validation import MEGATRON_NO_OPS
from tests.logs import megalm_logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]

# Flags whose value megalm/config/validation.py itself acts on (read nowhere else by design).
CONSUMED_BY_VALIDATION = {
    "use_flash_attn": "becomes --attention-backend flash",
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
    read = _attributes_read({"megalm/config/sections.py", "megalm/config/validation.py"})
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    unread = sorted(fields - read - set(CONSUMED_BY_VALIDATION))
    assert not unread, f"flags accepted but never read (implement, refuse, or list as a Megatron no-op): {unread}"
    assert set(CONSUMED_BY_VALIDATION) <= fields
    in_validation = _attributes_read({p for p in _all_py() if p != "megalm/config/validation.py"})
    assert set(CONSUMED_BY_VALIDATION) <= in_validation


def _all_py() -> set:
    out = {"pretrain_gpt.py"}
    for folder, _, files in os.walk(os.path.join(ROOT, "megalm")):
        out |= {os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")}
    return out


@pytest.mark.parametrize("flag", sorted(MEGATRON_NO_OPS))
def test_megatron_no_op_flags_warn_naming_the_flag(flag, capsys):
    with megalm_logs("stderr"):
        validate_config(config_from_args(build_parser().parse_args(BASE + [flag])))
    err = capsys.readouterr().err
    assert f"[megalm] {flag} has no effect in megalm: {MEGATRON_NO_OPS[flag]}" in err
    assert err.count("has no effect") == 1


def test_no_warning_without_the_no_op_flags(capsys):
    with megalm_logs("stderr"):
        validate_config(config_from_args(build_parser().parse_args(BASE)))
    assert "has no effect" not in capsys.readouterr().err
