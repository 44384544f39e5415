"""A cluster for the planner: nodes, devices, memory, compute rates and the two kinds of links.

File format (TOML, every key optional but ``nodes``; units in the key names)::

    name = "8xH100"
    nodes = 8
    devices_per_node = 8
    memory_gb = 80                   # per device, 1e9 bytes
    peak_tflops = 989                # per device, dense, the training dtype
    gemm_efficiency = 0.7            # of peak, large GEMMs (or a calibrated [gemm_tflops] table)
    attention_efficiency = 0.5       # of peak, the attention core (QK^T, softmax, AV)
    memory_bandwidth_gbps = 3350     # per device, GB/s: elementwise ops and the optimizer step
    intra_node_bandwidth_gbps = 450  # per device, per direction, GB/s (NVLink)
    intra_node_latency_us = 3
    inter_node_bandwidth_gbps = 400  # per NODE (all its NICs), per direction, GB/s
    inter_node_latency_us = 8
    inter_node_burst_bytes = 0       # a token-bucket shaped node link's burst (the simulated cluster's tc tbf)
    backend = "nccl"                 # "gloo": reduce-scatter sends what an all-reduce sends
    reserve_gb = 4                   # per device: CUDA context / process baseline, buffers, fragmentation
    layer_overhead_us = 40           # per layer and microbatch, forward + backward (kernel launches, Python)
    step_overhead_ms = 5             # per step (optimizer launch, logging)
    dp_overlap = 1.0                 # share of the backward that can hide data-parallel communication
    collective_call_us = 0           # per collective call on top of its latency steps (launch, a blocked wait)
    optimizer_ns_per_param = 0       # the optimizer step per element updated (0: 36 bytes at memory bandwidth)
    host_link_gbps = 50              # per device, per direction, GB/s: activation / optimizer offload copies
    host_optimizer_ns_per_param = 2  # --optimizer-cpu-offload: the host's optimizer step per element
    device = "cuda"                  # whose kernels' saved tensors the memory model counts
    host_cores = 0                   # cores every rank shares (the simulated cluster: one host); 0: own devices

    [gemm_tflops]                    # written by --calibrate: TFLOP/s by GEMM FLOPs (2 m n k), log-interpolated
    "1e6" = 2.1
    "1e9" = 40.0

The planner reads the rates of one process; ``--calibrate`` measures them with every rank of the cluster
busy, so the simulated cluster's shared cores are in the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import tomllib

from megalm.errors import MegalmError


class ClusterFileError(MegalmError):
    """The cluster file or preset is missing, unreadable or has a bad value."""


@dataclass
class Cluster:
    name: str = "cluster"
    nodes: int = 1
    devices_per_node: int = 8
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    gemm_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_bandwidth_gbps: float = 3350.0
    intra_node_bandwidth_gbps: float = 450.0
    intra_node_latency_us: float = 3.0
    inter_node_bandwidth_gbps: float = 400.0
    inter_node_latency_us: float = 8.0
    inter_node_burst_bytes: float = 0.0
    backend: str = "nccl"
    reserve_gb: float = 4.0
    layer_overhead_us: float = 40.0
    step_overhead_ms: float = 5.0
    dp_overlap: float = 1.0
    collective_call_us: float = 0.0
    optimizer_ns_per_param: float = 0.0
    host_link_gbps: float = 50.0
    host_optimizer_ns_per_param: float = 2.0
    device: str = "cuda"
    host_cores: int = 0
    gemm_tflops: Dict[str, float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def optimizer_s_per_param(self) -> float:
        """Seconds of the on-device optimizer step per element: calibrated, else Adam's 36 bytes at memory
        bandwidth (read grad, weight, two moments; write weight, moments; norm; zeroing)."""
        return self.optimizer_ns_per_param * 1e-9 or 36 / (self.memory_bandwidth_gbps * 1e9)

    def gemm_flops_per_s(self, flops: float) -> float:
        """Throughput of one GEMM of ``flops`` (2 m n k): the calibrated table, log-interpolated and
        clamped at its ends, else ``gemm_efficiency`` x peak."""
        if not self.gemm_tflops:
            return self.gemm_efficiency * self.peak_tflops * 1e12
        points = sorted((math.log(float(k)), v) for k, v in self.gemm_tflops.items())
        x = math.log(max(flops, 1.0))
        if x <= points[0][0]:
            return points[0][1] * 1e12
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return (y0 + (y1 - y0) * (x - x0) / (x1 - x0)) * 1e12
        return points[-1][1] * 1e12

    def check(self) -> "Cluster":
        for name in ("nodes", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ClusterFileError(f"cluster: {name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "collective_call_us",
            "optimizer_ns_per_param",
            "host_optimizer_ns_per_param",
            "inter_node_burst_bytes",
            "host_cores",
        ):
            if getattr(self, name) < 0:
                raise ClusterFileError(f"cluster: {name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "memory_gb",
            "peak_tflops",
            "memory_bandwidth_gbps",
            "intra_node_bandwidth_gbps",
            "host_link_gbps",
        ):
            if getattr(self, name) <= 0:
                raise ClusterFileError(f"cluster: {name} must be > 0, got {getattr(self, name)}")
        if self.nodes > 1 and self.inter_node_bandwidth_gbps <= 0:
            raise ClusterFileError("cluster: inter_node_bandwidth_gbps must be > 0 with more than one node")
        if self.backend not in ("nccl", "gloo"):
            raise ClusterFileError(f"cluster: backend must be nccl or gloo, got {self.backend!r}")
        if self.device not in ("cuda", "cpu"):
            raise ClusterFileError(f"cluster: device must be cuda or cpu, got {self.device!r}")
        return self


PRESETS = {
    # NVLink 4: 900 GB/s bidirectional per GPU; 8 x 400 Gb/s InfiniBand NDR per node (one NIC per GPU).
    "h100": Cluster(name="8xH100 SXM (NVLink, 8x400 Gb/s IB)", nodes=1, devices_per_node=8, memory_gb=80),
    # NVLink 3: 600 GB/s bidirectional per GPU; 8 x 200 Gb/s HDR per node.
    "a100": Cluster(
        name="8xA100 SXM 80GB (NVLink, 8x200 Gb/s IB)",
        peak_tflops=312.0,
        memory_bandwidth_gbps=2039.0,
        intra_node_bandwidth_gbps=300.0,
        inter_node_bandwidth_gbps=200.0,
        layer_overhead_us=60.0,
        host_link_gbps=25.0,
    ),
    # This CPU host run as the simulated cluster (tools/cluster/run.py, 2 processes per node, gloo): the
    # rates are placeholders until --calibrate measures them.
    "cpu-sim": Cluster(
        name="simulated cluster on this CPU host (gloo, tc-shaped links)",
        nodes=2,
        devices_per_node=2,
        memory_gb=6.0,
        peak_tflops=0.05,
        gemm_efficiency=0.5,
        attention_efficiency=0.2,
        memory_bandwidth_gbps=2.0,
        intra_node_bandwidth_gbps=1.0,
        intra_node_latency_us=100.0,
        inter_node_bandwidth_gbps=0.125,
        inter_node_latency_us=300.0,
        backend="gloo",
        reserve_gb=0.4,
        layer_overhead_us=3000.0,
        step_overhead_ms=20.0,
        dp_overlap=0.0,
        host_link_gbps=2.0,
        host_optimizer_ns_per_param=18.0,
        device="cpu",
    ),
}
PRESETS["cpu"] = dataclasses.replace(PRESETS["cpu-sim"], name="this CPU host (one node)", nodes=1)

_FIELDS = {f.name: f for f in dataclasses.fields(Cluster)}


def load_cluster(spec: str, overrides: Optional[dict] = None) -> Cluster:
    """A preset name (``h100``, ``a100``, ``cpu-sim``, ``cpu``) or a TOML file path, then ``overrides``."""
    if spec in PRESETS:
        cluster = dataclasses.replace(PRESETS[spec])
        cluster.gemm_tflops = dict(cluster.gemm_tflops)
    else:
        try:
            with open(spec, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ClusterFileError(f"no cluster preset or file {spec!r} (presets: {', '.join(PRESETS)})") from None
        except (tomllib.TOMLDecodeError, OSError) as e:
            raise ClusterFileError(f"cannot read the cluster file {spec}: {e}") from None
        base = PRESETS.get(values.pop("preset", "h100"))
        if base is None:
            raise ClusterFileError(f"{spec}: unknown preset (presets: {', '.join(PRESETS)})")
        cluster = dataclasses.replace(base, gemm_tflops={})
        _apply(cluster, values, spec)
    _apply(cluster, {k: v for k, v in (overrides or {}).items() if v is not None}, "flags")
    return cluster.check()


def _apply(cluster: Cluster, values: dict, where: str) -> None:
    for key, value in values.items():
        if key not in _FIELDS:
            raise ClusterFileError(f"{where}: unknown cluster key {key!r} (keys: {', '.join(_FIELDS)})")
        default = getattr(cluster, key)
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ClusterFileError(f"{where}: {key} must be a table")
            setattr(cluster, key, {str(k): float(v) for k, v in value.items()})
        elif isinstance(default, str):
            setattr(cluster, key, str(value))
        else:
            try:
                setattr(cluster, key, type(default)(value))
            except (TypeError, ValueError):
                raise ClusterFileError(f"{where}: {key} must be a number, got {value!r}") from None


def dump_cluster(cluster: Cluster) -> str:
    """The TOML text of ``cluster`` (every key; :func:`load_cluster` reads it back)."""
    lines = []
    for f in dataclasses.fields(Cluster):
        value = getattr(cluster, f.name)
        if isinstance(value, dict):
            continue
        lines.append(f"{f.name} = " + (f'"{value}"' if isinstance(value, str) else repr(value)))
    if cluster.gemm_tflops:
        lines += ["", "[gemm_tflops]"] + [f'"{k}" = {v!r}' for k, v in cluster.gemm_tflops.items()]
    return "\n".join(lines) + "\n"
