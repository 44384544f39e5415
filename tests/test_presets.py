"""megalm.presets: the table is frozen data, the launcher's overrides and the schedule arithmetic
give the numbers the GPT-3 / Llama recipes state, errors name the problem, and scripts/README.md
shows the table as it is."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megalm.errors import MegalmError
from megalm.presets import PRESETS, Overrides, PresetError, get_preset, preset_flags, resolve
from megalm.presets.cli import markdown_table

REPO = Path(__file__).resolve().parents[1]


def presets_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "tools/presets.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        check=False,
    )


def test_presets_are_frozen_data():
    p = PRESETS["llama2_70b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.layout.tp = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.shape.num_layers = 2
    assert all(name == preset.name for name, preset in PRESETS.items()) and len(PRESETS) == 14
    assert (p.shape.num_query_groups, p.layout.tp, p.layout.pp, p.layout.world_size) == (8, 8, 4, 32)


@pytest.mark.parametrize(
    "name,train,decay,warmup",
    [
        # GPT-3: 300B tokens / (batch x 2048), decay over 260/300 of them, 375M warm-up tokens.
        ("gpt3_125m", 572204, 495910, 715),
        ("gpt3_175b", 95367, 82651, 119),
        # Llama 2: 2T tokens / (1024 x 4096), decay over all, 2000 warm-up iterations.
        ("llama2_7b", 476837, 476837, 2000),
        ("llama3_8b", 3576278, 3576278, 2000),  # 15T / (512 x 8192)
        ("mixtral_8x7b", 500000, 320000, 500),  # given in iterations
        ("gpt_tiny_cpu", 20, 20, 2),
    ],
)
def test_schedule_defaults(name, train, decay, warmup):
    launch = resolve(get_preset(name), Overrides(precision="fp32"))
    assert (launch.train_iters, launch.lr_decay_iters, launch.lr_warmup_iters) == (train, decay, warmup)


def test_overrides_reshape_the_schedule():
    p = get_preset("gpt3_125m")
    half = resolve(p, Overrides(global_batch_size=128))  # iterations follow the batch in tokens
    assert (half.train_iters, half.lr_warmup_iters) == (300_000_000_000 // (128 * 2048), 375_000_000 // (128 * 2048))
    short = resolve(get_preset("llama2_7b"), Overrides(train_iters=50))  # warm-up cut to a tenth of the decay
    assert (short.train_iters, short.lr_decay_iters, short.lr_warmup_iters) == (50, 50, 5)
    tokens = resolve(p, Overrides(train_tokens=1_000_000_000, lr=1e-3))
    assert tokens.train_iters == 1_000_000_000 // (256 * 2048) and tokens.lr == 1e-3 and tokens.min_lr == 6e-5
    dense = resolve(p, Overrides(ep=4, tp=2))  # EP only applies to mixture-of-experts presets
    assert dense.layout.ep is None and dense.layout.tp == 2
    assert resolve(get_preset("mixtral_8x7b"), Overrides(ep=4)).layout.ep == 4


def test_overrides_from_the_environment():
    o = Overrides.from_env(
        {
            "TP": "2",
            "LR": "1e-3",
            "DIST_OPT": "0",
            "SEQUENCE_PARALLEL": "1",
            "PP": "",
            "RECOMPUTE": "full",
            "UNRELATED": "x",
        }
    )
    assert o == Overrides(tp=2, lr=1e-3, dist_opt=False, sequence_parallel=True, recompute="full")
    assert Overrides.from_env({}) == Overrides()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"TP": "two"}, "TP must be an integer, got 'two'"),
        ({"LR": "fast"}, "LR must be a number, got 'fast'"),
        ({"TRAIN_ITERS": "0"}, "TRAIN_ITERS must be >= 1, got 0"),
        ({"RECOMPUTE": "some"}, "RECOMPUTE must be none, selective or full, got 'some'"),
        ({"PRECISION": "fp8"}, "PRECISION must be bf16, fp16, fp32 or auto, got 'fp8'"),
    ],
)
def test_bad_overrides_are_preset_errors(env, message):
    with pytest.raises(PresetError) as e:
        resolve(get_preset("gpt3_125m"), Overrides.from_env(env))
    assert str(e.value) == message and isinstance(e.value, MegalmError)


def test_unknown_preset_lists_the_names():
    with pytest.raises(PresetError) as e:
        get_preset("gpt3_1b")
    assert "unknown preset 'gpt3_1b'" in str(e.value) and all(name in str(e.value) for name in PRESETS)
    proc = presets_cli("gpt3_1b")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown preset 'gpt3_1b'" in proc.stderr and all(name in proc.stderr for name in PRESETS)
    bad = presets_cli("gpt3_125m", "--shell", env={"RECOMPUTE": "some"})
    assert bad.returncode == 2 and "RECOMPUTE must be none, selective or full" in bad.stderr and bad.stdout == ""


def test_cli_lists_and_prints_flags():
    listing = presets_cli()
    assert listing.returncode == 0 and [line.split()[0] for line in listing.stdout.splitlines()] == list(PRESETS)
    flags = presets_cli("llama2_70b", env={"TP": "2"})  # without --shell the environment is not read
    assert flags.returncode == 0 and flags.stdout.splitlines() == preset_flags("llama2_70b")
    assert flags.stdout.splitlines()[flags.stdout.splitlines().index("--tensor-model-parallel-size") + 1] == "8"


def test_shell_code_evaluates_to_the_recipe():
    """bash evaluating ``--shell`` gets the arrays and variables scripts/common.sh uses."""
    env = {"TP": "4", "TRAIN_ITERS": "30", "PRECISION": "fp32"}
    code = presets_cli("gpt_tiny_cpu", "--shell", env=env)
    assert code.returncode == 0, code.stderr
    script = code.stdout + 'printf "%s\\n" "$MODEL_NAME" "$TP" "$SAVE_INTERVAL" "$LOG_INTERVAL" "${RECIPE_ARGS[@]}"'
    out = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={"PATH": os.environ["PATH"], "LOG_INTERVAL": "1"},
    ).stdout.splitlines()
    assert out[:4] == ["gpt_tiny_cpu", "4", "30", "1"]  # SAVE_INTERVAL: the run's end; LOG_INTERVAL: env wins
    assert out[4:] == preset_flags("gpt_tiny_cpu", Overrides.from_env(env))[:-4]  # less the tokenizer flags


def test_readme_table_is_current():
    readme = (REPO / "scripts" / "README.md").read_text()
    start, end = readme.index("<!-- presets table -->\n"), readme.index("<!-- end presets table -->")
    assert readme[start + len("<!-- presets table -->\n") : end] == markdown_table()
    assert (
        "| `pretrain_mixtral_8x7b.sh` | Mixtral 8x7B (8 experts, top-2) | 1 | 4 | 8 | 8 | 1 / 256 | 32 (4) |"
        in markdown_table()
    )
