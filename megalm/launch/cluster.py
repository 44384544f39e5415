"""Run one command on every node of a simulated cluster (``tools/cluster/run.py``).

Each node ``i`` runs, inside its namespace (:mod:`megalm.launch.netns`), either the real torchrun::

    python3 -m torch.distributed.run --nnodes N --node-rank i --nproc-per-node L \\
        --rdzv-backend c10d --rdzv-endpoint <node 0 address>:<port> --rdzv-id <name> \\
        --rdzv-conf is_host=<1 on node 0> --local-addr <node i address> --max-restarts 0 <command>

or, with ``raw``, the command itself (e.g. ``scripts/pretrain_*.sh``, which starts torchrun with
its own flags).  Both see ``GLOO_SOCKET_IFNAME=uplink`` and the rendezvous as Megatron scripts
read it: ``NNODES``, ``NODE_RANK``, ``GPUS_PER_NODE``, ``MASTER_ADDR``, ``MASTER_PORT``, plus
``CLUSTER_NODE_ADDRS`` (every node's address, in node order).

Every line a node prints goes to the launcher's stdout prefixed ``[node i] ``.  The exit code is
the worst (largest) exit code of the nodes that ended on their own (a signal ``s`` counts as
``128 + s``); once one node fails, the others get ``fail_grace`` seconds to end before they are
stopped.  ``timeout`` stops every node and gives 124.  Whatever way the run ends (success,
failure, timeout, an exception such as ``KeyboardInterrupt`` raised by the entry point's SIGINT /
SIGTERM handler), every process left in the namespaces is stopped (SIGTERM, then SIGKILL after
``kill_grace`` seconds) and every namespace removed before :func:`run_cluster` returns or raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megalm.launch.lock import ClusterLock
from megalm.launch.netns import NODE_IFNAME, ClusterError, ClusterNet, check_privileges
from megalm.log import get_logger

logger = get_logger(__name__)

TIMEOUT_EXIT_CODE = 124


@dataclass
class ClusterOptions:
    """What to run on how many simulated nodes, over which links."""

    nodes: int = 2
    procs_per_node: int = 1
    inter_node_bandwidth: Optional[str] = None  # e.g. "200mbit"; None: unshaped
    name: str = "mlc"
    subnet: str = "10.213.7.0/24"
    port: int = 29500
    timeout: Optional[float] = None  # seconds for the whole run
    fail_grace: float = 30.0  # seconds the others may run after one node fails
    kill_grace: float = 10.0  # seconds between SIGTERM and SIGKILL
    raw: bool = False  # run the command itself instead of torchrun <command>
    cut_node: Optional[int] = None  # node whose link is cut (a network failure) ...
    cut_after: float = 0.0  # ... this many seconds after the start (or after cut_after_file appears) ...
    cut_for: float = 0.0  # ... for this many seconds
    cut_after_file: Optional[str] = None  # the cut's clock starts when the workload creates this file
    command: List[str] = field(default_factory=list)

    def net(self) -> ClusterNet:
        return ClusterNet(self.name, self.nodes, self.subnet, self.inter_node_bandwidth)

    def lock_path(self) -> str:
        return os.path.join("/tmp", f"megalm-cluster-{self.name}.lock")


def node_env(opts: ClusterOptions, net: ClusterNet, node: int) -> Dict[str, str]:
    """Environment of node ``node``'s launcher process (the launcher's own, plus the rendezvous)."""
    env = dict(os.environ)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": NODE_IFNAME,
            "TP_SOCKET_IFNAME": NODE_IFNAME,
            "NNODES": str(opts.nodes),
            "NODE_RANK": str(node),
            "GPUS_PER_NODE": str(opts.procs_per_node),
            "MASTER_ADDR": net.address(0),
            "MASTER_PORT": str(opts.port),
            "CLUSTER_NODE_ADDRS": " ".join(net.address(i) for i in range(opts.nodes)),
        }
    )
    # Every simulated node shares this machine's cores: torchrun leaves OMP_NUM_THREADS unset with one
    # process per node, and each rank would then take all of them (measured: bench/cluster_scaling.py).
    ranks = opts.nodes * opts.procs_per_node
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    return env


def node_command(opts: ClusterOptions, net: ClusterNet, node: int) -> List[str]:
    """The argv node ``node`` runs inside its namespace."""
    if not opts.command:
        raise ClusterError("no command to run (give it after --)")
    if opts.raw:
        return list(opts.command)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(opts.nodes),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(opts.procs_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{net.address(0)}:{opts.port}",
        "--rdzv-id",
        opts.name,
        "--rdzv-conf",
        f"is_host={1 if node == 0 else 0}",
        "--local-addr",
        net.address(node),
        "--max-restarts",
        "0",
        *opts.command,
    ]


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell would report it (-s -> 128 + s)."""
    return 128 - returncode if returncode < 0 else returncode


class _Nodes:
    """The node processes of one run and the threads copying their output."""

    def __init__(self, opts: ClusterOptions, net: ClusterNet, out):
        self.opts, self.net, self.out = opts, net, out
        self.procs: List[subprocess.Popen] = []
        self.threads: List[threading.Thread] = []
        self.stopped = set()  # nodes the launcher stopped (their exit codes do not count)
        self.stop_time: Optional[float] = None
        self.cut_state = "before"  # "cut", "restored"
        self.cut_origin: Optional[float] = None  # elapsed seconds from which cut_after counts
        self._write_lock = threading.Lock()

    def start(self) -> None:
        for node in range(self.opts.nodes):
            if node == 1 and not self.opts.raw:
                self._wait_for_rendezvous_store()
            argv = ["ip", "netns", "exec", self.net.namespace(node), *node_command(self.opts, self.net, node)]
            proc = subprocess.Popen(
                argv,
                env=node_env(self.opts, self.net, node),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.procs.append(proc)
            thread = threading.Thread(target=self._copy, args=(node, proc.stdout), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _wait_for_rendezvous_store(self, timeout: float = 60.0) -> None:
        """Start the other nodes once node 0's torchrun listens on the rendezvous port (or has ended, or
        ``timeout`` passed): an agent that reaches for the store before it exists can fail its rendezvous
        with "The connection to the C10d store has failed" (seen on this machine)."""
        deadline = time.monotonic() + timeout
        probe = ["ip", "netns", "exec", self.net.namespace(0), "ss", "-ltnH"]
        while time.monotonic() < deadline and self.procs[0].poll() is None:
            listening = subprocess.run(probe, capture_output=True, text=True, timeout=10).stdout
            if any(f":{self.opts.port} " in line + " " for line in listening.splitlines()):
                return
            time.sleep(0.1)

    def _copy(self, node: int, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._write_lock:
                self.out.write(f"[node {node}] {line}\n")
                self.out.flush()
        stream.close()

    def running(self) -> List[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def stop_running(self) -> None:
        """SIGTERM every node still running (its whole process group), as the launcher's choice."""
        if self.stop_time is None:
            self.stop_time = time.monotonic()
        for node in self.running():
            self.stopped.add(node)
            _signal_group(self.procs[node].pid, signal.SIGTERM)

    def wait(self) -> int:
        """Wait for every node (with the timeout and the grace after a failure); the run's exit code."""
        start, failed_at = time.monotonic(), None
        timed_out = False
        while self.running():
            now = time.monotonic()
            self._cut_or_restore(now - start)
            if failed_at is None and any(p.poll() not in (None, 0) for p in self.procs):
                failed_at = now
                logger.warning("a node failed; stopping the others in %.0f s", self.opts.fail_grace)
            if self.opts.timeout is not None and now - start > self.opts.timeout and not timed_out:
                logger.error("cluster run timed out after %.0f s: stopping every node", self.opts.timeout)
                timed_out = True
                self.stop_running()
            elif failed_at is not None and now - failed_at > self.opts.fail_grace and not self.stopped:
                self.stop_running()
            if self.stop_time is not None and now - self.stop_time > self.opts.kill_grace:
                self.kill_remaining()
            time.sleep(0.05)
        for thread in self.threads:
            thread.join(timeout=5)
        own = [exit_code(p.returncode) for i, p in enumerate(self.procs) if i not in self.stopped]
        worst = max(own, default=0)
        return worst if worst or not timed_out else TIMEOUT_EXIT_CODE

    def _cut_or_restore(self, elapsed: float) -> None:
        """Apply ``cut_node`` / ``cut_after`` / ``cut_for`` at their time, counted from the start or from
        the moment ``cut_after_file`` exists (a workload that writes it once it runs is cut at a known point
        of its work, however long its start-up took)."""
        o = self.opts
        if o.cut_node is None:
            return
        if self.cut_origin is None:
            if o.cut_after_file is not None and not os.path.exists(o.cut_after_file):
                return
            self.cut_origin = elapsed
        since = elapsed - self.cut_origin
        if self.cut_state == "before" and since >= o.cut_after:
            self.net.cut(o.cut_node)
            self.cut_state = "cut"
            logger.warning("cut node %d's link for %.1f s", o.cut_node, o.cut_for)
        elif self.cut_state == "cut" and since >= o.cut_after + o.cut_for:
            self.net.restore(o.cut_node)
            self.cut_state = "restored"
            logger.warning("restored node %d's link", o.cut_node)

    def kill_remaining(self) -> None:
        for node in self.running():
            _signal_group(self.procs[node].pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def end_processes(net: ClusterNet, nodes: Optional[_Nodes], kill_grace: float) -> None:
    """Stop the node processes and anything else left inside the namespaces: SIGTERM, then SIGKILL."""
    if nodes is not None:
        nodes.stop_running()
    deadline = time.monotonic() + kill_grace
    pids = net.pids()
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    while time.monotonic() < deadline and (net.pids() or (nodes and nodes.running())):
        time.sleep(0.05)
    for pid in net.pids():
        _kill(pid, signal.SIGKILL)
    if nodes is not None:
        for proc in nodes.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=kill_grace)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def teardown(net: ClusterNet, nodes: Optional[_Nodes], kill_grace: float) -> None:
    """Every process in the namespaces ended, then every namespace removed."""
    end_processes(net, nodes, kill_grace)
    net.destroy()


def run_cluster(opts: ClusterOptions, out=None) -> int:
    """Make the cluster, run ``opts.command`` on every node, tear everything down; the exit code.

    Raises :class:`ClusterError` (or a subclass: no privileges, already running) before anything
    runs; an exception raised while the nodes run (``KeyboardInterrupt``) propagates after the
    teardown."""
    check_privileges()
    net = opts.net()
    if opts.procs_per_node < 1:
        raise ClusterError(f"--procs-per-node must be >= 1, got {opts.procs_per_node}")
    node_command(opts, net, 0)  # validates the command
    if opts.cut_node is not None and not 0 <= opts.cut_node < opts.nodes:
        raise ClusterError(f"--cut-node {opts.cut_node} is not a node of 0..{opts.nodes - 1}")
    with ClusterLock(opts.lock_path()) as took_over:
        if took_over or net.existing():
            logger.warning("removing what a previous launcher of cluster '%s' left behind", opts.name)
            teardown(net, None, opts.kill_grace)
        nodes = None
        try:
            net.create()
            logger.info(
                "cluster '%s': %d nodes x %d processes, %s, link %s",
                opts.name,
                opts.nodes,
                opts.procs_per_node,
                ", ".join(net.address(i) for i in range(opts.nodes)),
                opts.inter_node_bandwidth or "unshaped",
            )
            nodes = _Nodes(opts, net, out or sys.stdout)
            nodes.start()
            return nodes.wait()
        finally:
            teardown(net, nodes, opts.kill_grace)
