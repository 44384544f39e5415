"""Activation offloading (``--cpu-offloading``, ``--cpu-offloading-num-layers N``, as in Megatron-LM):
the tensors autograd saves in the forward of the first ``N`` transformer layers of a model chunk
wait in host memory until their backward.

Forward, per offloaded layer ``i`` and microbatch, an :class:`OffloadGroup` collects what the layer
saves (``torch.autograd.graph.saved_tensors_hooks``): each saved tensor on the compute device becomes a
handle (its storage, dtype, offset, sizes, strides), except views of the layer's own parameters (weights
are not offloaded) and of the inputs every layer gets (RoPE ``cos``/``sin``, the attention mask: one
storage saved by every layer; the caller holds it through the forward and the layers that are not
offloaded, at least the last, save it on the device, so a host copy per layer would free nothing and
move the same bytes ``N`` times).  When the layer returns, every distinct storage is copied to host memory once
(D2H, :class:`~megalm.host_transfer.HostTransfer`) and the device references are dropped, so the
device keeps one layer's saved tensors at a time (plus copies in flight).

Backward runs the layers in reverse.  A pass-through autograd node sits on the output of layers
``0 .. N`` (:class:`_LayerBoundary`); its backward runs just before the backward of the layer below it
and starts that layer's reload: when layer ``i``'s backward starts, layer ``i - 1``'s storages come
back (H2D, prefetched one layer ahead; layer ``N``, which is kept, prefetches layer ``N - 1``).
Unpacking a handle waits for its group's reload and rebuilds the tensor on the reloaded storage with
its original offset and strides, so the backward computes on the same bytes in the same layout:
results equal no offloading exactly.  Views of one storage stay views of one storage.

Bytes per offloaded layer and microbatch: the distinct storages the layer saves, less those of the
shared inputs (the activation formula of :func:`megalm.estimate.activations.layer_bytes`, which counts
fp32 RoPE tables once per model, not per layer), once D2H in forward and once H2D in backward.
On CUDA the copies run on a stream per direction into pinned buffers; on a CPU-only
machine both sides are CPU tensors and the copies are synchronous (the same code, real copies).
Each forward builds its own groups, so microbatches in flight do not mix.  No communication.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megalm.device import get_device
from megalm.host_transfer import HostTransfer


class OffloadGroup:
    """The saved tensors of one layer's forward for one microbatch (see the module docstring)."""

    def __init__(self, layer_number: int, transfer: HostTransfer, device: torch.device, kept_storages: set):
        self.layer_number = layer_number
        self.transfer = transfer
        self.device = device
        self.kept_storages = kept_storages  # data_ptr of the layer's parameters and of the shared inputs
        self.storages: Dict[int, torch.Tensor] = {}  # storage key -> uint8 device view (forward, then reloaded)
        self.host: Dict[int, torch.Tensor] = {}  # storage key -> uint8 host copy
        self.d2h_events: List = []
        self.h2d_events: Optional[List] = None  # set once the reload is issued
        self.waited = False

    def pack(self, t: torch.Tensor):
        """Saved-tensor hook: a handle for a tensor to offload, the tensor itself otherwise."""
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return t
        if t.is_conj() or t.is_neg() or t.is_quantized:  # bits a rebuilt view would not carry
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.kept_storages or storage.nbytes() == 0:
            return t
        if key not in self.storages:
            with torch.no_grad():
                self.storages[key] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        return (self, key, t.dtype, t.storage_offset(), t.size(), t.stride())

    @staticmethod
    def unpack(handle):
        """Saved-tensor hook: the tensor back, on its reloaded storage (waits for the reload)."""
        if isinstance(handle, torch.Tensor):
            return handle
        group, key, dtype, offset, size, stride = handle
        data = group.reloaded(key)
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, size, stride)

    @torch.no_grad()
    def offload(self) -> None:
        """After the layer's forward: D2H every saved storage, drop the device references."""
        for key, data in self.storages.items():
            host = self.transfer.host_empty(data.numel(), torch.uint8)
            self.d2h_events.append(self.transfer.to_host(host, data, self.layer_number))
            self.host[key] = host
        self.storages = {}

    @torch.no_grad()
    def reload(self) -> None:
        """Start the H2D copies back (once): called one layer ahead by the boundary above."""
        if self.h2d_events is not None:
            return
        self.h2d_events = []
        for key, host in self.host.items():  # after the D2H copies: the host copies must be complete
            data = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            self.h2d_events.append(self.transfer.to_device(data, host, self.layer_number, after=self.d2h_events))
            self.storages[key] = data
        self.host = {}

    def reloaded(self, key: int) -> torch.Tensor:
        """The device storage ``key`` once its copy has landed (reloading now if nobody prefetched)."""
        if self.h2d_events is None:
            self.reload()
        if not self.waited:
            for event in self.h2d_events:
                self.transfer.wait_on_device(event)
            self.waited = True
            if self.transfer.trace is not None:
                self.transfer.trace.append(("unpack", self.layer_number, 0))
        return self.storages[key]


class _LayerBoundary(torch.autograd.Function):
    """Identity on a layer's output; its backward (just before that layer's backward) reloads the
    layer's own group if nobody did (``this``) and prefetches the group of the layer below (``below``)."""

    @staticmethod
    def forward(ctx, hidden, this: Optional[OffloadGroup], below: Optional[OffloadGroup]):
        ctx.groups = (this, below)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        this, below = ctx.groups
        ctx.groups = None
        if this is not None:
            this.reload()
        if below is not None:
            below.reload()
        return grad, None, None


class ActivationOffload:
    """Runs a chunk's layers with the saved activations of the first ``num_layers`` offloaded."""

    def __init__(self, num_layers: int, transfer: Optional[HostTransfer] = None):
        self.num_layers = num_layers
        self.transfer = transfer if transfer is not None else HostTransfer()
        self.device = get_device()

    def run(self, layers: Sequence[torch.nn.Module], hidden, rotary_cos, rotary_sin, attention_mask=None):
        """The layers' forward, offloading the first ``num_layers`` (training with grad only); the tables and
        the mask every layer gets stay on the device (alive here for the whole forward: their addresses
        cannot be reused by another tensor meanwhile)."""
        every = (rotary_cos, rotary_sin, attention_mask)  # the mask: a tensor, or packed-sequence parameters
        shared = {t.untyped_storage().data_ptr() for t in every if torch.is_tensor(t)}
        below = None
        for index, layer in enumerate(layers):
            if index < self.num_layers:
                kept = shared | {p.untyped_storage().data_ptr() for p in layer.parameters()}
                group = OffloadGroup(layer.layer_number, self.transfer, self.device, kept)
                with torch.autograd.graph.saved_tensors_hooks(group.pack, OffloadGroup.unpack):
                    hidden = layer(hidden, rotary_cos, rotary_sin, attention_mask=attention_mask)
                group.offload()
                hidden = _LayerBoundary.apply(hidden, group, below)
                below = group
            else:
                hidden = layer(hidden, rotary_cos, rotary_sin, attention_mask=attention_mask)
                if below is not None:
                    hidden = _LayerBoundary.apply(hidden, None, below)
                    below = None
        return hidden
