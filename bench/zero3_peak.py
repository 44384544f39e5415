#!/usr/bin/env python
"""Per-rank peak memory per ``--data-parallel-sharding-strategy`` against the planner's formula.

A Llama-style fp32 model (RMSNorm, SwiGLU, RoPE, untied output layer, no biases) trained for two steps
on ``--ranks`` spawned gloo ranks (pure data parallel, one microbatch, ``--overlap-grad-reduce``,
``--ddp-bucket-size`` ``--bucket-size``: ZeRO-3 gathers one bucket at a time, and with Megatron's default
of 40M elements a 90M model is three buckets), one fresh group of processes per strategy.  On every rank,
glibc is told to return freed blocks (``mallopt``: mmap threshold 64 KiB, trim threshold 0) and three
numbers are taken:

* ``tracked``: the CPU allocator's own count (:class:`megalm.training.memory.TrackedAllocations`: every
  allocation and free c10 reports), the peak of live tensor bytes from model construction to the end of
  the second step, and its largest value during the build (model + DDP + optimizer) and the second step;
* ``rss``: the peak resident set size (``ru_maxrss``) less the RSS after imports (the interpreter and
  libraries);
* ``formula``: the planner's largest-rank bytes for that strategy (:func:`megalm.estimate.planner.plan`,
  no reserve): steady model state per strategy, the buckets ZeRO-2/3 hold above it during a step
  (:mod:`megalm.estimate.sharding_peaks`: for ZeRO-3 the gathered working set), activations and
  transient buffers.

``--experts E`` makes every layer an MoE layer (``--ep``: expert parallelism; the expert parameters are
sharded over the expert-data-parallel group, ``ranks / ep``).  ``--meta`` builds every run with
``--init-model-with-meta-device`` (the build column then holds no full
model under ZeRO-3).  The table prints the largest rank's numbers (MiB) and ``tracked / formula``.  Bytes
do not depend on the machine; RSS a little (allocator, thread stacks).

    python bench/zero3_peak.py [--ranks 4] [--layers 6 --hidden 768 --ffn 2048 --vocab 32000 --seq 256]
        [--bucket-size 2000000] [--meta] [--experts 8 --moe-ffn 1024 --ep 2]
        [--strategies no_shard optim optim_grads optim_grads_params] [--out bench/results/zero3_peak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.abspath(os.path.join(HERE, os.path.pardir)), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from comm_bytes import one_step, setup_trainer  # noqa: E402

from megalm.launch.spawn import run_distributed  # noqa: E402

MiB = 1024 * 1024
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def model_flags(a) -> list:
    return [
        *("--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--ffn-hidden-size", str(a.ffn)),
        *("--num-attention-heads", str(a.hidden // 64), "--seq-length", str(a.seq)),
        *("--max-position-embeddings", str(a.seq), "--vocab-size", str(a.vocab)),
        *("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"),
        *("--disable-bias-linear", "--untie-embeddings-and-output-weights"),
        *("--mock-data", "--num-workers", "0", "--lr", "3e-4", "--log-interval", "1000", "--eval-iters", "0"),
        *("--no-log-memory", "--micro-batch-size", "1", "--train-iters", "4", "--overlap-grad-reduce"),
        *(["--ddp-bucket-size", str(a.bucket_size)] if a.bucket_size else []),
        *(["--init-model-with-meta-device"] if a.meta else []),
        *(moe_flags(a) if a.experts else []),
    ]


def moe_flags(a) -> list:
    """``--experts E``: every layer an MoE layer of E SwiGLU experts (``--moe-ffn`` wide, top-2), EP ``--ep``."""
    return [
        *("--num-experts", str(a.experts), "--moe-ffn-hidden-size", str(a.moe_ffn), "--moe-router-topk", "2"),
        *("--expert-model-parallel-size", str(a.ep), "--moe-token-dispatcher-type", "alltoall"),
    ]


def _return_freed_memory() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks are mmapped, unmapped when freed
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: give the heap's free top back at once


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(argv: list) -> dict:
    import resource

    from megalm.training.memory import TrackedAllocations

    _return_freed_memory()
    import torch  # noqa: F401

    import pretrain_gpt  # noqa: F401  (imports before the baseline)

    base = _rss()
    with TrackedAllocations() as tracked:
        with tracked.phase("build"):
            trainer = setup_trainer(argv)
        one_step(trainer)
        with tracked.phase("step"):
            one_step(trainer)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for c in trainer.model for p in c.module.parameters())
    return {
        "tracked": tracked.peak,
        "build": tracked.phases["build"],
        "step": tracked.phases["step"],
        "rss": peak_rss - base,
        "params": params,
    }


def formula(argv: list, k: int) -> dict:
    from megalm.estimate.cli import parse
    from megalm.estimate.planner import plan

    flags = ["--world-size", str(k), "--reserve-gb", "0", "--device", "cpu", "--device-peak-flops", "1e12"]
    cfg, options = parse(argv + flags + ["--tokenizer-type", "NullTokenizer"])
    r = plan(cfg, options)
    return {"bytes": r["largest_rank_bytes_by_strategy"], "params": r["total_parameters"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--bucket-size", type=int, default=2_000_000, help="--ddp-bucket-size (0: Megatron's default, 40M)")
    ap.add_argument("--meta", action="store_true", help="build with --init-model-with-meta-device")
    ap.add_argument("--experts", type=int, default=0, help="MoE: experts per layer (0: dense)")
    ap.add_argument("--moe-ffn", type=int, default=1024, help="MoE: --moe-ffn-hidden-size")
    ap.add_argument("--ep", type=int, default=1, help="MoE: --expert-model-parallel-size")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--out")
    a = ap.parse_args()
    base = model_flags(a) + ["--global-batch-size", str(a.ranks)]
    planned = formula(base, a.ranks)
    rows = {}
    for s in a.strategies:
        argv = base + ["--data-parallel-sharding-strategy", s]
        ranks = run_distributed(worker, a.ranks, args=(argv,), timeout=1800)
        rows[s] = {key: max(r[key] for r in ranks) for key in ("tracked", "build", "step", "rss")}
        rows[s]["formula"] = planned["bytes"][s]
        print(s, {k: round(v / MiB, 1) for k, v in rows[s].items()}, flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    meta = ", --init-model-with-meta-device" if a.meta else ""
    moe = f", {a.experts} experts (--moe-ffn {a.moe_ffn}) at EP {a.ep}" if a.experts else ""
    size = f"{planned['params'] / 1e6:.1f}M parameters, fp32, DP {a.ranks}, bucket {a.bucket_size}"
    print(f"\n{size}{meta}{moe}; {cpu}\n")
    print("| strategy | formula MiB | tracked peak MiB | tracked / formula | build MiB | step MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for s, r in rows.items():
        print(
            f"| {s} | {r['formula'] / MiB:.0f} | {r['tracked'] / MiB:.0f} | {r['tracked'] / r['formula']:.2f} | "
            f"{r['build'] / MiB:.0f} | {r['step'] / MiB:.0f} | {r['rss'] / MiB:.0f} |"
        )
    if a.out:
        with open(a.out, "w") as f:
            out = {"params": planned["params"], "ranks": a.ranks, "meta": a.meta, "rows": rows}
            if a.experts:
                out.update(experts=a.experts, moe_ffn=a.moe_ffn, ep=a.ep)
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
