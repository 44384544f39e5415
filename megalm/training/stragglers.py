"""Megatron-LM's straggler report: ``--log-straggler``, ``--straggler-minmax-count N``,
``--disable-straggler-on-startup``, ``--straggler-ctrlr-port``.

Every log interval each rank contributes two numbers, in milliseconds per iteration averaged
over the interval:

* **step**: the wall time of the training step on this rank (:func:`megalm.training.step.train_step`
  and the numerics check: schedule, gradient reduction, optimizer), waiting in collectives
  included.  In a synchronous job every rank waits for the slowest, so step times come out
  nearly equal; a rank that is slow on its own shows in the compute time.
* **compute**: the time in the schedules' forward and backward steps (the ``forward-compute``
  and ``backward-compute`` timers of :mod:`megalm.timers`, kept on at every
  ``--timing-log-level`` under ``--log-straggler``): your ``forward_step`` with the model's
  forward and the loss, and the backward pass.  Pipeline exchanges, the wait for the
  data-parallel gradient reduction and the optimizer are outside it; the tensor-, context- and
  expert-parallel collectives inside the layers are inside it (megalm's timers do not separate
  them), and so is the launch (not the wait) of overlapped gradient reductions.  On CUDA each of
  these timers synchronizes the device, as at ``--timing-log-level 2``.

Communication: once at start an ``all_gather_object`` of the host names over the world; per
log interval one ``all_gather`` of 3 float64 values per rank over the world (every rank calls
:meth:`StragglerReport.gather` at the log line).  The logging rank then names the
``--straggler-minmax-count`` slowest and fastest ranks by each measure, with their node
(``node <rank // ranks per node>`` when there are several nodes) and host.

``--disable-straggler-on-startup`` starts with the report off; every TCP connection to rank 0's
``--straggler-ctrlr-port`` (``curl <rank-0 host>:<port>``, as in Megatron) toggles it, and the
next log interval follows rank 0's setting (its flag travels in the same gather).
"""

from __future__ import annotations

import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.log import get_logger
from megalm.timers import COMPUTE_TIMERS

logger = get_logger(__name__)


@dataclass(frozen=True)
class RankTime:
    """One rank's interval: milliseconds per iteration, and where it runs."""

    rank: int
    ms: float
    host: str
    node: Optional[int]  # None on one node

    def describe(self) -> str:
        where = f"node {self.node}, {self.host}" if self.node is not None else self.host
        return f"rank {self.rank} ({where}) {self.ms:.1f}"

    def as_record(self) -> dict:
        out = {"rank": self.rank, "ms": self.ms, "host": self.host}
        if self.node is not None:
            out["node"] = self.node
        return out


def slowest_and_fastest(times: List[RankTime], count: int) -> Dict[str, List[RankTime]]:
    """The ``count`` slowest (slowest first) and fastest (fastest first) ranks; ties by rank."""
    ordered = sorted(times, key=lambda t: (t.ms, t.rank))
    return {"slowest": list(reversed(ordered))[:count], "fastest": ordered[:count]}


class _Toggle(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        report = self.server.report
        report.enabled = not report.enabled
        state = "on" if report.enabled else "off"
        body = f"straggler report {state}\n".encode()
        self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        logger.info(f"straggler report turned {state} by a connection to port {self.server.server_address[1]}")


class StragglerReport:
    """The run's straggler report (one object, built by the trainer when ``--log-straggler``).

    Collective at construction (host names) and in :meth:`gather`.
    """

    def __init__(self, logging_cfg, ranks_per_node: int):
        self.count = logging_cfg.straggler_minmax_count
        self.enabled = not logging_cfg.disable_straggler_on_startup
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        hosts = [socket.gethostname()] * world
        if world > 1:
            dist.all_gather_object(hosts, socket.gethostname())
        self.hosts = hosts
        self.nodes = [r // ranks_per_node for r in range(world)] if ranks_per_node < world else None
        self.server = self._serve(logging_cfg.straggler_ctrlr_port) if self.rank == 0 else None

    def _serve(self, port: int):
        server = socketserver.ThreadingTCPServer(("", port), _Toggle, bind_and_activate=False)
        server.allow_reuse_address = True
        server.daemon_threads = True
        try:
            server.server_bind()
            server.server_activate()
        except OSError as e:
            logger.warning(f"--straggler-ctrlr-port {port} cannot be opened ({e}): the report stays as set")
            return None
        server.report = self
        threading.Thread(target=server.serve_forever, name="straggler-ctrlr", daemon=True).start()
        logger.info(
            f"straggler report {'on' if self.enabled else 'off'}; toggle it with a connection to "
            f"{socket.gethostname()}:{server.server_address[1]}"
        )
        return server

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def gather(self, step_seconds: float, iterations: int, timers) -> Optional[dict]:
        """Collective over the world: ``{"step": {"slowest": [...], "fastest": [...]}, "compute": ...}``
        of :class:`RankTime` lists, or None when rank 0 has the report off.  ``step_seconds``: this
        rank's summed step time over ``iterations``; the compute timers are read from ``timers``
        (reset unless ``--timing-log-level 2`` prints and resets them afterwards)."""
        reset = timers.log_level < 2
        compute = sum(timers(name).elapsed(reset=reset) for name in COMPUTE_TIMERS)
        n = max(iterations, 1)
        mine = torch.tensor([step_seconds / n, compute / n, float(self.enabled)], dtype=torch.float64)
        rows = mine.unsqueeze(0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            local = mine.to(get_device())
            every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(every, local)
            rows = torch.stack(every).cpu()
        if rows[0, 2] == 0:
            return None
        out = {}
        for column, measure in enumerate(("step", "compute")):
            times = [
                RankTime(r, float(rows[r, column]) * 1000.0, self.hosts[r], self.nodes[r] if self.nodes else None)
                for r in range(rows.shape[0])
            ]
            out[measure] = slowest_and_fastest(times, self.count)
        return out


def format_stragglers(report: dict) -> str:
    """The log line's tail: ``slowest step (ms): rank 1 (host) 210.3, ... | fastest step ...``."""
    parts = []
    for measure in ("step", "compute"):
        for end in ("slowest", "fastest"):
            ranks = ", ".join(t.describe() for t in report[measure][end])
            parts.append(f"{end} {measure} (ms): {ranks}")
    return " " + " | ".join(parts) + " |"


def stragglers_record(report: dict) -> dict:
    """The metrics-file fields: ``straggler_<measure>_<slowest|fastest>``: ``[{rank, ms, host[, node]}]``."""
    return {
        f"straggler_{measure}_{end}": [t.as_record() for t in report[measure][end]]
        for measure in ("step", "compute")
        for end in ("slowest", "fastest")
    }
