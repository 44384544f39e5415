"""Copies between the compute device and host memory, counted: the one transfer engine of the
offloads (activations: :mod:`megalm.transformer.activation_offload`; optimizer:
:mod:`megalm.optimizer.cpu_offload`).

On CUDA each direction has its own side stream: a copy first waits for the work already queued on
the current stream (its source is ready), runs ``non_blocking`` on its stream (pinned host memory,
so it is truly asynchronous) and records an event.  A consumer waits for that event where it reads
the copy: the current stream (:meth:`HostTransfer.wait_on_device`) or the host
(:meth:`HostTransfer.wait_on_host`).  The device source of a device-to-host copy is marked as in
use by the copy stream (``record_stream``), so the caching allocator does not hand its memory out
again before the copy has read it; its owner may drop it at once.

On a CPU-only machine the "device" is the CPU: the same calls copy synchronously into separate
tensors (real copies, counted the same way) and the events are None.

``bytes_d2h`` / ``bytes_h2d`` count the bytes copied each way; ``trace`` (None, or a list a test
installs) receives ``(direction, tag, bytes)`` per copy in issue order.  No communication.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalm.device import side_stream, use_cuda


class HostTransfer:
    """Device <-> host copies on a stream per direction (CUDA) or synchronous (CPU); see the module."""

    def __init__(self):
        self.cuda = use_cuda()
        self.d2h_stream = side_stream()
        self.h2d_stream = side_stream()
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.trace: Optional[list] = None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D host tensor (pinned on CUDA, so copies to and from it are asynchronous)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, tag=None, after=()):
        """``dst`` (host) <- ``src`` (device), after the current stream's work and the events ``after``;
        returns the copy's event (None on CPU)."""
        return self._copy(dst, src, self.d2h_stream, "d2h", tag, after)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, tag=None, after=()):
        """``dst`` (device) <- ``src`` (host), after the current stream's work and the events ``after``;
        returns the copy's event (None on CPU)."""
        return self._copy(dst, src, self.h2d_stream, "h2d", tag, after)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream, direction: str, tag, after):
        nbytes = src.numel() * src.element_size()
        if direction == "d2h":
            self.bytes_d2h += nbytes
        else:
            self.bytes_h2d += nbytes
        if self.trace is not None:
            self.trace.append((direction, tag, nbytes))
        if stream is None:
            dst.copy_(src)
            return None
        stream.wait_stream(torch.cuda.current_stream())
        for event in after:
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        (src if direction == "d2h" else dst).record_stream(stream)
        return event

    def wait_on_device(self, event) -> None:
        """The current stream waits for a copy (before it reads what the copy wrote)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait_on_device_all(self, events) -> None:
        for event in events:
            self.wait_on_device(event)

    def wait_on_host_all(self, events) -> None:
        for event in events:
            self.wait_on_host(event)

    def wait_on_host(self, event) -> None:
        """The host waits for a copy (before the CPU reads what it wrote, or writes what it reads)."""
        if event is not None:
            event.synchronize()
