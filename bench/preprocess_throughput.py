#!/usr/bin/env python
"""Preprocessing throughput: tools/preprocess_data.py with 1 and 2 workers vs bare sentencepiece.

Builds a jsonl corpus (>= 50 MB by default) from text files under ``sys.prefix`` (Python
sources and docs: one file = one document), trains a sentencepiece BPE model on it (8k
vocabulary) unless ``--tokenizer-model`` is given, then measures:

* reference: sentencepiece ``encode(list_of_documents)`` in one process with 1 and 2
  threads, plus writing the ids with numpy (JSON parsing not timed);
* megalm: ``tools/preprocess_data.py --append-eod`` as a subprocess, whole-command wall
  time (imports included), with ``--workers 1`` and ``--workers 2``.

Rounds are interleaved and the best time of each row is reported (the machine is
shared).  Prints tokens/s and MB/s per row and the ratio to the bare 2-thread reference,
and checks that both worker counts wrote identical files.

    python bench/preprocess_throughput.py [--size-mb 60] [--work-dir /tmp/megalm_bench]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def build_corpus(path: str, size_mb: float) -> int:
    """Documents from text files under sys.prefix (repeated if needed) until ``size_mb`` MB."""
    target = int(size_mb * 1e6)
    files = []
    for d, dirs, names in os.walk(sys.prefix):
        dirs.sort()
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith((".py", ".rst", ".txt", ".md"))]
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for p in files:
                try:
                    with open(p, encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if not text.strip():
                    continue
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= target:
                    break
    return written


def train_model(corpus: str, prefix: str, vocab_size: int) -> str:
    import sentencepiece as spm

    def lines():
        with open(corpus) as f:
            for raw in f:
                for line in json.loads(raw)["text"].splitlines():
                    if line.strip():
                        yield line

    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        input_sentence_size=300_000,
        shuffle_input_sentence=True,
        byte_fallback=True,
        minloglevel=2,
        num_threads=2,
    )
    return prefix + ".model"


def bare_sentencepiece(corpus: str, model: str, threads: int, out_path: str) -> tuple:
    """(seconds, tokens) of encode(list) + numpy write in one process."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    t0 = time.perf_counter()
    ids = sp.encode(texts, num_threads=threads)
    eos = sp.eos_id()
    flat = np.fromiter((t for doc in ids for t in doc + [eos]), dtype=np.uint16)
    flat.tofile(out_path)
    return time.perf_counter() - t0, int(flat.size)


def megalm_preprocess(corpus: str, model: str, workers: int, prefix: str) -> tuple:
    """(seconds, tokens) of the whole tools/preprocess_data.py command."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            corpus,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--append-eod",
            "--workers",
            str(workers),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - t0
    tokens = int(
        next(line for line in proc.stdout.splitlines() if "tokens:" in line)
        .split("tokens:")[1]
        .split()[0]
        .replace(",", "")
    )
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description="preprocessing throughput benchmark")
    parser.add_argument("--size-mb", type=float, default=60.0, help="Corpus size (at least 50 MB: docs/benchmarks.md).")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "megalm_bench_preprocess"))
    parser.add_argument("--tokenizer-model", default=None, help="Use this sentencepiece model instead of training.")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=2, help="Interleaved rounds (best time reported).")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    corpus = os.path.join(args.work_dir, f"corpus_{int(args.size_mb)}mb.jsonl")
    if not os.path.exists(corpus):
        build_corpus(corpus, args.size_mb)
    mb = os.path.getsize(corpus) / 1e6
    model = args.tokenizer_model or os.path.join(args.work_dir, f"bpe{args.vocab_size}.model")
    if not os.path.exists(model):
        t0 = time.perf_counter()
        train_model(corpus, model[: -len(".model")], args.vocab_size)
        print(f"trained sentencepiece BPE {args.vocab_size} in {time.perf_counter() - t0:.1f} s")
    print(f"corpus: {corpus} ({mb:.1f} MB), model: {model}, cores: {os.cpu_count()}")

    runs = {}
    for _ in range(args.repeats):  # interleaved rounds; the best of each is reported
        for threads in (1, 2):
            name = f"bare sentencepiece encode(list) + numpy write, {threads} thread(s)"
            runs.setdefault(name, []).append(
                bare_sentencepiece(corpus, model, threads, os.path.join(args.work_dir, f"bare{threads}.bin"))
            )
        for workers in (1, 2):
            name = f"megalm tools/preprocess_data.py --workers {workers} (whole command)"
            runs.setdefault(name, []).append(
                megalm_preprocess(corpus, model, workers, os.path.join(args.work_dir, f"megalm_w{workers}"))
            )
    rows = [(name, min(s for s, _ in r), r[0][1]) for name, r in runs.items()]
    same = all(
        filecmp.cmp(
            os.path.join(args.work_dir, f"megalm_w1_text_document{ext}"),
            os.path.join(args.work_dir, f"megalm_w2_text_document{ext}"),
            shallow=False,
        )
        for ext in (".bin", ".idx")
    )
    ref = rows[1][2] / rows[1][1]
    print("\n| what | seconds | tokens | M tokens/s | MB/s | vs bare 2-thread |")
    print("|---|---|---|---|---|---|")
    for name, s, n in rows:
        print(f"| {name} | {s:.2f} | {n:,} | {n / s / 1e6:.2f} | {mb / s:.1f} | {n / s / ref:.2f}x |")
    print(f"\nworkers 1 and 2 outputs identical: {same}")


if __name__ == "__main__":
    main()
