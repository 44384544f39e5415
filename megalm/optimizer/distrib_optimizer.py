"""Distributed optimizer (ZeRO-1): fp32 main weights and Adam moments sharded over data-parallel ranks.

Ownership.  Every gradient bucket of :class:`megalm.distributed.ParamAndGradBuffer` is padded
to a multiple of its group size ``K`` and split into ``K`` equal contiguous shards; data-parallel
rank ``r`` owns shard ``r`` of every bucket (expert buffers: the expert-data-parallel rank over
the expert-data-parallel group).  A shard covers, for each parameter it overlaps, one contiguous
range of that parameter's flattened (TP-local) tensor: a :class:`ShardRange`.  This rank keeps
fp32 main weights, ``exp_avg`` and ``exp_avg_sq`` for its ranges only (1-D tensors); for fp32
models the main weights are the ranges of the parameter buffer themselves (no copy).

One iteration (``K`` ranks, bucket of ``B`` bytes of gradients, ``P`` bytes of parameters)::

    backward -> reduce-scatter each gradient bucket (mean)        (K-1)/K B per rank, per bucket
                (overlapped with backward under --overlap-grad-reduce)
    step:  found_inf (fp16): MAX of a flag over the world          1 float
           grad norm: SUM of this rank's shard squares over world   2 floats
           clip, AdamW on the shard ranges, write the new weights (rounded to bf16/fp16)
           into this rank's shard of the parameter buffer
    all-gather each parameter bucket in place                      (K-1)/K P per rank, per bucket
                (without --overlap-param-gather: at once, right after the step; with it:
                 in the background, each module's forward pre-hook waits for its buckets)

against ``2 (K-1)/K B`` for the plain data-parallel all-reduce.  The norm over the world equals
"sum over the DP group of the shards, then over the model-parallel group" (see
:mod:`megalm.optimizer.clip_grads`): TP-replicated parameters count on TP rank 0 only and the
last stage's tied embedding copy not at all.  A skipped step (overflow or non-finite norm)
changes no weight, so nothing is gathered.

Memory per parameter on a rank (``d`` = data-parallel size): weights + gradient buffer + (fp32
main weights + fp32 main gradients + 8 B Adam state) / d, i.e. bf16 params with fp32 grads
``6 + 12/d``, fp32 ``8 + 8/d``, fp16/bf16 params with half-precision grads ``4 + 16/d`` (the
fp32 copy of the gradient shard is a persistent buffer of this class).  See
:mod:`megalm.optimizer.memory_accounting`.

With ``--num-distributed-optimizer-instances N`` the buffers shard over one instance of ``K = DP/N``
ranks (:mod:`megalm.distributed.data_parallel`); the ``N`` ranks holding the same shard hold the same
gradients (all-reduced across instances), main weights and state, so only the first instance counts in
the gradient norm, and a checkpoint holds each block ``N`` times, written once (DCP's planner).

Checkpoints: for each range, every state tensor is saved as the rectangular blocks of the full
tensor it covers (:func:`megalm.param_layout.param_range_specs`, through the checkpoint protocol
of the base class, :meth:`MegatronOptimizer.sharded_state_dict`), under the plain optimizer's
keys ``optimizer.<name>.{exp_avg, exp_avg_sq, main_param, step}``: a true sharded save with no
gather, loadable by this optimizer under any DP/TP/PP layout and by the plain optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megalm.distributed.data_parallel import DistributedDataParallel
from megalm.distributed.param_and_grad_buffer import Bucket
from megalm.optimizer.grad_scaler import GradScaler
from megalm.optimizer.matrix_shards import MatrixShards
from megalm.optimizer.optimizer import MegatronOptimizer, OptimizerError, ParamState
from megalm.parallel_state import ProcessGroups, group_rank, group_size


@dataclass
class ShardRange:
    """The part ``[start, end)`` (flat, of the TP-local tensor) of one parameter this rank owns."""

    name: str  # global parameter name
    param: torch.nn.Parameter  # the model parameter
    start: int
    end: int
    model: torch.Tensor  # 1-D view of the parameter buffer over the range
    grad: torch.Tensor  # 1-D view of the gradient buffer over the range
    main: torch.nn.Parameter  # fp32 main weights (``model`` itself for fp32 params)
    main_grad: Optional[torch.Tensor]  # persistent fp32 copy of ``grad`` when grads are not fp32
    bucket: Bucket

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def main_is_model(self) -> bool:
        return self.main.data_ptr() == self.model.data_ptr()


def _data_parallel_chunks(model_chunks: Sequence[torch.nn.Module]) -> list:
    chunks = list(model_chunks)
    for chunk in chunks:
        if not isinstance(chunk, DistributedDataParallel) or not chunk.use_distributed_optimizer:
            raise OptimizerError(
                "the distributed optimizer needs model chunks wrapped in "
                "megalm.distributed.DistributedDataParallel with use_distributed_optimizer=True "
                "(--use-distributed-optimizer)"
            )
    return chunks


class DistributedOptimizer(MegatronOptimizer):
    """The torch optimizer (AdamW, SGD, LAMB, LARS, Lion, Muon) over this rank's shard ranges; see the module docstring.

    Args:
        groups: from :func:`megalm.optimizer.get_param_groups` (model parameters, global names).
        make_optimizer: builds the torch optimizer from param-group dicts over main params.
        model_chunks: the DDP-wrapped chunks whose buffers define the shards.
        clip_grad, grad_scaler, log_num_zeros_in_grad, offload_fraction, offload_overlap, offload_path: as
            :class:`MegatronOptimizer`
            (offloading picks among this rank's shard ranges).
        process_groups: as :class:`MegatronOptimizer`; the norm and the overflow flag are reduced
            over all its ranks (data x model parallel).  The shards follow the DDP buffers'
            groups (``dp_cp``, expert buffers ``expt_dp``), given to DDP at its construction.
    """

    grads_sharded = True

    def __init__(
        self,
        groups: List[dict],
        make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
        model_chunks: Sequence[torch.nn.Module],
        clip_grad: float = 0.0,
        grad_scaler: Optional[GradScaler] = None,
        log_num_zeros_in_grad: bool = False,
        *,
        process_groups: ProcessGroups,
        offload_fraction: float = 0.0,
        offload_overlap: bool = False,
        offload_path: Optional[str] = None,
        comm_stats=None,
    ):
        self.model_chunks = _data_parallel_chunks(model_chunks)  # read by _make_main_params
        # --num-distributed-optimizer-instances: the ranks holding copies of this rank's shards (None: none)
        self.across_instances = next(
            (b.across_instances for c in self.model_chunks for b in c.all_buffers if b.across_instances is not None),
            None,
        )
        super().__init__(
            groups,
            make_optimizer,
            clip_grad=clip_grad,
            grad_scaler=grad_scaler,
            log_num_zeros_in_grad=log_num_zeros_in_grad,
            process_groups=process_groups,
            offload_fraction=offload_fraction,
            offload_overlap=offload_overlap,
            offload_path=offload_path,
            comm_stats=comm_stats,
        )
        self.data_parallel_size = max(
            (b.data_parallel_world_size for c in self.model_chunks for b in c.buffers), default=1
        )
        self.expert_data_parallel_size = max(
            (b.data_parallel_world_size for c in self.model_chunks for b in c.expert_buffers), default=1
        )

    def _make_main_params(self, groups: List[dict]) -> List[List[torch.nn.Parameter]]:
        """Main params are this rank's shard ranges (:attr:`ranges`), grouped like their parameters."""
        name_of = {id(p): n for g in groups for n, p in zip(g["names"], g["params"])}
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self.ranges = self._build_ranges(name_of, [p for g in groups for p in g["params"]])
        return [[r.main for r in self.ranges if group_of[id(r.param)] == gi] for gi in range(len(groups))]

    # --- shard layout ---------------------------------------------------------------------------
    def _build_ranges(self, name_of: Dict[int, str], model_params: List[torch.nn.Parameter]) -> List[ShardRange]:
        """Intersect this rank's shard of every bucket with the parameters in it."""
        pieces = []
        in_buffers = set()
        for chunk in self.model_chunks:
            for buf in chunk.all_buffers:
                for bucket in buf.buckets:
                    lo, hi = bucket.shard_range(buf.data_parallel_rank)
                    for p in bucket.params:
                        in_buffers.add(id(p))
                        ps, pe, _ = buf.param_index_map[p]
                        s, e = max(ps, lo), min(pe, hi)
                        if s >= e or id(p) not in name_of:
                            continue
                        pieces.append((p, s - ps, e - ps, buf, s, e, bucket))
        missing = [name_of[id(p)] for p in model_params if id(p) not in in_buffers]
        if missing:
            raise OptimizerError(f"parameters outside the data-parallel buffers cannot be sharded: {missing[:5]}")
        half_grads = [pc for pc in pieces if pc[3].grad_dtype != torch.float32]
        grad_copy = (
            torch.zeros(sum(pc[2] - pc[1] for pc in half_grads), dtype=torch.float32, device=pieces[0][0].device)
            if half_grads
            else None
        )
        ranges, cursor = [], 0
        for p, start, end, buf, s, e, bucket in pieces:
            model = buf.param_view(bucket, s, e)  # ZeRO-3: a view of the parameter shard
            if p.dtype == torch.float32:
                main = torch.nn.Parameter(model, requires_grad=p.requires_grad)  # shares the buffer's storage
            else:
                main = torch.nn.Parameter(model.detach().clone().float(), requires_grad=p.requires_grad)
            main_grad = None
            if buf.grad_dtype != torch.float32:
                main_grad = grad_copy[cursor : cursor + (e - s)]
                cursor += e - s
            grad = buf.reduced_grad(bucket, s, e)  # ZeRO-2: a view of the shard-sized buffer
            ranges.append(ShardRange(name_of[id(p)], p, start, end, model, grad, main, main_grad, bucket))
        return ranges

    def _norm_pairs(self, pairs: List[tuple]) -> List[tuple]:
        """The other instances hold copies of the first one's shards: they add nothing to the norm."""
        return pairs if group_rank(self.across_instances) == 0 else []

    def _attach_layout(self, muon: List[bool]) -> None:
        """As the base class; refused across distributed-optimizer instances (the norm and matrix groups would
        hold every instance's copy of a range)."""
        needs = hasattr(self.optimizer, "tensor_norms") or hasattr(self.optimizer, "tp_group")
        if needs and group_size(self.across_instances) > 1:
            raise OptimizerError(
                f"{type(self.optimizer).__name__} with --num-distributed-optimizer-instances > 1 is not built yet"
            )
        super()._attach_layout(muon)

    def describe(self) -> str:
        """One line per owned range: name, flat range, numel."""
        return "\n".join(f"{r.name}[{r.start}:{r.end}] ({r.numel})" for r in self.ranges)

    def _main_param_owners(self) -> list:
        """Each owned range with the index of its parameter in ``self.model_params``."""
        index = {id(p): i for i, p in enumerate(self.model_params)}
        return [(r.main, index[id(r.param)], r.param) for r in self.ranges]

    def _tensor_norm_group(self):
        """A tensor is cut over TP and, into flat ranges, over data (x context) parallel ranks."""
        return self.process_groups.tp_dp_cp

    def _matrix_shards(self, muon: List[bool]) -> MatrixShards:
        """Muon's matrices are assembled from the ranges (keyed by the tensors the torch optimizer
        updates: host copies when offloaded) over the data-parallel (x context) group, the experts'
        over the expert-data-parallel group."""
        index = {id(p): i for i, p in enumerate(self.model_params)}
        matrices = [(i, p) for i, p in enumerate(self.model_params) if muon[i]]
        owned = {
            id(self._torch_param(r.main)): (index[id(r.param)], r.start, r.end)
            for r in self.ranges
            if muon[index[id(r.param)]]
        }
        return MatrixShards(matrices, owned, self.process_groups.dp_cp, self.process_groups.expt_dp, self.comm_stats)

    # --- step hooks (the template is MegatronOptimizer.step) ------------------------------------
    def _prepare_grads(self) -> List[tuple]:
        """Wait for a pending parameter all-gather (it must not overwrite the shard the step writes),
        then point each range's main param at its gradient shard (fp32 copy for half gradients)."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        pairs = []
        for r in self.ranges:
            g = r.grad
            if r.main_grad is not None:
                r.main_grad.copy_(g)
                g = r.main_grad
            r.main.grad = g
            pairs.append((g, r.param))
        return pairs

    def _release_grads(self) -> None:
        for r in self.ranges:
            r.main.grad = None

    @torch.no_grad()
    def _copy_main_to_model(self) -> None:
        for r in self.ranges:
            if not r.main_is_model:
                r.model.copy_(r.main)

    def _after_update(self, timers) -> None:
        """All-gather the updated parameter buckets (the ``params-all-gather`` timer)."""
        with timers("params-all-gather"):
            for chunk in self.model_chunks:
                chunk.start_param_sync()

    # --- checkpoint protocol (MegatronOptimizer.sharded_state_dict / load_sharded_state_dict) ------
    def _param_states(self) -> List[ParamState]:
        """One :class:`ParamState` per owned range: 1-D tensors over ``[start, end)`` of the parameter."""
        out = []
        for r in self.ranges:
            tensors = self._checkpoint_state_of(r.main)
            if not r.main_is_model:
                tensors["main_param"] = r.main.data
            out.append(ParamState(r.name, r.param, tensors, (r.start, r.end)))
        return out

    def _whole_params_only(self, *_args, **_kwargs):
        raise OptimizerError(
            "the distributed optimizer holds ranges of parameters, not whole ones: checkpoint it with "
            "megalm.checkpoint (sharded_state_dict), which any layout can load"
        )

    # The plain optimizer's whole-parameter state protocols do not apply to ranges.
    sharded_param_state = state_dict = load_state_dict = _whole_params_only

    def _refresh_param_shards(self) -> None:
        for chunk in self.model_chunks:
            chunk.refresh_param_shards()

    def load_sharded_state_dict(self, common: dict, main_params_loaded: bool) -> None:
        """As the base class, after the ZeRO-3 shards took the loaded weights."""
        self._refresh_param_shards()
        super().load_sharded_state_dict(common, main_params_loaded)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Main ranges <- model weights (fp32 copies only)."""
        self._refresh_param_shards()
        for r in self.ranges:
            if not r.main_is_model:
                r.main.copy_(r.model.float())
        self._refresh_offload()

    # --- accounting ---------------------------------------------------------------------------------
    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds beyond the model's weights and gradient buffers, measured on the
        live tensors (the optimizer state is created first if no step was taken yet); ``host``: the
        bytes offloaded to the host (:mod:`megalm.optimizer.cpu_offload`)."""
        self.init_state()
        state = sum(
            t.numel() * t.element_size()
            for r in self.ranges
            if self._torch_param(r.main) is r.main  # offloaded state is on the host
            for t in self.optimizer.state[r.main].values()
            if t.dim() > 0
        )
        return {
            "main_params": sum(r.main.numel() * r.main.element_size() for r in self.ranges if not r.main_is_model),
            "main_grads": sum(
                r.main_grad.numel() * r.main_grad.element_size() for r in self.ranges if r.main_grad is not None
            ),
            "optimizer_state": state,
            "host": self.offload.host_bytes(self.optimizer.state) if self.offload is not None else 0,
        }
