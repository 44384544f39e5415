#!/usr/bin/env python
"""The memory ladder measured: step time and peak model-state bytes per ``--data-parallel-sharding-strategy``
(ZeRO-3 with and without prefetch), and the largest model each strategy fits in a per-rank budget.

1. Step time (``--ranks`` spawned gloo ranks, pure data parallel, the reference tiny GPT of
   bench/sharding_memory.py: 7.4M parameters, bf16, untied output layer, ``--ddp-bucket-size 500000
   --overlap-grad-reduce``, 2 microbatches per step): the median over ``--steps`` steps after a warm-up
   step of the slowest rank's step time, for no_shard, optim, optim_grads, optim_grads_params and
   optim_grads_params with ``--overlap-param-gather`` (prefetch), as ratios to no_shard measured in the
   same run; then one more step with sampling hooks for the peak of weights + gradient storage (rank 0,
   live tensors, at every module forward and gradient accumulation) plus the optimizer's bytes.
2. Largest model per budget: over a grid of layers x hidden (heads = hidden / 64, seq 256, vocab 8192,
   the same flags), the planner (:func:`megalm.estimate.planner.plan`, no reserve) gives each strategy's
   largest rank (steady model state, the buckets ZeRO-2/3 hold above it during a step
   (:mod:`megalm.estimate.sharding_peaks`), activations, transient buffers); the largest model (by
   parameters) whose plan fits ``--budget-mb`` is that strategy's boundary.  Each boundary model is then trained for two
   steps and measured: steady model state (between steps) and the sampled peak, each plus the planner's
   activations and transient buffers (tested against measured saved tensors in tests/test_estimate.py),
   against the budget.

3. ``--plot PATH``: the planner's largest model per strategy against the budget (``--plot-budgets``, no
   training), as an SVG line chart.

Timings depend on the machine and its load; bytes do not.  ``--out`` writes the numbers as JSON.

    python bench/sharding_ladder.py [--ranks 4] [--steps 4] [--budget-mb 160] [--skip-time] [--skip-budget]
        [--plot bench/results/sharding_ladder.svg] [--out bench/results/sharding_ladder.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.abspath(os.path.join(HERE, os.path.pardir)), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from comm_bytes import MODEL, one_step, setup_trainer  # noqa: E402
from sharding_memory import EXTRA, sampled_steps  # noqa: E402

from megalm.launch.spawn import run_distributed  # noqa: E402

STRATEGY = "--data-parallel-sharding-strategy"
LADDER = [
    ("no_shard", [STRATEGY, "no_shard"]),
    ("optim", [STRATEGY, "optim"]),
    ("optim_grads", [STRATEGY, "optim_grads"]),
    ("optim_grads_params", [STRATEGY, "optim_grads_params"]),
    ("optim_grads_params + prefetch", [STRATEGY, "optim_grads_params", "--overlap-param-gather"]),
]
HIDDEN = (128, 192, 256, 320, 384, 448, 512, 640, 768)
MAX_LAYERS = 32


def _model(layers: int, hidden: int) -> list:
    """MODEL with ``layers`` x ``hidden`` (heads of 64)."""
    argv = list(MODEL)
    for flag, value in (("--num-layers", layers), ("--hidden-size", hidden), ("--num-attention-heads", hidden // 64)):
        argv[argv.index(flag) + 1] = str(value)
    return argv


def _batch(k: int, micro: int, steps: int) -> list:
    return ["--micro-batch-size", "1", "--global-batch-size", str(k * micro), "--train-iters", str(steps + 2)]


def measure(configs, steps):
    """On every rank: per config, this rank's step times, then (rank 0's numbers count) steady and peak bytes."""
    import torch.distributed as dist

    from megalm import parallel_state

    out = []
    for name, argv in configs:
        trainer = setup_trainer(argv)
        times = []
        for _ in range(steps + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            one_step(trainer)
            times.append(time.perf_counter() - start)
        params = sum(p.numel() for c in trainer.model for p in c.parameters())
        row = {"name": name, "times": times[1:], "params": params}
        row.update(sampled_steps(trainer))
        out.append(row)
        parallel_state.destroy_model_parallel()
    return out


def time_table(k: int, steps: int, micro: int = 2) -> list:
    configs = [(name, MODEL + _batch(k, micro, steps) + EXTRA + flags) for name, flags in LADDER]
    ranks = run_distributed(measure, k, args=(configs, steps), timeout=900)
    rows = []
    for i, r in enumerate(ranks[0]):
        slowest = [max(rank[i]["times"][s] for rank in ranks) for s in range(steps)]
        rows.append({**r, "step_s": statistics.median(slowest)})
    ref = rows[0]
    print(f"K={k} ranks, {ref['params'] / 1e6:.2f}M parameters, bf16, {micro} microbatches per step, median of {steps}")
    print("| strategy | step s (slowest rank) | vs no_shard | peak MB/rank (model state) | vs no_shard |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.2f} | {r['peak'] / 1e6:.1f} | "
            f"{r['peak'] / ref['peak']:.2f} |"
        )
    return rows


def planned(k: int, layers: int, hidden: int, budget_mb: float) -> dict:
    """The planner's largest-rank bytes per strategy for this model on ``k`` ranks (no reserve)."""
    from megalm.estimate.cli import parse
    from megalm.estimate.planner import plan

    flags = ["--world-size", str(k), "--gpu-memory-gb", str(budget_mb / 1e3), "--reserve-gb", "0"]
    flags += ["--device", "cpu", "--device-peak-flops", "1e12"]  # no matmul measured: only bytes are used
    flags += ["--tokenizer-type", "NullTokenizer"]  # what --mock-data trains with (vocabulary + 1)
    cfg, options = parse(_model(layers, hidden) + _batch(k, 1, 2) + EXTRA + flags)
    r = plan(cfg, options)
    stage = r["stages"][0]
    return {
        "params": r["total_parameters"],
        "bytes": r["largest_rank_bytes_by_strategy"],
        "rest": stage["activations"] + stage["transient"],
    }


def boundaries(k: int, budget_mb: float) -> dict:
    """Per strategy: the model of the grid with the most parameters whose planned largest rank fits."""
    best = {}
    for hidden in HIDDEN:
        for layers in range(1, MAX_LAYERS + 1):
            p = planned(k, layers, hidden, budget_mb)
            fits = [s for s, b in p["bytes"].items() if b <= budget_mb * 1e6]
            if not fits:
                break  # deeper models only grow
            for s in fits:
                if s not in best or p["params"] > best[s]["params"]:
                    best[s] = {"layers": layers, "hidden": hidden, **p}
    return best


def measure_boundaries(rows):
    """On every rank: two steps of each boundary model, its steady and peak model-state bytes (rank 0's)."""
    from megalm import parallel_state

    out = []
    for name, argv in rows:
        trainer = setup_trainer(argv)
        one_step(trainer)
        out.append({"name": name, **sampled_steps(trainer)})
        parallel_state.destroy_model_parallel()
    return out


def budget_table(k: int, budget_mb: float) -> dict:
    best = boundaries(k, budget_mb)
    strategies = [s for s in ("no_shard", "optim", "optim_grads", "optim_grads_params") if s in best]
    runs = [
        (s, _model(best[s]["layers"], best[s]["hidden"]) + _batch(k, 1, 2) + EXTRA + [STRATEGY, s]) for s in strategies
    ]
    measured = {r["name"]: r for r in run_distributed(measure_boundaries, k, args=(runs,), timeout=1200)[0]}
    print(f"\nLargest model per {budget_mb:.0f} MB per rank, K={k} ranks (planner; measured at the boundary)")
    print(
        f"| strategy | layers x hidden | parameters (M) | vs {strategies[0]} | planned MB/rank | measured steady "
        "MB/rank | measured peak MB/rank |"
    )
    print("|---|---|---|---|---|---|---|")
    ref = best[strategies[0]]["params"]
    for s in strategies:
        b, m = best[s], measured[s]
        steady, peak = m["steady"] + b["rest"], m["peak"] + b["rest"]
        best[s].update(measured_steady=steady, measured_peak=peak)
        print(
            f"| {s} | {b['layers']} x {b['hidden']} | {b['params'] / 1e6:.1f} | {b['params'] / ref:.2f} | "
            f"{b['bytes'][s] / 1e6:.1f} | {steady / 1e6:.1f} | {peak / 1e6:.1f}"
            f"{'' if peak <= budget_mb * 1e6 else ' (over)'} |"
        )
    return best


def plot(k: int, budgets: list, path: str) -> dict:
    """The planner's largest model (M parameters) per strategy at each budget, drawn to ``path``."""
    from svg_plot import write_line_chart

    series = {}
    for budget in budgets:
        for s, b in boundaries(k, budget).items():
            series.setdefault(s, []).append((budget, b["params"] / 1e6))
    write_line_chart(
        path,
        series,
        title=f"Largest model per rank budget, {k} ranks (planner)",
        xlabel="budget per rank (MB: model state + activations)",
        ylabel="parameters (M)",
    )
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per strategy (after one warm-up)")
    ap.add_argument("--budget-mb", type=float, default=160.0, help="per-rank memory budget (1e6 bytes)")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-budget", action="store_true")
    ap.add_argument("--plot", default=None, help="draw the planner's largest model against the budget here (SVG)")
    ap.add_argument("--plot-budgets", type=float, nargs="+", default=[80, 120, 160, 200, 240, 320, 400])
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    result = {}
    if not args.skip_time:
        result["time"] = time_table(args.ranks, args.steps)
    if not args.skip_budget:
        result["budget"] = budget_table(args.ranks, args.budget_mb)
    if args.plot:
        result["plot"] = plot(args.ranks, args.plot_budgets, args.plot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
