"""Optimizer CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``,
``--overlap-cpu-optimizer-d2h-h2d``): the update of a fraction of the main parameters runs on the host.

Which: the main parameters (fp32 main weights, or the distributed optimizer's shard ranges) are
walked in order and each goes to the host while the elements offloaded before it are fewer than
``fraction x total`` (whole tensors, as Megatron's HybridDeviceOptimizer; ``fraction`` 1 offloads
all).  For each, a host copy (pinned on CUDA, a separate CPU tensor on a CPU-only machine) stands in
for it in the torch optimizer, so its optimizer state (Adam moments, momentum buffers) is created and
kept on the host; the device keeps the main weight itself (and, for fp32 models, it is the model weight).

Per step, after unscaling, the norm and clipping ran on the device gradients (so they are unchanged)::

    D2H  host.grad <- main.grad          (4 bytes per offloaded element, fp32)
    torch optimizer step                  (host tensors on the CPU, the rest on the device)
    H2D  main <- host                     (4 bytes per offloaded element), then main -> model as usual

Copies go through :class:`~megalm.host_transfer.HostTransfer` (a stream per direction on CUDA,
synchronous on a CPU-only machine; bytes counted).  Without overlap, all gradients come to the host,
one torch step updates everything, all weights go back.  With ``--overlap-cpu-optimizer-d2h-h2d``
the offloaded tensors are cut into up to :data:`OVERLAP_BUCKETS` buckets (whole tensors, in order,
about equal elements) and the step is pipelined::

    issue D2H bucket 0
    torch step of the device parameters (no host gradient attached yet; queued on the device)
    for k: wait for D2H k; issue D2H k+1; torch step of bucket k alone (CPU); issue H2D k
    the current stream waits for every H2D

so the gradient copy of bucket k+1 and the weight copy of bucket k-1 overlap the CPU update of bucket
k.  A torch step updates exactly the tensors whose ``.grad`` is set, element by element as one step
would: the results equal the non-overlapped offload (and no offload) exactly.

Layer-wise optimizers (LAMB, LARS, Muon: one tensor's update depends on a norm or a matrix assembled
from pieces on other ranks, one collective per step over all tensors) cannot take a step per bucket:
the ranks would disagree on the number of collectives, and a bucket's norms would miss the other
buckets' pieces.  They split their step in two (``prepare_step``: the state, the norms / orthogonalized
matrices, all the communication; ``apply_step``: the weight update of the tensors given), and the
overlapped step becomes::

    issue D2H of every bucket; wait for them
    prepare_step over every parameter (device and host: the one collective, as without offload)
    apply_step of the device parameters
    for k: apply_step of bucket k (CPU); issue H2D k
    the current stream waits for every H2D

so only the weight copies overlap (bucket k's with the update of bucket k+1); the gradient copies do not
overlap compute.  The results equal no offload exactly: the same arithmetic on the same tensors.
Lion is element-wise and takes the per-bucket steps.  Norms and matrices are keyed by the host copies
(:meth:`megalm.optimizer.optimizer.MegatronOptimizer._attach_layout`).

Loading a checkpoint or reloading main weights refreshes the host copies (:meth:`CpuOffload.refresh`).
No communication of its own.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from megalm.host_transfer import HostTransfer

OVERLAP_BUCKETS = 8  # at most this many pipelined buckets with --overlap-cpu-optimizer-d2h-h2d


class CpuOffload:
    """The host stand-ins of the offloaded main parameters (see the module docstring)."""

    def __init__(self, main_params: List[torch.nn.Parameter], fraction: float, overlap: bool = False):
        self.transfer = HostTransfer()
        self.overlap = overlap
        total = sum(m.numel() for m in main_params)
        threshold, done = fraction * total, 0
        self.host: Dict[int, torch.nn.Parameter] = {}  # id(main) -> host copy
        self.pairs = []  # (main, host) in order
        for m in main_params:
            if done >= threshold:
                break
            host = torch.nn.Parameter(self._host_like(m.data), requires_grad=m.requires_grad)
            host.grad = None
            self.host[id(m)] = host
            self.pairs.append((m, host))
            done += m.numel()
        self.refresh()
        self.host_grads = {id(h): self._host_like(h.data) for _, h in self.pairs}  # persistent D2H targets
        self.buckets = _buckets(self.pairs, OVERLAP_BUCKETS)

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.transfer.host_empty(t.numel(), t.dtype).view(t.shape)

    @property
    def numel(self) -> int:
        """Elements whose update runs on the host."""
        return sum(m.numel() for m, _ in self.pairs)

    def torch_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        """What the torch optimizer updates for ``main``: its host copy, or ``main`` itself."""
        return self.host.get(id(main), main)

    @torch.no_grad()
    def refresh(self) -> None:
        """Host copies <- main weights (after construction, a checkpoint load, a reload)."""
        for main, host in self.pairs:
            host.data.copy_(main.data)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update of every parameter of ``optimizer``, the offloaded ones on the host."""
        if not self.overlap or not self.buckets:  # nothing offloaded on this rank: one plain step
            self.transfer.wait_on_host_all(self._gradients_to_host(self.pairs))
            self._attach_grads(self.pairs)
            optimizer.step()
            self.transfer.wait_on_device_all(self._weights_to_device(self.pairs))
            return
        if hasattr(optimizer, "prepare_step"):
            self._layerwise_step(optimizer)
            return
        pending, h2d = self._gradients_to_host(self.buckets[0], 0), []
        optimizer.step()  # the device parameters alone: no host gradient is attached yet
        device_grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in device_grads:
            p.grad = None
        for k, bucket in enumerate(self.buckets):
            self.transfer.wait_on_host_all(pending)
            pending = self._gradients_to_host(self.buckets[k + 1], k + 1) if k + 1 < len(self.buckets) else []
            self._attach_grads(bucket)
            optimizer.step()  # bucket k alone: only its host gradients are attached
            h2d += self._weights_to_device(bucket, k)
        self.transfer.wait_on_device_all(h2d)
        for p, g in device_grads:
            p.grad = g

    def _layerwise_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The overlapped step of a layer-wise optimizer: every gradient to the host, one ``prepare_step``
        (its collective), then the updates applied bucket by bucket, each bucket's weights sent back
        as soon as it is done (see the module docstring)."""
        pending = [e for k, bucket in enumerate(self.buckets) for e in self._gradients_to_host(bucket, k)]
        self.transfer.wait_on_host_all(pending)
        self._attach_grads(self.pairs)
        entries = optimizer.prepare_step()
        by_param = {id(e[0]): e for e in entries}
        hosts = {id(host) for _, host in self.pairs}
        optimizer.apply_step([e for e in entries if id(e[0]) not in hosts])
        h2d = []
        for k, bucket in enumerate(self.buckets):
            optimizer.apply_step([by_param[id(host)] for _, host in bucket if id(host) in by_param])
            h2d += self._weights_to_device(bucket, k)
        self.transfer.wait_on_device_all(h2d)

    def _gradients_to_host(self, pairs: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]], tag=None) -> list:
        """D2H: the host gradient buffers <- the main parameters' (final, clipped) gradients; the copies' events."""
        return [
            self.transfer.to_host(self.host_grads[id(host)], main.grad, tag)
            for main, host in pairs
            if main.grad is not None
        ]

    def _attach_grads(self, pairs: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]]) -> None:
        """The host copies' ``.grad``: their (landed) host gradient buffers, None where the main has none."""
        for main, host in pairs:
            host.grad = self.host_grads[id(host)] if main.grad is not None else None

    def _weights_to_device(self, pairs: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]], tag=None) -> list:
        """H2D: main weights <- updated host copies (the copies' events); the host gradients are released."""
        events = []
        for main, host in pairs:
            events.append(self.transfer.to_device(main.data, host.data, tag))
            host.grad = None
        return events

    def host_bytes(self, state: Dict[torch.Tensor, dict]) -> int:
        """Host bytes: copies, gradient buffers and optimizer state of the offloaded parameters."""
        out = 0
        for _, host in self.pairs:
            out += 2 * host.numel() * host.element_size()
            out += sum(t.numel() * t.element_size() for t in state[host].values() if t.dim() > 0)
        return out


def bucket_starts(sizes: Sequence[int], count: int) -> List[int]:
    """Where each bucket starts when tensors of ``sizes`` elements, in order, are cut into at most ``count``
    runs of whole tensors of about equal elements (a run closes once it holds ``ceil(total / count)``)."""
    size, starts, filled = max(1, -(-sum(sizes) // count)), [], None
    for i, n in enumerate(sizes):
        if filled is None or filled >= size:
            starts.append(i)
            filled = 0
        filled += n
    return starts


def _buckets(pairs: list, count: int) -> List[list]:
    """``pairs`` in order, cut into at most ``count`` runs of whole tensors of about equal elements."""
    starts = bucket_starts([m.numel() for m, _ in pairs], count)
    return [pairs[a:b] for a, b in zip(starts, starts[1:] + [len(pairs)])]
