#!/usr/bin/env python
"""Time per training step with and without communication overlap, on 4 ranks (pure data parallel).

Five configurations of the reference tiny GPT (hidden 256, 4 layers, seq 256, vocab 8192), all
with ``--ddp-bucket-size 1000000`` (about 6 buckets, so there is something to overlap) and the
same batch (``--micro-batch-size 2``, 2 microbatches per rank):

* plain DP (all-reduce after backward), plain DP + ``--overlap-grad-reduce``,
* distributed optimizer (reduce-scatter after backward, all-gather after the step),
  + ``--overlap-grad-reduce``, + ``--overlap-param-gather``.

All five are built in one process group and measured in alternating blocks of ``--steps``
steps (rotating the order each round; a block ends with waiting for pending all-gathers, inside
the timing), so machine noise hits them alike.  Reported: the median over ``--rounds`` blocks of
the per-step time (rank 0; ranks are synchronized by the collectives), and its ratio to plain DP;
then the median time of the bare collectives on a buffer of the model's size (fp32), which on
gloo is what decides the comparison (gloo's reduce-scatter is not a bandwidth-optimal ring).

    python bench/overlap_step_time.py [--ranks 4] [--rounds 5] [--steps 3] [--bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))

from comm_bytes import MODEL, one_step, setup_trainer  # noqa: E402

from megalm.launch.spawn import run_distributed  # noqa: E402

CONFIGS = [
    ("plain DP", []),
    ("plain DP + overlap grad reduce", ["--overlap-grad-reduce"]),
    ("distributed optimizer", ["--use-distributed-optimizer"]),
    ("distributed + overlap grad reduce", ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    (
        "distributed + overlap grad reduce + param gather",
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    ),
]


def measure(common, rounds, steps):
    import torch.distributed as dist

    from megalm.checkpoint.model_state import finish_param_sync

    trainers = [setup_trainer(common + extra) for _, extra in CONFIGS]
    for trainer in trainers:  # warm-up step each
        one_step(trainer)
        finish_param_sync(trainer.model)
    numel = sum(b.grad_data.numel() for c in trainers[0].model for b in c.all_buffers)
    collectives = time_collectives(numel, rounds * steps)
    times = [[] for _ in CONFIGS]
    for r in range(rounds):
        order = [(i + r) % len(CONFIGS) for i in range(len(CONFIGS))]
        for i in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step(trainers[i])
            finish_param_sync(trainers[i].model)
            times[i].append((time.perf_counter() - t0) / steps)
    return times, collectives


def time_collectives(numel, repeats):
    """Median seconds of all-reduce, reduce-scatter and all-gather of ``numel`` fp32 over the world."""
    import torch
    import torch.distributed as dist

    from megalm.tensor_parallel.utils import all_gather_flat, reduce_scatter_flat

    k, r = dist.get_world_size(), dist.get_rank()
    shard = -(-numel // k)
    x = torch.randn(shard * k)
    ops = {
        "all-reduce": lambda: dist.all_reduce(x),
        "reduce-scatter": lambda: reduce_scatter_flat(x[r * shard : (r + 1) * shard], x),
        "all-gather": lambda: all_gather_flat(x, x[r * shard : (r + 1) * shard]),
    }
    out = {}
    for name, op in ops.items():
        ts = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts[1:])
    out["bytes"] = 4 * shard * k
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json", default=None)
    args, extra = ap.parse_known_args()
    k = args.ranks
    common = (
        MODEL
        + [
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            str(4 * k),
            "--ddp-bucket-size",
            "1000000",
            "--train-iters",
            str(10 * args.rounds * args.steps),
        ]
        + (["--bf16"] if args.bf16 else [])
        + extra
    )
    times, collectives = run_distributed(measure, k, args=(common, args.rounds, args.steps), timeout=1800)[0]
    medians = [statistics.median(t) for t in times]
    print(f"{k} ranks, {'bf16' if args.bf16 else 'fp32'}, median of {args.rounds} blocks of {args.steps} steps")
    print("| configuration | s/step (median) | min..max | vs plain DP |")
    print("|---|---|---|---|")
    for (name, _), med, t in zip(CONFIGS, medians, times):
        print(f"| {name} | {med:.3f} | {min(t):.3f}..{max(t):.3f} | {med / medians[0]:.3f} |")
    mb = collectives.pop("bytes") / 1e6
    rs_ag = (collectives["reduce-scatter"] + collectives["all-gather"]) / collectives["all-reduce"]
    print(
        f"\nbare collectives on {mb:.1f} MB (fp32, {k} ranks): "
        + ", ".join(f"{name} {sec * 1e3:.0f} ms" for name, sec in collectives.items())
        + f"; reduce-scatter + all-gather = {rs_ag:.2f} x all-reduce"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": k,
                    "bf16": args.bf16,
                    "configs": [n for n, _ in CONFIGS],
                    "times": times,
                    "collectives": collectives,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
