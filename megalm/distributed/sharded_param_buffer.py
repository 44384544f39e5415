"""Sharded parameters (ZeRO-3, ``--data-parallel-sharding-strategy optim_grads_params``): each
data-parallel rank stores only its shard of the weights, gradients and optimizer state.

On top of :class:`~megalm.distributed.sharded_grad_buffer.ShardedGradBuffer` (gradients as ZeRO-2):

* ``param_shard_data`` (persistent, ``numel / K`` elements of the parameter dtype) holds this rank's
  shard of every bucket, at the same offsets as the gradient shard; the distributed optimizer
  reads and writes its ranges there (:meth:`ShardedParamBuffer.param_view`).
* Every bucket owns a full-size parameter tensor (``bucket.param_data``) whose views are the
  parameters; its storage is resized to 0 when the bucket is freed and back when it is gathered
  (all-gather of the shards over the buffer's group, ``(K-1)/K`` x bucket bytes per rank).  The
  parameters keep their identity and their views, so autograd's saved references stay valid.
* :meth:`ShardedParamBucket.gather` makes the full parameters valid before it returns;
  :meth:`ShardedParamBucket.prefetch` only launches the all-gather (``async_op=True``; the handle is
  the bucket's ``param_handle``) and the next :meth:`~ShardedParamBucket.gather`, ``finish_param_sync``
  or :meth:`~ShardedParamBucket.free` waits for it.  A bucket counts as gathered (its bytes are held)
  from the launch on.

When buckets are gathered and freed around the forward and backward is decided by
:class:`megalm.distributed.unsharder.Unsharder`; here:

* a bucket is freed once each of its parameters' gradients has been accumulated in this backward
  (:meth:`ShardedParamBucket.note_grad`);
* after the optimizer step the shards are new: every bucket is freed (:meth:`ShardedParamBucket.start_param_sync`);
* readers of whole weights (checkpoint save and load, the parameter norm) call
  ``DistributedDataParallel.gather_params`` first; after a load the shards are refreshed from the
  loaded weights (:meth:`ShardedParamBuffer.refresh_shards`).

A bucket holding a tied embedding weight (used outside its module, by the output layer) is
pinned: gathered after every step and never freed.

MoE expert parameters live in buffers of their own whose group is the expert-data-parallel group
(``d_e = dp x cp x tp / (ep x etp)`` ranks holding the same experts): their weights, gradients and optimizer
state are sharded over ``d_e`` ranks, the dense ones over ``dp x cp``, and their buckets are gathered and freed
as the dense ones (:mod:`megalm.distributed.unsharder`).
"""

from __future__ import annotations

from typing import Dict

import torch

from megalm.distributed import comm
from megalm.distributed.sharded_grad_buffer import ShardedGradBucket, ShardedGradBuffer
from megalm.tensor_parallel.meta_init import initial_value, set_data
from megalm.tensor_parallel.param_info import param_info


def _pinned(param) -> bool:
    """Kept gathered: a tied embedding weight (the output layer reads it outside the embedding's forward)."""
    return param_info(param).tied


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
        """Make the full parameters valid: wait for a prefetch in flight, else all-gather the shards now."""
        if self.param_handle is not None:
            self.finish_param_sync()
        elif not self.gathered:
            self._launch(async_op=False)

    def prefetch(self) -> bool:
        """Launch the all-gather without waiting (the next :meth:`gather` waits); False if gathered already."""
        if self.gathered:
            return False
        self._launch(async_op=True)
        return True

    @torch.no_grad()
    def _launch(self, async_op: bool) -> None:
        self.param_data.untyped_storage().resize_(self._nbytes())
        group = self.buffer.data_parallel_group
        if group is None:
            self.param_data.copy_(self.param_shard)
        else:
            handle = comm.all_gather_into_tensor(
                self.param_data,
                self.param_shard,
                group=group,
                async_op=async_op,
                kind="param_all_gather",
                stats=self.buffer.comm_stats,
            )
            self.param_handle = handle if async_op else None
        self.gathered = True

    def free(self, force: bool = False) -> None:
        """Release the full storage (not for a pinned bucket unless ``force``), after any gather in flight."""
        if self.gathered and (force or not self.pinned):
            self.finish_param_sync()
            self.param_data.untyped_storage().resize_(0)
            self.gathered = False
            self.grads_seen = set()

    def start_param_sync(self, async_op: bool = True) -> None:
        """The shards were updated: drop the stale full copy (pinned buckets gather at once)."""
        self.free(force=True)
        if self.pinned:
            self.gather()

    def note_grad(self, param: torch.nn.Parameter) -> None:
        """Backward accumulated ``param``'s gradient; free the bucket once all of them are in (every
        use of its weights in this backward is then done: autograd accumulates a leaf's gradient after
        all the nodes that use it)."""
        self.grads_seen.add(param)
        if len(self.grads_seen) == len(self.params):
            self.grads_seen = set()
            self.free()


class ShardedParamBuffer(ShardedGradBuffer):
    """A :class:`ShardedGradBuffer` whose parameters are stored sharded too (see the module docstring)."""

    bucket_class = ShardedParamBucket

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)  # builds the buckets one at a time (_bucket_param_data)
        self.storage_to_bucket: Dict[int, ShardedParamBucket] = {
            b.param_data.untyped_storage()._cdata: b for b in self.buckets
        }

    def _allocate_param_data(self) -> None:
        """No full-size parameter buffer: only this rank's shards (filled bucket by bucket)."""
        k = self.data_parallel_world_size
        self.param_shard_data = torch.empty(self.numel // k, dtype=self.param_dtype, device=self.device)
        return None

    @torch.no_grad()
    def _bucket_param_data(self, start: int, end: int, members) -> torch.Tensor:
        """Storage of the bucket's own (so that it can be freed alone): the parameters move into it,
        its shard is copied into ``param_shard_data`` and it is freed at once (a pinned bucket's is
        kept).  The parameters' former storage is released as each parameter moves (if nothing else
        holds it), so building the buffer holds the model, the shards and one bucket at most, never a
        second copy of the model."""
        full = torch.zeros(end - start, dtype=self.param_dtype, device=self.device)
        for p in members:
            lo, hi, _ = self.param_index_map[p]
            view = full[lo - start : hi - start].view(p.shape)
            view.copy_(initial_value(p) if p.is_meta else p.data)  # meta: its initial values, made now
            set_data(p, view)
        k, rank = self.data_parallel_world_size, self.data_parallel_rank
        shard = (end - start) // k
        self.param_shard_data[start // k : end // k].copy_(full[rank * shard : (rank + 1) * shard])
        if not any(_pinned(p) for p in members):  # a pinned bucket stays gathered
            full.untyped_storage().resize_(0)
        return full

    def _make_bucket(self, *args) -> ShardedParamBucket:
        b = super()._make_bucket(*args)
        b.pinned = b.gathered = any(_pinned(p) for p in b.params)
        b.grads_seen = set()
        return b

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
