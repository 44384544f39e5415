#!/usr/bin/env python
"""Pipeline bubble of the real 1F1B and interleaved schedules over real gloo p2p, measured with
simulated stage compute.

Each rank holds 2 stand-in "layers" (``--layers-per-rank``): a layer's forward sleeps
``--layer-ms`` and its backward twice that (inside a custom autograd function), so compute time
is fixed and the 2 CPU cores do not distort it.  With ``v`` virtual stages the rank's layers are
split into ``v`` chunks.  Per configuration (p, m, v) the schedule runs ``--iters`` timed
iterations after one warm-up; each iteration starts at a barrier, and the fastest iteration is
kept (on a shared machine other processes only ever add time).

    step time T      = slowest rank's schedule time (fastest of the timed iterations)
    busy time C_r    = time rank r spent inside layer forward/backward (measured, includes sleep overshoot)
    measured bubble  = mean over ranks of (T - C_r) / T
    theory           = (p - 1) / (v m + p - 1)
    overhead T0      = step time of the same schedule with 0-ms layers (p2p latency + Python:
                       the cost of the exchanges on the critical path, which the theory leaves out)
    bubble w/o T0    = (T - T0 - ideal compute) / (T - T0)

The theory is the fraction of a 1F1B step that a stage idles when every stage's forward +
backward of one microbatch takes the same time and communication is free: the step lasts
``(m + (p - 1) / v)`` microbatch-times of which ``(p - 1) / v`` are idle (interleaving shrinks
the fill/drain by ``v``).

    python bench/pipeline_bubble.py [--layer-ms 10] [--iters 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.launch.spawn import run_distributed  # noqa: E402

SHAPE = (16, 2, 64)  # [s, b, h] exchanged between stages
BUSY = {"seconds": 0.0}


class _SleepLayer(torch.autograd.Function):
    """Identity whose forward sleeps ``t`` seconds and backward ``2 t``."""

    @staticmethod
    def forward(ctx, x, weight, t):
        ctx.t = t
        start = time.perf_counter()
        time.sleep(t)
        BUSY["seconds"] += time.perf_counter() - start
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(2 * ctx.t)
        BUSY["seconds"] += time.perf_counter() - start
        return grad, grad.sum().reshape(1), None


class SleepChunk(torch.nn.Module):
    """A model chunk of ``layers`` simulated layers; the first stage reads its input from data,
    the last returns a scalar loss."""

    def __init__(self, layers: int, layer_seconds: float, pre_process: bool, post_process: bool):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(1)) for _ in range(layers)])
        self.t = layer_seconds
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.pre_process else self.input_tensor
        for w in self.weights:
            h = _SleepLayer.apply(h, w, self.t)
        return h.mean() if self.post_process else h


def _forward_step(data_iterator, model):
    x = next(data_iterator) if model.pre_process else None
    return model(x), lambda loss: (loss, {"loss": loss.detach()})


def _data():
    while True:
        yield torch.ones(SHAPE)


def _one_config(p: int, m: int, v: int, layers_per_rank: int, layer_seconds: float, iters: int) -> dict:
    from megalm import parallel_state as ps
    from megalm.pipeline_parallel.p2p_communication import P2PCommunicator
    from megalm.pipeline_parallel.schedules import get_forward_backward_func

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v if v > 1 else None
    )
    try:
        rank = ps.get_pipeline_model_parallel_rank()
        per_chunk = layers_per_rank // v
        chunks = [
            SleepChunk(per_chunk, layer_seconds, c == 0 and rank == 0, c == v - 1 and rank == p - 1) for c in range(v)
        ]
        groups = ps.get_process_groups()
        schedule = get_forward_backward_func(groups, v)
        comm = P2PCommunicator(SHAPE, torch.float32, groups=groups)
        steps, busy = [], []
        for i in range(iters + 1):
            dist.barrier(group=ps.get_pipeline_model_parallel_group())
            BUSY["seconds"] = 0.0
            start = time.perf_counter()
            schedule(
                forward_step_func=_forward_step,
                data_iterator=_data(),
                model=chunks,
                num_microbatches=m,
                communicator=comm,
                groups=groups,
            )
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
            if i > 0:
                steps.append(float(elapsed))
                busy.append(BUSY["seconds"])
        best = min(range(iters), key=lambda i: steps[i])  # the least disturbed iteration (same on every rank)
        return {"step": steps[best], "busy": busy[best]}
    finally:
        ps.destroy_model_parallel()


def _rank_main(p: int, configs, layers_per_rank: int, layer_seconds: float, iters: int) -> list:
    out = []
    for m, v in configs:
        row = _one_config(p, m, v, layers_per_rank, layer_seconds, iters)
        row["overhead"] = _one_config(p, m, v, layers_per_rank, 0.0, iters)["step"]
        out.append(row)
    return out


def theory(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-ms", type=float, default=10.0, help="forward time of one layer (backward is 2x)")
    ap.add_argument("--layers-per-rank", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--virtual-stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    for p in args.pipeline_sizes:
        configs = [(m, v) for m in args.microbatches for v in args.virtual_stages]
        per_rank = run_distributed(
            _rank_main, p, args=(p, configs, args.layers_per_rank, args.layer_ms / 1e3, args.iters), timeout=600
        )
        for i, (m, v) in enumerate(configs):
            step = per_rank[0][i]["step"]
            idle = [(step - r[i]["busy"]) / step for r in per_rank]
            ideal = m * args.layers_per_rank * 3 * args.layer_ms / 1e3
            overhead = per_rank[0][i]["overhead"]
            rows.append(
                {
                    "p": p,
                    "m": m,
                    "v": v,
                    "step_s": step,
                    "ideal_compute_s": ideal,
                    "measured_bubble": statistics.mean(idle),
                    "max_rank_bubble": max(idle),
                    "overhead_s": overhead,
                    "bubble_without_overhead": (step - overhead - ideal) / (step - overhead),
                    "theory": theory(p, m, v),
                }
            )
    print(
        "| p | m | v | step (s) | ideal compute (s) | bubble measured | theory (p-1)/(vm+p-1) | measured / theory "
        "| overhead T0 (s) | bubble w/o T0 | w/o T0 / theory |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['p']} | {r['m']} | {r['v']} | {r['step_s']:.3f} | {r['ideal_compute_s']:.3f} | "
            f"{r['measured_bubble']:.3f} | {r['theory']:.3f} | {r['measured_bubble'] / r['theory']:.2f} | "
            f"{r['overhead_s']:.3f} | {r['bubble_without_overhead']:.3f} | "
            f"{r['bubble_without_overhead'] / r['theory']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
