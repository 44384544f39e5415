#!/usr/bin/env python
"""Flat vs hierarchical data-parallel reduction on the simulated cluster (DP 4 = 2 nodes x 2 ranks).

Each configuration is one real training run through ``tools/cluster/run.py`` (network namespaces,
inter-node links shaped with ``tc``; needs root or CAP_NET_ADMIN), run by :mod:`cluster_training`:
``pretrain_gpt.py`` on mock data, a ~1.9M-parameter GPT (hidden 128, 4 layers, vocab 8192), global batch 8,
``--log-interval 1`` into a metrics file.
Reported per configuration: the median step time over the iterations after the first, and the
inter-node bytes per step of the busiest node (``inter_node_bytes`` of the metrics file, the ring
model of :mod:`megalm.distributed.comm`), with the analytic expectation for B bytes of fp32
gradients: flat all-reduce 2 (K-1)/K B = 1.5 B per node, hierarchical 2 (n-1)/n B = 1.0 B; with the
distributed optimizer (reduce-scatter + parameter all-gather) 1.5 B vs 1.0 B under the ring model, and on
gloo, whose reduce-scatter is an all-reduce (``bench/collective_wire_bytes.py``), 2.25 B vs 1.5 B, as
:mod:`megalm.distributed.comm` now counts it (the table below was counted with the ring's bytes).

    python3 bench/hierarchical_reduce.py [--bandwidth 100mbit] [--iters 6] [--distributed-optimizer]

Measured here (2-core host shared with other jobs, ``--iters 5 --distributed-optimizer``, 100mbit;
about 2 minutes; B = 7.47 MB of padded fp32 buckets)::

    configuration                             step (ms)  inter-node MB/step/node  final loss
    flat                                           1098                    11.20      8.9513
    hierarchical                                    781                     7.47      8.9513
    flat + distributed optimizer                   1633                    11.20      8.9513
    hierarchical + distributed optimizer           1205                     7.47      8.9513
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
from cluster_training import cluster_training  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bandwidth", default="100mbit", help="inter-node link rate (tc units) or 'unshaped'")
    p.add_argument("--iters", type=int, default=6, help="training iterations per configuration")
    p.add_argument("--distributed-optimizer", action="store_true", help="also with --use-distributed-optimizer")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cluster run")
    p.add_argument("--name", default="mlchier", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    configs = [("flat", []), ("hierarchical", ["--hierarchical-grad-reduce"])]
    if args.distributed_optimizer:
        configs += [(f"{n} + distributed optimizer", e + ["--use-distributed-optimizer"]) for n, e in configs]
    with tempfile.TemporaryDirectory(prefix="megalm-hier-bench-") as tmp:
        os.chmod(tmp, 0o777)
        results = [
            cluster_training(
                name.replace(" ", "_"),
                extra,
                tmp,
                bandwidth=args.bandwidth,
                iters=args.iters,
                cluster_name=args.name,
                timeout=args.timeout,
            )
            | {"name": name}
            for name, extra in configs
        ]
    print(f"2 nodes x 2 ranks, DP 4, inter-node link {args.bandwidth}")
    print(f"{'configuration':40s} {'step (ms)':>10s} {'inter-node MB/step/node':>24s} {'final loss':>11s}")
    for r in results:
        print(f"{r['name']:40s} {r['step_ms']:10.0f} {r['inter_node_MB_per_step']:24.2f} {r['final_loss']:11.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": args.bandwidth, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
