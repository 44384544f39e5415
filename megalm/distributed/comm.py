"""Counted collectives: every gradient / optimizer collective in megalm goes through here.

Each wrapper records the call in a process-wide counter (readable by benchmarks and tests)
and then calls ``torch.distributed`` (looked up at call time, so tests may patch it).

Two byte counts are kept per operation kind:

* ``tensor_bytes``: size of the tensor handed to the collective (for all-gather the output).
* ``wire_bytes``: bytes each rank sends under the ring model, for a buffer of ``B`` bytes over
  ``K`` ranks: all-reduce ``2 (K-1)/K B``; reduce-scatter and all-gather ``(K-1)/K B`` of the
  full (unsharded) buffer; broadcast ``B`` (upper bound).

Groups of size 1 are not communicated over: the wrappers return at once and count nothing.
``group=None`` means torch's default (world) group here, as in ``torch.distributed``; callers
holding a :class:`megalm.parallel_state.ProcessGroups` field that is ``None`` (this rank alone)
do not call these wrappers at all.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Dict

import torch
import torch.distributed as dist

from megalm.tensor_parallel.utils import all_gather_flat, reduce_scatter_flat


@dataclass
class CollectiveStats:
    calls: int = 0
    tensor_bytes: int = 0
    wire_bytes: float = 0.0


_LOCK = threading.Lock()
_STATS: Dict[str, CollectiveStats] = {}


def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _record(kind: str, nbytes: int, wire: float) -> None:
    with _LOCK:
        s = _STATS.setdefault(kind, CollectiveStats())
        s.calls += 1
        s.tensor_bytes += int(nbytes)
        s.wire_bytes += float(wire)


def get_comm_stats() -> Dict[str, dict]:
    """``{kind: {"calls", "tensor_bytes", "wire_bytes"}}`` since the last reset (a copy)."""
    with _LOCK:
        return {k: asdict(v) for k, v in _STATS.items()}


def total_comm_calls() -> int:
    with _LOCK:
        return sum(v.calls for v in _STATS.values())


def reset_comm_stats() -> None:
    with _LOCK:
        _STATS.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False,
               kind: str = "all_reduce"):
    """In-place all-reduce over ``group``; returns a work handle when ``async_op`` (else None)."""
    k = _group_size(group)
    if k == 1:
        return None
    b = _nbytes(tensor)
    _record(kind, b, 2.0 * (k - 1) / k * b)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False, kind: str = "reduce_scatter"):
    """``output`` (1/K of ``input``) receives this rank's shard of the reduced ``input``."""
    k = _group_size(group)
    if k == 1:
        output.copy_(input)
        return None
    b = _nbytes(input)
    _record(kind, b, (k - 1) / k * b)
    return reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                           kind: str = "all_gather"):
    """``output`` (K x ``input``) receives every rank's ``input`` in rank order."""
    k = _group_size(group)
    if k == 1:
        output.copy_(input)
        return None
    b = _nbytes(output)
    _record(kind, b, (k - 1) / k * b)
    return all_gather_flat(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, kind: str = "broadcast"):
    """Broadcast from global rank ``src`` to ``group``."""
    k = _group_size(group)
    if k == 1:
        return None
    b = _nbytes(tensor)
    _record(kind, b, b)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
