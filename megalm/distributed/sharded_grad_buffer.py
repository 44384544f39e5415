"""Sharded gradients (ZeRO-2, ``--data-parallel-sharding-strategy optim_grads``): each data-parallel
rank keeps only its shard of the reduced gradients.

Same layout and ownership as :class:`~megalm.distributed.param_and_grad_buffer.ParamAndGradBuffer`
under the distributed optimizer (buckets padded to a multiple of ``K``, rank ``r`` owns shard ``r``
of every bucket), but no persistent full-size ``grad_data``:

* ``shard_data`` (persistent, ``numel / K`` elements of the gradient dtype) is the concatenation of
  this rank's shard of every bucket: bucket ``b``'s shard sits at ``[b.offset / K, (b.offset +
  b.numel) / K)`` (bucket offsets and sizes are multiples of ``K``).  The optimizer reads its
  ranges there (:meth:`reduced_grad`).
* A bucket's full gradient storage (``bucket.grad_data``, ``b.numel`` elements) is allocated when
  the first gradient of one of its parameters arrives (``param.main_grad`` becomes a view of it),
  accumulates every microbatch, and is freed as soon as the bucket's reduce-scatter has completed:
  in :meth:`ShardedGradBucket.finish_grad_sync`, or earlier when a later bucket of the buffer
  launches: bucket ``k``'s launch waits for bucket ``k-2``'s reduction and frees it (and bucket
  ``k-1``'s if done), so under ``--overlap-grad-reduce`` at most two reductions are in flight and
  the full storage of the buckets already reduced is freed during the backward.

Communication per bucket and iteration (unchanged from ZeRO-1): it is scaled by
``gradient_scaling_factor`` and reduce-scattered (SUM) over the buffer's group of ``K`` ranks,
with the bucket as input and its slice of ``shard_data`` as output: ``(K-1)/K`` x bucket bytes per
rank, launched by DDP exactly as the ZeRO-1 reduce-scatter (same order, same overlap).  With
``--num-distributed-optimizer-instances`` (HSDP) the group is one instance and the shard is then
all-reduced across the instances (:meth:`~megalm.distributed.param_and_grad_buffer.Bucket.instance_reduction`);
ZeRO-3's parameters are sharded over, and gathered inside, the instance.

With ``compressor`` (``--grad-compression``) the reduce-scatter is the compressor's
(:meth:`~megalm.distributed.compression.GradCompressor.reduce_scatter` with ``into`` = the bucket's
slice of ``shard_data``: int8/fp8 one all-to-all of ``(K-1) (S + 4 M)`` bytes, PowerSGD and top-k
their all-reduce, then the shard), bit for bit what ZeRO-1 holds.  Error feedback needs the whole
bucket: its residual (fp32, ``numel`` elements, per bucket) persists between steps, so compression
gives back the 4 bytes per parameter of fp32 gradients that ZeRO-2 saves (the bucket's gradient
storage is still freed after the reduction).

Gradient accumulation policy: microbatches accumulate into the full bucket, which is
reduce-scattered once, after the last microbatch's backward (as plain DP and ZeRO-1 do).  The
gradient traffic stays one reduce-scatter per bucket per iteration and the reduced values are
bit-identical to ZeRO-1's; the price is that with ``M > 1`` microbatches every bucket's full
storage lives from the first microbatch's backward to the last one's reduction.  (Reduce-scattering
every microbatch, as DeepSpeed's ZeRO-2 does, would bound that to the buckets in flight but send
``M`` times the gradient bytes.)  Memory per parameter on a rank, for fp32 gradients: ``4 / K``
bytes between the reduction and the next backward (optimizer step, forward of the first
microbatch), instead of 4.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megalm.distributed import comm
from megalm.distributed.hierarchical import CollectiveChain
from megalm.distributed.param_and_grad_buffer import Bucket, DataParallelError, ParamAndGradBuffer


class ShardedGradBucket(Bucket):
    """A bucket whose full gradient storage exists only between its first gradient and its reduction."""

    def __init__(self, index, params, grad_data, param_data, offset, numel_unpadded, param_ranges, buffer):
        self._numel = param_data.numel()  # padded bucket length (the parameter buffer always exists)
        super().__init__(index, params, grad_data, param_data, offset, numel_unpadded, param_ranges, buffer)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice of the buffer's ``shard_data``: the reduced gradient of its shard."""
        k = self.buffer.data_parallel_world_size
        return self.buffer.shard_data[self.offset // k : (self.offset + self.numel) // k]

    def allocate(self) -> torch.Tensor:
        """Zeroed full storage of the bucket; the parameters' ``main_grad`` become views of it."""
        if self.grad_data is None:
            self.grad_data = torch.zeros(self.numel, dtype=self.buffer.grad_dtype, device=self.buffer.device)
            for p, (start, end) in self.param_ranges.items():
                p.main_grad = self.grad_data[start:end].view(p.shape)
        return self.grad_data

    def release(self) -> None:
        """Free the full storage (the parameters' ``main_grad`` go with it)."""
        if self.grad_data is not None:
            for p in self.params:
                p.main_grad = None
            self.grad_data = None

    def start_grad_sync(self) -> None:
        """Scale and launch the async reduce-scatter (SUM) of the full bucket into :attr:`shard`;
        first free the storage of the earlier buckets of the buffer: those whose reduction has
        completed, and, waiting for it, all but the one launched just before (at most two buckets'
        reductions are in flight, so their full storage is bounded during the backward)."""
        if self.launched:
            return
        self.launched = True
        for earlier in self.buffer.buckets[: self.index]:
            if earlier.index < self.index - 1:
                earlier.finish_grad_sync()  # launched already (buckets launch in order): wait, free
            else:
                earlier.release_if_done()
        full = self.allocate()  # zeros when none of its parameters got a gradient
        if self.buffer.nonfinite is not None:  # this rank's own gradients, before the reduction
            self.buffer.nonfinite.logical_or_(~torch.isfinite(full).all())
        factor = self.buffer.gradient_scaling_factor
        if factor != 1.0:
            full.mul_(factor)
        group, compressor = self.buffer.data_parallel_group, self.buffer.compressor
        compressor = None if compressor is not None and compressor.exact else compressor  # its warm-up: exact
        if compressor is not None and group is None:  # a residual resharded from a larger DP size
            compressor.flush(f"{self.buffer.compress_key}.{self.index}", full)
        if group is None:  # this rank alone: its shard is the whole bucket
            self.shard.copy_(full)
            self.release()
            if self.buffer.across_instances is not None:
                self.handle = self.instance_reduction(self.shard, full, None)
            return
        if self.buffer.across_instances is not None:  # inside the instance, then the shard across instances
            self.handle = self.instance_reduction(self.shard, full, group)
            return
        if compressor is not None:  # error feedback over the whole bucket; the shard lands in shard_data
            key, matrices = f"{self.buffer.compress_key}.{self.index}", self.matrices(0, self.numel)
            self.handle = compressor.reduce_scatter(key, full, self.local_shard(), matrices, group, into=self.shard)
            return
        self.handle = comm.reduce_scatter_tensor(
            self.shard, full, group=group, async_op=True, kind="grad_reduce_scatter", stats=self.buffer.comm_stats
        )

    def release_if_done(self) -> None:
        """Free the storage if the reduce-scatter has completed (never blocks; a compressed one is a
        chain of stages that completes only when waited for)."""
        done = self.handle is None or (
            self.handle.done if isinstance(self.handle, CollectiveChain) else self.handle.is_completed()
        )
        if self.launched and done:
            if self.handle is not None:
                self.handle.wait()
                self.handle = None
            self.release()

    def finish_grad_sync(self) -> None:
        """Launch if needed, wait for the reduce-scatter, free the full storage."""
        super().finish_grad_sync()
        self.release()


class ShardedGradBuffer(ParamAndGradBuffer):
    """A :class:`ParamAndGradBuffer` keeping only this rank's shard of the reduced gradients (see
    the module docstring).  Takes the same arguments; implies ``use_distributed_optimizer``."""

    bucket_class = ShardedGradBucket

    def __init__(self, params, grad_dtype, bucket_size, data_parallel_group, data_parallel_world_size, *args, **kw):
        kw["use_distributed_optimizer"] = True
        if kw.get("node_groups") is not None:
            raise DataParallelError("sharded gradients with hierarchical reduction are not built")
        super().__init__(params, grad_dtype, bucket_size, data_parallel_group, data_parallel_world_size, *args, **kw)
        self.shard_data = torch.zeros(self.numel // self.data_parallel_world_size, dtype=grad_dtype, device=self.device)
        for p in self.params:
            p.main_grad = None

    def _allocate_grad_data(self) -> Optional[torch.Tensor]:
        return None

    def accumulate_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        bucket = self.bucket_of(param)
        if bucket.launched:
            raise DataParallelError(
                f"gradient of a parameter of shape {tuple(param.shape)} arrived after its bucket {bucket.index} "
                f"was reduce-scattered: run the backward of every microbatch but the last inside no_sync()"
            )
        bucket.allocate()
        param.main_grad.add_(grad)

    @property
    def reduced_grad_data(self) -> torch.Tensor:
        return self.shard_data

    def reduced_grad(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        lo, _ = bucket.shard_range(self.data_parallel_rank)
        base = bucket.offset // self.data_parallel_world_size
        return self.shard_data[base + start - lo : base + end - lo]

    def grad_bytes(self) -> int:
        live: List[torch.Tensor] = [b.grad_data for b in self.buckets if b.grad_data is not None]
        return sum(t.numel() * t.element_size() for t in [self.shard_data, *live])

    def reset(self, zero: bool = True) -> None:
        """Zero the shard and free every bucket's full storage (``zero``); forget communication state."""
        if zero:
            self.shard_data.zero_()
            for b in self.buckets:
                b.release()
        for b in self.buckets:
            b.reset()
