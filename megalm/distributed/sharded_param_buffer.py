"""Sharded parameters (ZeRO-3, ``--data-parallel-sharding-strategy optim_grads_params``): each
data-parallel rank stores only its shard of the weights, gradients and optimizer state.

On top of :class:`~megalm.distributed.sharded_grad_buffer.ShardedGradBuffer` (gradients as ZeRO-2):

* ``param_shard_data`` (persistent, ``numel / K`` elements of the parameter dtype) holds this rank's
  shard of every bucket, at the same offsets as the gradient shard; the distributed optimizer
  reads and writes its ranges there (:meth:`ShardedParamBuffer.param_view`).
* Every bucket owns a full-size parameter tensor (``bucket.param_data``) whose views are the
  parameters; its storage is resized to 0 when the bucket is freed and back when it is gathered
  (all-gather of the shards, ``(K-1)/K`` x bucket bytes per rank, synchronous: no prefetch).  The
  parameters keep their identity and their views, so autograd's saved references stay valid.

When a bucket is gathered (the unit is the gradient bucket, ``--ddp-bucket-size``):

* forward: a pre-hook on every module owning parameters gathers the buckets holding them and frees
  every other gathered bucket (at most one module's buckets stay gathered);
* backward: a saved-tensor hook, installed around the wrapped module's forward, notes the bucket of
  every saved tensor that is a view of a bucket and gathers it again when backward unpacks it; a
  bucket is freed once each of its parameters' gradients has been accumulated;
* after the optimizer step the shards are new: every bucket is freed (:meth:`ShardedParamBucket.start_param_sync`);
* readers of whole weights (checkpoint save and load, the parameter norm) call
  ``DistributedDataParallel.gather_params`` first; after a load the shards are refreshed from the
  loaded weights (:meth:`ShardedParamBuffer.refresh_shards`).

A bucket holding a tied embedding weight (used outside its module, by the output layer) is never
freed; an untied output layer's weight (read by the fused linear cross entropy in the model's own
forward) is gathered for the whole forward.  Other parameters used outside the module that owns
them are not supported, nor is
recompute (its forward replay would free buckets the replayed layer still needs); validation
refuses both configurations it knows of.  Per microbatch each bucket is gathered once for the
forward and once for the backward: ``2 (K-1)/K`` x parameter bytes, plus the gradient
reduce-scatter ``(K-1)/K`` x gradient bytes once per iteration (1.5x plain DP's traffic with one
microbatch).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

from megalm.distributed import comm
from megalm.distributed.sharded_grad_buffer import ShardedGradBucket, ShardedGradBuffer
from megalm.tensor_parallel.param_info import param_info


class ShardedParamBucket(ShardedGradBucket):
    """A bucket whose full parameter storage exists only while it is gathered."""

    pinned = False  # never freed (a tied embedding weight)
    gathered = True

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's slice of the buffer's ``param_shard_data``."""
        k = self.buffer.data_parallel_world_size
        return self.buffer.param_shard_data[self.offset // k : (self.offset + self.numel) // k]

    def _nbytes(self) -> int:
        return self.param_data.numel() * self.param_data.element_size()

    @torch.no_grad()
    def gather(self) -> None:
        """Make the full parameters valid: re-allocate the storage and all-gather the shards into it."""
        if self.gathered:
            return
        self.param_data.untyped_storage().resize_(self._nbytes())
        group = self.buffer.data_parallel_group
        if group is None:
            self.param_data.copy_(self.param_shard)
        else:
            comm.all_gather_into_tensor(self.param_data, self.param_shard, group=group, kind="param_all_gather")
        self.gathered = True
        self.grads_seen = set()

    def free(self, force: bool = False) -> None:
        """Release the full storage (not for a pinned bucket unless ``force``)."""
        if self.gathered and (force or not self.pinned):
            self.param_data.untyped_storage().resize_(0)
            self.gathered = False

    def start_param_sync(self, async_op: bool = True) -> None:
        """The shards were updated: drop the stale full copy (pinned buckets gather at once)."""
        self.free(force=True)
        if self.pinned:
            self.gather()

    def note_grad(self, param: torch.nn.Parameter) -> None:
        """Backward accumulated ``param``'s gradient; free the bucket once all of them are in."""
        self.grads_seen.add(param)
        if len(self.grads_seen) == len(self.params):
            self.grads_seen = set()
            self.free()


class ShardedParamBuffer(ShardedGradBuffer):
    """A :class:`ShardedGradBuffer` whose parameters are stored sharded too (see the module docstring)."""

    bucket_class = ShardedParamBucket

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        k = self.data_parallel_world_size
        self.param_shard_data = torch.empty(self.numel // k, dtype=self.param_dtype, device=self.device)
        for b in self.buckets:  # each bucket gets storage of its own, so that it can be freed alone
            full = b.param_data.clone()
            for p, (start, end) in b.param_ranges.items():
                p.data = full[start:end].view(p.shape)
            b.param_data = full
            lo, hi = b.local_shard()
            b.param_shard.copy_(full[lo:hi])
            b.pinned = any(param_info(p).tied for p in b.params)
            b.grads_seen = set()
        self.param_data = None
        self.storage_to_bucket: Dict[int, ShardedParamBucket] = {
            b.param_data.untyped_storage()._cdata: b for b in self.buckets
        }
        for b in self.buckets:
            b.free()

    def param_view(self, bucket, start: int, end: int) -> torch.Tensor:
        lo, _ = bucket.shard_range(self.data_parallel_rank)
        base = bucket.offset // self.data_parallel_world_size
        return self.param_shard_data[base + start - lo : base + end - lo]

    def accumulate_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        super().accumulate_grad(param, grad)
        self.bucket_of(param).note_grad(param)

    def param_bytes(self) -> int:
        """Bytes of parameter storage held now: the shard and the gathered buckets."""
        live = sum(b._nbytes() for b in self.buckets if b.gathered)
        return self.param_shard_data.numel() * self.param_shard_data.element_size() + live

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Shards <- the gathered full parameters (after weights were loaded into them)."""
        for b in self.buckets:
            if b.gathered:
                lo, hi = b.local_shard()
                b.param_shard.copy_(b.param_data[lo:hi])


class Unsharder:
    """When buckets of ``buffers`` are gathered and freed around the forward and backward of ``module``.

    Forward: a pre-hook on every module owning parameters gathers their buckets and frees every
    gathered bucket no module still inside its forward needs (a post-hook pops it again), so
    nested modules keep their parents' weights.  The wrapped module's own pre-hook also gathers its
    ``output_layer``'s parameters (a GPT's fused linear cross entropy uses the output weight in the
    model's forward, outside the output layer's), kept for the whole forward.  Backward:
    :meth:`forward` installs saved-tensor hooks that gather a saved view's bucket again when backward
    unpacks it.
    """

    def __init__(self, module: torch.nn.Module, buffers: List[ShardedParamBuffer]):
        self.buffers = buffers
        self.buckets = [b for buf in buffers for b in buf.buckets]
        self.by_storage = {k: b for buf in buffers for k, b in buf.storage_to_bucket.items()}
        self.active: List[list] = []
        bucket_of = {p: buf.bucket_of(p) for buf in buffers for p in buf.param_index_map}
        self.handles = []
        output_layer = getattr(module, "output_layer", None)
        for m in module.modules():
            mine = []
            used = list(m.parameters(recurse=False))
            if m is module and isinstance(output_layer, torch.nn.Module):
                used += list(output_layer.parameters())  # the fused linear cross entropy reads them here
            for p in used:
                if p in bucket_of and bucket_of[p] not in mine:
                    mine.append(bucket_of[p])
            if mine:
                self.handles.append(m.register_forward_pre_hook(self._pre(mine)))
                self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, mine: list):
        def hook(module, args):
            self.active.append(mine)
            needed = {id(b) for group in self.active for b in group}
            for b in self.buckets:
                if id(b) not in needed:
                    b.free()
            for b in mine:
                b.gather()

        return hook

    def _post(self, module, args, output):
        if self.active:
            self.active.pop()

    def _pack(self, t: torch.Tensor):
        bucket = self.by_storage.get(t.untyped_storage()._cdata)
        return (bucket, t) if bucket is not None else t

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            bucket, t = packed
            bucket.gather()
            return t
        return packed

    @contextlib.contextmanager
    def forward(self):
        """Around the wrapped module's forward: a fresh stack and the saved-tensor hooks."""
        self.active = []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
