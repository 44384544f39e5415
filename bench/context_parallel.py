#!/usr/bin/env python
"""Context parallelism on a tiny GPT: per-rank memory, step time and attention bytes sent per step.

For each sequence length and CP size (one spawned gloo rank per CP rank: DP = TP = PP = 1, micro-batch
1) and ``--cp-comm-type`` (p2p, a2a), a few training steps through megalm's trainer.  Per rank:

* step time: median of the timed steps (after one warm-up step);
* memory: the step's peak RSS above the RSS just before it (the kernel's peak-RSS record is restarted
  before each timed step, ``/proc/self/clear_refs``): activations and temporaries, since weights,
  gradients and optimizer state were allocated by the warm-up step; the largest over the timed steps,
  beside the planner's activation estimate (:mod:`megalm.estimate.activations`) for the same rank;
* bytes sent by the attention core per step, counted by wrapping ``torch.distributed.isend`` (ring)
  and ``all_to_all_single`` (Ulysses), against the analytic counts per layer (``B`` bytes per element,
  ``s/CP`` positions per rank, ``b`` micro-batch, ``n`` heads, ``g`` KV groups, ``d`` head dim):

  - p2p: ``(CP-1)`` K/V blocks forward, ``(CP-1)`` K/V blocks and ``CP`` dK/dV blocks backward, each
    ``2 b g (s/CP) d B``: ``(3 CP - 2) 2 b g (s/CP) d B``;
  - a2a: forward q, k, v in and the output back, backward their gradients, each all-to-all sending
    ``(CP-1)/CP`` of its tensor: ``2 (CP-1)/CP (s/CP) b (2n + 2g) d B``.

The longest sequence within a memory budget per rank (``--budget-mb``, ``--budget-comm``): for each CP
size, the planner's estimate picks the longest sequence on a ladder of multiples of ``--budget-step``
whose estimated activations fit the budget; that sequence trains (warm-up and one measured step), and
the ladder is walked from there by measurement (down while the step peak exceeds the budget, up while
it fits; at most 4 runs per CP) to the longest rung that fits.

    python bench/context_parallel.py [--seq 2048 4096 8192] [--cp 1 2 4] [--steps 3] [--json out.json]
        [--budget-mb 64] [--budget-comm a2a] [--budget-step 1024] [--no-table]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.launch.spawn import run_distributed  # noqa: E402

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


def _return_freed_memory() -> None:
    """glibc: serve every allocation of 64 KiB or more by mmap and trim the heap above 128 KiB, so freed
    tensors leave the RSS at once (by default glibc raises its mmap threshold as large blocks are freed
    and keeps them in the heap, so the RSS before a step would hold the previous step's activations)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 128 * 1024)


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS record (VmHWM) of this process at its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_since_reset_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


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

    _return_freed_memory()
    trainer = setup_trainer(argv)
    counter = _ByteCounter()
    one_step(trainer)  # warm-up: allocates gradients and optimizer state, compiles the fused kernels
    times, peaks = [], []
    for _ in range(steps):
        counter.sent = 0.0
        before = _rss_mb()
        _reset_peak_rss()
        start = time.perf_counter()
        one_step(trainer)
        times.append(time.perf_counter() - start)
        peaks.append(_peak_rss_since_reset_mb() - before)
    m, p = trainer.cfg.model, trainer.cfg.parallel
    sh = Shape(m.seq_length, 1, 1, False, 4, "cpu", cp=p.context_parallel_size, cp_comm_type=p.cp_comm_type)
    estimate = stage_activation_bytes(trainer.cfg, 0, sh, 1)
    return {
        "step_s": statistics.median(times),
        "step_peak_mb": max(peaks),
        "sent_bytes": counter.sent,
        "estimate_mb": (estimate["activations"] + estimate["transient"]) / 2**20,
    }


def model_argv(seq: int, cp: int, comm: str) -> list:
    argv = MODEL + ["--seq-length", str(seq), "--max-position-embeddings", str(seq)]
    return argv + ["--context-parallel-size", str(cp), "--cp-comm-type", comm, "--train-iters", "100"]


def estimate_mb(seq: int, cp: int, comm: str) -> float:
    """The planner's per-rank activations (+ transient) for one microbatch, as :func:`measure` reports it."""
    from megalm.config import parse_config
    from megalm.estimate.activations import Shape, stage_activation_bytes

    cfg = parse_config(model_argv(seq, cp, comm), world_size=cp)
    sh = Shape(seq, 1, 1, False, 4, "cpu", cp=cp, cp_comm_type=comm)
    estimate = stage_activation_bytes(cfg, 0, sh, 1)
    return (estimate["activations"] + estimate["transient"]) / 2**20


def longest_within_budget(cp: int, comm: str, budget_mb: float, step: int) -> int:
    """The longest multiple of ``step`` whose estimate fits ``budget_mb`` (0 if none)."""
    seq = 0
    while estimate_mb(seq + step, cp, comm) <= budget_mb:
        seq += step
    return seq


def budget_rows(cps, comm: str, budget_mb: float, step: int, max_runs: int = 4) -> list:
    """Per CP size: measure the estimate's pick, then walk the ladder (down while over the budget, up while
    within it) until the longest fitting rung is bracketed, at most ``max_runs`` runs; rows marked ``fits``."""
    rows = []
    for cp in cps:
        kind = comm if cp > 1 else "p2p"
        seq, measured = max(step, longest_within_budget(cp, kind, budget_mb, step)), {}
        while seq > 0 and seq not in measured and len(measured) < max_runs:
            per_rank = run_distributed(measure, cp, args=(model_argv(seq, cp, kind), 1), timeout=900)
            measured[seq] = max(r["step_peak_mb"] for r in per_rank)
            _progress({"budget cp": cp, "seq": seq, "step_peak_mb": measured[seq]})
            seq = seq + step if measured[seq] <= budget_mb else seq - step
        fitting = [s for s, mb in measured.items() if mb <= budget_mb]
        for seq in sorted(measured):
            rows.append(
                {
                    "cp": cp,
                    "comm": kind if cp > 1 else "-",
                    "seq": seq,
                    "measured_mb": measured[seq],
                    "estimate_mb": estimate_mb(seq, cp, kind),
                    "longest_fitting": bool(fitting) and seq == max(fitting),
                }
            )
    return rows


def _progress(row: dict) -> None:
    """Each measurement as it lands (stderr), so an interrupted run keeps what it measured."""
    print("progress " + json.dumps(row), file=sys.stderr, flush=True)


def analytic_bytes(comm: str, seq: int, cp: int) -> float:
    if cp == 1:
        return 0.0
    d, local, elem = HIDDEN // HEADS, seq // cp, 4
    if comm == "p2p":
        return LAYERS * (3 * cp - 2) * 2 * GROUPS * local * d * elem
    return LAYERS * 2 * (cp - 1) / cp * local * (2 * HEADS + 2 * GROUPS) * d * elem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--budget-comm", default="a2a", choices=["p2p", "a2a", "allgather"])
    ap.add_argument("--budget-step", type=int, default=1024)
    ap.add_argument("--no-table", action="store_true", help="only the memory-budget rows")
    ap.add_argument("--svg", default=None, help="write measured step peak MB against sequence length (SVG)")
    args = ap.parse_args()
    rows = [] if args.no_table else table_rows(args.seq, args.cp, args.steps)
    budget = budget_rows(args.cp, args.budget_comm, args.budget_mb, args.budget_step) if args.budget_mb else []
    print_table(rows)
    print(f"\nLongest sequence within {args.budget_mb:.0f} MB per rank (estimate picks, measured checks):\n")
    print("| CP | comm | seq | measured step peak MB | estimate MB | longest within budget |")
    print("|---|---|---|---|---|---|")
    for row in budget:
        mark = "**yes**" if row["longest_fitting"] else ""
        print(
            f"| {row['cp']} | {row['comm']} | {row['seq']} | {row['measured_mb']:.1f} | {row['estimate_mb']:.1f} "
            f"| {mark} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": rows, "budget_mb": args.budget_mb, "budget": budget}, f, indent=1)
    if args.svg:
        write_memory_chart(args.svg, rows + [dict(r, step_peak_mb=r["measured_mb"]) for r in budget])


def write_memory_chart(path: str, rows: list) -> None:
    """Measured step peak MB per rank against sequence length, one line per (CP, comm)."""
    from bench.svg_plot import write_line_chart

    series = {}
    for row in sorted(rows, key=lambda r: r["seq"]):
        label = f"CP {row['cp']}" + (f" {row['comm']}" if row["cp"] > 1 else "")
        points = series.setdefault(label, [])
        if all(x != row["seq"] for x, _ in points):
            points.append((row["seq"], row["step_peak_mb"]))
    write_line_chart(
        path,
        series,
        title="Context parallelism: measured step peak per rank (tiny GPT, fp32)",
        xlabel="sequence length",
        ylabel="step peak MB per rank",
    )


def table_rows(seqs, cps, steps) -> list:
    rows = []
    for seq in seqs:
        for cp in cps:
            for comm in ("p2p",) if cp == 1 else ("p2p", "a2a"):
                per_rank = run_distributed(measure, cp, args=(model_argv(seq, cp, comm), steps), timeout=900)
                rows.append(
                    {
                        "seq": seq,
                        "cp": cp,
                        "comm": comm if cp > 1 else "-",
                        "step_s": max(r["step_s"] for r in per_rank),
                        "step_peak_mb": max(r["step_peak_mb"] for r in per_rank),
                        "estimate_mb": per_rank[0]["estimate_mb"],
                        "sent_bytes": per_rank[0]["sent_bytes"],
                        "analytic_bytes": analytic_bytes(comm, seq, cp),
                    }
                )
                _progress(rows[-1])
    return rows


def print_table(rows) -> None:
    if not rows:
        return
    print(
        "| seq | CP | comm | step s (max rank) | vs CP 1 | step peak MB (max rank) | estimate MB "
        "| sent MB/rank (analytic) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ref = next(r for r in rows if r["seq"] == row["seq"] and r["cp"] == 1)
        print(
            f"| {row['seq']} | {row['cp']} | {row['comm']} | {row['step_s']:.3f} | "
            f"{row['step_s'] / ref['step_s']:.2f} | {row['step_peak_mb']:.1f} | {row['estimate_mb']:.1f} | "
            f"{row['sent_bytes'] / 1e6:.3f} ({row['analytic_bytes'] / 1e6:.3f}) |"
        )


if __name__ == "__main__":
    main()
