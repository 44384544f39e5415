"""Optimizer offload to local disk (``--optimizer-offload-device nvme --offload-path DIR``): the optimizer
update of the offloaded main parameters runs on the host, as :mod:`megalm.optimizer.cpu_offload`, but their
host fp32 copies and optimizer state (Adam moments, momentum buffers: every state tensor shaped like the
parameter; 0-dim step counters stay in memory) live in swap files, one per bucket
(:mod:`megalm.optimizer.swap_files`), not in host memory.

The offloaded main parameters are chosen as the CPU offload does (whole tensors, in order, up to
``--optimizer-offload-fraction`` of the elements) and cut into :data:`OVERLAP_BUCKETS` buckets of about
equal elements, more when that keeps a bucket near :data:`BUCKET_BYTES` (whole tensors: the largest tensor
is the smallest a bucket can be).  A bucket's payload is, per parameter in order, its fp32 copy then each state tensor
(``P`` bytes for the bucket).  Host memory holds two staging slots (the largest payload and gradient
bytes each), never the whole state.  Each step::

    queue read bucket 0 -> slot 0
    torch step of the device parameters (no host gradient attached)
    for k: wait read k; queue read k+1 -> slot (k+1) % 2
           bind bucket k's parameters and state to views of slot k % 2; D2H its gradients (4 B/element)
           torch step of bucket k alone; H2D the updated weights (4 B/element)
           queue write slot k % 2 -> bucket k (after its H2D copies)
    wait for every write

One worker thread runs the reads and writes in order, so reading bucket k+1 overlaps the update of bucket k
and writing bucket k overlaps the update of k+1, and a slot is read into only after it was written out.
Bytes per step: ``sum P`` read and ``sum P`` written (Adam, fp32: 12 B per offloaded element each way),
counted in ``bytes_read`` / ``bytes_written`` and reported in the training log.  The arithmetic is the CPU
offload's per-bucket step on the same values, so the results equal the CPU offload and no offload bit for bit.

Checkpoints hold the state, not the swap files, under the keys and in the files of a run without offload,
streamed: :meth:`NvmeOffload.checkpoint_state` hands a checkpoint meta-device stand-ins of the swapped state
tensors, each with a :class:`~megalm.optimizer.swap_blocks.SwapBlock` that reads a block from its file when
the save writes it and writes a loaded block straight into the file (at most one block in memory; then
:meth:`NvmeOffload.refresh` puts the loaded main weights into the files, a bucket at a time).  The
whole-tensor protocols (``state_dict``, an in-memory copy) use :meth:`NvmeOffload.materialize`, which reads
every bucket's state into fresh host tensors; those are authoritative until :meth:`NvmeOffload.refresh`
(after a load, or at the next step) writes them back into the files and drops them.  No communication of
its own.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Dict, List, Tuple

import torch

from megalm.host_transfer import HostTransfer
from megalm.optimizer.cpu_offload import OVERLAP_BUCKETS, _buckets
from megalm.optimizer.state_init import init_param_state
from megalm.optimizer.swap_blocks import SwapBlock, stand_in
from megalm.optimizer.swap_files import SwapError, SwapFiles

BUCKET_BYTES = 64 * 2**20  # buckets of about this many payload + gradient bytes (at least OVERLAP_BUCKETS)
Region = Tuple[torch.dtype, int]  # a region of a staging slot: dtype, byte offset


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


class NvmeOffload:
    """Disk-backed host stand-ins of the offloaded main parameters (see the module docstring).

    The interface of :class:`~megalm.optimizer.cpu_offload.CpuOffload` plus :meth:`attach` (after the torch
    optimizer exists: creates the state bucket by bucket and the files), :meth:`materialize` and :meth:`close`.
    """

    def __init__(self, main_params: List[torch.nn.Parameter], fraction: float, directory: str, rank: int):
        self.transfer = HostTransfer()
        self.directory, self.rank = directory, rank
        total = sum(m.numel() for m in main_params)
        threshold, done = fraction * total, 0
        self.host: Dict[int, torch.nn.Parameter] = {}
        self.pairs = []
        for m in main_params:
            if done >= threshold:
                break
            host = torch.nn.Parameter(_empty(m.dtype), requires_grad=m.requires_grad)
            self.host[id(m)] = host
            self.pairs.append((m, host))
            done += m.numel()
        self.shapes = {id(host): m.shape for m, host in self.pairs}
        count = max(OVERLAP_BUCKETS, -(-16 * self.numel // BUCKET_BYTES))  # ~16 B per element: Adam + gradient
        self.buckets = _buckets(self.pairs, count)
        self.files = None
        self.resident = False  # full-size state tensors in the optimizer (materialized or loaded)

    @property
    def numel(self) -> int:
        return sum(m.numel() for m, _ in self.pairs)

    def torch_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        return self.host.get(id(main), main)

    # --- layout -----------------------------------------------------------------------------------
    def _state_keys(self, optimizer, group: dict, dtype: torch.dtype) -> List[Tuple[str, torch.dtype]]:
        """The state tensors the optimizer keeps shaped like a parameter of ``group`` (probed on one element)."""
        probe = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        init_param_state(optimizer, group, probe)
        keys = [(k, t.dtype) for k, t in optimizer.state.pop(probe, {}).items() if t.dim() > 0]
        return sorted(keys)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Lay out the buckets, create the files and write each bucket's initial state (weights from the
        main parameters, zero moments), one bucket in memory at a time."""
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.regions: Dict[int, Dict[str, Region]] = {}  # id(host) -> state key ("" the fp32 copy) -> region
        payload, grads = [], []
        for bucket in self.buckets:
            offset = goffset = 0
            for main, host in bucket:
                regions = {}
                for key, dtype in [("", main.dtype)] + self._state_keys(optimizer, group_of[id(host)], main.dtype):
                    size = torch.tensor([], dtype=dtype).element_size()
                    offset = -(-offset // size) * size  # aligned to the element (no padding when all fp32)
                    regions[key] = (dtype, offset)
                    offset += main.numel() * size
                self.regions[id(host)] = regions
                goffset += main.numel() * main.element_size()
            payload.append(offset)
            grads.append(goffset)
        self.slots = [self.transfer.host_empty(max(payload, default=0), torch.uint8) for _ in range(2)]
        self.grad_slots = [self.transfer.host_empty(max(grads, default=0), torch.uint8) for _ in range(2)]
        self.payload_bytes = payload
        self._bucket_of = {id(host): k for k, bucket in enumerate(self.buckets) for _, host in bucket}
        self.blocks: Dict[int, SwapBlock] = {}  # stand-ins handed out by checkpoint_state, until take_blocks
        self.optimizer = optimizer
        self.files = SwapFiles(self.directory, self.rank, payload)
        self._finalizer = weakref.finalize(self, self.files.close)
        slot = self.slots[0]
        for k, bucket in enumerate(self.buckets):
            for main, host in bucket:
                host.data = self._view(slot, host, "")
                host.data.copy_(main.data)
                init_param_state(optimizer, group_of[id(host)], host)  # as the first step would, in memory
                for key, _ in self._state_regions(host):
                    self._view(slot, host, key).copy_(optimizer.state[host][key])
            self._unbind(bucket, optimizer)  # the in-memory state of this bucket is dropped
            self._wait(self.files.write(k, slot))

    def _view(self, slot: torch.Tensor, host: torch.nn.Parameter, key: str) -> torch.Tensor:
        """The region ``key`` ("" the fp32 copy) of ``host`` in ``slot``, shaped like its main parameter."""
        shape, (dtype, offset) = self.shapes[id(host)], self.regions[id(host)][key]
        size = torch.tensor([], dtype=dtype).element_size()
        return slot[offset : offset + shape.numel() * size].view(dtype).view(shape)

    def _state_regions(self, host: torch.nn.Parameter) -> List[Tuple[str, torch.dtype]]:
        """``(state key, dtype)`` of the swapped state tensors of ``host``."""
        return [(key, dtype) for key, (dtype, _) in self.regions[id(host)].items() if key]

    def _bind(self, bucket, slot: torch.Tensor, optimizer) -> None:
        """Point the bucket's host parameters and state tensors at their regions of ``slot``."""
        for _, host in bucket:
            host.data = self._view(slot, host, "")
            st = optimizer.state[host]
            for key, _ in self._state_regions(host):
                st[key] = self._view(slot, host, key)

    def _unbind(self, bucket, optimizer) -> None:
        """Drop the bucket's views (empty placeholders: nothing of the state stays in memory)."""
        for _, host in bucket:
            host.data = _empty(host.dtype)
            host.grad = None
            st = optimizer.state[host]
            for key, dtype in self._state_regions(host):
                st[key] = _empty(dtype)

    @staticmethod
    def _wait(future: Future) -> None:
        try:
            future.result()
        except SwapError:
            raise
        except Exception as e:  # noqa: BLE001 - an error of the I/O thread, named
            raise SwapError(f"optimizer swap I/O failed: {e}") from e

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update of every parameter of ``optimizer``, the offloaded ones bucket by bucket from disk."""
        if self.resident:
            self.refresh()
        if not self.buckets:
            optimizer.step()
            return
        reads = {0: self.files.read(0, self.slots[0])}
        optimizer.step()  # the device parameters alone: no host gradient is attached
        device_grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in device_grads:
            p.grad = None
        writes, h2d_all = [], []
        for k, bucket in enumerate(self.buckets):
            slot, grad_slot = self.slots[k % 2], self.grad_slots[k % 2]
            self._wait(reads.pop(k))
            if k + 1 < len(self.buckets):
                reads[k + 1] = self.files.read(k + 1, self.slots[(k + 1) % 2])
            self._bind(bucket, slot, optimizer)
            offset, d2h = 0, []
            for main, host in bucket:
                nbytes = main.numel() * main.element_size()
                if main.grad is not None:
                    g = grad_slot[offset : offset + nbytes].view(main.dtype).view(main.shape)
                    d2h.append(self.transfer.to_host(g, main.grad, k))
                    host.grad = g
                offset += nbytes
            self.transfer.wait_on_host_all(d2h)
            optimizer.step()  # bucket k alone: only its host gradients are attached
            h2d = [self.transfer.to_device(main.data, host.data, k) for main, host in bucket]
            h2d_all += h2d
            self._unbind(bucket, optimizer)
            writes.append(self.files.write(k, slot, [lambda e=e: self.transfer.wait_on_host(e) for e in h2d]))
        for w in writes:
            self._wait(w)
        self.transfer.wait_on_device_all(h2d_all)
        for p, g in device_grads:
            p.grad = g

    # --- checkpoints and reloads ------------------------------------------------------------------
    def checkpoint_state(self, host: torch.nn.Parameter, state: dict) -> Dict[str, torch.Tensor]:
        """``state`` (the optimizer's state of ``host``) with each swapped tensor replaced by a meta stand-in
        whose :class:`SwapBlock` is in :attr:`blocks` (by ``id`` of the stand-in); unchanged when the state
        is resident (materialized or loaded in memory) or ``host`` is not offloaded."""
        if self.resident or id(host) not in self.regions:
            return dict(state)
        bucket = self._bucket_of[id(host)]
        out = dict(state)
        for key, dtype in self._state_regions(host):
            meta = stand_in(self.shapes[id(host)], dtype)
            self.blocks[id(meta)] = SwapBlock(self.files, bucket, self.regions[id(host)][key][1], meta)
            out[key] = meta
        return out

    def take_blocks(self) -> Dict[int, SwapBlock]:
        """The :class:`SwapBlock` of every stand-in handed out since the last call, by ``id`` of the stand-in
        (a view's is its ``_base``'s); forgotten here."""
        blocks, self.blocks = self.blocks, {}
        return blocks

    @torch.no_grad()
    def materialize(self) -> None:
        """Every offloaded state tensor read into a fresh host tensor in the optimizer (for a checkpoint
        save or load); they stay authoritative until :meth:`refresh`."""
        if self.resident:
            return
        optimizer = self.optimizer
        for k, bucket in enumerate(self.buckets):
            self._wait(self.files.read(k, self.slots[0]))
            for _, host in bucket:
                st = optimizer.state[host]
                for key, _ in self._state_regions(host):
                    st[key] = self._view(self.slots[0], host, key).clone()
        self.resident = True

    @torch.no_grad()
    def refresh(self) -> None:
        """The files <- the main weights and any full-size state tensors in the optimizer (after a
        checkpoint load, a reload of the weights, a :meth:`materialize`); the state tensors are dropped."""
        optimizer = self.optimizer
        for k, bucket in enumerate(self.buckets):
            slot = self.slots[0]
            self._wait(self.files.read(k, slot))
            for main, host in bucket:
                self._view(slot, host, "").copy_(main.data)
                st = optimizer.state[host]
                for key, dtype in self._state_regions(host):
                    if st[key].numel() == main.numel():
                        self._view(slot, host, key).copy_(st[key].view(main.shape))
                    st[key] = _empty(dtype)
            self._wait(self.files.write(k, slot))
        self.resident = False

    # --- accounting -------------------------------------------------------------------------------
    def host_bytes(self, state) -> int:
        """Host bytes: the two staging slots (payload and gradients), plus any resident state."""
        out = sum(s.numel() for s in self.slots + self.grad_slots)
        for _, host in self.pairs:
            out += sum(t.numel() * t.element_size() for t in state[host].values() if t.dim() > 0)
        return out

    @property
    def disk_bytes(self) -> int:
        """Payload bytes in the swap files (read and written once each per step)."""
        return sum(self.payload_bytes)

    def close(self) -> None:
        """Stop the I/O thread and remove the swap files."""
        if self.files is not None:
            self._finalizer()
