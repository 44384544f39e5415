#!/usr/bin/env python
"""Communication-efficient data parallelism on the simulated cluster (DP 4 = 2 nodes x 2 ranks).

Each configuration is one real training run through ``tools/cluster/run.py`` (network namespaces,
inter-node links shaped with ``tc``; needs root or CAP_NET_ADMIN): ``pretrain_gpt.py`` on mock data,
the ~1.8M-parameter GPT of ``bench/hierarchical_reduce.py`` (hidden 128, 4 layers, vocab 8192),
every configuration with ``--hierarchical-grad-reduce`` (exact inside a node; the compression, or
the local-SGD / DiLoCo outer sync, on the inter-node leg only), ``--log-interval 1`` into a metrics
file and one validation at the end.  Reported per configuration, against uncompressed DP measured in
the same run: tokens/s (all iterations after the first, wall time of the steps), its ratio to
uncompressed, the inter-node bytes per step of the busiest node (mean over the steps: local SGD sends
once every H), the validation loss after the same number of tokens, and the training loss after the
same wall time (the fastest configuration's training time).  ``--json`` also keeps each run's loss
curve (seconds, training loss) for a plot.

    python3 bench/comm_efficient_dp.py [--bandwidth 100mbit] [--iters 64] [--only none,topk]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
MODEL = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--mock-data", "--vocab-size", "8192", "--num-workers", "0",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--log-interval", "1",
    "--ddp-bucket-size", "500000", "--overlap-grad-reduce", "--hierarchical-grad-reduce", "--eval-iters", "4",
]  # fmt: skip
CONFIGS = {
    "none": [],
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", "4"],
    "topk": ["--grad-compression", "topk", "--topk-ratio", "0.01"],
    "int8": ["--grad-compression", "int8"],
    "local_sgd_h8": ["--local-sgd-interval", "8"],
    "diloco_h32": ["--local-sgd-interval", "32", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
}
LABELS = {
    "none": "uncompressed DP",
    "powersgd": "PowerSGD rank 4",
    "topk": "top-k 1%",
    "int8": "int8 (nearest)",
    "local_sgd_h8": "local SGD H=8",
    "diloco_h32": "DiLoCo H=32",
}


def run(name: str, extra, args, tmp: str) -> dict:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", "2", "--procs-per-node", "2",
           "--name", args.name, "--timeout", str(args.timeout)]  # fmt: skip
    if args.bandwidth != "unshaped":
        cmd += ["--inter-node-bandwidth", args.bandwidth]
    cmd += ["--", os.path.join(ROOT, "pretrain_gpt.py")] + MODEL + extra
    cmd += ["--train-iters", str(args.iters), "--eval-interval", str(args.iters), "--metrics-file", metrics]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the cluster run exited {done.returncode}:\n{done.stdout[-3000:]}")
    rows = [json.loads(line) for line in open(metrics)]
    train = [r for r in rows if r.get("lm_loss") is not None and "split" not in r]
    valid = [r for r in rows if r.get("split") == "validation"]
    later = train[1:] or train
    seconds = sum(r["elapsed_ms"] for r in later) / 1e3
    tokens = len(later) * 8 * 64
    elapsed, curve = 0.0, []
    for r in train:
        elapsed += r["elapsed_ms"] / 1e3
        curve.append((elapsed, r["lm_loss"]))
    return {
        "name": name,
        "curve": curve,  # (seconds since the start of training, training loss) per iteration
        "tokens_per_s": tokens / seconds,
        "inter_node_MB_per_step": max(sum(r["inter_node_bytes"] for r in later) / len(later) / 1e6, 0.0),
        "train_loss": train[-1]["lm_loss"],
        "valid_loss": valid[-1]["loss"] if valid else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidth", default="100mbit", help="inter-node link rate (tc units) or 'unshaped'")
    p.add_argument("--iters", type=int, default=64, help="training iterations per configuration")
    p.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations ('none' always runs)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cluster run")
    p.add_argument("--name", default="mlccomp", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    names = ["none"] + [n for n in args.only.split(",") if n != "none"]
    with tempfile.TemporaryDirectory(prefix="megalm-comp-bench-") as tmp:
        os.chmod(tmp, 0o777)
        results = [run(n, CONFIGS[n], args, tmp) for n in names]
    base = results[0]
    t_equal = min(r["curve"][-1][0] for r in results)  # the fastest run's training time
    print(f"2 nodes x 2 ranks, DP 4 (hierarchical), inter-node link {args.bandwidth}, {args.iters} iterations")
    print(
        f"{'method':18s} {'tokens/s':>9s} {'x DP':>6s} {'inter-node MB/step':>19s} {'valid loss':>11s} {'vs DP':>7s} "
        f"{f'train loss at {t_equal:.0f} s':>20s}"
    )
    for r in results:
        rel = "" if r["valid_loss"] is None else f"{100 * (r['valid_loss'] / base['valid_loss'] - 1):+6.1f}%"
        valid = "" if r["valid_loss"] is None else f"{r['valid_loss']:.4f}"
        at_equal_time = [loss for t, loss in r["curve"] if t <= t_equal][-1]
        print(
            f"{LABELS[r['name']]:18s} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:6.2f} "
            f"{r['inter_node_MB_per_step']:19.3f} {valid:>11s} {rel:>7s} {at_equal_time:20.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "iters": args.iters, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
