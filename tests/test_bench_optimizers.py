"""bench/optimizers.py's bookkeeping on a saved result (no training): the search's choice, each optimizer's
learning-rate rule at the large batch, the flags of one run, the tables of docs/benchmarks.md and the charts."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import optimizers as bench  # noqa: E402


def run(lr, losses, ms=10.0, batch=16):
    return {"lr": lr, "batch": batch, "curve": [(i * 1000, v) for i, v in enumerate(losses, 1)], "ms_per_iter": ms}


def saved():
    search = {
        "adam": [run(1e-3, [6.0]), run(2e-3, [5.5]), run(4e-3, [float("nan")])],  # NaN: never chosen
        "lars": [run(0.05, [7.0]), run(0.1, [6.5])],
    }
    runs = {
        "adam x1": run(2e-3, [6.0, 5.0], ms=10.0),
        "adam x8": run(2e-3 * math.sqrt(8), [6.5, 5.5], ms=20.0, batch=128),
        "lars x1": run(0.1, [6.5, 6.0], ms=5.0),
        "lars x8": run(0.8, [7.0, 6.6], ms=30.0, batch=128),
    }
    settings = {"device": "cpu", "torch": "x", "model": bench.MODEL, "batch": 16, "factor": 8, "grid_iters": 64}
    settings.update(tokens=2**21, rules=bench.RULES)
    return {"settings": settings, "search": search, "chosen": {"adam": 2e-3, "lars": 0.1}, "runs": runs}


def test_search_picks_the_lowest_final_loss_and_rules_scale_the_lr():
    s = saved()
    assert bench.best_lr(s["search"]["adam"]) == 2e-3
    assert bench.best_lr([run(1e-3, []), run(2e-3, [float("inf")])]) == 1e-3  # none finished: the first
    assert bench.scaled_lr(2e-3, bench.RULES["adam"], 8) == pytest.approx(2e-3 * math.sqrt(8))
    assert bench.scaled_lr(0.1, bench.RULES["lars"], 8) == pytest.approx(0.8)


def test_run_flags_warm_up_evaluate_and_scale():
    data = ["--data-cache-path", "cache"]
    argv = bench.run_argv(bench.MODEL, data, 128, "lars", 0.8, 128, 256, bench.EVALS, "m.jsonl")

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--lr") == "0.8" and flag("--min-lr") == "0.08" and flag("--lr-warmup-iters") == "25"
    assert flag("--global-batch-size") == "128" and flag("--micro-batch-size") == "128"
    assert flag("--eval-interval") == "32" and flag("--eval-iters") == str(bench.EVAL_SAMPLES // 128)
    assert flag("--hidden-size") == "256" and flag("--seq-length") == "128" and "--bf16" in argv
    assert flag("--lars-trust-coefficient") == "0.01"
    # one evaluation: after training only
    search = bench.run_argv(bench.MODEL, data, 128, "adam", 1e-3, 16, 64, 1, "m.jsonl")
    assert search[search.index("--eval-interval") + 1] == "64"


def test_tables_and_charts(tmp_path):
    bench.report(saved(), str(tmp_path))
    text = (tmp_path / "optimizers_table.md").read_text()
    assert "| AdamW (β2 0.95) | 0.001: 6.000 | **0.002: 5.500** | 0.004: inf |" in text
    # lars x1 6.0 / AdamW 5.0; x8 6.6 / 5.5; 6.6 / 6.0 at equal tokens; times 5/10 and 30/20
    assert "| linear | 0.1 | 0.8 | 6.000 | 1.200 | 6.600 | 1.200 | 1.100 | 0.50 | 1.50 |" in text
    for name in ("optimizers_b16.svg", "optimizers_b128.svg", "optimizers_lr_search.svg"):
        assert (tmp_path / name).read_text().startswith("<svg")
