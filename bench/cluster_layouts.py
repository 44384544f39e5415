#!/usr/bin/env python
"""Parallel layouts on the simulated cluster (2 nodes x 2 ranks) over slow and fast inter-node links.

Each cell is one real training run through :mod:`cluster_training` (``tools/cluster/run.py``; needs root or
CAP_NET_ADMIN): the ~1.9M-parameter GPT of ``bench/hierarchical_reduce.py``, global batch 8, micro batch 2,
``--overlap-grad-reduce``, each layout with the distributed optimizer off and on, each at every inter-node
link rate of ``--bandwidths`` (``unshaped`` is the namespaces' veths without ``tc``: the reference):

* ``DP4``: data parallel over all 4 ranks, flat ring reduction;
* ``DP4 hier``: the same with ``--hierarchical-grad-reduce`` (reduce inside the node, across nodes, gather);
* ``TP2xDP2``: tensor parallel inside each node, data parallel across the two nodes;
* ``PP2xTP2``: tensor parallel inside each node, the two pipeline stages on the two nodes (4 micro batches).

Reported per cell: the median step time of the iterations after the first; per layout the inter-node MB per
step of the busiest node: ``counted`` is the metrics file's ``inter_node_bytes`` (the ring model of the
collectives issued through :mod:`megalm.distributed.comm`), ``+p2p`` adds the pipeline's activation and
gradient sends, which that count leaves out (analytic: each of the TP ranks of a stage sends one fp32
``[seq, micro batch, hidden]`` tensor per micro batch, forward from stage 0, backward from stage 1:
``m * tp * s * b * h * 4`` bytes per node and step); and the communication share of the step at each
shaped rate, ``1 - t(unshaped) / t(rate)``: the part of the step the slower link adds (what is left in the
unshaped step is compute plus the fast veth/loopback traffic; the 4 ranks share the host's cores).

``--wire`` instead measures what node 0 really sent over its link per step (TCP/IP headers included), on
unshaped links: two runs per layout, of ``--iters`` and ``2 --iters`` iterations, whose difference of the
link's tx byte counter over the difference of iterations cancels the start-up traffic.

    python3 bench/cluster_layouts.py [--bandwidths unshaped,1gbit,100mbit] [--iters 5] [--json out.json]
    python3 bench/cluster_layouts.py --wire [--iters 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
from cluster_training import HIDDEN, MICRO_BATCH, SEQ_LENGTH, cluster_training, wire_bytes_per_step  # noqa: E402

GLOBAL_BATCH = 8
LAYOUTS = [  # name, flags, tp, pp (dp = 4 / (tp pp))
    ("DP4", [], 1, 1),
    ("DP4 hier", ["--hierarchical-grad-reduce"], 1, 1),
    ("TP2xDP2", ["--tensor-model-parallel-size", "2"], 2, 1),
    ("PP2xTP2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2, 2),
]


def p2p_bytes_per_node(tp: int, pp: int) -> float:
    """Pipeline sends per node and step across the two nodes (0 without pipeline parallelism)."""
    if pp == 1:
        return 0.0
    micro_batches = GLOBAL_BATCH // (MICRO_BATCH * (4 // (tp * pp)))
    return float(micro_batches * tp * SEQ_LENGTH * MICRO_BATCH * HIDDEN * 4)


def layout_runs():
    """``(tag, flags, row)`` per layout, without and with the distributed optimizer: the runs' tag, the
    extra training flags, and the row's fixed cells (layout, distributed optimizer, p2p MB per step)."""
    for name, flags, tp, pp in LAYOUTS:
        for dist_opt in (False, True):
            extra = flags + (["--use-distributed-optimizer"] if dist_opt else [])
            row = {"layout": name, "distributed_optimizer": dist_opt, "p2p_MB": p2p_bytes_per_node(tp, pp) / 1e6}
            yield f"{name}_{int(dist_opt)}".replace(" ", "_"), extra, row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidths", default="unshaped,1gbit,100mbit", help="comma-separated; first: the reference")
    p.add_argument("--iters", type=int, default=5, help="training iterations per run")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per cluster run")
    p.add_argument("--name", default="mlclay", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--wire", action="store_true", help="measure node 0's link bytes per step instead")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.wire:
        return wire_table(args)
    rates = args.bandwidths.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="megalm-layouts-bench-") as tmp:
        os.chmod(tmp, 0o777)
        for layout_tag, extra, row in layout_runs():
            for rate in rates:
                tag = f"{layout_tag}_{rate}"
                kw = dict(bandwidth=rate, iters=args.iters, cluster_name=args.name, timeout=args.timeout)
                for attempt in (1, 2):  # retry once, then report the failure in the table
                    try:
                        row[rate] = cluster_training(tag, extra, tmp, **kw)
                        break
                    except RuntimeError as err:
                        print(f"{tag}: attempt {attempt} failed: {str(err)[-500:]}", file=sys.stderr)
                print(f"{tag}: {row.get(rate)}", file=sys.stderr, flush=True)
            rows.append(row)
    print_table(rows, rates)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidths": rates, "iters": args.iters, "rows": rows}, f, indent=1)
    return 0


def wire_table(args) -> int:
    """Markdown: layout, distributed optimizer, counted inter-node MB (+p2p), MB node 0 sent per step."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="megalm-layouts-wire-") as tmp:
        os.chmod(tmp, 0o777)
        for tag, extra, row in layout_runs():
            kw = dict(cluster_name=args.name, wire=True, timeout=args.timeout)
            short = cluster_training(tag + "_s", extra, tmp, iters=args.iters, **kw)
            long = cluster_training(tag + "_l", extra, tmp, iters=2 * args.iters, **kw)
            row |= {"counted_MB": long["inter_node_MB_per_step"], "wire_MB": wire_bytes_per_step(short, long) / 1e6}
            print(row, file=sys.stderr, flush=True)
            rows.append(row)
    print("| layout | dist. opt. | counted MB/step | +p2p | node 0 sent MB/step (measured) |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [r["layout"], "on" if r["distributed_optimizer"] else "off", f"{r['counted_MB']:.2f}"]
        cells += [f"{r['counted_MB'] + r['p2p_MB']:.2f}", f"{r['wire_MB']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"iters": args.iters, "rows": rows}, f, indent=1)
    return 0


def print_table(rows, rates) -> None:
    """Markdown: layout, distributed optimizer, inter-node MB (counted, +p2p), step ms per rate, comm shares."""
    ref = rates[0]
    head = ["layout", "dist. opt.", "inter-node MB/step (counted)", "+p2p"]
    head += [f"step ms {r}" for r in rates] + [f"comm share {r}" for r in rates[1:]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        runs = [row.get(r) for r in rates]
        counted = next((x["inter_node_MB_per_step"] for x in runs if x), float("nan"))
        cells = [row["layout"], "on" if row["distributed_optimizer"] else "off"]
        cells += [f"{counted:.2f}", f"{counted + row['p2p_MB']:.2f}"]
        cells += [f"{x['step_ms']:.0f}" if x else "failed" for x in runs]
        base = row.get(ref)
        for x in runs[1:]:
            cells.append(f"{1 - base['step_ms'] / x['step_ms']:.0%}" if x and base else "-")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
