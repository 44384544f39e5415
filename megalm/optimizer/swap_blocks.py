"""Checkpoint blocks of the NVMe optimizer offload's state read from and written to the swap files directly,
one tensor at a time (:mod:`megalm.optimizer.nvme_offload`, ``--optimizer-offload-device nvme``).

A swapped state tensor (an Adam moment of an offloaded parameter) is not in memory between steps.  For a
checkpoint the optimizer hands out a meta-device tensor of its shape and dtype in its place, with a
:class:`SwapBlock` saying where its bytes are (bucket file, byte offset).  The checkpoint's blocks are views
of that meta tensor (a TP slice, the distributed optimizer's flat ranges cut into rectangles); a view's
storage offset and strides locate its elements in the tensor, so::

    read(view):   pread the elements' byte span [lo, hi] of the tensor's region  -> as_strided -> a new tensor
    write(view):  pwrite the same span, after reading it first when the view does not cover it whole

A save therefore holds at most one block of the swapped state in memory (DCP resolves its write items one
at a time), a load one read item's block: never the rank's whole state.  The I/O runs on the swap files'
worker thread in submission order (after any transfer queued before it).  No communication.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megalm.optimizer.swap_files import SwapError, SwapFiles


def _span(view: torch.Tensor) -> Tuple[int, int]:
    """First element and element count of the storage span ``view`` covers (0, 0 when empty)."""
    if view.numel() == 0:
        return 0, 0
    last = sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return view.storage_offset(), last + 1


class SwapBlock:
    """The stored values of the meta tensor ``base`` (contiguous): its bytes start at ``offset`` of bucket
    ``bucket``'s payload in ``files``.  The ``read`` / ``write`` of :class:`megalm.param_layout.BlockSource`."""

    def __init__(self, files: SwapFiles, bucket: int, offset: int, base: torch.Tensor):
        self.files, self.bucket, self.offset, self.base = files, bucket, offset, base

    def _check(self, view: torch.Tensor) -> None:
        root = view if view._base is None else view._base
        if root is not self.base:
            raise SwapError("a swap block reads and writes only views of its own meta tensor")

    def read(self, view: torch.Tensor) -> torch.Tensor:
        self._check(view)
        lo, count = _span(view)
        buf = torch.empty(count, dtype=view.dtype)
        if count:
            self._wait(self.files.read_range(self.bucket, self.offset + lo * buf.element_size(), buf))
        out = buf.as_strided(view.shape, view.stride(), view.storage_offset() - lo)
        return out.contiguous()  # ``buf`` itself when the span is the view in order, else a copy of the view

    @torch.no_grad()
    def write(self, view: torch.Tensor, values: torch.Tensor) -> None:
        self._check(view)
        if tuple(values.shape) != tuple(view.shape):
            raise SwapError(f"writing {tuple(values.shape)} values into a {tuple(view.shape)} swap block")
        lo, count = _span(view)
        if not count:
            return
        start = self.offset + lo * view.element_size()
        if count == view.numel() and view.is_contiguous():  # the span is the view, in order: write the values
            self._wait(self.files.write_range(self.bucket, start, values.to(view.dtype).contiguous()))
            return
        buf = torch.empty(count, dtype=view.dtype)  # other elements in the span: keep theirs
        self._wait(self.files.read_range(self.bucket, start, buf))
        buf.as_strided(view.shape, view.stride(), view.storage_offset() - lo).copy_(values)
        self._wait(self.files.write_range(self.bucket, start, buf))

    @staticmethod
    def _wait(future) -> None:
        future.result()


def stand_in(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape`` and ``dtype`` (what a checkpoint sees of a swapped state tensor)."""
    return torch.empty(shape, dtype=dtype, device="meta")
