#!/usr/bin/env python
"""Validation loss vs tokens for AdamW, LAMB, LARS, Muon and Lion at global batch B and 8 B.

The quickstart's corpus (the Python standard library's sources, an 8k sentencepiece BPE tokenizer,
Megatron ``.bin/.idx``; ``examples/quickstart.sh``'s steps 2-4, run the same way into a temp dir unless
``--data-dir`` holds them) and the quickstart's GPT at half its width and sequence: 4 layers, hidden 128,
4 heads, sequence 64, the 8k vocabulary (1.8M parameters; hidden 256 and sequence 128 cost ~3x more per
token, too much for ten runs on a shared 2-core machine).  fp32, one process per configuration (one
``pretrain_gpt.main`` each, ``--workers`` of them at a time, one thread each), cosine decay to 10% of the
peak after a linear warm-up over 10% of the iterations, weight decay 0.1, gradient clipping 1.0.

Both batches see the same tokens (8x fewer iterations at 8 B) and every evaluation reads the same
``EVAL_SAMPLES`` validation samples at both batches (``--eval-iters`` = ``EVAL_SAMPLES`` / batch), at the
same token counts.  At 8 B the learning rate follows one rule for all five, the square root (x sqrt 8):
each method's step size is set by a normalized or sign direction (Adam's m/sqrt(v), LAMB's and LARS'
trust ratios, Lion's sign, Muon's orthogonalized matrix), not by the raw gradient, and the square root
is the rule the LAMB paper uses and the one derived for Adam (Malladi et al., 2022); the linear rule is
plain SGD's (Goyal et al., 2017).  Base learning rates were set once, not tuned: AdamW 2e-3; LAMB 1e-2
(each tensor moves by lr ||w|| per step); LARS 0.25 with trust coefficient 0.02 and momentum 0.9
(lr x coefficient = 0.005 of ||w|| per step before momentum); Muon 2e-3 with its matrices' update RMS
matched to AdamW's (``--muon-extra-scale-factor 0.2``); Lion 2e-4 (AdamW's / 10, as the Lion paper
advises; the same weight decay 0.1).

    python3 bench/optimizers.py [--data-dir quickstart_out] [--iters 240] [--batch 16] [--out-dir bench/results]

Reported: the validation loss at each evaluation, the last one as a ratio to AdamW's at the same batch,
and the mean time per iteration as a ratio to AdamW's at the same batch (measured in the same invocation,
the two batches of one optimizer side by side; only ratios, since the absolute times follow the
machine's load, and even those are noisy on a shared machine).  Writes ``optimizers.json`` and one
chart per batch (``optimizers_b<B>.svg``) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

SEQ = 64
EVAL_SAMPLES = 128  # validation samples per evaluation, the same at both batches
EVALS = 6  # evaluations per run
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(SEQ),
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
# name -> (flags, peak learning rate at batch B)
OPTIMIZERS = {
    "adam": (["--optimizer", "adam", "--adam-beta2", "0.95"], 2e-3),
    "lamb": (["--optimizer", "lamb", "--adam-beta2", "0.95"], 1e-2),
    "lars": (["--optimizer", "lars", "--lars-trust-coefficient", "0.02", "--sgd-momentum", "0.9"], 0.25),
    "muon": (
        ["--optimizer", "muon", "--muon-extra-scale-factor", "0.2", "--muon-use-nesterov", "--adam-beta2", "0.95"],
        2e-3,
    ),
    "lion": (["--optimizer", "lion"], 2e-4),
}
FACTOR = 8  # the large batch is FACTOR x the small one


def scaled_lr(lr: float, factor: int) -> float:
    """The square-root rule: ``lr x sqrt(batch / B)``."""
    return lr * math.sqrt(factor)


def build_corpus(out: str) -> None:
    """The quickstart's corpus, tokenizer and ``.bin/.idx`` files in ``out`` (its steps 2-4)."""
    py, env = sys.executable, dict(os.environ, PYTHONPATH=ROOT)
    steps = [
        [py, f"{ROOT}/examples/build_stdlib_corpus.py", "--output", "corpus.jsonl", "--max-mb", "20"],
        [py, f"{ROOT}/tools/train_tokenizer.py", "--input", "corpus.jsonl", "--json-keys", "text"]
        + ["--model-prefix", "tokenizer", "--vocab-size", "8192", "--model-type", "bpe", "--byte-fallback"],
        [py, f"{ROOT}/tools/preprocess_data.py", "--input", "corpus.jsonl", "--json-keys", "text"]
        + ["--output-prefix", "stdlib", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
        + ["tokenizer.model", "--append-eod", "--workers", "2", "--no-progress"],
    ]
    for cmd in steps:
        subprocess.run(cmd, cwd=out, env=env, check=True, stdout=subprocess.DEVNULL)


def train(argv):
    """One configuration through pretrain_gpt.main on this (single) rank."""
    import pretrain_gpt

    pretrain_gpt.main(argv)


def configuration(name: str, batch: int, factor: int, iters: int, data: list, metrics: str) -> list:
    flags, lr = OPTIMIZERS[name]
    gbs, steps = batch * factor, iters // factor
    lr = scaled_lr(lr, factor)
    return (
        MODEL
        + data
        + flags
        + ["--lr", f"{lr:.6g}", "--min-lr", f"{lr / 10:.6g}", "--lr-warmup-iters", str(max(1, steps // 10))]
        + ["--micro-batch-size", str(min(gbs, 32)), "--global-batch-size", str(gbs), "--train-iters", str(steps)]
        + ["--eval-interval", str(steps // EVALS), "--eval-iters", str(EVAL_SAMPLES // gbs)]
        + ["--log-interval", str(steps // EVALS), "--metrics-file", metrics]
    )


def read_metrics(metrics: str) -> tuple:
    """``([(tokens, validation loss)], mean ms per iteration after the first log line)`` from a metrics file."""
    if not os.path.exists(metrics):
        return [], float("nan")
    rows = [json.loads(line) for line in open(metrics)]
    consumed = {r["iteration"]: r["consumed_samples"] for r in rows if "consumed_samples" in r}
    curve = [(consumed.get(r["iteration"], 0) * SEQ, r["loss"]) for r in rows if r.get("split") == "validation"]
    times = [r["elapsed_ms"] for r in rows if "elapsed_ms" in r][1:]  # the first interval includes start-up
    return curve, (sum(times) / len(times) if times else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None, help="a quickstart_out/ (default: build the corpus in a temp dir)")
    parser.add_argument("--iters", type=int, default=240, help=f"iterations at the small batch (x {FACTOR * EVALS})")
    parser.add_argument("--batch", type=int, default=16, help="the small global batch B")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--factors", nargs="+", type=int, default=[1, FACTOR], help="batches: B x each")
    parser.add_argument("--workers", type=int, default=2, help="configurations run at a time (one thread each)")
    parser.add_argument("--out-dir", default=None, help="write optimizers.json and the charts here")
    parser.add_argument("--replot", default=None, help="an optimizers.json: print its table, redraw its charts")
    args = parser.parse_args()
    if args.replot:
        return replot(args.replot, args.out_dir)
    if args.iters % (FACTOR * EVALS) or EVAL_SAMPLES % (FACTOR * args.batch):
        parser.error(f"--iters must be a multiple of {FACTOR * EVALS}, {EVAL_SAMPLES} of {FACTOR} x --batch")

    from megalm.testing import run_distributed

    tmp = tempfile.mkdtemp(prefix="bench_optimizers_")
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.join(tmp, "quickstart_out")
        os.makedirs(data_dir)
        build_corpus(data_dir)
    data = ["--data-path", os.path.join(data_dir, "stdlib_text_document"), "--tokenizer-type"]
    data += ["SentencePieceTokenizer", "--tokenizer-model", os.path.join(data_dir, "tokenizer.model")]
    jobs = {}  # optimizer-major, so a cut-short run leaves whole pairs
    for name in args.optimizers:
        for factor in args.factors:
            metrics = os.path.join(tmp, f"{name}_{factor}.jsonl")
            cache = ["--data-cache-path", os.path.join(tmp, f"cache_{factor}")]  # one per batch: built concurrently
            argv = configuration(name, args.batch, factor, args.iters, data + cache, metrics)
            jobs[f"{name} x{factor}"] = (argv, metrics)

    def one(key):
        argv, metrics = jobs[key]
        try:  # a run that stops (NaN loss, say) keeps its curve so far; the others go on
            run_distributed(train, 1, args=(argv,), timeout=4 * 3600, threads=1)
        except Exception as e:  # noqa: BLE001 - reported next to the numbers
            print(f"{key}: stopped: {str(e).splitlines()[0][:200]}", flush=True)
        curve, ms = read_metrics(metrics)
        print(f"{key}: " + " ".join(f"{t // 1000}k:{loss:.3f}" for t, loss in curve), flush=True)
        return key, {"curve": curve, "ms_per_iter": ms}

    start = time.monotonic()
    with ThreadPoolExecutor(args.workers) as pool:
        results = dict(pool.map(one, list(jobs)))
    print(f"{len(jobs)} trainings, {args.workers} at a time: {(time.monotonic() - start) / 60:.1f} min", flush=True)
    report(results, args)


NAMES = {"adam": "AdamW", "lamb": "LAMB", "lars": "LARS", "muon": "Muon", "lion": "Lion"}


def report(results: dict, args) -> None:
    """Markdown table (last validation loss and mean time per iteration, each also as a ratio to AdamW's
    at the same batch), then, with ``--out-dir``, the JSON and one chart per batch."""
    batches = [args.batch * f for f in args.factors]
    print(
        "\n| optimizer | "
        + " | ".join(f"peak lr at {b}" for b in batches)
        + " | "
        + " | ".join(f"val loss at {b} | vs AdamW" for b in batches)
        + " | "
        + " | ".join(f"time/iter at {b} vs AdamW" for b in batches)
        + " |"
    )
    print("|---|" + "---|" * (4 * len(batches)))
    for name in args.optimizers:
        lrs, losses, times = [], [], []
        for f in args.factors:
            r, base = results[f"{name} x{f}"], results[f"adam x{f}"]
            last = r["curve"][-1][1] if r["curve"] else float("nan")
            base_last = base["curve"][-1][1] if base["curve"] else float("nan")
            lrs.append(f"{scaled_lr(OPTIMIZERS[name][1], f):.3g}")
            losses += [f"{last:.3f}", f"{last / base_last:.3f}"]
            times.append(f"{r['ms_per_iter'] / base['ms_per_iter']:.2f}")
        print("| " + " | ".join([NAMES[name]] + lrs + losses + times) + " |")
    if not args.out_dir:
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from svg_plot import write_line_chart

    os.makedirs(args.out_dir, exist_ok=True)
    meta = {"iters_at_small_batch": args.iters, "batch": args.batch, "seq_length": SEQ, "lr_rule": "sqrt"}
    with open(os.path.join(args.out_dir, "optimizers.json"), "w") as f:
        json.dump({"settings": meta, "runs": results}, f, indent=1)
    for factor, gbs in zip(args.factors, batches):
        series = {
            NAMES[n]: [(t, v) for t, v in results[f"{n} x{factor}"]["curve"] if math.isfinite(v)]
            for n in args.optimizers
        }
        write_line_chart(
            os.path.join(args.out_dir, f"optimizers_b{gbs}.svg"),
            {n: pts for n, pts in series.items() if pts},
            title=f"GPT 4 x 128 on the quickstart corpus, global batch {gbs} (x {SEQ} tokens)",
            xlabel="training tokens",
            ylabel="validation loss",
        )


def replot(path: str, out_dir: str) -> None:
    """``--replot optimizers.json``: the table and charts again from a saved run."""
    with open(path) as f:
        saved = json.load(f)
    runs, st = saved["runs"], saved["settings"]
    names = [n for n in OPTIMIZERS if f"{n} x1" in runs]
    factors = sorted({int(k.split(" x")[1]) for k in runs})
    report(
        runs,
        argparse.Namespace(
            batch=st["batch"], factors=factors, optimizers=names, iters=st["iters_at_small_batch"], out_dir=out_dir
        ),
    )


if __name__ == "__main__":
    main()
