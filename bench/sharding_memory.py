#!/usr/bin/env python
"""Model-state bytes per rank and data-parallel bytes moved per step for each
``--data-parallel-sharding-strategy`` (no_shard, optim, optim_grads, optim_grads_params).

Trains the reference tiny GPT of bench/comm_bytes.py (hidden 256, 4 layers, seq 256, vocab 8192,
untied output layer, bf16, ``--ddp-bucket-size`` 500k, overlapped reduction) on K spawned gloo
ranks (pure data parallel, 1 and 2 microbatches per step) and measures on rank 0, on the live tensors:

* steady: weights + gradients + fp32 main weights/gradients + Adam state held between iterations;
* peak: the largest sum of weights and gradient storage seen at any module forward or gradient
  accumulation of the last step, plus the optimizer's (constant) bytes;
* bytes each rank sends per step in the gradient and parameter collectives (ring model,
  :mod:`megalm.distributed.comm`) against the analytic count with ``G`` the padded fp32 gradient
  buffer, ``P`` the padded bf16 parameter buffer, ``M`` microbatches: no_shard ``2 (K-1)/K G``;
  optim and optim_grads ``(K-1)/K (G + P)``; optim_grads_params at most ``(K-1)/K (G + 2 M P)``
  (every bucket gathered for each microbatch's forward and again for its backward, less the
  buckets still gathered when they are needed again).

Numbers are bytes, deterministic; no timing (the CPU does not matter).

    python bench/sharding_memory.py [--ranks 4] [--steps 2] [--micro 1 2]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.abspath(os.path.join(HERE, os.path.pardir)), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from comm_bytes import MODEL, one_step, setup_trainer  # noqa: E402

from megalm.launch.spawn import run_distributed  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
EXTRA = ["--bf16", "--untie-embeddings-and-output-weights", "--ddp-bucket-size", "500000", "--overlap-grad-reduce"]
GRAD_KINDS = ("grad_all_reduce", "grad_reduce_scatter")
PARAM_KINDS = ("param_all_gather",)


def _live_bytes(chunks) -> int:
    """Weights and gradient storage held now (shards plus whatever is gathered / allocated)."""
    total = 0
    for chunk in chunks:
        for buf in chunk.all_buffers:
            total += buf.grad_bytes()
            if hasattr(buf, "param_bytes"):
                total += buf.param_bytes()
            else:
                total += sum(p.numel() * p.element_size() for p in buf.param_index_map)
    return total


def sampled_steps(trainer, steps: int = 1, before_step=None) -> dict:
    """Run ``steps`` steps (``before_step()`` before each) with sampling hooks on every module forward and
    gradient accumulation.  ``peak``: the largest weights + gradient storage seen in the last step;
    ``steady``: what is held after it; both plus the optimizer's (constant) bytes."""
    chunks, peak = trainer.model, [0]

    def sample(*_args):
        peak[0] = max(peak[0], _live_bytes(chunks))

    handles = [m.register_forward_pre_hook(sample) for c in chunks for m in c.module.modules()]
    handles += [p.register_post_accumulate_grad_hook(sample) for c in chunks for p in c.parameters()]
    for _ in range(steps):
        peak[0] = 0
        if before_step is not None:
            before_step()
        one_step(trainer)
        for c in chunks:
            c.finish_param_sync()
    for h in handles:
        h.remove()
    opt = trainer.optimizer.memory_breakdown()
    opt_bytes = opt["main_params"] + opt["main_grads"] + opt["optimizer_state"]
    return {"steady": _live_bytes(chunks) + opt_bytes, "peak": peak[0] + opt_bytes}


def measure(configs, steps):
    from megalm import parallel_state

    out = []
    for name, argv in configs:
        trainer = setup_trainer(argv)
        chunks = trainer.model
        mem = sampled_steps(trainer, steps, before_step=trainer.comm_stats.reset)  # comm stats of the last step
        stats = trainer.comm_stats.get()
        bufs = [b for c in chunks for b in c.all_buffers]
        numel = sum(b.numel for b in bufs)
        out.append(
            {
                "name": name,
                "params": sum(p.numel() for c in chunks for p in c.parameters()),
                **mem,
                "grad_wire": sum(stats.get(k, {}).get("wire_bytes", 0.0) for k in GRAD_KINDS),
                "param_wire": sum(stats.get(k, {}).get("wire_bytes", 0.0) for k in PARAM_KINDS),
                "G": 4 * numel,
                "P": 2 * numel,
            }
        )
        parallel_state.destroy_model_parallel()
    return out


def analytic(strategy, k, G, P, micro):
    f = (k - 1) / k
    return {
        "no_shard": 2 * f * G,
        "optim": f * (G + P),
        "optim_grads": f * (G + P),
        "optim_grads_params": f * (G + 2 * micro * P),
    }[strategy]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2], help="microbatches per step")
    args = ap.parse_args()
    for micro in args.micro:
        table(args.ranks, micro, args.steps)


def table(k, micro, steps):
    batch = ["--micro-batch-size", "1", "--global-batch-size", str(k * micro), "--train-iters", str(steps)]
    configs = [(s, MODEL + batch + EXTRA + ["--data-parallel-sharding-strategy", s]) for s in STRATEGIES]
    rows = run_distributed(measure, k, args=(configs, steps), timeout=900)[0]
    ref = rows[0]
    print(f"K={k} ranks, {ref['params'] / 1e6:.2f}M parameters, bf16, {micro} microbatches per step")
    print(
        "| strategy | steady MB/rank | vs no_shard | peak MB/rank (sampled) | vs no_shard "
        "| DP bytes sent MB/rank/step (analytic) | vs no_shard |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sent = r["grad_wire"] + r["param_wire"]
        want = analytic(r["name"], k, r["G"], r["P"], micro)
        ref_sent = ref["grad_wire"] + ref["param_wire"]
        print(
            f"| {r['name']} | {r['steady'] / 1e6:.2f} | {r['steady'] / ref['steady']:.3f} | {r['peak'] / 1e6:.2f} | "
            f"{r['peak'] / ref['peak']:.3f} | {sent / 1e6:.2f} ({want / 1e6:.2f}) | {sent / ref_sent:.3f} |"
        )


if __name__ == "__main__":
    main()
