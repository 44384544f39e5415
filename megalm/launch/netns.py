"""The simulated cluster's network: one Linux network namespace per node, joined by a bridge.

Layout for a cluster named ``mlc`` with subnet ``10.213.7.0/24`` and two nodes::

    namespace mlc-sw:  bridge br0 <- veth n0, veth n1          (the "switch")
    namespace mlc-n0:  lo, uplink 10.213.7.10/24  (peer of n0)  (node 0)
    namespace mlc-n1:  lo, uplink 10.213.7.11/24  (peer of n1)  (node 1)

Node ``i`` has address ``<subnet>.(10 + i)``: two digits, so that torchrun's c10d rendezvous, which
orders nodes by their address *string*, gives node ``i`` the ranks ``i * L ... i * L + L - 1``
(up to 90 nodes).  Nothing is created in the host's namespace, and the namespaces have no route
beyond their /24: no address outside the cluster can be reached.

Shaping: a token bucket (``tc tbf``) on both ends of each node's veth, i.e. on the egress of
``uplink`` (node -> switch) and of ``n<i>`` (switch -> node), so each direction of every node's
link runs at the given rate.  Traffic between two processes of one node goes to the node's own
address, which Linux routes over the namespace's ``lo`` (``ip route get`` says ``local ... dev lo``):
it never meets the shaper.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional

from megalm.errors import MegalmError

NODE_IFNAME = "uplink"
BRIDGE = "br0"
FIRST_HOST = 10


class ClusterError(MegalmError):
    """The simulated cluster could not be set up, run or torn down."""


class ClusterPrivilegeError(ClusterError):
    """No ``ip``/``tc`` or no CAP_NET_ADMIN: network namespaces cannot be made here."""


def rate_bits(rate: str) -> int:
    """``"200mbit"`` -> 200_000_000 (tc's units: bit, kbit, mbit, gbit, decimal)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ClusterError(f"bandwidth '{rate}' is not a number followed by bit, kbit, mbit or gbit (e.g. 200mbit)")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[match.group(2)]
    bits = int(float(match.group(1)) * scale)
    if bits < 8000:
        raise ClusterError(f"bandwidth '{rate}' is below 8kbit")
    return bits


def tbf_burst_bytes(bits_per_s: int) -> int:
    """Token bucket depth: one timer tick (1/250 s) of traffic, at least 128 KiB so a 64 KiB
    segmentation-offloaded packet always fits."""
    return max(128 * 1024, bits_per_s // 8 // 250)


def check_privileges() -> None:
    """Raise :class:`ClusterPrivilegeError` (one line) unless ``ip``/``tc`` exist and this process
    holds CAP_NET_ADMIN."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterPrivilegeError(f"the simulated cluster needs iproute2's {' and '.join(missing)} (not found)")
    if not _has_cap_net_admin():
        raise ClusterPrivilegeError(
            "the simulated cluster needs CAP_NET_ADMIN (run as root) to make network namespaces"
        )


def _has_cap_net_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return os.geteuid() == 0
    return bool(int(caps, 16) >> 12 & 1)  # CAP_NET_ADMIN = 12


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterError(f"'ip {' '.join(args)}' failed: {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class ClusterNet:
    """Names and addresses of one simulated cluster; :meth:`create` / :meth:`destroy` make and remove it."""

    name: str
    nodes: int
    subnet: str = "10.213.7.0/24"
    bandwidth: Optional[str] = None  # tc rate of every node's link (each direction); None = unshaped

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.name):
            raise ClusterError(
                f"cluster name '{self.name}' must be 1-8 lowercase letters/digits, starting with a letter"
            )
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as e:
            raise ClusterError(f"subnet {self.subnet}: {e}") from None
        if not net.is_private or net.prefixlen != 24 or net.version != 4:
            raise ClusterError(f"subnet {self.subnet} must be a private IPv4 /24 (e.g. 10.213.7.0/24)")
        if not 1 <= self.nodes <= 90:
            raise ClusterError(f"--nodes must be between 1 and 90, got {self.nodes}")
        if self.bandwidth is not None:
            rate_bits(self.bandwidth)

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def namespace(self, node: int) -> str:
        return f"{self.name}-n{node}"

    def address(self, node: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[FIRST_HOST + node])

    def namespaces(self) -> List[str]:
        return [self.namespace(i) for i in range(self.nodes)] + [self.switch]

    def create(self) -> None:
        """Make the switch and every node; on any failure remove what was made and raise."""
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            self.destroy()
            raise

    def _add_node(self, node: int) -> None:
        ns, port = self.namespace(node), f"n{node}"
        _ip("netns", "add", ns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", NODE_IFNAME)
        _ip("-n", ns, "link", "set", NODE_IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.bandwidth is not None:
            self._shape(ns, NODE_IFNAME)
            self._shape(self.switch, port)

    def _shape(self, ns: str, dev: str) -> None:
        bits = rate_bits(self.bandwidth)
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{bits}bit",
                "burst",
                str(tbf_burst_bytes(bits)),
                "latency",
                "100ms",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise ClusterError(f"could not shape {dev} in {ns} with tc tbf: {proc.stderr.strip()}")

    def cut(self, node: int) -> None:
        """Cut node ``node`` off the switch: its port leaves the bridge, so every frame to or from
        the node is dropped silently (no error to the sender: TCP just retransmits)."""
        _ip("-n", self.switch, "link", "set", f"n{node}", "nomaster")

    def restore(self, node: int) -> None:
        """Undo :meth:`cut`."""
        _ip("-n", self.switch, "link", "set", f"n{node}", "master", BRIDGE)

    def existing(self) -> List[str]:
        """This cluster's namespaces that exist now."""
        listed = _ip("netns", "list").stdout.split("\n")
        present = {line.split()[0] for line in listed if line.strip()}
        return [ns for ns in self.namespaces() if ns in present]

    def pids(self) -> List[int]:
        """Processes running inside this cluster's namespaces."""
        out = []
        for ns in self.existing():
            out += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        return out

    def destroy(self) -> None:
        """Remove every namespace of this cluster (their veths, bridge and qdiscs go with them).
        Processes must have ended first (see :func:`megalm.launch.processes.kill_all`)."""
        errors = []
        for ns in self.existing():
            proc = _ip("netns", "del", ns, check=False)
            if proc.returncode != 0:
                errors.append(f"{ns}: {proc.stderr.strip()}")
        if errors:
            raise ClusterError("could not remove namespace(s) " + "; ".join(errors))
