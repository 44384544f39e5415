"""Data-parallel wrapper: gradients accumulate in contiguous buffers and are reduced by bucket.

Per iteration the trainer does::

    model.zero_grad_buffer()                 # zero main_grad buffers
    for each microbatch but the last:
        with model.no_sync():                # no communication at all
            backward(...)
    backward(last microbatch)                # overlap_grad_reduce: buckets are launched here
    finalize_model_grads([model])            # -> model.finish_grad_sync(): waits / reduces

Communication: one all-reduce (SUM of grads pre-scaled by 1/DP, i.e. the mean) per bucket over
the data-parallel group (with context parallel: data x context); expert parameters
(``param.allreduce is False``) live in separate buffers reduced over the expert-data-parallel
group, pre-scaled by the same 1/DP as Megatron (each expert sees tokens of all EP ranks).

With ``hierarchical_grad_reduce`` (``--hierarchical-grad-reduce``) each bucket's collective is
the intra-node / inter-node chain of :mod:`megalm.distributed.hierarchical` over ``dp_cp_intra`` /
``dp_cp_inter`` (expert buffers: ``expt_dp_intra`` / ``expt_dp_inter``): intra-node
reduce-scatter, inter-node all-reduce of the shard, intra-node all-gather (distributed optimizer:
intra-node then inter-node reduce-scatter, and the inverse all-gathers of the parameters).  When
bucket ``k`` of a queue is launched, bucket ``k-2`` then bucket ``k-1`` are advanced to their
third and second stage, so the inter-node stage of a bucket overlaps the backward of the next
ones; the sequence depends only on ``k``, hence is the same on every rank.

With ``num_distributed_optimizer_instances`` N > 1 (``--num-distributed-optimizer-instances``, distributed
optimizer only) the dense buffers are sharded over ``dp_cp_instance`` (DP/N consecutive ranks) instead of
``dp_cp``: each bucket is reduce-scattered inside the instance (pre-scaled by 1/DP) and its shard all-reduced
over ``dp_cp_across_instances`` (a two-stage chain advanced like the hierarchical one); the parameters are
all-gathered inside the instance.

With ``grad_compression`` (``--grad-compression powersgd|topk|int8|fp8``) each bucket of every buffer
(dense and expert: both are data-parallel) is reduced by :class:`~megalm.distributed.compression.GradCompressor`
with error feedback instead of the exact all-reduce; hierarchically, only the inter-node all-reduce
of the chunk is replaced (the intra-node reduce-scatter and all-gather stay exact).  It runs once
per step: inside ``no_sync()`` nothing is reduced, so the accumulated gradient is compressed
once.  The residuals live in :attr:`compressor` (``None`` without compression).  With
``use_distributed_optimizer`` (ZeRO-1, and ZeRO-2/3's sharded gradients) the flat reduce-scatter
becomes the compressor's (int8/fp8: an all-to-all of each shard's quantized values; PowerSGD and
top-k: their all-reduce, of which the rank keeps its shard); hierarchically the compressed
all-reduce chain runs as without it.  A buffer that compresses nothing (data-parallel size 1, one
node under hierarchical reduction) adds a residual resharded from a larger layout to its next
gradient (:mod:`megalm.distributed.compression.reshard`).

With ``local_sgd_interval`` (``--local-sgd-interval``, :mod:`megalm.distributed.local_sgd`) each
replica keeps its own gradient: buckets are reduced over no rank (scale 1), or with
``hierarchical_grad_reduce`` all-reduced inside the node only (scale ``1/L``); the parameters are
averaged across replicas every H steps by :class:`megalm.distributed.local_sgd.OuterSync`.

Buckets sharing one process group are always launched in the same order on every rank (a
ready bucket waits for the buckets before it), so data-dependent gradient order cannot make
ranks issue collectives in different orders.

With ``use_distributed_optimizer`` (ZeRO-1, see :mod:`megalm.optimizer.distrib_optimizer`):

* each bucket is reduce-scattered instead of all-reduced (``(K-1)/K`` instead of ``2 (K-1)/K``
  x bucket bytes), so after :meth:`finish_grad_sync` a rank holds the mean gradient of its
  shard only; tied embedding copies (``param.shared_embedding``) get buckets of their own;
* parameters live in ``param_data`` buffers; after the optimizer step
  :meth:`start_param_sync` all-gathers them bucket by bucket (another ``(K-1)/K`` x bucket
  bytes, in the parameter dtype).  Without ``overlap_param_gather`` it waits at once; with it
  the all-gathers run in the background (launched in forward order) and a forward pre-hook on
  every module that owns parameters waits for the buckets holding them, so the next forward
  overlaps the rest.  :meth:`finish_param_sync` waits for everything (before a checkpoint is
  saved or loaded, and before the next optimizer step writes its shard).

``data_parallel_sharding_strategy`` ``optim`` is the above; ``optim_grads`` (ZeRO-2) builds
:class:`~megalm.distributed.sharded_grad_buffer.ShardedGradBuffer` instead: the same buckets and
collectives, but a rank keeps only its shard of the reduced gradients and each bucket's full
storage lives from its first gradient to its reduce-scatter (:meth:`sharded_grad_views` gives the
shards of chosen parameters, for the sequence-parallel sum over TP).  ``optim_grads_params`` (ZeRO-3)
builds :class:`~megalm.distributed.sharded_param_buffer.ShardedParamBuffer`: the weights are stored as
shards too, gathered per bucket by the hooks of :class:`~megalm.distributed.unsharder.Unsharder`
around :meth:`forward` (forward pre-hooks; saved-tensor hooks for backward; with ``overlap_param_gather``
the next bucket's all-gather is prefetched instead of the after-step all-gather); :meth:`gather_params`
makes them whole for readers, :meth:`refresh_param_shards` stores loaded weights back into the shards.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional

import torch

from megalm import parallel_state
from megalm.device import get_device
from megalm.distributed.comm import CommStats
from megalm.distributed.compression import build_compressor
from megalm.distributed.hierarchical import NodeGroups
from megalm.distributed.param_and_grad_buffer import Bucket, DataParallelError, ParamAndGradBuffer
from megalm.distributed.sharded_grad_buffer import ShardedGradBuffer
from megalm.distributed.sharded_param_buffer import ShardedParamBuffer
from megalm.distributed.unsharder import Unsharder
from megalm.parallel_layout import NodeLayoutError
from megalm.parallel_state import ProcessGroups, group_size
from megalm.tensor_parallel.meta_init import materialize_remaining
from megalm.tensor_parallel.param_info import param_info


def default_bucket_size(data_parallel_size: int) -> int:
    """Megatron's default: max(40M, 1M x DP) elements."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


def _is_shared_embedding(param: torch.nn.Parameter) -> bool:
    return param_info(param).tied


def node_groups_of(pg: ProcessGroups, name: str) -> Optional[NodeGroups]:
    """The intra-/inter-node halves of ``pg``'s ``name`` group (``dp_cp`` or ``expt_dp``); None for
    a group of one rank.  Raises :class:`NodeLayoutError` when the layout gave it none (the group
    does not split evenly over nodes, or ``pg`` was built by hand without them)."""
    if group_size(getattr(pg, name)) == 1:
        return None
    if f"{name}_inter" not in pg.ranks:
        raise NodeLayoutError(
            f"--hierarchical-grad-reduce: the {name} group (ranks {list(pg.ranks.get(name, ()))}) has no "
            f"intra-/inter-node split: it does not spread evenly over the nodes of "
            f"{parallel_state.get_ranks_per_node()} ranks (parallel_layout.node_split says how it falls)"
        )
    return NodeGroups(getattr(pg, f"{name}_intra"), getattr(pg, f"{name}_inter"))


def _instance_groups(pg: ProcessGroups, instances: int, expert: bool):
    """``--num-distributed-optimizer-instances``: the group across instances (the buffer's own group is
    ``pg.dp_cp_instance``); raises where the bundle has none or the buffers are the experts'."""
    if expert:
        raise DataParallelError(f"--num-distributed-optimizer-instances {instances} with MoE experts is not built yet")
    if "dp_cp_across_instances" not in pg.ranks or len(pg.ranks["dp_cp_across_instances"]) != instances:
        raise NodeLayoutError(
            f"--num-distributed-optimizer-instances {instances}: the process groups have no such instance groups "
            f"(build them with parallel_state.initialize_model_parallel(num_distributed_optimizer_instances="
            f"{instances}))"
        )
    return pg.dp_cp_across_instances


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _wait_for(buckets: List[Bucket]):
    def hook(module, args):
        for bucket in buckets:
            if bucket.param_handle is not None:
                bucket.finish_param_sync()

    return hook


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module``; see the module docstring for the protocol.

    Args:
        module: the model chunk.
        parallel_cfg: :class:`megalm.config.ParallelConfig` (``ddp_bucket_size``,
            ``overlap_grad_reduce``, ``accumulate_allreduce_grads_in_fp32``,
            ``use_distributed_optimizer``, ``overlap_param_gather``, ``hierarchical_grad_reduce``).
        grad_dtype: dtype of ``main_grad``; default fp32 when
            ``accumulate_allreduce_grads_in_fp32`` else each parameter's dtype.
        process_groups: a :class:`megalm.parallel_state.ProcessGroups`; dense gradients are
            reduced over ``dp_cp``, expert gradients (``param.allreduce is False``) over
            ``expt_dp`` (required; kept as :attr:`process_groups`).  The configuration is
            validated by :func:`megalm.config.validate_config`.

    Bucket size: ``ddp_bucket_size`` when given; otherwise max(40M, 1M x DP) with
    ``overlap_grad_reduce`` and a single bucket per buffer without it (as Megatron).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        parallel_cfg,
        grad_dtype: Optional[torch.dtype] = None,
        *,
        process_groups: ProcessGroups,
        check_for_nan_in_grad: bool = False,
        comm_stats: Optional[CommStats] = None,
    ):
        super().__init__()
        self.comm_stats = comm_stats  # where the gradient / parameter collectives are counted (None: not counted)
        pg = self.process_groups = process_groups
        self.module = module
        self.overlap_grad_reduce = parallel_cfg.overlap_grad_reduce
        strategy = parallel_cfg.data_parallel_sharding_strategy
        self.shard_params = strategy == "optim_grads_params"  # ZeRO-3: megalm.distributed.sharded_param_buffer
        self.shard_grads = strategy in ("optim_grads", "optim_grads_params")  # ZeRO-2: sharded_grad_buffer
        self.use_distributed_optimizer = parallel_cfg.use_distributed_optimizer or strategy != "no_shard"
        self.overlap_param_gather = parallel_cfg.overlap_param_gather
        self.hierarchical = parallel_cfg.hierarchical_grad_reduce
        self.instances = parallel_cfg.num_distributed_optimizer_instances
        self._chained = self.hierarchical or self.instances > 1  # buckets reduced by a CollectiveChain
        # local SGD's replicas are the data-parallel ranks; across torchft replica groups they are
        # the groups, and inside a group the ranks reduce every step
        self.local_sgd = bool(parallel_cfg.local_sgd_interval) and parallel_cfg.ft_replica_group_id is None
        self.local_sgd_warmup = parallel_cfg.local_sgd_warmup_iters if self.local_sgd else 0
        self.compression_warmup = parallel_cfg.grad_compression_warmup_iters
        self._reductions: Dict[ParamAndGradBuffer, dict] = {}  # local SGD's warm-up: buffer -> {mode: reduction}
        self._synchronous: Optional[bool] = None  # the mode the buffers reduce in (local SGD's warm-up)
        fp32_grads = parallel_cfg.accumulate_allreduce_grads_in_fp32
        dp = group_size(pg.dp_cp)
        self.data_parallel_world_size = dp
        self.bucket_size = parallel_cfg.ddp_bucket_size
        if self.bucket_size is None and self.overlap_grad_reduce:
            self.bucket_size = default_bucket_size(dp)
        names = {p: n for n, p in module.named_parameters()}
        first = next(module.parameters())
        self.device = get_device() if first.is_meta else first.device  # meta: filled by the buffers
        self.compressor = None  # across torchft replica groups the groups' average is compressed instead
        if parallel_cfg.ft_replica_group_id is None:
            self.compressor = build_compressor(parallel_cfg, self.device, _global_rank(), comm_stats)

        def pick_grad_dtype(p):
            return grad_dtype or (torch.float32 if fp32_grads else p.dtype)

        self.buffers: List[ParamAndGradBuffer] = []
        self.expert_buffers: List[ParamAndGradBuffer] = []
        for expert in (False, True):
            keyed: Dict[tuple, list] = {}
            for p in module.parameters():
                if p.requires_grad and param_info(p).expert == expert:
                    keyed.setdefault((p.dtype, pick_grad_dtype(p)), []).append(p)
            group = pg.expt_dp if expert else pg.dp_cp
            nodes = node_groups_of(pg, "expt_dp" if expert else "dp_cp") if self.hierarchical and keyed else None
            scale = 1.0 / dp
            across = _instance_groups(pg, self.instances, expert) if keyed and self.instances > 1 else None
            if across is not None:
                group = pg.dp_cp_instance
            sync = (group if group_size(group) > 1 else None, group_size(group), nodes, scale)
            if self.local_sgd:  # each replica's own mean: nothing reduced, or inside the node only
                group, nodes = nodes.intra if nodes is not None else None, None
                scale = 1.0 / group_size(group)
            world = group_size(group)
            warmup = {"pad_multiple": sync[1]} if self.local_sgd_warmup else {}  # padded for both groups
            buffer_class = ShardedGradBuffer if self.shard_grads else ParamAndGradBuffer
            buffer_class = ShardedParamBuffer if self.shard_params else buffer_class
            for bi, ((_, gdtype), params) in enumerate(keyed.items()):
                buf = buffer_class(
                    params,
                    gdtype,
                    self.bucket_size,
                    group if world > 1 else None,
                    world,
                    scale,
                    param_names=names,
                    use_distributed_optimizer=self.use_distributed_optimizer,
                    isolate=_is_shared_embedding if self.use_distributed_optimizer else None,
                    node_groups=nodes,
                    compressor=self.compressor,
                    compress_key=f"{'expert' if expert else 'dense'}{bi}",
                    comm_stats=comm_stats,
                    across_instances=across,
                    **warmup,
                )
                if warmup:
                    self._reductions[buf] = {True: sync, False: (group if world > 1 else None, world, nodes, scale)}
                (self.expert_buffers if expert else self.buffers).append(buf)
        materialize_remaining([module], self.device)  # meta parameters no buffer took (requires_grad False)
        # --check-for-nan-in-loss-and-grad: which rank's own gradients were not finite (before reduction)
        self.local_nonfinite_grads: Optional[torch.Tensor] = None
        if check_for_nan_in_grad:
            self.local_nonfinite_grads = torch.zeros((), dtype=torch.bool, device=self.device)
            for buf in self.all_buffers:
                buf.nonfinite = self.local_nonfinite_grads
        self._param_to_buffer = {p: b for b in self.all_buffers for p in b.param_index_map}
        self._build_launch_queues()
        self._grad_sync_enabled = True
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook()) for p in self._param_to_buffer]
        if self.overlap_param_gather and not self.shard_params:
            self._hook_handles += self._register_param_gather_hooks()
        self._unsharder = None  # ZeRO-3: --overlap-param-gather prefetches the next bucket
        if self.shard_params:
            self._unsharder = Unsharder(module, self.all_buffers, prefetch=self.overlap_param_gather)
        if self._unsharder is not None:
            self._hook_handles += self._unsharder.handles

    # --- structure -----------------------------------------------------------------------
    @property
    def all_buffers(self) -> List[ParamAndGradBuffer]:
        return self.buffers + self.expert_buffers

    def _build_launch_queues(self) -> None:
        """One ordered queue of buckets per process group (launch order is identical on all ranks)."""
        queues: Dict[int, List[Bucket]] = {}
        for buf in self.all_buffers:
            queues.setdefault(id(buf.data_parallel_group), []).extend(buf.buckets)
        self._queues = list(queues.values())
        self._cursors = [0] * len(self._queues)
        self._queue_of = {id(b): qi for qi, q in enumerate(self._queues) for b in q}

    def bucket_ranges(self) -> Dict[str, tuple]:
        """``{param name: (buffer index, start, end, bucket id)}`` (expert buffers after dense ones)."""
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        for bi, buf in enumerate(self.all_buffers):
            for p, (s, e, b) in buf.param_index_map.items():
                out[names[p]] = (bi, s, e, b)
        return out

    def forward(self, *args, **kwargs):
        if self._unsharder is not None:  # ZeRO-3: gather per module, again for backward
            with self._unsharder.forward():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    # --- hooks ---------------------------------------------------------------------------
    def _make_hook(self):
        # The hook lives in each parameter's C++ hook list, which Python's garbage collector does not
        # traverse: a strong reference to ``self`` would make a cycle it never frees (this wrapper, its
        # buffers and process groups alive as long as the parameters, with every gloo group's threads).
        ddp = weakref.ref(self)

        def hook(param: torch.nn.Parameter) -> None:
            wrapper = ddp()
            if wrapper is None or param.grad is None:
                return
            wrapper._param_to_buffer[param].accumulate_grad(param, param.grad)
            param.grad = None
            if wrapper.overlap_grad_reduce and wrapper._grad_sync_enabled:
                bucket = wrapper._param_to_buffer[param].bucket_of(param)
                bucket.mark_ready(param)
                if bucket.is_ready():
                    wrapper._advance(wrapper._queue_of[id(bucket)])

        return hook

    def _advance(self, qi: int) -> None:
        """Launch the ready prefix of queue ``qi``."""
        queue = self._queues[qi]
        while self._cursors[qi] < len(queue) and queue[self._cursors[qi]].is_ready():
            self._launch(queue, self._cursors[qi])
            self._cursors[qi] += 1

    def _launch(self, queue: List[Bucket], k: int) -> None:
        """Launch bucket ``k``; hierarchical: advance buckets ``k-2`` and ``k-1`` one stage each."""
        queue[k].start_grad_sync()
        if self._chained:
            for lag in (2, 1):
                if k >= lag:
                    queue[k - lag].advance_grad_sync(lag + 1)

    # --- protocol --------------------------------------------------------------------------
    def begin_step(self, iteration: int) -> None:
        """Before the forward-backward of ``iteration`` (1-based): the warm-ups.  With
        ``--grad-compression-warmup-iters W`` iterations ``1..W`` reduce exactly; with
        ``--local-sgd-warmup-iters W`` they reduce over the whole data-parallel group (synchronous data
        parallelism, 1/DP pre-scaled) and the later ones over the replica's group only."""
        if self.compressor is not None:
            self.compressor.exact = iteration <= self.compression_warmup
        synchronous = iteration <= self.local_sgd_warmup
        if not self._reductions or synchronous == self._synchronous:
            return
        for buf, modes in self._reductions.items():
            buf.set_reduction(*modes[synchronous])
        self._synchronous = synchronous
        self._build_launch_queues()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this context only accumulates into ``main_grad`` (no communication)."""
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = True

    def start_grad_sync(self) -> None:
        """Launch every bucket not yet launched, queue by queue in order (async)."""
        for qi, queue in enumerate(self._queues):
            for k in range(self._cursors[qi], len(queue)):
                self._launch(queue, k)
            self._cursors[qi] = len(queue)

    def finish_grad_sync(self) -> None:
        """Make ``main_grad`` hold the DP mean: launch what is left, wait for every bucket."""
        self.start_grad_sync()
        for queue in self._queues:
            for bucket in queue:
                bucket.finish_grad_sync()
        for buf in self.all_buffers:
            buf.reset(zero=False)
        self._cursors = [0] * len(self._queues)

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (and free ``param.grad``); call once per iteration."""
        for p in self._param_to_buffer:
            p.grad = None
        for buf in self.all_buffers:
            buf.reset(zero=True)
        if self.local_nonfinite_grads is not None:
            self.local_nonfinite_grads.zero_()
        self._cursors = [0] * len(self._queues)
        self._grad_sync_enabled = True

    def sharded_grad_views(self, params) -> List[torch.Tensor]:
        """Sharded gradients (``shard_grads``): for each of ``params``, the 1-D view of the reduced
        gradient of this rank's shard of it (empty where it owns none of it)."""
        views = []
        for p in params:
            buf = self._param_to_buffer[p]
            start, end, _ = buf.param_index_map[p]
            bucket = buf.bucket_of(p)
            lo, hi = bucket.shard_range(buf.data_parallel_rank)
            s, e = max(start, lo), min(end, hi)
            views.append(buf.reduced_grad(bucket, s, max(s, e)))
        return views

    # --- parameter all-gather (distributed optimizer) --------------------------------------------
    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every bucket's ``param_data`` (each rank's shard was just updated).

        Buckets are launched in forward order (the reverse of the buffer order), queue by
        queue, the same on every rank.  Waits at once unless ``overlap_param_gather`` (and not
        ``force_sync``); then the forward pre-hooks wait, bucket by bucket.
        """
        if not self.use_distributed_optimizer:
            raise DataParallelError("start_param_sync is only used with use_distributed_optimizer")
        wait = force_sync or not self.overlap_param_gather
        for queue in self._queues:
            for bucket in reversed(queue):
                bucket.start_param_sync(async_op=not wait)

    def gather_params(self) -> None:
        """ZeRO-3: make every parameter whole (for readers of the weights: checkpoints, norms)."""
        if self.shard_params:
            for buf in self.all_buffers:
                for bucket in buf.buckets:
                    bucket.gather()

    def refresh_param_shards(self) -> None:
        """ZeRO-3: the stored shards <- the (gathered, just loaded) parameters."""
        if self.shard_params:
            for buf in self.all_buffers:
                buf.refresh_shards()

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (no-op when none is pending)."""
        for buf in self.all_buffers:
            for bucket in buf.buckets:
                bucket.finish_param_sync()

    def _register_param_gather_hooks(self) -> list:
        """A forward pre-hook per module owning parameters: wait for the buckets holding them."""
        handles = []
        for module in self.module.modules():
            buckets, seen = [], set()
            for p in module.parameters(recurse=False):
                buf = self._param_to_buffer.get(p)
                if buf is not None and id(buf.bucket_of(p)) not in seen:
                    seen.add(id(buf.bucket_of(p)))
                    buckets.append(buf.bucket_of(p))
            if buckets:
                handles.append(module.register_forward_pre_hook(_wait_for(buckets)))
        return handles

    # --- pass-through state --------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
