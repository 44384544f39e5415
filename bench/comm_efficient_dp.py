#!/usr/bin/env python
"""Communication-efficient data parallelism on the simulated cluster (DP 4 = 2 nodes x 2 ranks).

Each configuration is one real training run through ``tools/cluster/run.py`` (network namespaces,
inter-node links shaped with ``tc``; needs root or CAP_NET_ADMIN) of ``pretrain_gpt.py``, every
configuration with ``--hierarchical-grad-reduce`` (exact inside a node; the compression, or the
local-SGD / DiLoCo outer sync, on the inter-node leg only), ``--log-interval 1`` into a metrics file.

* ``--data-dir DIR`` (the quickstart's output: ``stdlib_text_document.{bin,idx}``, ``tokenizer.model``):
  the quickstart's model and training flags (4 layers, hidden 256, sequence 128, global batch 16,
  vocab 8192, ~5.3M parameters; bf16 with fp32 gradients, AdamW, cosine LR, warmup 20 iterations or
  half the run if shorter) on the quickstart corpus,
  validation every ``--eval-interval`` iterations;
* without it: the ~1.9M-parameter GPT of ``bench/hierarchical_reduce.py`` on mock data, one validation
  at the end.

Reported per configuration, against uncompressed DP measured in the same run: tokens/s (all
iterations after the first, the steps' wall time, evaluations excluded), its ratio to uncompressed,
the inter-node bytes per step of the busiest node (mean over the steps: local SGD sends once every
H), the validation loss after the same number of tokens, and after the same training wall time (the
fastest configuration's; validation losses interpolated linearly in time between two evaluations),
and the training loss at that time.  ``--json`` keeps every run's curves; ``--svg PREFIX`` writes
``PREFIX_tokens.svg`` (validation loss vs tokens) and ``PREFIX_time.svg`` (vs training seconds).

    python3 bench/comm_efficient_dp.py [--data-dir quickstart_out] [--bandwidth 100mbit] [--iters 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from svg_plot import write_line_chart  # noqa: E402

COMMON = ["--num-workers", "0", "--log-interval", "1", "--ddp-bucket-size", "500000", "--overlap-grad-reduce",
          "--hierarchical-grad-reduce"]  # fmt: skip
MOCK = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--mock-data", "--vocab-size", "8192",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--eval-iters", "4",
]  # fmt: skip
QUICKSTART = [  # examples/quickstart.sh's model and optimizer (bf16: its choice on CPUs with native bf16)
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--bf16", "--split", "98,1,1", "--tokenizer-type", "SentencePieceTokenizer",
]  # fmt: skip
CONFIGS = {
    "none": [],
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", "4"],
    "topk": ["--grad-compression", "topk", "--topk-ratio", "0.01"],
    "int8": ["--grad-compression", "int8"],
    "local_sgd_h8": ["--local-sgd-interval", "8"],
    "diloco_h32": ["--local-sgd-interval", "32", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
    "fp8": ["--grad-compression", "fp8"],
    "local_sgd_h8_overlap": ["--local-sgd-interval", "8", "--local-sgd-overlap-steps", "4"],
    "local_sgd_h4_overlap": ["--local-sgd-interval", "4", "--local-sgd-overlap-steps", "4"],
    "local_sgd_h8_overlap1": ["--local-sgd-interval", "8", "--local-sgd-overlap-steps", "1"],
    "local_sgd_h8_overlap2": ["--local-sgd-interval", "8", "--local-sgd-overlap-steps", "2"],
    "diloco_h8_overlap1": ["--local-sgd-interval", "8", "--local-sgd-overlap-steps", "1"]
    + ["--outer-lr", "0.7", "--outer-momentum", "0.9"],
}
LABELS = {
    "none": "uncompressed DP",
    "powersgd": "PowerSGD rank 4",
    "topk": "top-k 1%",
    "int8": "int8 (nearest)",
    "local_sgd_h8": "local SGD H=8",
    "diloco_h32": "DiLoCo H=32",
    "fp8": "fp8 e4m3 (nearest)",
    "local_sgd_h8_overlap": "local SGD H=8, overlapped 4 steps",
    "local_sgd_h4_overlap": "local SGD H=4, overlapped 4 steps",
    "local_sgd_h8_overlap1": "local SGD H=8, overlapped 1 step",
    "local_sgd_h8_overlap2": "local SGD H=8, overlapped 2 steps",
    "diloco_h8_overlap1": "DiLoCo H=8, overlapped 1 step",
}


def model_flags(args) -> tuple:
    """(flags, tokens per iteration, evaluation interval)."""
    if not args.data_dir:
        return COMMON + MOCK, 8 * 64, args.iters
    d = os.path.abspath(args.data_dir)
    data = ["--data-path", os.path.join(d, "stdlib_text_document")]
    data += ["--tokenizer-model", os.path.join(d, "tokenizer.model")]
    data += ["--eval-iters", str(args.eval_iters), "--lr-warmup-iters", str(min(20, args.iters // 2))]
    return COMMON + QUICKSTART + data, 16 * 128, args.eval_interval


def run(name: str, extra, args, tmp: str) -> dict:
    flags, tokens_per_iter, eval_interval = model_flags(args)
    metrics = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", "2", "--procs-per-node", "2",
           "--name", args.name, "--timeout", str(args.timeout)]  # fmt: skip
    if args.bandwidth != "unshaped":
        cmd += ["--inter-node-bandwidth", args.bandwidth]
    cmd += ["--", os.path.join(ROOT, "pretrain_gpt.py")] + flags + extra
    cmd += ["--train-iters", str(args.iters), "--eval-interval", str(eval_interval), "--metrics-file", metrics]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the cluster run exited {done.returncode}:\n{done.stdout[-3000:]}")
    rows = [json.loads(line) for line in open(metrics)]
    train = [r for r in rows if r.get("lm_loss") is not None and "split" not in r]
    later = train[1:] or train
    seconds = sum(r["elapsed_ms"] for r in later) / 1e3
    elapsed, curve, at = 0.0, [], {}
    for r in train:
        elapsed += r["elapsed_ms"] / 1e3
        curve.append((elapsed, r["lm_loss"]))
        at[r["iteration"]] = elapsed
    valid = [
        (r["iteration"] * tokens_per_iter, at[r["iteration"]], r["loss"])
        for r in rows
        if r.get("split") == "validation"
    ]
    return {
        "name": name,
        "curve": curve,  # (seconds since the start of training, training loss) per iteration
        "valid": valid,  # (tokens, training seconds, validation loss) per evaluation
        "tokens_per_s": len(later) * tokens_per_iter / seconds,
        "inter_node_MB_per_step": max(sum(r["inter_node_bytes"] for r in later) / len(later) / 1e6, 0.0),
        "train_loss": train[-1]["lm_loss"],
        "valid_loss": valid[-1][2] if valid else None,
    }


def valid_at(r: dict, t: float):
    """Validation loss at training time ``t``, linear between the evaluations around it (None before the first)."""
    points = [(s, loss) for _, s, loss in r["valid"]]
    if not points or t < points[0][0]:
        return None
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= t <= s1:
            return l0 + (l1 - l0) * (t - s0) / (s1 - s0)
    return points[-1][1]


def report(results, args) -> None:
    base = results[0]
    t_equal = min(r["curve"][-1][0] for r in results)  # the fastest run's training time
    print(f"2 nodes x 2 ranks, DP 4 (hierarchical), inter-node link {args.bandwidth}, {args.iters} iterations")
    print(
        f"{'method':18s} {'tokens/s':>9s} {'x DP':>6s} {'inter-node MB/step':>19s} {'valid loss':>11s} {'vs DP':>7s} "
        f"{f'valid loss at {t_equal:.0f} s':>20s} {f'train loss at {t_equal:.0f} s':>20s}"
    )
    for r in results:
        rel = "" if r["valid_loss"] is None else f"{100 * (r['valid_loss'] / base['valid_loss'] - 1):+6.1f}%"
        valid = "" if r["valid_loss"] is None else f"{r['valid_loss']:.4f}"
        at_time = valid_at(r, t_equal)
        at_time = "" if at_time is None else f"{at_time:.4f}"
        train_at_time = [loss for t, loss in r["curve"] if t <= t_equal][-1:] or [float("nan")]
        print(
            f"{LABELS[r['name']]:18s} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:6.2f} "
            f"{r['inter_node_MB_per_step']:19.3f} {valid:>11s} {rel:>7s} {at_time:>20s} {train_at_time[0]:20.4f}"
        )


def plot(results, args) -> None:
    by_tokens = {LABELS[r["name"]]: [(tok / 1000, loss) for tok, _, loss in r["valid"]] for r in results}
    by_time = {LABELS[r["name"]]: [(s, loss) for _, s, loss in r["valid"]] for r in results}
    where = f"DP 4 = 2 nodes x 2, {args.bandwidth} between nodes"
    write_line_chart(f"{args.svg}_tokens.svg", by_tokens, title="Validation loss at equal tokens (any link)",
                     xlabel="training tokens (thousands)", ylabel="validation loss")  # fmt: skip
    write_line_chart(f"{args.svg}_time.svg", by_time, title=f"Validation loss over training time ({where})",
                     xlabel="training seconds (evaluations excluded)", ylabel="validation loss")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", help="the quickstart's output directory (corpus .bin/.idx, tokenizer.model)")
    p.add_argument("--bandwidth", default="100mbit", help="inter-node link rate (tc units) or 'unshaped'")
    p.add_argument("--iters", type=int, default=64, help="training iterations per configuration")
    p.add_argument("--eval-interval", type=int, default=8, help="iterations between validations (--data-dir)")
    p.add_argument("--eval-iters", type=int, default=5, help="validation batches per evaluation (--data-dir)")
    p.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations ('none' always runs)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cluster run")
    p.add_argument("--name", default="mlccomp", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--svg", help="write the validation-loss plots to PREFIX_tokens.svg and PREFIX_time.svg")
    p.add_argument("--report", help="no runs: print the table (and --svg plots) of this earlier --json file")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        args.bandwidth, args.iters, results = saved["bandwidth"], saved["iters"], saved["results"]
    else:
        results = measure(args)
    report(results, args)
    if args.svg:
        plot(results, args)
    return 0


def measure(args) -> list:
    """Every configuration's run, in order ('none' first); written to ``--json`` as they finish."""
    names = ["none"] + [n for n in args.only.split(",") if n != "none"]
    results = []
    with tempfile.TemporaryDirectory(prefix="megalm-comp-bench-") as tmp:
        os.chmod(tmp, 0o777)
        for n in names:
            results.append(run(n, CONFIGS[n], args, tmp))
            print(f"{n}: {results[-1]['tokens_per_s']:.0f} tokens/s, valid {results[-1]['valid_loss']}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"bandwidth": args.bandwidth, "iters": args.iters, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(main())
