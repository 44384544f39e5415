#!/usr/bin/env python
"""Weak scaling on the simulated cluster: 1, 2, 4 nodes of one process each, measured against a model.

Each run is one real training through :mod:`cluster_training` (``tools/cluster/run.py``; needs root or
CAP_NET_ADMIN): the ~1.9M-parameter GPT of ``bench/hierarchical_reduce.py``, data parallel over the N nodes,
the same per-rank batch (micro batch 2, global batch 2 N), ``--overlap-grad-reduce``, inter-node links at
``--bandwidth``; each N > 1 is also run with unshaped links.  Every rank runs ``--threads`` (1) compute threads,
the same for every N (the launcher's default, the host's cores over all ranks, would give N = 1 more): torchrun
leaves OMP_NUM_THREADS unset with one process per node, and megalm then gives the rank all of the host's cores,
which the simulated nodes share (4 single-process nodes on 2 cores: 8 threads, steps ~10x slower).

Reported per N: tokens/s (the metrics file's, median of the iterations after the first), the weak-scaling
efficiency ``E = tokens/s(N) / (N tokens/s(1))`` (= ``t(1) / t(N)``, the step times), and the model's

    t_model(N) = t_compute + bytes(N) / bandwidth,    E_model = t(1) / t_model(N)

with ``bytes(N)`` the measured inter-node bytes per step of the busiest node (``inter_node_bytes``: a flat
ring all-reduce of the B bytes of fp32 gradient buckets sends ``2 (N-1)/N B`` per node; each direction of
each node's link has the full rate, so sending and receiving overlap) and ``t_compute`` either ``t(1)`` (one
process, nothing to communicate) or ``t(N)`` with unshaped links (compute plus fast veth traffic, with the N
processes sharing the host's cores: on a host with fewer cores than N, compute itself slows with N).  The
model sends after computing (no overlap), so it bounds the step time from above when the gradient reduction
overlaps the backward.

    python3 bench/cluster_scaling.py [--bandwidth 1gbit] [--nodes 1,2,4] [--iters 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
for _path in (ROOT, os.path.abspath(os.path.dirname(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from cluster_training import MICRO_BATCH, cluster_training  # noqa: E402

from megalm.launch.netns import rate_bits  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidth", default="1gbit", help="inter-node link rate (tc units)")
    p.add_argument("--nodes", default="1,2,4", help="comma-separated node counts; the first must be 1")
    p.add_argument("--iters", type=int, default=6, help="training iterations per run")
    p.add_argument("--name", default="mlcscale", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank (the same compute per rank)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    bytes_per_s = rate_bits(args.bandwidth) / 8
    runs = {}
    with tempfile.TemporaryDirectory(prefix="megalm-scaling-bench-") as tmp:
        os.chmod(tmp, 0o777)
        for n in counts:
            for rate in [args.bandwidth, "unshaped"] if n > 1 else ["unshaped"]:
                kw = dict(nodes=n, procs_per_node=1, bandwidth=rate, iters=args.iters, global_batch=MICRO_BATCH * n)
                kw["threads"] = args.threads
                runs[(n, rate)] = cluster_training(f"n{n}_{rate}", [], tmp, cluster_name=args.name, **kw)
                print(f"{n} nodes, {rate}: {runs[(n, rate)]}", file=sys.stderr, flush=True)
    one = runs[(counts[0], "unshaped")]
    rows = []
    for n in counts:
        meas = runs[(n, args.bandwidth)] if n > 1 else one
        fast = runs[(n, "unshaped")]
        comm_s = meas["inter_node_MB_per_step"] * 1e6 / bytes_per_s
        rows.append(
            {
                "nodes": n,
                "tokens_per_sec": meas["tokens_per_sec"],
                "step_ms": meas["step_ms"],
                "step_ms_unshaped": fast["step_ms"],
                "inter_node_MB_per_step": meas["inter_node_MB_per_step"],
                "efficiency": meas["tokens_per_sec"] / (n * one["tokens_per_sec"]),
                "model_ms_t1": one["step_ms"] + 1e3 * comm_s,
                "model_ms_unshaped": fast["step_ms"] + 1e3 * comm_s,
            }
        )
    print(f"weak scaling, 1 process per node, micro batch {MICRO_BATCH} per rank, {args.threads} thread(s) per rank,")
    print(f"inter-node link {args.bandwidth}")
    head = ["nodes", "tokens/s", "step ms", "step ms unshaped", "inter-node MB/step", "E measured"]
    head += ["model ms (t1)", "E model (t1)", "model ms (unshaped)", "E model (unshaped)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    t1 = one["step_ms"]
    for r in rows:
        cells = [str(r["nodes"]), f"{r['tokens_per_sec']:.0f}", f"{r['step_ms']:.0f}", f"{r['step_ms_unshaped']:.0f}"]
        cells += [f"{r['inter_node_MB_per_step']:.2f}", f"{r['efficiency']:.0%}"]
        cells += [f"{r['model_ms_t1']:.0f}", f"{t1 / r['model_ms_t1']:.0%}"]
        cells += [f"{r['model_ms_unshaped']:.0f}", f"{t1 / r['model_ms_unshaped']:.0%}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "iters": args.iters, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
