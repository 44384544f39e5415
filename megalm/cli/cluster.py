"""Run a megalm entry point on a simulated multi-node cluster on this machine (needs root).

    python3 tools/cluster/run.py --nodes 2 --procs-per-node 2 --inter-node-bandwidth 200mbit -- \\
        pretrain_gpt.py --mock-data --num-layers 2 --hidden-size 64 ...
    python3 tools/cluster/run.py --nodes 2 --raw -- bash scripts/pretrain_gpt_tiny_cpu.sh

Every node is a network namespace with its own address on a bridge, its link shaped with tc;
each node runs torchrun (c10d rendezvous at node 0) on the command, or with --raw the command
itself with NNODES / NODE_RANK / GPUS_PER_NODE / MASTER_ADDR / MASTER_PORT set.  Output lines are
prefixed "[node i] ".  Exit code: the worst node's; 124 on --timeout; 130 / 143 on SIGINT /
SIGTERM; 2 when the cluster cannot be made (no root, no ip/tc, another run active, bad flags).
Everything made (namespaces, links, processes) is removed however the run ends.
See tools/cluster/README.md.
"""

import argparse
import signal
import sys

from megalm.errors import MegalmError
from megalm.launch.cluster import ClusterOptions, run_cluster
from megalm.log import get_logger, setup_logging

logger = get_logger(__name__)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    # Ignore further signals: a second Ctrl-C must not cut the teardown short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def parse(argv):
    d = ClusterOptions()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[1], allow_abbrev=False, usage="%(prog)s [options] -- COMMAND [ARGS...]"
    )
    p.add_argument("--nodes", type=int, default=d.nodes, help="simulated nodes (default %(default)s)")
    p.add_argument(
        "--procs-per-node",
        type=int,
        default=d.procs_per_node,
        help="torchrun --nproc-per-node on every node (default %(default)s)",
    )
    p.add_argument(
        "--inter-node-bandwidth",
        default=d.inter_node_bandwidth,
        help="rate of every node's link, each direction, in tc units (e.g. 200mbit, 1gbit); default: unshaped",
    )
    p.add_argument(
        "--name",
        default=d.name,
        help="cluster name: namespaces <name>-n<i>, <name>-sw and the lock "
        "/tmp/megalm-cluster-<name>.lock (default %(default)s)",
    )
    p.add_argument("--subnet", default=d.subnet, help="private /24 used inside the namespaces (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="rendezvous port on node 0 (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds before every node is stopped (exit 124)")
    p.add_argument(
        "--fail-grace",
        type=float,
        default=d.fail_grace,
        help="seconds the other nodes may run after one fails (default %(default)s)",
    )
    p.add_argument(
        "--cut-node",
        type=int,
        default=d.cut_node,
        help="simulate a network failure: node whose link is cut (frames dropped silently)",
    )
    p.add_argument("--cut-after", type=float, default=d.cut_after, help="seconds after the start of the cut")
    p.add_argument(
        "--cut-after-file",
        default=d.cut_after_file,
        help="count --cut-after from the moment this file exists (the workload creates it once running)",
    )
    p.add_argument("--cut-for", type=float, default=d.cut_for, help="seconds the cut lasts")
    p.add_argument("--raw", action="store_true", help="run COMMAND itself on every node, not torchrun COMMAND")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the script and its flags")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    values = {k: v for k, v in vars(args).items() if k != "command"}
    return ClusterOptions(**values, command=command)


def main(argv=None) -> int:
    setup_logging(stream="stderr")
    opts = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return run_cluster(opts)
    except Interrupted as e:
        logger.error("cluster: stopped by %s; everything it made is removed", e)
        return 128 + e.signum
    except MegalmError as e:
        logger.error("cluster: %s", e)
        return 2
