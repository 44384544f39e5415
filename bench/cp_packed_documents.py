#!/usr/bin/env python
"""Packed documents (``--qkv-format thd``) in the context-parallel attention cores: time against the causal ring.

On ``CP`` spawned gloo ranks (one CP group), the attention core alone (8 heads of 64, GQA 8/4, fp32, one row of
``s`` tokens whose documents end with probability ``1/doc`` per token), forward + backward, per rank:

* ``p2p causal``: the ring without documents (the reference, 1.00);
* ``p2p documents``: the ring with the documents (each block masks other documents' keys; blocks no query row
  may see are skipped);
* ``p2p documents, no skip``: the same with every block computed (``_Ring.computed_steps`` patched to all
  True): what the skip saves;
* ``allgather documents``: the all-gathered K/V, each query chunk masking other documents.

Each case is timed as the median of ``--reps`` interleaved repetitions (after one warm-up of each): the
slowest rank's wall time per repetition (the ring waits on its slowest member) and the CPU time of all ranks
together (``time.process_time``: the work, which a loaded machine disturbs far less than the wall time).  The
table gives each case's times over ``p2p causal``'s of the same run, and the ring blocks (rank x step, the
first step excluded) skipped.  Only the ratios mean anything on a loaded machine.

    python bench/cp_packed_documents.py [--seq 4096] [--cp 2 4] [--doc 128 1024] [--reps 5]

Writes bench/results/cp_packed_documents.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, os.path.pardir)))

from megalm.launch.spawn import run_distributed  # noqa: E402

HEADS, GROUPS, DIM = 8, 4, 64
CASES = ("p2p causal", "p2p documents", "p2p documents, no skip", "allgather documents")


def _documents(seq: int, doc: int, seed: int):
    """``[1, seq]`` document ids: a document ends after each token with probability ``1 / doc``."""
    import torch

    ends = torch.rand(seq, generator=torch.Generator().manual_seed(seed)) < 1.0 / doc
    return (torch.cumsum(ends.long(), 0) - ends.long()).unsqueeze(0)


def _measure(seq: int, doc: int, reps: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megalm.context_parallel import context_parallel_attention, split_sequence
    from megalm.context_parallel import ring as ring_module

    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    documents = _documents(seq, doc, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(seq, 1, HEADS, DIM, generator=g)
    k, v = (torch.randn(seq, 1, GROUPS, DIM, generator=g) for _ in range(2))
    q, k, v = (split_sequence(t, 0, rank, cp).requires_grad_() for t in (q, k, v))

    def causal(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

    computed_steps = ring_module._Ring.computed_steps

    def all_steps(self, documents, q):
        return [True] * self.size

    def run(case: str) -> float:
        comm = case.split()[0]
        docs = None if case == "p2p causal" else documents
        ring_module._Ring.computed_steps = all_steps if case.endswith("no skip") else computed_steps
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        out = context_parallel_attention(q, k, v, group, comm, causal, documents=docs)
        out.sum().backward()
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        ring_module._Ring.computed_steps = computed_steps
        return wall.item(), cpu.item()

    for case in CASES:
        run(case)  # warm-up
    times = {case: [] for case in CASES}
    for _ in range(reps):
        for case in CASES:
            times[case].append(run(case))
    wall = {case: statistics.median(t[0] for t in ts) for case, ts in times.items()}
    cpu = {case: statistics.median(t[1] for t in ts) for case, ts in times.items()}
    heads_first = q.detach().permute(1, 2, 0, 3)
    skipped = computed_steps(ring_module._Ring(group), documents, heads_first)[1:].count(False)
    counts = torch.tensor([skipped], dtype=torch.int64)
    dist.all_reduce(counts)
    return {
        "median_wall_s": wall,
        "median_cpu_s": cpu,
        "skipped_blocks": int(counts.item()),
        "ring_blocks": cp * (cp - 1),
        "documents": int(documents.max().item()) + 1,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--doc", type=int, nargs="+", default=[128, 1024], help="mean document length")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "cp_packed_documents.json"))
    args = parser.parse_args(argv)
    with open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    print(
        "| CP | s | mean document (documents) | p2p causal CPU s (wall s) | " + " | ".join(CASES[1:]) + " | skipped |"
    )
    print("|---" * (len(CASES) + 4) + "|")
    rows = []
    for cp in args.cp:
        for doc in args.doc:
            result = run_distributed(_measure, cp, args=(args.seq, doc, args.reps), timeout=1800)[0]
            wall, cpu = result["median_wall_s"], result["median_cpu_s"]
            row = {"cp": cp, "seq": args.seq, "mean_doc": doc, **result}
            row["wall_ratio"] = {case: t / wall["p2p causal"] for case, t in wall.items()}
            row["cpu_ratio"] = {case: t / cpu["p2p causal"] for case, t in cpu.items()}
            rows.append(row)
            ratios = " | ".join(f"{row['cpu_ratio'][case]:.2f} ({row['wall_ratio'][case]:.2f})" for case in CASES[1:])
            skipped = f"{result['skipped_blocks']}/{result['ring_blocks']}"
            ref = f"{cpu['p2p causal']:.2f} ({wall['p2p causal']:.2f})"
            head = f"| {cp} | {args.seq} | {doc} ({result['documents']}) | {ref}"
            print(f"{head} | {ratios} | {skipped} |")
    record = {
        "command": "python bench/cp_packed_documents.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{cpu_model}, {os.cpu_count()} CPUs",
        "date": datetime.date.today().isoformat(),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
