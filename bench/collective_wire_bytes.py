#!/usr/bin/env python
"""Bytes one rank really sends for each gloo collective, against the ring model of megalm.distributed.comm.

On the simulated cluster (``tools/cluster/run.py``, N nodes of 1 process; needs root or CAP_NET_ADMIN) every
rank runs one all-reduce, reduce-scatter and all-gather of a B-byte fp32 buffer; rank 0 reads its node's
``uplink`` tx byte counter (``/proc/net/dev`` of its namespace) before and after each, between barriers, and
prints the bytes sent next to the ring model (all-reduce ``2 (K-1)/K B``, reduce-scatter and all-gather
``(K-1)/K B``).  Measured here (2026-11-26, torch 2.13 CPU, AMD EPYC, B = 10 MB, ~15 s)::

      K  collective                sent MB  ring model MB
      2  all_reduce                  10.08          10.00
      2  reduce_scatter_tensor       10.08           5.00
      2  all_gather_into_tensor       5.01           5.00
      4  all_reduce                  15.03          15.00
      4  reduce_scatter_tensor       15.03           7.50
      4  all_gather_into_tensor       7.51           7.50

gloo's reduce-scatter sends what a whole all-reduce sends.

    python3 bench/collective_wire_bytes.py [--nodes 2,4] [--mbytes 10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))


def _sent() -> int:
    """This namespace's ``uplink`` tx bytes."""
    for line in open("/proc/net/dev"):
        if "uplink" in line:
            return int(line.split(":")[1].split()[8])
    raise RuntimeError("no uplink interface: run under tools/cluster/run.py")


def rank_main(mbytes: float) -> None:
    """One rank of the cluster run: each collective between barriers; rank 0 prints what its node sent."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    k, n = dist.get_world_size(), int(mbytes * 1e6 / 4) // 4 * 4
    x, shard = torch.ones(n), torch.ones(n // k)
    ops = [
        ("all_reduce", lambda: dist.all_reduce(x), 2 * (k - 1) / k),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(n // k), x), (k - 1) / k),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(n), shard), (k - 1) / k),
    ]
    for name, op, ring in ops:
        dist.barrier()
        before = _sent()
        op()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"RESULT {k:2d}  {name:24s} {(_sent() - before) / 1e6:8.2f} {ring * n * 4 / 1e6:14.2f}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="2,4", help="comma-separated node counts (1 process each)")
    p.add_argument("--mbytes", type=float, default=10.0, help="buffer size in MB")
    p.add_argument("--name", default="mlcwire", help="cluster name (tools/cluster/run.py --name)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # inside the cluster
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.mbytes)
        return 0
    print("  K  collective                sent MB  ring model MB")
    for nodes in args.nodes.split(","):
        cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", nodes, "--name", args.name]
        cmd += ["--timeout", "300", "--", os.path.abspath(__file__), "--rank", "--mbytes", str(args.mbytes)]
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{nodes} nodes: the cluster run exited {done.returncode}:\n{done.stdout[-3000:]}")
        for line in done.stdout.splitlines():
            if "RESULT" in line:
                print(line.split("RESULT", 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
