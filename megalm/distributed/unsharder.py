"""When ZeRO-3's buckets are gathered and freed (``--data-parallel-sharding-strategy optim_grads_params``).

The unit of gathering is the gradient bucket of :class:`~megalm.distributed.sharded_param_buffer.ShardedParamBuffer`
(``--ddp-bucket-size``).  :class:`Unsharder` hooks the wrapped module:

* forward: a pre-hook on every module owning parameters gathers the buckets holding them (a module marked
  :data:`GATHER_UNIT`: those holding its own and all its descendants' parameters) and frees
  every gathered bucket that no module still inside its forward needs (a post-hook pops it again),
  so nested modules keep their parents' weights.  The wrapped module's own pre-hook also gathers its
  ``output_layer``'s parameters (a GPT's fused linear cross entropy reads the output weight in the
  model's forward, outside the output layer's), kept for the whole forward;
* backward: :meth:`Unsharder.forward` installs saved-tensor hooks that note the bucket of every saved
  tensor that is a view of one and gather it again when backward unpacks it; a bucket is freed once
  all its gradients are in (:meth:`~megalm.distributed.sharded_param_buffer.ShardedParamBucket.note_grad`);
* expert parameters (MoE, their own buffers over the expert-data-parallel group): the same, per bucket.  The
  ranks of that group route different tokens (an expert may get none on one of them), but each runs every MoE
  layer's :class:`~megalm.transformer.moe.experts.LocalExperts` (a :data:`GATHER_UNIT`) once per forward and
  builds the same autograd graph whatever the token counts, so their gathers, in forward and when backward
  unpacks, come in the same order on every rank of the group;
* activation recomputation: a pre-hook that runs outside the wrapped forward is the replay of a
  recomputed region inside backward (:func:`megalm.tensor_parallel.random.checkpoint`).  It gathers
  its buckets and frees nothing: the replay's own saved tensors are plain references to the weights,
  valid as long as the bucket stays gathered, and it does until all its gradients are in, which
  autograd accumulates only after every node using them ran.

Prefetch (``prefetch=True``, ``--overlap-param-gather``, Megatron-FSDP's name): while a unit runs,
the all-gather of the next one is already in flight (``async_op=True``), waited for just before use.

* forward order: the order in which the previous forward's pre-hooks first asked for each bucket
  (identical on every rank: the same modules run in the same order; the first forward has no
  prefetch).  After a pre-hook gathered bucket ``i``, the first bucket after ``i`` in that order that
  is not gathered is launched;
* backward order: this forward's buckets by the last time one of their views was saved, latest
  first (the order backward unpacks them).  Unpacking bucket ``i`` launches the next bucket of that
  order that is not gathered;
* at most one prefetch is outstanding (launched, not yet asked for), and the forward's pre-hooks do
  not free it.  Memory: one bucket more than without prefetch; with one module's buckets in use at a
  time that is two buckets gathered at once.  Results are bit-identical (the same all-gathers, in the
  same order on every rank, only waited for later), and so is the number of all-gathers as long as
  every prefetched bucket is used;
* replayed (recomputed) forwards gather synchronously: no prefetch inside a recomputed region.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from megalm.distributed.sharded_param_buffer import ShardedParamBucket, ShardedParamBuffer

# Attribute a module sets (True) when its forward reads its descendants' parameters itself, or runs them in a
# data-dependent way (MoE's local experts: the grouped GEMM stacks the weights without running the experts'
# modules): its pre-hook gathers the buckets of all of them and none of its descendants is hooked.
GATHER_UNIT = "megalm_zero3_gather_unit"


class Unsharder:
    """The forward / backward / recompute hooks of ``module`` over ``buffers`` (see the module docstring).

    ``prefetches`` counts the all-gathers launched ahead of use."""

    def __init__(self, module: torch.nn.Module, buffers: List[ShardedParamBuffer], prefetch: bool = False):
        self.buffers = buffers
        self.prefetch = prefetch
        self.buckets = [b for buf in buffers for b in buf.buckets]
        self.by_storage = {k: b for buf in buffers for k, b in buf.storage_to_bucket.items()}
        self.active: List[list] = []
        self.in_forward = False
        self.prefetched: Optional[ShardedParamBucket] = None  # launched ahead, not yet asked for
        self.prefetches = 0
        self.forward_order: List[ShardedParamBucket] = []  # the previous forward's
        self.backward_order: List[ShardedParamBucket] = []  # this forward's, for its backward
        self._position: Dict[int, Dict[int, int]] = {}  # id(order) -> {id(bucket): index}
        self._asked: Dict[int, ShardedParamBucket] = {}  # this forward's requests, first time each, in order
        self._last_saved: Dict[int, tuple] = {}  # id(bucket) -> (save count, bucket)
        self._saves = 0
        self.handles = []
        bucket_of = {p: buf.bucket_of(p) for buf in buffers for p in buf.param_index_map}
        output_layer = getattr(module, "output_layer", None)
        inside_unit = set()  # modules under a GATHER_UNIT module: its hook covers their parameters
        for m in module.modules():
            if id(m) in inside_unit:
                continue
            unit = getattr(m, GATHER_UNIT, False)
            if unit:
                inside_unit.update(id(sub) for sub in m.modules() if sub is not m)
            mine = []
            used = list(m.parameters(recurse=bool(unit)))
            if m is module and isinstance(output_layer, torch.nn.Module):
                used += list(output_layer.parameters())  # the fused linear cross entropy reads them here
            for p in used:
                if p in bucket_of and bucket_of[p] not in mine:
                    mine.append(bucket_of[p])
            if mine:
                self.handles.append(m.register_forward_pre_hook(self._pre(mine)))
                self.handles.append(m.register_forward_hook(self._post))

    # --- forward ----------------------------------------------------------------------------
    def _pre(self, mine: list):
        def hook(module, args):
            if not self.in_forward:  # a recomputed region replayed in backward: keep what it gathers
                self._use(mine)
                return
            self.active.append(mine)
            for b in mine:
                self._asked.setdefault(id(b), b)
            needed = {id(b) for group in self.active for b in group}
            if self.prefetched is not None:
                needed.add(id(self.prefetched))
            for b in self.buckets:
                if id(b) not in needed:
                    b.free()
            self._use(mine)
            self._launch_after(mine, self.forward_order)

        return hook

    def _post(self, module, args, output):
        if self.in_forward and self.active:
            self.active.pop()

    def _use(self, buckets) -> None:
        """Gather ``buckets`` now (waiting for a prefetch in flight)."""
        for b in buckets:
            b.gather()
            if b is self.prefetched:
                self.prefetched = None

    def _launch_after(self, buckets, order: List[ShardedParamBucket]) -> None:
        """Prefetch the first bucket after the last of ``buckets`` in ``order`` that is not gathered."""
        if not self.prefetch or self.prefetched is not None:
            return
        where = self._position.get(id(order), {})
        positions = [where[id(b)] for b in buckets if id(b) in where]
        if not positions:
            return
        for b in order[max(positions) + 1 :]:
            if b.prefetch():
                self.prefetched = b
                self.prefetches += 1
                return

    # --- backward ----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        bucket = self.by_storage.get(t.untyped_storage()._cdata)
        if bucket is None:
            return t
        self._saves += 1
        self._last_saved[id(bucket)] = (self._saves, bucket)
        return bucket, t

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        bucket, t = packed
        self._use([bucket])
        self._launch_after([bucket], self.backward_order)
        return t

    @contextlib.contextmanager
    def forward(self):
        """Around the wrapped module's forward: a fresh stack, the saved-tensor hooks; on exit the
        request order becomes the next forward's prefetch order and the save order this backward's."""
        self.active, self._asked, self._last_saved, self._saves = [], {}, {}, 0
        self.prefetched = None  # one the last backward launched and never used: free to go
        self.in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.in_forward = False
        self.forward_order = list(self._asked.values())
        if self._last_saved:
            self.backward_order = [b for _, b in sorted(self._last_saved.values(), key=lambda x: -x[0])]
        self._position = {id(o): {id(b): i for i, b in enumerate(o)} for o in (self.forward_order, self.backward_order)}
