#!/usr/bin/env python
"""Bytes communicated per training step per rank: plain data parallel vs the distributed optimizer.

Trains the reference tiny GPT (hidden 256, 4 layers, seq 256, vocab 8192; ``--hidden-size`` etc.
to change) for a few steps on K spawned gloo ranks (pure data parallel) with and without
``--use-distributed-optimizer``, in fp32 and bf16, and reads megalm's collective counters
(:mod:`megalm.distributed.comm`, ring model) for the last step.  Analytic counts, with ``B`` the
padded gradient buffer (fp32) and ``P`` the padded parameter buffer (fp32 or bf16):

* plain DP: all-reduce ``2 (K-1)/K x B``;
* distributed optimizer: reduce-scatter ``(K-1)/K x B`` + all-gather ``(K-1)/K x P``.

Small collectives (grad norm, loss averaging, found-inf) are listed as "other".

    python bench/comm_bytes.py [--ranks 2 4] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.launch.spawn import run_distributed  # noqa: E402

MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--vocab-size",
    "8192",
    "--mock-data",
    "--num-workers",
    "0",
    "--lr",
    "3e-4",
    "--log-interval",
    "1000",
    "--eval-iters",
    "0",
    "--no-log-memory",
    "--seed",
    "1",
]
GRAD_KINDS = ("grad_all_reduce", "grad_reduce_scatter")
PARAM_KINDS = ("param_all_gather",)


def setup_trainer(argv):
    """A set-up :class:`megalm.training.training.Trainer` (parallel state initialized, model,
    optimizer and data built), ready for :meth:`step`-by-step use."""
    import pretrain_gpt
    from megalm.config import parse_config
    from megalm.training.initialize import world_size_from_env
    from megalm.training.training import Trainer

    cfg = parse_config(list(argv), world_size=world_size_from_env())
    trainer = Trainer(cfg, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    trainer.setup()
    return trainer


def one_step(trainer):
    from megalm.training.step import train_step

    return train_step(
        trainer.cfg,
        trainer.forward_step_func,
        trainer.train_iter,
        trainer.model,
        trainer.optimizer,
        trainer.scheduler,
        trainer.state,
        trainer.microbatches,
        trainer.groups,
        comm_stats=trainer.comm_stats,
    )


def measure(configs, steps):
    """On every rank: per config, the collective counters of the last of ``steps`` steps."""
    from megalm import parallel_state
    from megalm.checkpoint.model_state import finish_param_sync

    out = []
    for name, argv in configs:
        trainer = setup_trainer(argv)
        for _ in range(steps):
            trainer.comm_stats.reset()
            one_step(trainer)
            finish_param_sync(trainer.model)
        stats = trainer.comm_stats.get()
        bufs = [b for c in trainer.model for b in c.all_buffers]
        out.append(
            {
                "name": name,
                "stats": stats,
                "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs),
                "param_buffer_bytes": sum(b.grad_data.numel() * b.param_dtype.itemsize for b in bufs),
                "params": sum(p.numel() for c in trainer.model for p in c.parameters()),
            }
        )
        parallel_state.destroy_model_parallel()
    return out


def analytic(k, grad_bytes, param_bytes, distributed):
    if distributed:
        return (k - 1) / k * grad_bytes, (k - 1) / k * param_bytes
    return 2 * (k - 1) / k * grad_bytes, 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args, extra = ap.parse_known_args()
    rows = []
    for k in args.ranks:
        batch = ["--micro-batch-size", "1", "--global-batch-size", str(k), "--train-iters", str(args.steps)]
        configs = [
            (
                f"{prec} {'distributed' if dist_opt else 'plain'}",
                MODEL
                + batch
                + extra
                + ([] if prec == "fp32" else ["--bf16"])
                + (["--use-distributed-optimizer"] if dist_opt else []),
            )
            for prec in ("fp32", "bf16")
            for dist_opt in (False, True)
        ]
        per_rank = run_distributed(measure, k, args=(configs, args.steps), timeout=900)
        for i, (name, _) in enumerate(configs):
            res = [r[i] for r in per_rank]
            stats = res[0]["stats"]
            for r in res[1:]:  # every rank communicates the same
                assert {kk: v["wire_bytes"] for kk, v in r["stats"].items()} == {
                    kk: v["wire_bytes"] for kk, v in stats.items()
                }, name
            grad = sum(stats.get(kind, {}).get("wire_bytes", 0.0) for kind in GRAD_KINDS)
            param = sum(stats.get(kind, {}).get("wire_bytes", 0.0) for kind in PARAM_KINDS)
            other = sum(v["wire_bytes"] for kind, v in stats.items() if kind not in GRAD_KINDS + PARAM_KINDS)
            a_grad, a_param = analytic(
                k, res[0]["grad_buffer_bytes"], res[0]["param_buffer_bytes"], "distributed" in name
            )
            rows.append(
                {
                    "ranks": k,
                    "config": name,
                    "params": res[0]["params"],
                    "grad_bytes": grad,
                    "param_bytes": param,
                    "other_bytes": other,
                    "analytic_grad": a_grad,
                    "analytic_param": a_param,
                    "collectives": {kk: v["calls"] for kk, v in stats.items()},
                }
            )
    print(
        "| K | config | grad collective MB/rank (analytic) | param all-gather MB/rank (analytic) | other KB | "
        "total vs plain DP |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        plain = next(
            r for r in rows if r["ranks"] == row["ranks"] and r["config"] == row["config"].split()[0] + " plain"
        )
        total = row["grad_bytes"] + row["param_bytes"]
        print(
            f"| {row['ranks']} | {row['config']} | "
            f"{row['grad_bytes'] / 1e6:.3f} ({row['analytic_grad'] / 1e6:.3f}) | "
            f"{row['param_bytes'] / 1e6:.3f} ({row['analytic_param'] / 1e6:.3f}) | {row['other_bytes'] / 1e3:.2f} | "
            f"{total / (plain['grad_bytes'] + plain['param_bytes']):.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
