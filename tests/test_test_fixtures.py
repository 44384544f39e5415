"""The tests build configs and argvs with the shared builders (tests/configs.py, tests/training_runs.py):
no test file calls ``MegalmConfig()`` or defines its own config/argv builder (a ``make_cfg``, ``_cfg``,
``*_cfg``, ``*_config`` or ``*_argv`` function).  A file whose tests share a special shape keeps it as a
dict constant and calls :func:`tests.configs.make_config` with it.  Also checks the builder itself."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from tests.configs import make_config, model_config, optimizer_config, parallel_config, tiny_config

TESTS = Path(__file__).resolve().parent
SHARED = {"configs.py", "training_runs.py"}  # the shared builders live here
BUILDER = re.compile(r"(make_)?(cfg|config|argv)|\w*_(cfg|config|argv)")

# Files that keep a builder of something that is not a megalm config or argv, each with its reason.
ALLOWED = {
    ("test_gptoss.py", "hf_config"): "a Hugging Face GptOssConfig (the converter's input), not a megalm config",
    ("test_megatron_scripts.py", "script_argv"): "Megatron-LM's example scripts' flags, read from .args files",
    ("test_planner.py", "_layout_cfg"): "one line: a planner Layout applied to tiny_flags_config (the tests' subject)",
}


# What a violation's source line looks like: only files with one are parsed (parsing them all costs ~0.5 s).
SUSPECT = re.compile(r"MegalmConfig\s*\(|def\s+\w*(cfg|config|argv)\s*\(")


def _violations(path: Path) -> list:
    out, source = [], path.read_text(encoding="utf-8")
    if not SUSPECT.search(source):
        return out
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and not node.args and not node.keywords:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "MegalmConfig":
                out.append(f"{path.name}:{node.lineno}: MegalmConfig() (use tests.configs.make_config)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and BUILDER.fullmatch(node.name):
            if not node.name.startswith("test_") and (path.name, node.name) not in ALLOWED:
                out.append(f"{path.name}:{node.lineno}: def {node.name} (a per-file builder: use tests/configs.py)")
    return sorted(out, key=lambda v: int(v.split(":")[1]))


def test_no_per_file_config_builders():
    found = [v for path in sorted(TESTS.glob("*.py")) if path.name not in SHARED for v in _violations(path)]
    assert not found, "\n".join(found)
    for name, function in ALLOWED:  # an allowance outlives no function
        assert f"def {function}(" in (TESTS / name).read_text(encoding="utf-8"), (name, function)


def test_guard_catches_builders(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "from megalm.config import MegalmConfig\n"
        "def make_cfg():\n    return MegalmConfig()\n"
        "def _model_cfg(**kw):\n    return 1\n"
        "def _argv(tmp):\n    return []\n"
        "def test_x():\n    import megalm.config as c\n    c.MegalmConfig()\n"
    )
    found = _violations(bad)
    assert [v.split(": ", 1)[0] for v in found] == [f"test_bad.py:{n}" for n in (2, 3, 4, 6, 10)], found


def test_make_config_routes_fields_to_their_sections():
    shape = dict(num_layers=3, hidden_size=32, num_attention_heads=4, lr=1e-3)
    cfg = make_config(shape, num_layers=2, tensor_model_parallel_size=2, vocab_size=100, world_size=2)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.training.lr) == (2, 32, 1e-3)  # later values win
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.model.padded_vocab_size == 256  # padded to a multiple of 128 * TP by validation
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 4
    with pytest.raises(TypeError, match="no config section has a field 'num_layer'"):
        make_config(num_layer=2)
    editable = optimizer_config(optimizer="sgd", lr=0.5)
    editable.training.lr = 0.25  # not validated: not frozen
    assert (editable.training.optimizer, editable.training.lr, editable.model.padded_vocab_size) == ("sgd", 0.25, None)
    assert tiny_config(500, hidden_size=32, num_attention_heads=4).model.padded_vocab_size == 512
    m, p = model_config(dict(num_layers=3), hidden_size=8), parallel_config(ddp_bucket_size=100)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, p.ddp_bucket_size) == (3, 8, None, 100)  # unvalidated
