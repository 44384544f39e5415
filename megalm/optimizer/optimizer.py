"""Optimizer wrappers: fp32 main weights, loss-scale handling, global-norm clipping.

``step()`` is one template for every optimizer (the subclass hooks in brackets)::

    [_prepare_grads]  main.grad <- model.main_grad (fp32 view from DDP; aliased, no copy) or model.grad
    if loss scaler:  main.grad *= 1/scale; found_inf = MAX over model-parallel ranks
                     scaler.update(found_inf); found_inf -> skip (return False, None, None)
    norm = global L2 norm (each distinct gradient once over TP x PP, see clip_grads)
    norm not finite (no scaler: bf16/fp32) -> skip (return False, norm, zeros)
    clip_grad > 0 -> main.grad *= clip / (norm + 1e-6) when < 1
    torch optimizer step (AdamW: decoupled weight decay; SGD: momentum, L2 decay; LAMB, LARS, Lion,
                          Muon: megalm's, see their modules)
    [_copy_main_to_model]  model param <- main param (rounded to bf16/fp16 for mixed precision)
    [_after_update]  (the distributed optimizer: all-gather the updated parameters)
    return (True, norm, num_zeros or None)      [_release_grads] in every case

Communication (groups from the ``ProcessGroups`` given at construction): found_inf one MAX all-reduce of a flag over
``mp`` (all ranks with EP > 1), the norm one SUM all-reduce over ``mp`` (plus ``tp_ep_pp`` for
expert parameters with EP > 1); see :mod:`megalm.optimizer.clip_grads`.

Checkpoint protocol (what :mod:`megalm.checkpoint` calls, the same for every optimizer):
:meth:`MegatronOptimizer.sharded_state_dict` describes each state tensor this rank holds
(:class:`ParamState`: whole local TP tensors here, flat ranges in the distributed optimizer) as
blocks of its full tensor, keyed ``optimizer.<global name>.<state>``;
:meth:`~MegatronOptimizer.common_state_dict` is the JSON rest; after the tensors were loaded in
place, :meth:`~MegatronOptimizer.load_sharded_state_dict` restores the rest, told explicitly
whether the checkpoint held the fp32 main weights.

Skipping non-finite updates without a scaler is a deliberate difference from Megatron
(which would apply them); the trainer stops at such an iteration under
``--check-for-nan-in-loss-and-grad`` (the default, :mod:`megalm.training.loss_checks`) and
counts it as skipped with ``--no-check-for-nan-in-loss-and-grad``.

Parameter groups: weight decay on parameters with ndim >= 2, none on biases and norm
weights (ndim <= 1).

``state_dict()`` (whole tensors; plain optimizers only) structure (every tensor keyed by the
parameter's global name, so a checkpointer can reshard: tensors are this rank's local TP shard,
``param_meta`` says how)::

    {"format": "megalm-optimizer-v1",
     "optimizer": {"state": {name: {"exp_avg": T, "exp_avg_sq": T, "step": T}  # SGD: momentum_buffer
                             ...},
                   "param_groups": [{"lr": .., "weight_decay": .., ..., "params": [name, ...]}, ...]},
     "main_params": {name: fp32 T} (mixed precision only; {} for fp32, where the model holds them),
     "grad_scaler": scaler.state_dict() or None,
     "param_meta": {name: {"shape": local shape, "global_shape": .., "tensor_model_parallel": bool,
                           "partition_dim": int or None, "partition_stride": int}}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.distributed.comm import CommStats
from megalm.distributed.finalize_model_grads import grad_of
from megalm.errors import MegalmError
from megalm.optimizer.clip_grads import clip_grads_by_total_norm, grad_norm_and_zeros, unscale_and_check_for_inf
from megalm.optimizer.cpu_offload import CpuOffload
from megalm.optimizer.grad_scaler import GradScaler
from megalm.optimizer.nvme_offload import NvmeOffload
from megalm.optimizer.state_init import init_param_state
from megalm.optimizer.tensor_norms import build_tensor_norms
from megalm.parallel_state import ProcessGroups, group_size
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec, param_range_specs, param_spec
from megalm.tensor_parallel.param_info import param_info
from megalm.timers import NULL_TIMERS

FORMAT = "megalm-optimizer-v1"
StepResult = Tuple[bool, Optional[float], Optional[float]]


def grad_of_dtype(param: torch.Tensor) -> Optional[torch.dtype]:
    """dtype of the gradient the parameter accumulates into (``main_grad`` under DDP)."""
    g = getattr(param, "main_grad", None)
    return g.dtype if g is not None else None


def _param_meta(p: torch.nn.Parameter, groups: ProcessGroups) -> dict:
    info = param_info(p)
    dim = info.partition_dim if info.tensor_parallel else None
    global_shape = list(p.shape)
    if dim is not None:  # split over TP, or over ETP for an expert parameter
        global_shape[dim] *= group_size(groups.etp if info.expert else groups.tp)
    return {
        "shape": tuple(p.shape),
        "global_shape": tuple(global_shape),
        "tensor_model_parallel": info.tensor_parallel,
        "partition_dim": dim,
        "partition_stride": info.partition_stride,
    }


class OptimizerError(MegalmError, ValueError):
    """An optimizer built or loaded inconsistently (names, groups, shapes, config)."""


@dataclass(frozen=True)
class ParamState:
    """The optimizer tensors one rank holds for one parameter: the typed unit of the checkpoint protocol.

    ``tensors``: state key -> live tensor (``exp_avg``, ``exp_avg_sq``, ``step``, ``momentum_buffer``,
    ``main_param``), laid out like the local (TP) parameter when ``flat_range`` is None, else 1-D
    over the flat elements ``[start, end)`` of it (the distributed optimizer's shard ranges).  Where
    the blocks sit in the full tensor follows from ``param``'s TP attributes
    (:mod:`megalm.param_layout`).
    """

    name: str  # global parameter name
    param: torch.nn.Parameter  # the model parameter
    tensors: Dict[str, torch.Tensor]
    flat_range: Optional[Tuple[int, int]] = None


class MegatronOptimizer:
    """Common logic; subclasses decide what the main (fp32) parameters are.

    Args:
        groups: from :func:`get_param_groups` (model parameters and their global names).
        make_optimizer: builds the torch optimizer from param-group dicts over main params.
        clip_grad: max global L2 norm (0 disables clipping; the norm is still computed).
        grad_scaler: None (no loss scaling) or a :class:`GradScaler`.
        log_num_zeros_in_grad: also return the number of zero gradient entries.
        process_groups: the groups of the gradient norm (``mp``; ``tp_ep_pp`` for expert
            parameters with EP > 1) and of the overflow flag, and the ``tp`` / ``pp`` ranks that
            decide which gradients count once (required).
        offload_fraction: > 0: the update of that fraction of the main parameters runs on the host
            (:mod:`megalm.optimizer.cpu_offload`, ``--optimizer-cpu-offload``).
        offload_overlap: pipeline the offloaded update's copies bucket by bucket
            (``--overlap-cpu-optimizer-d2h-h2d``).
        offload_path: a directory: the offloaded parameters' host copies and optimizer state live in swap
            files there (:mod:`megalm.optimizer.nvme_offload`, ``--optimizer-offload-device nvme``).
        comm_stats: the :class:`megalm.distributed.comm.CommStats` the norm, overflow and layer-wise
            collectives are counted in (None: not counted).
    """

    def __init__(
        self,
        groups: List[dict],
        make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
        clip_grad: float = 0.0,
        grad_scaler: Optional[GradScaler] = None,
        log_num_zeros_in_grad: bool = False,
        *,
        process_groups: ProcessGroups,
        offload_fraction: float = 0.0,
        offload_overlap: bool = False,
        offload_path: Optional[str] = None,
        comm_stats: Optional[CommStats] = None,
    ):
        self.process_groups = process_groups
        self.comm_stats = comm_stats
        self.model_params: List[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.names: List[str] = [n for g in groups for n in g["names"]]
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise OptimizerError(f"parameter names must be unique across model chunks, duplicated: {dup[:5]}")
        main_groups = self._make_main_params(groups)
        self.main_params: List[torch.nn.Parameter] = [m for mains in main_groups for m in mains]
        self.offload = None
        if offload_fraction > 0 and offload_path is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.offload = NvmeOffload(self.main_params, offload_fraction, offload_path, rank)
        elif offload_fraction > 0:
            self.offload = CpuOffload(self.main_params, offload_fraction, offload_overlap)
        torch_groups = [
            {k: v for k, v in g.items() if k not in ("params", "names")}
            | {"params": [self._torch_param(m) for m in mains]}
            for g, mains in zip(groups, main_groups)
        ]
        self.optimizer = make_optimizer(torch_groups)
        if isinstance(self.offload, NvmeOffload):
            self.offload.attach(self.optimizer)  # creates the swap files (errors before training starts)
        self._attach_layout([bool(g.get("muon")) for g in groups for _ in g["params"]])
        self.clip_grad = float(clip_grad)
        self.grad_scaler = grad_scaler
        self.log_num_zeros_in_grad = log_num_zeros_in_grad

    # --- subclass hooks --------------------------------------------------------------------
    # Called by __init__ and the template step() (in this order): _make_main_params;
    # _prepare_grads, [unscale, norm, clip, inner step], _copy_main_to_model, _after_update;
    # _release_grads (always, last).
    grads_sharded = False  # True: each data-parallel rank holds a disjoint shard of every gradient
    data_parallel_size = 1  # how many ranks the main weights and the optimizer state are sharded over
    expert_data_parallel_size = 1  # the same for the MoE expert parameters (the expert-data-parallel group)

    def _make_main_params(self, groups: List[dict]) -> List[List[torch.nn.Parameter]]:
        """The parameters the torch optimizer updates, one list per entry of ``groups``."""
        raise NotImplementedError

    def _main_param_owners(self) -> List[Tuple[torch.nn.Parameter, int, torch.nn.Parameter]]:
        """``(main param, index of its model param in self.model_params, model param)`` per main param."""
        return [(main, i, model) for i, (model, main) in enumerate(zip(self.model_params, self.main_params))]

    def _tensor_norm_group(self):
        """The ranks whose main params are pieces of one tensor: TP (whole local TP tensors here)."""
        return self.process_groups.tp

    def _matrix_shards(self, muon: List[bool]):
        """How a matrix optimizer assembles whole matrices from its main params (keyed by
        :meth:`_torch_param`): None, they are whole."""
        return None

    def _attach_layout(self, muon: List[bool]) -> None:
        """Tell a layer-wise optimizer (one with ``tensor_norms``: LAMB, LARS) how to compute norms
        of full tensors, and a matrix optimizer (one with ``tp_group``: Muon) its TP group and how
        to assemble whole matrices (``muon``: per model param, whether it is one of Muon's matrices).
        Both are keyed by the tensor the torch optimizer updates (:meth:`_torch_param`: an offloaded
        main param's host copy), so an offloaded piece finds its row and its matrix."""
        needs_layout = hasattr(self.optimizer, "tensor_norms") or hasattr(self.optimizer, "tp_group")
        if needs_layout and self.grads_sharded and type(self)._matrix_shards is MegatronOptimizer._matrix_shards:
            raise OptimizerError(
                f"{type(self).__name__} shards parameters but does not say how (_main_param_owners, "
                "_tensor_norm_group, _matrix_shards): LAMB, LARS and Muon would use partial norms and matrices"
            )
        owners = [(self._torch_param(main), index, model) for main, index, model in self._main_param_owners()]
        if hasattr(self.optimizer, "tensor_norms"):
            self.optimizer.tensor_norms = build_tensor_norms(
                owners,
                len(self.model_params),
                self._tensor_norm_group(),
                self.process_groups.tp,
                self.process_groups.ep,
                self.comm_stats,
            )
        if hasattr(self.optimizer, "tp_group"):
            self.optimizer.tp_group = self.process_groups.tp
            self.optimizer.param_infos = {id(torch_param): param_info(model) for torch_param, _, model in owners}
            self.optimizer.shards = self._matrix_shards(muon)

    def _prepare_grads(self) -> List[Tuple[Optional[torch.Tensor], torch.nn.Parameter]]:
        """Point each main param's ``.grad`` at its model gradient (fp32: alias, no copy);
        return ``(main grad or None, model param)`` pairs, the model param deciding whether the
        gradient counts in the norm (:mod:`megalm.optimizer.clip_grads`)."""
        pairs = []
        for model, main in zip(self.model_params, self.main_params):
            g = grad_of(model)
            main.grad = None if g is None else (g if g.dtype == main.dtype else g.to(main.dtype))
            pairs.append((main.grad, model))
        return pairs

    def _norm_pairs(self, pairs: List[Tuple[Optional[torch.Tensor], torch.nn.Parameter]]) -> list:
        """The pairs of :meth:`_prepare_grads` that count in the gradient norm (all of them here)."""
        return pairs

    def _copy_main_to_model(self) -> None:
        """Model weights <- updated main weights (nothing when they are the same tensors)."""

    def _after_update(self, timers) -> None:
        """After a successful update (the distributed optimizer launches its parameter all-gather)."""

    def _release_grads(self) -> None:
        for model, main in zip(self.model_params, self.main_params):
            main.grad = None
            if getattr(model, "main_grad", None) is not None:
                model.grad = None

    def _torch_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        """The tensor the torch optimizer updates for ``main`` (its host copy when offloaded)."""
        return main if self.offload is None else self.offload.torch_param(main)

    def _state_of(self, main: torch.nn.Parameter) -> dict:
        """The torch optimizer's state of ``main`` (on the host when offloaded)."""
        return self.optimizer.state[self._torch_param(main)]

    def _refresh_offload(self) -> None:
        if self.offload is not None:
            self.offload.refresh()

    def materialize_offload(self) -> None:
        """Swapped-out state into host memory (:meth:`NvmeOffload.materialize`), for a consumer that needs live
        tensors (the whole-tensor protocols, a torchft peer's recovery); checkpoints stream it instead."""
        if isinstance(self.offload, NvmeOffload):
            self.offload.materialize()

    def close(self) -> None:
        """Release what outlives a step: the NVMe offload's I/O thread and swap files (idempotent)."""
        if isinstance(self.offload, NvmeOffload):
            self.offload.close()

    def offload_io_bytes(self) -> Tuple[int, int]:
        """Bytes read from and written to the NVMe offload's swap files so far (0, 0 without)."""
        if isinstance(self.offload, NvmeOffload) and self.offload.files is not None:
            return self.offload.files.bytes_read, self.offload.files.bytes_written
        return 0, 0

    # --- public API --------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current loss scale before backward."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free ``.grad`` of model and main params (DDP's ``main_grad`` is zeroed by zero_grad_buffer)."""
        for p in self.model_params + self.main_params:
            p.grad = None

    @torch.no_grad()
    def step(self, timers=NULL_TIMERS) -> StepResult:
        """One update; returns ``(update_successful, grad_norm, num_zeros_in_grad or None)``.
        ``timers``: Megatron's level-1 ``optimizer-*`` timers (:mod:`megalm.timers`)."""
        try:
            with timers("optimizer-copy-to-main-grad"):
                pairs = self._prepare_grads()
            grads = [g for g, _ in pairs if g is not None]
            if self.grad_scaler is not None:
                with timers("optimizer-unscale-and-check-inf"):
                    found_inf = unscale_and_check_for_inf(
                        grads,
                        self.grad_scaler.inv_scale,
                        sharded=self.grads_sharded,
                        groups=self.process_groups,
                        comm_stats=self.comm_stats,
                    )
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return False, None, None
            with timers("optimizer-clip-main-grad"):
                norm, zeros = grad_norm_and_zeros(
                    self._norm_pairs(pairs),
                    self.log_num_zeros_in_grad,
                    sharded=self.grads_sharded,
                    groups=self.process_groups,
                    comm_stats=self.comm_stats,
                )
                if math.isfinite(norm) and self.clip_grad > 0.0:
                    clip_grads_by_total_norm(grads, self.clip_grad, norm)
            if not math.isfinite(norm):
                return False, norm, zeros
            with timers("optimizer-inner-step"):
                if self.offload is not None:
                    self.offload.step(self.optimizer)
                else:
                    self.optimizer.step()
            with timers("optimizer-copy-main-to-model-params"):
                self._copy_main_to_model()
            self._after_update(timers)
            return True, norm, zeros
        finally:
            self._release_grads()

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer state keyed by global parameter name (see the module docstring)."""
        self.materialize_offload()
        inner = self.optimizer.state_dict()
        state = {self.names[i]: s for i, s in inner["state"].items()}
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": [self.names[i] for i in g["params"]]}
            for g in inner["param_groups"]
        ]
        return {
            "format": FORMAT,
            "optimizer": {"state": state, "param_groups": groups},
            "main_params": self._main_params_state(),
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "param_meta": {n: _param_meta(p, self.process_groups) for n, p in zip(self.names, self.model_params)},
        }

    def _main_params_state(self) -> Dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` output, matching parameters by name."""
        if state_dict.get("format") != FORMAT:
            raise OptimizerError(
                f"not a megalm optimizer state dict (format {state_dict.get('format')!r}, expected {FORMAT!r})"
            )
        saved_groups = state_dict["optimizer"]["param_groups"]
        saved_names = [n for g in saved_groups for n in g["params"]]
        missing, unexpected = set(self.names) - set(saved_names), set(saved_names) - set(self.names)
        if missing or unexpected:
            raise OptimizerError(
                f"optimizer checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        index = {n: i for i, n in enumerate(self.names)}
        group_of = {n: g for g in saved_groups for n in g["params"]}
        cur_groups = self.optimizer.state_dict()["param_groups"]
        new_groups = []
        for g in cur_groups:
            names = [self.names[i] for i in g["params"]]
            src = group_of[names[0]]
            if set(src["params"]) != set(names):
                raise OptimizerError(f"parameter group '{g.get('name')}' differs from the checkpoint's")
            # Saved settings win; keys the checkpoint predates (e.g. wd_mult) keep their current value.
            new_groups.append(g | {k: v for k, v in src.items() if k != "params"} | {"params": list(g["params"])})
        state = {index[n]: s for n, s in state_dict["optimizer"]["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": new_groups})
        self._load_main_params(state_dict.get("main_params") or {})
        self._refresh_offload()
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _load_main_params(self, main_params: Dict[str, torch.Tensor]) -> None:
        pass

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Main params <- model weights (fp32 copies only), after the weights were loaded without
        the optimizer's fp32 main weights."""
        for model, main in zip(self.model_params, self.main_params):
            if main is not model:
                main.copy_(model.float())
        self._refresh_offload()

    # --- checkpoint protocol (megalm.checkpoint), the same for every optimizer -----------------
    def init_state(self) -> None:
        """Create the optimizer state (zero moments, step 0) if no step was taken yet, so that a
        checkpoint can be loaded into it in place.  The next step behaves exactly as the lazy init."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                init_param_state(self.optimizer, group, p)

    def _checkpoint_state_of(self, main: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """The state tensors of ``main`` a checkpoint sees: those swapped to disk by the NVMe offload as
        meta stand-ins (:meth:`NvmeOffload.checkpoint_state`), the others as they are."""
        if isinstance(self.offload, NvmeOffload):
            return self.offload.checkpoint_state(self._torch_param(main), self._state_of(main))
        return dict(self._state_of(main))

    def _param_states(self) -> List[ParamState]:
        """This rank's state tensors, one :class:`ParamState` per parameter (whole local tensors)."""
        out = []
        for name, model, main in zip(self.names, self.model_params, self.main_params):
            tensors = self._checkpoint_state_of(main)
            if main is not model:
                tensors["main_param"] = main.data
            out.append(ParamState(name, model, tensors))
        return out

    def sharded_state_dict(self, params: Dict[str, torch.nn.Parameter]) -> ShardedStateDict:
        """``optimizer.<name>.<state>`` -> the blocks of the full tensors this rank holds.

        ``params``: the checkpointed parameters by global name (state of a parameter left out there
        is left out here).  Each block wraps the live tensor (the state is created first), so a
        checkpoint load fills the optimizer in place; :meth:`load_sharded_state_dict` follows it.
        The NVMe offload's swapped state is no live tensor: its blocks are meta views whose ``source``
        reads and writes the swap files (:mod:`megalm.optimizer.swap_blocks`), so a checkpoint streams
        it, under the same keys and shapes.  ``step`` (0-dim) is saved replicated as one element;
        ``main_param`` only where the fp32 main weights are a copy (half-precision models).  No communication.
        """
        self.init_state()
        specs: ShardedStateDict = {}
        for piece in self._param_states():
            if piece.name not in params:
                continue
            for key, t in piece.tensors.items():
                fqn = f"optimizer.{piece.name}.{key}"
                if t.dim() == 0:
                    specs[fqn] = ShardedTensorSpec.replicated(t.reshape(1))
                elif piece.flat_range is None:
                    specs[fqn] = param_spec(piece.param, t, groups=self.process_groups)
                else:
                    blocks = param_range_specs(piece.param, t, *piece.flat_range, groups=self.process_groups)
                    if blocks:
                        specs[fqn] = blocks
        if isinstance(self.offload, NvmeOffload):
            swapped = self.offload.take_blocks()
            for value in specs.values():
                for spec in value if isinstance(value, list) else [value]:
                    if spec.local.is_meta:
                        spec.source = swapped[id(spec.local if spec.local._base is None else spec.local._base)]
        return specs

    def common_state_dict(self) -> dict:
        """JSON-serializable rest: loss scaler and (for the record) the hyper-parameters."""
        groups = [
            {k: v for k, v in g.items() if isinstance(v, (int, float, str, bool)) and k != "params"}
            for g in self.optimizer.param_groups
        ]
        return {
            "format": FORMAT,
            "optimizer": type(self.optimizer).__name__,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "param_groups": groups,
        }

    def load_sharded_state_dict(self, common: dict, main_params_loaded: bool) -> None:
        """Finish a load into the tensors of :meth:`sharded_state_dict`: restore the loss scaler from
        ``common`` (:meth:`common_state_dict`'s output).  ``main_params_loaded`` False (the checkpoint
        had no fp32 main weights, e.g. an fp32 run resumed with ``--bf16``): the main weights are
        rebuilt from the (loaded) model weights; True keeps the checkpoint's, more precise, values.
        A checkpoint of another optimizer (whose state may share names, e.g. AdamW's and LAMB's moments)
        is refused."""
        saved, mine = common.get("optimizer"), type(self.optimizer).__name__
        if saved is not None and saved != mine:
            raise OptimizerError(
                f"the checkpoint's optimizer state is {saved}'s but this run uses {mine}: load it with "
                "--no-load-optim to start a fresh optimizer from its weights"
            )
        if self.grad_scaler is not None and common.get("grad_scaler"):
            self.grad_scaler.load_state_dict(common["grad_scaler"])
        if not main_params_loaded:
            self.reload_model_params()
        self._refresh_offload()

    def sharded_param_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """``{global name: {state key: live tensor}}`` (whole local tensors): moments, ``step``
        (0-dim) and, for mixed precision, ``main_param`` (fp32)."""
        self.materialize_offload()
        self.init_state()
        return {piece.name: piece.tensors for piece in self._param_states()}

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes beyond the model's weights and gradient buffers: fp32 main weights (copies only),
        fp32 main gradients (copies made during the step when gradients are not fp32) and the
        optimizer state (moments; the 0-dim step counters are left out) on the device, and ``host``:
        the bytes offloaded to the host (:mod:`megalm.optimizer.cpu_offload`).  The state is created
        first if no step was taken yet."""
        self.init_state()
        copies = [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not p]
        half_grads = [p for p, _ in copies if (grad_of_dtype(p) or p.dtype) != torch.float32]
        return {
            "main_params": sum(m.numel() * m.element_size() for _, m in copies),
            "main_grads": sum(p.numel() * 4 for p in half_grads),
            "optimizer_state": sum(
                t.numel() * t.element_size()
                for m in self.main_params
                if self._torch_param(m) is m
                for t in self.optimizer.state[m].values()
                if t.dim() > 0
            ),
            "host": self.offload.host_bytes(self.optimizer.state) if self.offload is not None else 0,
        }


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the model parameters are the optimizer's parameters."""

    def _make_main_params(self, groups):
        return [list(g["params"]) for g in groups]


class MixedPrecisionOptimizer(MegatronOptimizer):
    """bf16/fp16 model: the optimizer updates fp32 copies, then rounds them into the model."""

    def _make_main_params(self, groups):
        return [
            [torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad) for p in g["params"]]
            for g in groups
        ]

    @torch.no_grad()
    def _copy_main_to_model(self) -> None:
        for model, main in zip(self.model_params, self.main_params):
            model.data.copy_(main)

    def _main_params_state(self) -> Dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in zip(self.names, self.main_params)}

    @torch.no_grad()
    def _load_main_params(self, main_params: Dict[str, torch.Tensor]) -> None:
        if not main_params:
            self.reload_model_params()
            return
        for n, m in zip(self.names, self.main_params):
            if tuple(main_params[n].shape) != tuple(m.shape):
                raise OptimizerError(
                    f"main param {n}: checkpoint shape {tuple(main_params[n].shape)} != local shape {tuple(m.shape)}"
                )
            m.copy_(main_params[n])
