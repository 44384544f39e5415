#!/usr/bin/env python
"""Validation loss vs tokens for AdamW, LAMB, LARS, Muon and Lion at global batch B and 8 B.

Each configuration is one single-process training through ``pretrain_gpt.main`` on the quickstart
corpus (``examples/quickstart.sh`` builds ``quickstart_out/``: the Python standard library's
sources, an 8k sentencepiece tokenizer), a small GPT (2 layers, hidden 128, sequence 64), cosine
decay to 10% with 10% warm-up.  Both batch sizes see the same tokens (8x fewer iterations at 8 B)
and are evaluated at the same token counts on the same validation samples.  At 8 B each method's
learning rate follows its usual rule: linear (x8) for LARS, square root (x2.83) for the others
(AdamW, LAMB, Lion; Muon's updates are matched to AdamW's RMS by ``--muon-extra-scale-factor 0.2``).
Base learning rates were picked once, not tuned.

    python3 bench/optimizers.py --data-dir quickstart_out [--iters 128] [--batch 16] [--out results.json]

Reported: the validation loss at each evaluation, and the final one as a ratio to AdamW's at the
same batch (measured in the same invocation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--num-workers",
    "0",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--lr-decay-style",
    "cosine",
    "--split",
    "98,2,0",
    "--seed",
    "1234",
    "--no-log-memory",
]
# (flags, base learning rate at batch B, rule at 8 B)
OPTIMIZERS = {
    "adam": (["--optimizer", "adam", "--adam-beta2", "0.95"], 2e-3, "sqrt"),
    "lamb": (["--optimizer", "lamb", "--adam-beta2", "0.95"], 1e-2, "sqrt"),
    "lars": (["--optimizer", "lars", "--lars-trust-coefficient", "0.02", "--sgd-momentum", "0.9"], 2.0, "linear"),
    "muon": (
        ["--optimizer", "muon", "--muon-extra-scale-factor", "0.2", "--muon-use-nesterov", "--adam-beta2", "0.95"],
        2e-3,
        "sqrt",
    ),
    "lion": (["--optimizer", "lion"], 2e-4, "sqrt"),
}


def scaled_lr(lr: float, rule: str, factor: int) -> float:
    return lr * (factor if rule == "linear" else math.sqrt(factor))


def train(argvs):
    """Run each argv through pretrain_gpt.main on this (single) rank."""
    import pretrain_gpt
    from megalm import parallel_state

    for argv in argvs:
        pretrain_gpt.main(argv)
        parallel_state.destroy_model_parallel()


def configuration(name: str, batch: int, factor: int, iters: int, data: list, metrics: str) -> list:
    flags, lr, rule = OPTIMIZERS[name]
    gbs, steps = batch * factor, iters // factor
    lr = scaled_lr(lr, rule, factor)
    evals = 4  # evaluations per run, at the same token counts for both batches (iters: a multiple of 32)
    if steps % evals:
        raise SystemExit(f"--iters {iters}: need a multiple of {8 * evals} (8x batch, {evals} evaluations)")
    return (
        MODEL
        + data
        + flags
        + ["--lr", f"{lr:.6g}", "--min-lr", f"{lr / 10:.6g}", "--lr-warmup-iters", str(max(1, steps // 10))]
        + ["--micro-batch-size", str(min(gbs, 32)), "--global-batch-size", str(gbs), "--train-iters", str(steps)]
        + ["--eval-interval", str(steps // evals), "--eval-iters", str(max(1, 64 // gbs))]
        + ["--log-interval", str(steps // evals), "--metrics-file", metrics]
    )


def validation_curve(metrics: str, seq_length: int = 64) -> list:
    """``[(tokens, validation loss)]`` from a metrics file (consumed samples x sequence length)."""
    rows = [json.loads(line) for line in open(metrics)]
    consumed = {r["iteration"]: r["consumed_samples"] for r in rows if "consumed_samples" in r}
    return [(consumed.get(r["iteration"], 0) * seq_length, r["loss"]) for r in rows if r.get("split") == "validation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "quickstart_out"))
    parser.add_argument("--iters", type=int, default=128, help="iterations at the small batch (a multiple of 32)")
    parser.add_argument("--batch", type=int, default=16, help="the small global batch B")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--out", default=None, help="write the curves as JSON here")
    args = parser.parse_args()

    from megalm.testing import run_distributed

    tmp = tempfile.mkdtemp(prefix="bench_optimizers_")
    data = [
        "--data-path",
        os.path.join(args.data_dir, "stdlib_text_document"),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        os.path.join(args.data_dir, "tokenizer.model"),
        "--data-cache-path",
        os.path.join(tmp, "cache"),
    ]
    runs, names = [], []
    for factor in (1, 8):
        for name in args.optimizers:
            metrics = os.path.join(tmp, f"{name}_{factor}.jsonl")
            runs.append(configuration(name, args.batch, factor, args.iters, data, metrics))
            names.append((name, factor, metrics))
    run_distributed(train, 1, args=(runs,), timeout=3600, threads=2)

    curves = {f"{n} x{f}": validation_curve(m) for n, f, m in names}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(curves, f, indent=1)
    print(f"validation loss vs tokens (batch {args.batch} and {8 * args.batch}, {args.iters} iterations at the first)")
    for key, curve in curves.items():
        print(f"{key:10s} " + " ".join(f"{t // 1000}k:{loss:.3f}" for t, loss in curve))
    print("\n| optimizer | lr rule at 8x | final val loss, batch B | vs AdamW | final val loss, 8 B | vs AdamW |")
    print("|---|---|---|---|---|---|")
    base = {f: curves.get(f"adam x{f}", [(0, float("nan"))])[-1][1] for f in (1, 8)}
    for name in args.optimizers:
        small, large = curves[f"{name} x1"][-1][1], curves[f"{name} x8"][-1][1]
        rule = OPTIMIZERS[name][2]
        print(f"| {name} | {rule} | {small:.3f} | {small / base[1]:.3f} | {large:.3f} | {large / base[8]:.3f} |")


if __name__ == "__main__":
    main()
