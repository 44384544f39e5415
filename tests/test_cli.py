"""The tools as commands: pyproject's console scripts are megalm.cli.COMMANDS, each command's
``main(["--help"])`` prints its usage, and each ``python tools/<tool>.py`` shim runs that main as a
script (megalm from the checkout, via PYTHONPATH: see conftest)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from megalm.cli import COMMANDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIMS = {
    "megalm-preprocess": "tools/preprocess_data.py",
    "megalm-merge-datasets": "tools/merge_datasets.py",
    "megalm-train-tokenizer": "tools/train_tokenizer.py",
    "megalm-convert": "tools/checkpoint/convert.py",
    "megalm-inspect": "tools/checkpoint/inspect.py",
    "megalm-generate": "tools/generate.py",
    "megalm-estimate": "tools/estimate.py",
    "megalm-cluster": "tools/cluster/run.py",
    "megalm-plan": "tools/plan.py",
    "megalm-presets": "tools/presets.py",
}


def test_pyproject_scripts_are_the_commands():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == COMMANDS
    assert set(SHIMS) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help(command, capsys):
    module, function = COMMANDS[command].split(":")
    main = getattr(importlib.import_module(module), function)
    try:
        code = main(["--help"])
    except SystemExit as e:  # argparse's --help
        code = e.code
    assert code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(SHIMS))
def test_shim_runs_the_command(command, monkeypatch, capsys):
    """``python tools/<tool>.py --help``, run in this process as ``__main__`` (runpy): the shim calls the
    command's main and exits with its status."""
    import runpy

    monkeypatch.setattr(sys, "argv", [SHIMS[command], "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(REPO, SHIMS[command]), run_name="__main__")
    assert e.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_checkpoint_shim_runs_as_a_script():
    """tools/checkpoint/ holds inspect.py: run as a real script (its directory first on sys.path), convert.py
    still imports the standard library's inspect (tests/test_inspect.py runs inspect.py itself)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "checkpoint", "convert.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
