#!/usr/bin/env python
"""Context parallelism on a tiny GPT: per-rank memory, step time and attention bytes sent per step.

For each sequence length and CP size (one spawned gloo rank per CP rank: DP = TP = PP = 1, micro-batch
1) and ``--cp-comm-type`` (p2p, a2a), a few training steps through megalm's trainer.  Per rank:

* step time: median of the timed steps (after one warm-up step);
* memory: the step's peak RSS above the RSS after the warm-up step (activations and temporaries;
  weights, gradients and optimizer state are already allocated), beside the planner's activation
  estimate (:mod:`megalm.estimate.activations`) for the same rank;
* bytes sent by the attention core per step, counted by wrapping ``torch.distributed.isend`` (ring)
  and ``all_to_all_single`` (Ulysses), against the analytic counts per layer (``B`` bytes per element,
  ``s/CP`` positions per rank, ``b`` micro-batch, ``n`` heads, ``g`` KV groups, ``d`` head dim):

  - p2p: ``(CP-1)`` K/V blocks forward, ``(CP-1)`` K/V blocks and ``CP`` dK/dV blocks backward, each
    ``2 b g (s/CP) d B``: ``(3 CP - 2) 2 b g (s/CP) d B``;
  - a2a: forward q, k, v in and the output back, backward their gradients, each all-to-all sending
    ``(CP-1)/CP`` of its tensor: ``2 (CP-1)/CP (s/CP) b (2n + 2g) d B``.

    python bench/context_parallel.py [--seq 2048 4096] [--cp 1 2 4] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.testing import run_distributed  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS = 2, 128, 8, 4
MODEL = [
    *("--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS)),
    *("--group-query-attention", "--num-query-groups", str(GROUPS), "--position-embedding-type", "rope"),
    *("--vocab-size", "1024", "--mock-data", "--num-workers", "0", "--attention-dropout", "0"),
    *("--hidden-dropout", "0", "--lr", "3e-4", "--log-interval", "1000", "--eval-iters", "0"),
    *("--no-log-memory", "--seed", "1", "--micro-batch-size", "1", "--global-batch-size", "1"),
]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _ByteCounter:
    """Wraps ``torch.distributed.isend`` and ``all_to_all_single`` to add up the bytes this rank sends."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.sent = dist, 0.0
        self.isend, self.a2a = dist.isend, dist.all_to_all_single

        def isend(tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return self.isend(tensor, *args, **kwargs)

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            k = dist.get_world_size(group)
            self.sent += input.numel() * input.element_size() * (k - 1) / k
            return self.a2a(output, input, *args, group=group, **kwargs)

        dist.isend, dist.all_to_all_single = isend, all_to_all_single


def measure(argv, steps):
    """On every rank: step times, peak RSS growth, attention bytes sent in the last step, estimate."""
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))
    from bench.comm_bytes import one_step, setup_trainer
    from megalm.estimate.activations import Shape, stage_activation_bytes

    trainer = setup_trainer(argv)
    counter = _ByteCounter()
    one_step(trainer)  # warm-up: allocates gradients and optimizer state
    base = _rss_mb()
    times = []
    for _ in range(steps):
        counter.sent = 0.0
        start = time.perf_counter()
        one_step(trainer)
        times.append(time.perf_counter() - start)
    m, p = trainer.cfg.model, trainer.cfg.parallel
    sh = Shape(m.seq_length, 1, 1, False, 4, "cpu", cp=p.context_parallel_size, cp_comm_type=p.cp_comm_type)
    estimate = stage_activation_bytes(trainer.cfg, 0, sh, 1)
    return {
        "step_s": statistics.median(times),
        "peak_growth_mb": _peak_rss_mb() - base,
        "sent_bytes": counter.sent,
        "estimate_mb": (estimate["activations"] + estimate["transient"]) / 2**20,
    }


def analytic_bytes(comm: str, seq: int, cp: int) -> float:
    if cp == 1:
        return 0.0
    d, local, elem = HIDDEN // HEADS, seq // cp, 4
    if comm == "p2p":
        return LAYERS * (3 * cp - 2) * 2 * GROUPS * local * d * elem
    return LAYERS * 2 * (cp - 1) / cp * local * (2 * HEADS + 2 * GROUPS) * d * elem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for seq in args.seq:
        for cp in args.cp:
            for comm in ("p2p",) if cp == 1 else ("p2p", "a2a"):
                argv = MODEL + ["--seq-length", str(seq), "--max-position-embeddings", str(seq)]
                argv += ["--context-parallel-size", str(cp), "--cp-comm-type", comm, "--train-iters", "100"]
                per_rank = run_distributed(measure, cp, args=(argv, args.steps), timeout=900)
                rows.append(
                    {
                        "seq": seq,
                        "cp": cp,
                        "comm": comm if cp > 1 else "-",
                        "step_s": max(r["step_s"] for r in per_rank),
                        "peak_growth_mb": max(r["peak_growth_mb"] for r in per_rank),
                        "estimate_mb": per_rank[0]["estimate_mb"],
                        "sent_bytes": per_rank[0]["sent_bytes"],
                        "analytic_bytes": analytic_bytes(comm, seq, cp),
                    }
                )
    print(
        "| seq | CP | comm | step s (max rank) | vs CP 1 | step peak RSS growth MB | estimate MB "
        "| sent MB/rank (analytic) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ref = next(r for r in rows if r["seq"] == row["seq"] and r["cp"] == 1)
        print(
            f"| {row['seq']} | {row['cp']} | {row['comm']} | {row['step_s']:.3f} | "
            f"{row['step_s'] / ref['step_s']:.2f} | "
            f"{row['peak_growth_mb']:.1f} | {row['estimate_mb']:.1f} | "
            f"{row['sent_bytes'] / 1e6:.3f} ({row['analytic_bytes'] / 1e6:.3f}) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
