"""tools/checkpoint/inspect.py: a checkpoint described from its metadata alone, read by megalm.checkpoint.safe_metadata
(hostile .metadata files: tests/test_checkpoint_security.py)."""

import json
import os
import pickle
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from megalm.checkpoint.resume import find_checkpoint
from megalm.checkpoint.safe_metadata import CheckpointSecurityError, load_metadata
from megalm.checkpoint.save import save_checkpoint
from megalm.checkpoint.stateful import CheckpointStates
from megalm.conversion.checkpoint_info import describe, format_description
from megalm.parallel_state import get_process_groups
from megalm.training.checkpoint_states import DataPosition
from megalm.training.step import TrainState
from tests.configs import make_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megalm.models import GPTModel
    from megalm.optimizer import build_optimizer

    cfg = make_config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=100)
    model = GPTModel(cfg, process_groups=get_process_groups())
    optimizer = build_optimizer(cfg, [model], process_groups=get_process_groups())
    root = tmp_path_factory.mktemp("ckpt")
    for iteration in (5, 10):  # the data position, as the trainer registers it
        states = CheckpointStates()
        states.register("data", DataPosition(TrainState(iteration, consumed_train_samples=4 * iteration)))
        save_checkpoint(str(root), iteration, [model], optimizer, config=cfg.to_dict(), states=states)
    n = sum(p.numel() for p in model.parameters()) - (128 - 100) * 32  # padded vocabulary rows are not saved
    return root, n


def test_describe_reads_metadata_only(checkpoint):
    root, n = checkpoint
    info = describe(str(root))
    assert info["iteration"] == 10 and info["consumed_train_samples"] == 40
    assert info["total_parameters"] == n and info["model_bytes"] == 4 * n
    assert info["hf_architecture"] == "GPT2LMHeadModel" and info["has_optimizer_state"]
    shapes = {t["name"]: tuple(t["shape"]) for t in info["model_tensors"]}
    assert shapes["model.embedding.word_embeddings.weight"] == (100, 32)
    assert shapes["model.decoder.layers.1.self_attention.linear_qkv.weight"] == (96, 32)
    assert describe(str(root), iteration=5)["consumed_train_samples"] == 20
    text = format_description(info)
    assert f"{n:,} parameters" in text and "float32" in text and "tensor 1" in text


def test_cli_runs_as_a_script_without_shadowing_stdlib_inspect(checkpoint, capsys):
    root, n = checkpoint
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "checkpoint" / "inspect.py"), str(root), "--json", "--iteration", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["iteration"] == 5 and info["total_parameters"] == n
    main = runpy.run_path(str(REPO / "tools" / "checkpoint" / "inspect.py"))["main"]
    assert main([str(root / "nope")]) == 2 and "does not exist" in capsys.readouterr().err
    assert main([str(root), "--all"]) == 0 and "optimizer.decoder.layers.0" in capsys.readouterr().out


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_reader_refuses_arbitrary_objects(checkpoint, tmp_path):
    root, _ = checkpoint
    path = find_checkpoint(str(root))
    assert load_metadata(path).state_dict_metadata  # the real metadata passes
    bad = tmp_path / "iter"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointSecurityError, match="refusing to unpickle"):
        load_metadata(str(bad))
