"""Peak memory per rank: CUDA allocator peaks on GPU, peak resident set size on CPU.

On CPU the number is the whole process's peak RSS (``resource.getrusage``: kilobytes on Linux,
bytes on macOS) and cannot be reset; on GPU it is ``torch.cuda.max_memory_allocated`` (tensors)
and ``max_memory_reserved`` (allocator cache), resettable with :func:`reset_peak_memory`.
"""

from __future__ import annotations

import resource
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megalm.tensor_parallel.utils import all_gather_flat

MB = 1024 * 1024


def _cpu_peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory(device: Optional[torch.device] = None) -> Dict[str, object]:
    """``{"kind", "peak_bytes", ...}`` for this rank: ``cuda`` (allocated and reserved peaks) or
    ``cpu_rss`` (peak resident set size of the process)."""
    device = device or (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        return {
            "kind": "cuda",
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "current_bytes": int(torch.cuda.memory_allocated(device)),
        }
    return {"kind": "cpu_rss", "peak_bytes": _cpu_peak_rss_bytes()}


def peak_memory_bytes(device: Optional[torch.device] = None) -> int:
    return int(peak_memory(device)["peak_bytes"])


def memory_scalars(device: Optional[torch.device] = None) -> Dict[str, int]:
    """``--log-memory-to-tensorboard``: Megatron's ``mem-*`` scalars of this rank on CUDA
    (allocator bytes and the live allocation count), the peak RSS on CPU."""
    m = peak_memory(device)
    if m["kind"] != "cuda":
        return {"mem-max-rss-bytes": int(m["peak_bytes"])}
    stats = torch.cuda.memory_stats(device)
    return {
        "mem-reserved-bytes": int(stats.get("reserved_bytes.all.current", 0)),
        "mem-allocated-bytes": int(stats.get("allocated_bytes.all.current", 0)),
        "mem-max-allocated-bytes": int(m["peak_bytes"]),
        "mem-allocated-count": int(stats.get("allocation.all.current", 0)),
    }


def reset_peak_memory(device: Optional[torch.device] = None) -> None:
    """Reset CUDA peak statistics (no-op on CPU, where the OS keeps the peak RSS)."""
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def memory_report(rank: Optional[int] = None, device: Optional[torch.device] = None) -> str:
    """One line, e.g. ``[rank 0] memory (MB) | max allocated: 1234.5 | max reserved: 1500.0``."""
    rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
    m = peak_memory(device)
    if m["kind"] == "cuda":
        return (
            f"[rank {rank}] memory (MB) | allocated: {m['current_bytes'] / MB:.1f} | max allocated: "
            f"{m['peak_bytes'] / MB:.1f} | max reserved: {m['peak_reserved_bytes'] / MB:.1f}"
        )
    return f"[rank {rank}] memory (MB) | peak RSS (process): {m['peak_bytes'] / MB:.1f}"


def gather_peak_memory(group=None) -> List[int]:
    """Peak bytes of every rank of ``group`` (collective: one all-gather of an int64)."""
    local = torch.tensor([peak_memory_bytes()], dtype=torch.int64)
    if not dist.is_initialized():
        return [int(local.item())]
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        local = local.cuda()
    out = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=local.device)
    all_gather_flat(out, local, group=group)
    return [int(v) for v in out.cpu()]


class TrackedAllocations:
    """Bytes the CPU allocator reports allocating and freeing inside a ``with`` block.

    Every allocation and free of c10's CPU allocator is reported to the profiler (``profile_memory``);
    summing them in time order gives the live bytes at every instant.  After the block: ``peak`` (the
    largest live total above the start), ``end`` (live at the end, above the start), ``allocated``
    (the sum of all allocations) and ``phases[name]``: the peak inside each ``with tracker.phase(name)``
    (the last one of that name), on the same scale.  A block allocated before the tracker started is
    not counted when it is freed, so allocate what is measured inside it.  Deterministic (no RSS, no
    page cache), but the profiler slows the block down: for tests and benchmarks, not for training.
    """

    def __init__(self):
        self.peak = self.end = self.allocated = 0
        self.phases: Dict[str, int] = {}
        self._prof = None

    def __enter__(self) -> "TrackedAllocations":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def phase(self, name: str):
        """A region whose peak is reported in ``phases[name]``."""
        return torch.profiler.record_function(f"tracked_phase:{name}")

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        spans = {}
        for e in events:
            if e.name().startswith("tracked_phase:"):
                spans[e.name().split(":", 1)[1]] = (e.start_ns(), e.start_ns() + e.duration_ns())
        live, timeline = 0, []
        for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            live += e.nbytes()
            self.allocated += max(e.nbytes(), 0)
            self.peak = max(self.peak, live)
            timeline.append((e.start_ns(), live))
        self.end = live
        for name, (lo, hi) in spans.items():
            before = [v for t, v in timeline if t < lo]
            inside = [v for t, v in timeline if lo <= t <= hi]
            self.phases[name] = max(inside + before[-1:] or [0])
