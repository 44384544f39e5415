"""Contiguous gradient buffers split into communication buckets.

Layout of one :class:`ParamAndGradBuffer` (all parameters share one param dtype, one grad
dtype and one reduction group)::

    grad_data: [ bucket 0 | pad | bucket 1 | pad | ... ]      (1-D, grad_dtype, zero-filled)
                 ^ last parameter of the module first: backward produces its gradient first

* Parameters are laid out in *reverse* module order (``reversed(module.parameters())``), the
  order in which backward produces gradients, so the first bucket fills up first.
* ``param.main_grad`` is a view ``grad_data[start:end].view(param.shape)``; gradients are
  accumulated there (fp32 by default) and ``param.grad`` is freed.
* A bucket is closed as soon as it holds at least ``bucket_size`` elements (``None``: one
  bucket).  A parameter is never split across buckets.
* Each bucket's end is padded with zeros to a multiple of ``pad_multiple`` (the data-parallel
  size by default), so a bucket can be reduce-scattered into equal shards: DP rank ``r`` owns
  ``[bucket.offset + r * shard, bucket.offset + (r + 1) * shard)`` with ``shard = numel / DP``
  (:meth:`Bucket.shard_range`).  Padding stays zero.
* ``param_index_map[param] = (start, end, bucket_id)`` in buffer coordinates;
  ``bucket.param_ranges[param] = (start, end)`` relative to the bucket start.
* With ``allocate_param_data`` (for the distributed optimizer) the parameters' storage is
  moved into a parallel buffer ``param_data`` with the same layout (``param.data`` becomes a
  view), so updated shards can be all-gathered bucket by bucket.
* Parameters on the meta device (``--init-model-with-meta-device``,
  :mod:`megalm.tensor_parallel.meta_init`) get their storage here, filled with their initial values
  one parameter at a time: views of ``param_data``, or storage of their own without it.
* ``isolate(param)`` True puts that parameter in a bucket of its own (the distributed optimizer
  does this for tied embedding copies, so that the first and the last pipeline stage shard the
  weight identically and the embedding all-reduce after the reduce-scatter stays correct).

Communication (:meth:`Bucket.start_grad_sync`), per bucket, asynchronous, over the buffer's group
of ``K`` ranks; :meth:`Bucket.finish_grad_sync` waits:

* plain data parallel: the bucket is multiplied by ``gradient_scaling_factor`` (1/DP: the mean
  over data-parallel ranks) and all-reduced (SUM): ``2 (K-1)/K`` x bucket bytes per rank.
* ``use_distributed_optimizer``: scaled the same way, then reduce-scattered in place: only this
  rank's shard of ``grad_data`` holds the mean afterwards (the rest keeps local, unreduced
  values, never read): ``(K-1)/K`` x bucket bytes.  After the optimizer wrote the updated
  weights of its shard into ``param_data``, :meth:`Bucket.start_param_sync` all-gathers the
  bucket's ``param_data`` in place (``(K-1)/K`` x bucket bytes of the parameter dtype) and
  :meth:`Bucket.finish_param_sync` waits for it.
* ``compressor`` (``--grad-compression``): the bucket's all-reduce, or with the distributed optimizer
  its reduce-scatter, is the compressed one of :mod:`megalm.distributed.compression` (error feedback
  over the whole bucket; see :meth:`Bucket._start_compressed`).  A bucket whose reduction compresses
  nothing (:meth:`Bucket.compresses`: a group of one, or one node) only adds a residual loaded from
  a checkpoint of another layout to its gradient, once, before the exact reduction.
* ``node_groups`` (``--hierarchical-grad-reduce``): each of these collectives becomes the chain
  of intra-node and inter-node collectives of :mod:`megalm.distributed.hierarchical` (same
  results; only ``1/L`` of the bucket crosses nodes per rank).  The handle is then a
  :class:`~megalm.distributed.hierarchical.CollectiveChain`; :meth:`Bucket.advance_grad_sync`
  launches its next stage (DDP calls it as later buckets launch), the finish methods run the rest.
* ``across_instances`` (``--num-distributed-optimizer-instances N``): the buffer's group is one instance of
  ``K = DP/N`` ranks (its shards are ``1/K`` of a bucket) and, after the reduce-scatter inside it, the
  shard is SUM-all-reduced over the ``N`` ranks holding the same shard in the other instances (``2 (N-1)/N
  x B/K`` per rank, kind ``grad_all_reduce_across_instances``); a chain of the two, as hierarchical.  The
  gradients are pre-scaled by ``1/DP`` (the mean over every data-parallel rank); the parameters are
  all-gathered inside the instance only.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megalm.device import get_device
from megalm.distributed import comm, compression, hierarchical
from megalm.errors import MegalmError
from megalm.parallel_state import group_rank
from megalm.tensor_parallel.meta_init import initial_value, materialize, set_data


class DataParallelError(MegalmError, RuntimeError):
    """Gradient buffers built or driven out of protocol (e.g. a backward outside ``no_sync()``)."""


class Bucket:
    """A contiguous slice of a :class:`ParamAndGradBuffer` reduced by one collective."""

    def __init__(
        self,
        index: int,
        params: List[torch.nn.Parameter],
        grad_data: torch.Tensor,
        param_data: Optional[torch.Tensor],
        offset: int,
        numel_unpadded: int,
        param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]],
        buffer: "ParamAndGradBuffer",
    ):
        self.index = index
        self.param_handle = None  # pending all-gather of param_data
        self.params = params  # in buffer order
        self.grad_data = grad_data  # view into buffer.grad_data (padded length)
        self.param_data = param_data  # view into buffer.param_data or None
        self.offset = offset  # start of the bucket in the buffer
        self.numel_unpadded = numel_unpadded
        self.param_ranges = param_ranges  # param -> (start, end) relative to the bucket
        self.buffer = buffer
        self._params_set = set(params)
        self.reset()

    @property
    def numel(self) -> int:
        return self.grad_data.numel()

    def reset(self) -> None:
        """Forget readiness and communication state (after finish / zeroing)."""
        self.params_ready: set = set()
        self.handle = None
        self.launched = False

    def is_ready(self) -> bool:
        return len(self.params_ready) == len(self.params)

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        if self.launched:
            raise DataParallelError(
                f"gradient of a parameter of shape {tuple(param.shape)} arrived after its bucket "
                f"{self.index} was already reduced: run the backward of every microbatch but the last "
                f"inside DistributedDataParallel.no_sync(), and call zero_grad_buffer() each iteration"
            )
        self.params_ready.add(param)

    def shard_range(self, dp_rank: int, dp_size: Optional[int] = None) -> Tuple[int, int]:
        """Buffer coordinates of the equal shard of this bucket owned by ``dp_rank``."""
        dp_size = dp_size or self.buffer.data_parallel_world_size
        shard = self.numel // dp_size
        return self.offset + dp_rank * shard, self.offset + (dp_rank + 1) * shard

    def local_shard(self) -> Tuple[int, int]:
        """This rank's shard ``(start, end)`` relative to the bucket start."""
        start, end = self.shard_range(self.buffer.data_parallel_rank)
        return start - self.offset, end - self.offset

    def start_grad_sync(self) -> None:
        """Scale by ``gradient_scaling_factor`` and launch the async all-reduce (SUM) of the bucket,
        or its in-place reduce-scatter (SUM) with ``use_distributed_optimizer``."""
        if self.launched:
            return
        self.launched = True
        if self.buffer.nonfinite is not None:  # this rank's own gradients, before any reduction
            self.buffer.nonfinite.logical_or_(~torch.isfinite(self.grad_data).all())
        factor = self.buffer.gradient_scaling_factor
        if factor != 1.0:
            self.grad_data.mul_(factor)
        group = self.buffer.data_parallel_group
        nodes = self.buffer.node_groups
        if self.buffer.compressor is not None and not self.buffer.compressor.exact:  # exact: its warm-up
            if self.compresses():
                self._start_compressed(group, nodes)
                return
            key = f"{self.buffer.compress_key}.{self.index}"  # e.g. residuals resharded from a larger DP size
            self.buffer.compressor.flush(key, self.grad_data)
        if self.buffer.across_instances is not None:
            lo, hi = self.local_shard()
            self.handle = self.instance_reduction(self.grad_data[lo:hi], self.grad_data, group)
            return
        if group is None:  # a group of one, nothing to reduce
            return
        if nodes is not None:
            if self.buffer.use_distributed_optimizer:
                lo, hi = self.local_shard()
                self.handle = hierarchical.reduce_scatter(
                    self.grad_data, self.grad_data[lo:hi], nodes, stats=self.buffer.comm_stats
                )
            else:
                self.handle = hierarchical.all_reduce(self.grad_data, nodes, stats=self.buffer.comm_stats)
            return
        if self.buffer.use_distributed_optimizer:
            lo, hi = self.local_shard()
            self.handle = comm.reduce_scatter_tensor(
                self.grad_data[lo:hi],
                self.grad_data,
                group=group,
                async_op=True,
                kind="grad_reduce_scatter",
                stats=self.buffer.comm_stats,
            )
        else:
            self.handle = comm.all_reduce(
                self.grad_data, group=group, async_op=True, kind="grad_all_reduce", stats=self.buffer.comm_stats
            )

    def instance_reduction(self, shard: torch.Tensor, full: torch.Tensor, group) -> hierarchical.CollectiveChain:
        """:func:`~megalm.distributed.hierarchical.instance_reduce` over ``group`` (this instance; None: a
        rank alone) and the buffer's ``across_instances``."""
        across, stats = self.buffer.across_instances, self.buffer.comm_stats
        return hierarchical.instance_reduce(shard, full, group, across, stats=stats)

    def compresses(self) -> bool:
        """Whether this bucket's reduction is compressed: a data-parallel group of more than one rank
        and, under hierarchical reduction, more than one node."""
        nodes = self.buffer.node_groups
        return self.buffer.data_parallel_group is not None and (nodes is None or nodes.inter is not None)

    def residual_range(self) -> Tuple[int, int, int]:
        """``(lo, hi, ranks)``: the part of the bucket this rank's error-feedback residual covers and
        the number of ranks holding a residual of that part (their sum is what error feedback still
        owes there, :mod:`megalm.distributed.compression.reshard`): the whole bucket over the
        data-parallel group, or with hierarchical reduction chunk ``i`` (the node-local index) over
        the nodes; a bucket that compresses nothing: the whole bucket over the group (see ``flush``)."""
        nodes = self.buffer.node_groups
        if self.compresses() and nodes is not None:
            c = self.numel // nodes.local_size
            return nodes.local_rank * c, (nodes.local_rank + 1) * c, nodes.num_nodes
        return 0, self.numel, self.buffer.data_parallel_world_size

    def matrices(self, lo: int, hi: int):
        """The matrices of ``grad_data[lo:hi]`` (:func:`~megalm.distributed.compression.matrix_segments`)."""
        ranges = [(s, e, tuple(p.shape)) for p, (s, e) in self.param_ranges.items()]
        return compression.matrix_segments(ranges, lo, hi)

    def _start_compressed(self, group, nodes) -> None:
        """Compressed all-reduce (:mod:`megalm.distributed.compression`) over ``group``, or with
        ``nodes`` over the inter-node leg only, keyed by buffer and bucket for the residuals.
        Distributed optimizer: flat, the compressor's reduce-scatter into this rank's shard (int8:
        an all-to-all; the other methods: their all-reduce); hierarchical, the same chain as without
        it (intra-node exact, inter-node compressed, intra-node all-gather), of which the optimizer
        reads its shard (a node's chunk after the inter-node leg is not one rank's flat shard)."""
        comp, key = self.buffer.compressor, f"{self.buffer.compress_key}.{self.index}"
        if nodes is None:
            matrices = self.matrices(0, self.numel)
            if self.buffer.use_distributed_optimizer:
                self.handle = comp.reduce_scatter(key, self.grad_data, self.local_shard(), matrices, group)
            else:
                self.handle = comp.all_reduce(key, self.grad_data, matrices, group)
            return

        def inter(chunk, lo, hi):
            job = compression.CompressionJob(
                key, chunk, self.matrices(lo, hi), nodes.inter, "grad_inter", stats=self.buffer.comm_stats
            )
            return comp.stages(job)

        self.handle = hierarchical.all_reduce(self.grad_data, nodes, inter=inter, stats=self.buffer.comm_stats)

    def advance_grad_sync(self, stage: int) -> None:
        """Hierarchical reduction: launch stages until ``stage`` of them have run (no-op otherwise)."""
        if isinstance(self.handle, hierarchical.CollectiveChain):
            self.handle.advance_to(stage)

    def finish_grad_sync(self) -> None:
        """Launch if needed, then wait for the bucket's all-reduce."""
        if not self.launched:
            self.start_grad_sync()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def start_param_sync(self, async_op: bool = True) -> None:
        """All-gather ``param_data`` in place: every rank contributes its shard (distributed optimizer)."""
        if self.param_data is None:
            raise DataParallelError("start_param_sync needs a buffer built with allocate_param_data")
        self.finish_param_sync()
        group = self.buffer.data_parallel_group
        if group is None:
            return
        lo, hi = self.local_shard()
        if self.buffer.node_groups is not None:
            self.param_handle = hierarchical.all_gather(
                self.param_data, self.param_data[lo:hi], self.buffer.node_groups, stats=self.buffer.comm_stats
            )
            if not async_op:
                self.finish_param_sync()
            return
        self.param_handle = comm.all_gather_into_tensor(
            self.param_data,
            self.param_data[lo:hi],
            group=group,
            async_op=async_op,
            kind="param_all_gather",
            stats=self.buffer.comm_stats,
        )
        if not async_op:
            self.param_handle = None

    def finish_param_sync(self) -> None:
        """Wait for the pending parameter all-gather, if any."""
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None


class ParamAndGradBuffer:
    """One contiguous gradient (and optionally parameter) buffer over ``params``.

    ``nonfinite``: None, or a 0-dim bool tensor (owned by DDP, shared by its buffers) each bucket ORs
    with "my local gradients hold a NaN/inf" before it is reduced (``--check-for-nan-in-loss-and-grad``).

    ``params``: in module order (they are laid out reversed).  ``data_parallel_group``: the group
    the buckets are reduced (and, for the distributed optimizer, gathered) over, as DDP passes it
    (``dp_cp`` or ``expt_dp`` of a :class:`megalm.parallel_state.ProcessGroups`); None for this
    rank alone (no communication).  ``use_distributed_optimizer`` reduce-scatters instead of
    all-reducing and implies ``allocate_param_data``.  ``node_groups``: a
    :class:`~megalm.distributed.hierarchical.NodeGroups` factoring ``data_parallel_group`` for the
    hierarchical collectives (checked against it here), or None for the flat ones.  ``across_instances``
    (distributed optimizer only): the group of the ranks holding this rank's shard in the other
    distributed-optimizer instances (``data_parallel_group`` is then this rank's instance), or None.  See
    the module docstring for the layout.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        bucket_size: Optional[int],
        data_parallel_group,
        data_parallel_world_size: int,
        gradient_scaling_factor: float,
        pad_multiple: Optional[int] = None,
        allocate_param_data: bool = False,
        param_names: Optional[Dict[torch.nn.Parameter, str]] = None,
        use_distributed_optimizer: bool = False,
        isolate: Optional[Callable[[torch.nn.Parameter], bool]] = None,
        node_groups: Optional[hierarchical.NodeGroups] = None,
        compressor: Optional[compression.GradCompressor] = None,
        compress_key: str = "",
        comm_stats: Optional[comm.CommStats] = None,
        across_instances=None,
    ):
        if not params:
            raise DataParallelError("ParamAndGradBuffer needs at least one parameter")
        self.nonfinite: Optional[torch.Tensor] = None
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise DataParallelError(f"one buffer holds one parameter dtype, got {sorted(map(str, dtypes))}")
        if bucket_size is not None and bucket_size <= 0:
            raise DataParallelError(f"bucket_size must be positive or None, got {bucket_size}")
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.data_parallel_rank = group_rank(data_parallel_group)
        if node_groups is not None and data_parallel_group is not None:
            node_groups.check_factors(data_parallel_group, "ParamAndGradBuffer")
        self.node_groups = node_groups if data_parallel_group is not None else None
        self.use_distributed_optimizer = use_distributed_optimizer
        if across_instances is not None and (not use_distributed_optimizer or node_groups or compressor):
            raise DataParallelError(
                "distributed-optimizer instances (across_instances) need use_distributed_optimizer and neither "
                "hierarchical reduction nor gradient compression"
            )
        self.across_instances = across_instances
        self.compressor = compressor  # a group of one compresses nothing but applies loaded residuals
        self.compress_key = compress_key
        self.comm_stats = comm_stats  # where the collectives are counted (None: not counted)
        allocate_param_data = allocate_param_data or use_distributed_optimizer
        self.gradient_scaling_factor = gradient_scaling_factor
        self.pad_multiple = pad_multiple or data_parallel_world_size
        self.params = list(reversed(list(params)))  # buffer order
        self.param_names = param_names or {}
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
        self.device = get_device() if params[0].is_meta else params[0].device  # meta: --init-model-with-meta-device

        bucket_spans = self._layout(bucket_size, isolate or (lambda p: False))
        self.numel = bucket_spans[-1][1] if bucket_spans else 0
        if not allocate_param_data:  # parameters built on meta keep storage of their own, made one at a time
            for p in self.params:  # (before the gradient buffer: the transient is one fp32 initial value)
                if p.is_meta:
                    materialize(p, self.device)
        self.grad_data = self._allocate_grad_data()
        self.param_data = self._allocate_param_data() if allocate_param_data else None
        self._attach_views()
        self.buckets = [
            self._make_bucket(i, start, end, members, unpadded)
            for i, (start, end, members, unpadded) in enumerate(bucket_spans)
        ]

    def set_reduction(self, group, world: int, node_groups, scale: float) -> None:
        """Reduce over ``group`` of ``world`` ranks (``node_groups``: hierarchically) with gradients
        pre-scaled by ``scale`` from the next step on (local SGD's warm-up of synchronous steps switches
        between the replica's group and the data-parallel group; the buffer must be padded for both)."""
        if self.param_data is not None or self.numel % max(world, 1):
            raise DataParallelError(f"a buffer of {self.numel} elements (param data: "
                                    f"{self.param_data is not None}) cannot switch to a group of {world}")  # fmt: skip
        self.data_parallel_group, self.data_parallel_world_size = group, world
        self.data_parallel_rank = group_rank(group)
        self.node_groups = node_groups if group is not None else None
        self.gradient_scaling_factor = scale

    # --- layout ------------------------------------------------------------------------
    def _pad(self, n: int) -> int:
        return int(math.ceil(n / self.pad_multiple) * self.pad_multiple)

    def _layout(self, bucket_size: Optional[int], isolate: Callable[[torch.nn.Parameter], bool]) -> List[tuple]:
        """Assign ``(start, end, bucket_id)`` to every parameter; return bucket spans.

        Span: ``(start, padded_end, params, unpadded_end)`` in buffer coordinates.
        """
        spans, cursor, bucket_start, members = [], 0, 0, []
        for p in self.params:
            alone = isolate(p)
            if alone and members:  # close the open bucket: p gets one of its own
                padded = self._pad(cursor)
                spans.append((bucket_start, padded, members, cursor))
                cursor = bucket_start = padded
                members = []
            start, end = cursor, cursor + p.numel()
            self.param_index_map[p] = (start, end, len(spans))
            members.append(p)
            cursor = end
            if alone or (bucket_size is not None and cursor - bucket_start >= bucket_size):
                padded = self._pad(cursor)
                spans.append((bucket_start, padded, members, cursor))
                cursor = bucket_start = padded
                members = []
        if members:
            spans.append((bucket_start, self._pad(cursor), members, cursor))
        return spans

    def _allocate_grad_data(self) -> Optional[torch.Tensor]:
        """The persistent full-size gradient buffer (None in the sharded-gradient subclass)."""
        return torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)

    def _allocate_param_data(self) -> Optional[torch.Tensor]:
        """The persistent full-size parameter buffer (None where each bucket owns its storage)."""
        return torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)

    def _attach_views(self) -> None:
        for p, (start, end, _) in self.param_index_map.items():
            if self.grad_data is not None:
                p.main_grad = self.grad_data[start:end].view(p.shape)
            if self.param_data is not None:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(initial_value(p) if p.is_meta else p.data)
                set_data(p, view)

    def _make_bucket(
        self, index: int, start: int, end: int, members: List[torch.nn.Parameter], unpadded_end: int
    ) -> Bucket:
        ranges = {p: (self.param_index_map[p][0] - start, self.param_index_map[p][1] - start) for p in members}
        param_view = self._bucket_param_data(start, end, members)
        grad_view = self.grad_data[start:end] if self.grad_data is not None else None
        return self.bucket_class(index, members, grad_view, param_view, start, unpadded_end - start, ranges, self)

    def _bucket_param_data(self, start: int, end: int, members: List[torch.nn.Parameter]) -> Optional[torch.Tensor]:
        """The bucket's parameter storage: a view of ``param_data`` (None without one)."""
        return self.param_data[start:end] if self.param_data is not None else None

    # --- state -------------------------------------------------------------------------
    bucket_class = Bucket

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self.buckets[self.param_index_map[param][2]]

    def accumulate_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``main_grad += grad`` (DDP's post-accumulate-grad hook)."""
        param.main_grad.add_(grad)

    @property
    def reduced_grad_data(self) -> torch.Tensor:
        """The tensor holding the reduced gradients after ``finish_grad_sync`` (the whole buffer)."""
        return self.grad_data

    def reduced_grad(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """The reduced gradient over buffer coordinates ``[start, end)`` (inside ``bucket``)."""
        return self.grad_data[start:end]

    def param_view(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """The stored parameters over buffer coordinates ``[start, end)`` (inside ``bucket``)."""
        return self.param_data[start:end]

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this buffer holds now."""
        return self.grad_data.numel() * self.grad_data.element_size()

    def reset(self, zero: bool = True) -> None:
        """Zero the gradients (padding included) and forget communication state."""
        if zero:
            self.grad_data.zero_()
        for b in self.buckets:
            b.reset()

    def describe(self) -> str:
        """One line per bucket: index, buffer range, element count, parameter names."""
        lines = []
        for b in self.buckets:
            names = [self.param_names.get(p, f"<{tuple(p.shape)}>") for p in b.params]
            lines.append(
                f"bucket {b.index}: [{b.offset}, {b.offset + b.numel}) numel {b.numel} "
                f"(unpadded {b.numel_unpadded}) params {names}"
            )
        return "\n".join(lines)
