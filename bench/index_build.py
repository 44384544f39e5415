#!/usr/bin/env python
"""Index building for 1 B tokens, cache reload, blending, and loader samples/s.

* GPT indices (document / sample / shuffle) for one epoch of ``--tokens`` synthetic tokens
  (documents of 1..``2 x --mean-doc-length`` tokens), for several sequence lengths;
* the same through :class:`GPTDataset` on a real .idx of that size (tokens file sparse),
  first build (and cache write) then the cached reload;
* the blending index for ``--blend-samples`` samples over 3 datasets;
* DataLoader samples/s over a real ``--loader-tokens`` dataset, 0 and 2 workers.

    python bench/index_build.py [--tokens 1e9] [--work-dir /tmp/megalm_bench_index]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.data import helpers  # noqa: E402
from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_indices  # noqa: E402
from megalm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, write_index  # noqa: E402


def synthetic_lengths(tokens: float, mean: int, seed: int = 0) -> np.ndarray:
    n = int(tokens / mean)
    return np.random.default_rng(seed).integers(1, 2 * mean, size=n, dtype=np.int32)


def bench_indices(lengths: np.ndarray, seq_lengths) -> list:
    docs = np.arange(lengths.size, dtype=np.int32)
    total = int(lengths.sum(dtype=np.int64))
    rows = []
    for seq in seq_lengths:
        n = (total - 1) // seq
        t0 = time.perf_counter()
        idx = build_gpt_indices(lengths, docs, n, seq, seed=1234)
        rows.append((seq, n, time.perf_counter() - t0, idx["sample_index"].shape[0] - 1))
    return rows


def sparse_dataset(prefix: str, lengths: np.ndarray) -> None:
    """A real .idx for ``lengths`` and a sparse uint16 .bin of the right size (never read here)."""
    write_index(prefix + ".idx", np.uint16, lengths, np.arange(lengths.size + 1, dtype=np.int64))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)


def bench_gpt_dataset(prefix: str, lengths: np.ndarray, seq: int) -> tuple:
    ds_file = IndexedDataset(prefix)
    n = (int(lengths.sum(dtype=np.int64)) - 1) // seq
    cfg = GPTDatasetConfig(seq_length=seq, seed=1234, eod=0)
    t0 = time.perf_counter()
    first = GPTDataset(ds_file, np.arange(len(ds_file), dtype=np.int32), n, "train", cfg)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = GPTDataset(IndexedDataset(prefix), np.arange(len(ds_file), dtype=np.int32), n, "train", cfg)
    load = time.perf_counter() - t0
    assert first.built_indices and not again.built_indices
    return build, load


def real_dataset(prefix: str, tokens: float, mean: int) -> None:
    lengths = synthetic_lengths(tokens, mean, seed=1)
    rng = np.random.default_rng(2)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for start in range(0, lengths.size, 10_000):
            chunk = lengths[start : start + 10_000]
            b.add_documents(rng.integers(0, 32000, int(chunk.sum()), dtype=np.uint16), chunk)
        b.finalize()


def bench_loader(prefix: str, seq: int, mbs: int, workers: int, batches: int) -> float:
    import torch

    from megalm.data.loaders import build_pretraining_data_loader

    ds_file = IndexedDataset(prefix)
    n = batches * mbs * 2
    ds = GPTDataset(
        ds_file, np.arange(len(ds_file), dtype=np.int32), n, "train", GPTDatasetConfig(seq_length=seq, seed=1, eod=0)
    )
    loader = build_pretraining_data_loader(ds, 0, mbs, 0, 1, num_workers=workers)
    it = iter(loader)
    next(it)  # worker start-up not timed
    t0 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
    assert b["tokens"].shape == (mbs, seq) and b["tokens"].dtype == torch.int64
    return batches * mbs / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description="index build and loader benchmark")
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--mean-doc-length", type=int, default=500)
    parser.add_argument("--blend-samples", type=int, default=10_000_000)
    parser.add_argument("--loader-tokens", type=float, default=2e7)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "megalm_bench_index"))
    args = parser.parse_args()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)

    lengths = synthetic_lengths(args.tokens, args.mean_doc_length)
    total = int(lengths.sum(dtype=np.int64))
    print(f"{lengths.size:,} documents, {total / 1e9:.2f} B tokens, cores: {os.cpu_count()}\n")
    print("| index build (1 epoch) | samples | seconds |")
    print("|---|---|---|")
    for seq, n, s, _ in bench_indices(lengths, (4096, 2048, 1024)):
        print(f"| GPT indices, seq {seq} | {n:,} | {s:.2f} |")
    prefix = os.path.join(args.work_dir, "big_text_document")
    sparse_dataset(prefix, lengths)
    build, load = bench_gpt_dataset(prefix, lengths, 2048)
    print(f"| GPTDataset seq 2048: build + md5 key + cache write | | {build:.2f} |")
    print(f"| GPTDataset seq 2048: reload from cache | | {load:.2f} |")
    t0 = time.perf_counter()
    helpers.build_blending_indices([0.2, 0.3, 0.5], args.blend_samples)
    print(f"| blending index, 3 datasets | {args.blend_samples:,} | {time.perf_counter() - t0:.2f} |")

    small = os.path.join(args.work_dir, "small_text_document")
    real_dataset(small, args.loader_tokens, args.mean_doc_length)
    print("\n| loader (micro-batch 8) | seq | workers | samples/s |")
    print("|---|---|---|---|")
    for seq in (1024, 2048):
        for workers in (0, 2):
            rate = bench_loader(small, seq, 8, workers, batches=200)
            print(f"| GPTDataset + DataLoader | {seq} | {workers} | {rate:,.0f} |")
    shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
