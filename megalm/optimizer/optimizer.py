"""Optimizer wrappers: fp32 main weights, loss-scale handling, global-norm clipping.

``step()`` (both wrappers)::

    main.grad <- model.main_grad (fp32 view from DDP; aliased, no copy) or model.grad
    if loss scaler:  main.grad *= 1/scale; found_inf = MAX over model-parallel ranks
                     scaler.update(found_inf); found_inf -> skip (return False, None, None)
    norm = global L2 norm (each distinct gradient once over TP x PP, see clip_grads)
    norm not finite (no scaler: bf16/fp32) -> skip (return False, norm, zeros)
    clip_grad > 0 -> main.grad *= clip / (norm + 1e-6) when < 1
    torch optimizer step (AdamW: decoupled weight decay; SGD: momentum, L2 decay)
    model param <- main param (rounded to bf16/fp16 for mixed precision)
    return (True, norm, num_zeros or None)

Skipping non-finite updates without a scaler is a deliberate difference from Megatron
(which would apply them); the trainer counts such iterations as skipped.

Parameter groups: weight decay on parameters with ndim >= 2, none on biases and norm
weights (ndim <= 1).

``state_dict()`` structure (every tensor keyed by the parameter's global name, so a
checkpointer can reshard: tensors are this rank's local TP shard, ``param_meta`` says how)::

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.distributed.finalize_model_grads import grad_of, unwrap_model
from megalm.optimizer.clip_grads import clip_grads_by_total_norm, grad_norm_and_zeros, unscale_and_check_for_inf
from megalm.optimizer.grad_scaler import GradScaler, build_grad_scaler
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel.param_info import param_info
from megalm.timers import NULL_TIMERS

FORMAT = "megalm-optimizer-v1"
StepResult = Tuple[bool, Optional[float], Optional[float]]


def grad_of_dtype(param: torch.Tensor) -> Optional[torch.dtype]:
    """dtype of the gradient the parameter accumulates into (``main_grad`` under DDP)."""
    g = getattr(param, "main_grad", None)
    return g.dtype if g is not None else None


def get_param_groups(named_params: Sequence[Tuple[str, torch.nn.Parameter]], weight_decay: float) -> List[dict]:
    """Two groups: ``decay`` (ndim >= 2, ``weight_decay``) and ``no_decay`` (ndim <= 1, 0.0)."""
    decay = [(n, p) for n, p in named_params if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named_params if p.ndim < 2]
    groups = []
    for tag, members, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)):
        if members:
            groups.append({"name": tag, "params": [p for _, p in members], "names": [n for n, _ in members],
                           "weight_decay": wd, "lr_mult": 1.0})
    return groups


def _param_meta(p: torch.nn.Parameter) -> dict:
    info = param_info(p)
    dim = info.partition_dim if info.tensor_parallel else None
    global_shape = list(p.shape)
    if dim is not None:
        global_shape[dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return {"shape": tuple(p.shape), "global_shape": tuple(global_shape), "tensor_model_parallel": info.tensor_parallel,
            "partition_dim": dim, "partition_stride": info.partition_stride}


class MegatronOptimizer:
    """Common logic; subclasses decide what the main (fp32) parameters are.

    Args:
        groups: from :func:`get_param_groups` (model parameters and their global names).
        make_optimizer: builds the torch optimizer from param-group dicts over main params.
        clip_grad: max global L2 norm (0 disables clipping; the norm is still computed).
        grad_scaler: None (no loss scaling) or a :class:`GradScaler`.
        log_num_zeros_in_grad: also return the number of zero gradient entries.
    """

    def __init__(self, groups: List[dict], make_optimizer: Callable[[List[dict]], torch.optim.Optimizer],
                 clip_grad: float = 0.0, grad_scaler: Optional[GradScaler] = None,
                 log_num_zeros_in_grad: bool = False):
        self.model_params: List[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.names: List[str] = [n for g in groups for n in g["names"]]
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ValueError(f"parameter names must be unique across model chunks, duplicated: {dup[:5]}")
        self.main_params: List[torch.nn.Parameter] = self._make_main_params(self.model_params)
        main_of = dict(zip(map(id, self.model_params), self.main_params))
        torch_groups = [{k: v for k, v in g.items() if k not in ("params", "names")} |
                        {"params": [main_of[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = make_optimizer(torch_groups)
        self.clip_grad = float(clip_grad)
        self.grad_scaler = grad_scaler
        self.log_num_zeros_in_grad = log_num_zeros_in_grad

    # --- subclass hooks --------------------------------------------------------------------
    def _make_main_params(self, model_params: List[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        raise NotImplementedError

    def _copy_main_to_model(self) -> None:
        pass

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

    def _main_grads(self) -> List[Optional[torch.Tensor]]:
        """Point each main param's ``.grad`` at its model gradient (fp32: alias, no copy)."""
        grads = []
        for model, main in zip(self.model_params, self.main_params):
            g = grad_of(model)
            main.grad = None if g is None else (g if g.dtype == main.dtype else g.to(main.dtype))
            grads.append(main.grad)
        return grads

    def _release_grads(self) -> None:
        for model, main in zip(self.model_params, self.main_params):
            main.grad = None
            if getattr(model, "main_grad", None) is not None:
                model.grad = None

    @torch.no_grad()
    def step(self, timers=NULL_TIMERS) -> StepResult:
        """One update; returns ``(update_successful, grad_norm, num_zeros_in_grad or None)``.
        ``timers``: Megatron's level-1 ``optimizer-*`` timers (:mod:`megalm.timers`)."""
        try:
            with timers("optimizer-copy-to-main-grad"):
                grads = self._main_grads()
            present = [g for g in grads if g is not None]
            if self.grad_scaler is not None:
                with timers("optimizer-unscale-and-check-inf"):
                    found_inf = unscale_and_check_for_inf(present, self.grad_scaler.inv_scale)
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return False, None, None
            with timers("optimizer-clip-main-grad"):
                norm, zeros = grad_norm_and_zeros(list(zip(grads, self.model_params)), self.log_num_zeros_in_grad)
                if math.isfinite(norm) and self.clip_grad > 0.0:
                    clip_grads_by_total_norm(present, self.clip_grad, norm)
            if not math.isfinite(norm):
                return False, norm, zeros
            with timers("optimizer-inner-step"):
                self.optimizer.step()
            with timers("optimizer-copy-main-to-model-params"):
                self._copy_main_to_model()
            return True, norm, zeros
        finally:
            self._release_grads()

    # --- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer state keyed by global parameter name (see the module docstring)."""
        inner = self.optimizer.state_dict()
        state = {self.names[i]: s for i, s in inner["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [self.names[i] for i in g["params"]]}
                  for g in inner["param_groups"]]
        return {"format": FORMAT, "optimizer": {"state": state, "param_groups": groups},
                "main_params": self._main_params_state(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
                "param_meta": {n: _param_meta(p) for n, p in zip(self.names, self.model_params)}}

    def _main_params_state(self) -> Dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` output, matching parameters by name."""
        if state_dict.get("format") != FORMAT:
            raise ValueError(f"not a megalm optimizer state dict (format {state_dict.get('format')!r}, "
                             f"expected {FORMAT!r})")
        saved_groups = state_dict["optimizer"]["param_groups"]
        saved_names = [n for g in saved_groups for n in g["params"]]
        missing, unexpected = set(self.names) - set(saved_names), set(saved_names) - set(self.names)
        if missing or unexpected:
            raise ValueError(f"optimizer checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        index = {n: i for i, n in enumerate(self.names)}
        group_of = {n: g for g in saved_groups for n in g["params"]}
        cur_groups = self.optimizer.state_dict()["param_groups"]
        new_groups = []
        for g in cur_groups:
            names = [self.names[i] for i in g["params"]]
            src = group_of[names[0]]
            if set(src["params"]) != set(names):
                raise ValueError(f"parameter group '{g.get('name')}' differs from the checkpoint's")
            new_groups.append({k: v for k, v in src.items() if k != "params"} | {"params": list(g["params"])})
        state = {index[n]: s for n, s in state_dict["optimizer"]["state"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": new_groups})
        self._load_main_params(state_dict.get("main_params") or {})
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _load_main_params(self, main_params: Dict[str, torch.Tensor]) -> None:
        pass

    def reload_model_params(self) -> None:
        """Copy model params into the main params (after loading weights without optimizer state)."""

    # --- in-place (sharded) checkpointing used by megalm.checkpointing ----------------------------
    def init_state(self) -> None:
        """Create the optimizer state (zero moments, step 0) if no step was taken yet, so that a
        checkpoint can be loaded into it in place.  The next step behaves exactly as the lazy init."""
        for group in self.optimizer.param_groups:
            fused = bool(group.get("fused"))
            for p in group["params"]:
                state = self.optimizer.state[p]
                if state:
                    continue
                if isinstance(self.optimizer, torch.optim.AdamW):
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif isinstance(self.optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_param_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """``{global name: {state key: live tensor}}``: moments (shaped like the local param shard),
        ``step`` (0-dim) and, for mixed precision, ``main_param`` (fp32).  Loading into these tensors
        in place restores the optimizer; call :meth:`load_common_state_dict` afterwards."""
        self.init_state()
        out = {}
        for name, main in zip(self.names, self.main_params):
            tensors = dict(self.optimizer.state[main])
            tensors.update(self._main_params_state_one(name, main))
            out[name] = tensors
        return out

    def _main_params_state_one(self, name: str, main: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        return {}

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes beyond the model's weights and gradient buffers: fp32 main weights (copies only),
        fp32 main gradients (copies made during the step when gradients are not fp32) and the
        optimizer state (moments; the 0-dim step counters are left out).  The state is created
        first if no step was taken yet."""
        self.init_state()
        copies = [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not p]
        half_grads = [p for p, _ in copies if (grad_of_dtype(p) or p.dtype) != torch.float32]
        return {"main_params": sum(m.numel() * m.element_size() for _, m in copies),
                "main_grads": sum(p.numel() * 4 for p in half_grads),
                "optimizer_state": sum(t.numel() * t.element_size() for m in self.main_params
                                       for t in self.optimizer.state[m].values() if t.dim() > 0)}

    def common_state_dict(self) -> dict:
        """JSON-serializable rest: loss scaler and (for the record) the hyper-parameters."""
        groups = [{k: v for k, v in g.items() if isinstance(v, (int, float, str, bool)) and k != "params"}
                  for g in self.optimizer.param_groups]
        return {"format": FORMAT, "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
                "param_groups": groups}

    def load_common_state_dict(self, common: dict) -> None:
        """Restore the loss scaler; marks the main params as restored, so that the
        :meth:`reload_model_params` that follows a checkpoint load keeps the fp32 values."""
        if self.grad_scaler is not None and common.get("grad_scaler"):
            self.grad_scaler.load_state_dict(common["grad_scaler"])
        self._main_params_restored = True


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the model parameters are the optimizer's parameters."""

    def _make_main_params(self, model_params):
        return list(model_params)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """bf16/fp16 model: the optimizer updates fp32 copies, then rounds them into the model."""

    def _make_main_params(self, model_params):
        mains = []
        for p in model_params:
            main = torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
            mains.append(main)
        return mains

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
                raise ValueError(f"main param {n}: checkpoint shape {tuple(main_params[n].shape)} "
                                 f"!= local shape {tuple(m.shape)}")
            m.copy_(main_params[n])

    def _main_params_state_one(self, name, main):
        return {"main_param": main.data}

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Main params <- model params; skipped once right after :meth:`load_common_state_dict`
        (the fp32 main params were just restored from the checkpoint and are more precise)."""
        if getattr(self, "_main_params_restored", False):
            self._main_params_restored = False
            return
        for model, main in zip(self.model_params, self.main_params):
            main.copy_(model.float())


# --- construction ---------------------------------------------------------------------------

def named_parameters_for_optimizer(model_chunks: Sequence[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    """``(global name, param)`` over all chunks.

    Name: ``module.global_parameter_name(local_name)`` when the (unwrapped) module defines it,
    otherwise ``named_parameters()``' name made canonical (the model names layers globally, as
    the checkpoint code assumes; :func:`megalm.parameter_names.canonical_name` gives a Transformer
    Engine model's fused norm weights their local names).  Names must be unique over the chunks.
    """
    out = []
    for chunk in model_chunks:
        module = unwrap_model(chunk)
        to_global = getattr(module, "global_parameter_name", None)
        for n, p in module.named_parameters():
            if not p.requires_grad:
                continue
            out.append((to_global(n) if callable(to_global) else canonical_name(n), p))
    return out


def _make_torch_optimizer(t) -> Callable[[List[dict]], torch.optim.Optimizer]:
    def make(groups: List[dict]) -> torch.optim.Optimizer:
        if t.optimizer == "adam":
            cls, kw = torch.optim.AdamW, dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                              weight_decay=t.weight_decay)
        elif t.optimizer == "sgd":
            cls, kw = torch.optim.SGD, dict(lr=t.lr, momentum=t.sgd_momentum, weight_decay=t.weight_decay)
        else:
            raise ValueError(f"unknown --optimizer {t.optimizer!r} (choose adam or sgd)")
        try:  # the fused kernels are ~5x faster on CPU and on GPU
            return cls(groups, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError):
            return cls(groups, **kw)
    return make


def build_optimizer(cfg, model_chunks: Sequence[torch.nn.Module],
                    log_num_zeros_in_grad: Optional[bool] = None, report_memory: bool = True) -> MegatronOptimizer:
    """Optimizer over every trainable parameter of ``model_chunks`` (DDP-wrapped or not).

    Mixed precision (fp32 main params) when any parameter is bf16/fp16; fp16 gets a dynamic
    (or ``--loss-scale`` constant) loss scaler.  ``--use-distributed-optimizer``: a
    :class:`megalm.optimizer.distrib_optimizer.DistributedOptimizer` over the chunks' DDP buffers
    (built with the same config).  ``log_num_zeros_in_grad`` defaults to the config's
    ``training.log_num_zeros_in_grad`` when that field exists, else False.  ``report_memory``:
    global rank 0 prints the bytes per parameter of weights, gradients, main weights and
    optimizer state against the formula (:mod:`megalm.optimizer.memory_accounting`).
    """
    t = cfg.training
    if log_num_zeros_in_grad is None:
        log_num_zeros_in_grad = bool(getattr(t, "log_num_zeros_in_grad", False))
    named = named_parameters_for_optimizer(model_chunks)
    if not named:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    groups = get_param_groups(named, t.weight_decay)
    if getattr(cfg.parallel, "use_distributed_optimizer", False):
        from megalm.optimizer.distrib_optimizer import DistributedOptimizer

        optimizer = DistributedOptimizer(groups, _make_torch_optimizer(t), model_chunks, clip_grad=t.clip_grad,
                                         grad_scaler=build_grad_scaler(t), log_num_zeros_in_grad=log_num_zeros_in_grad)
    else:
        half = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in named)
        cls = MixedPrecisionOptimizer if half else FP32Optimizer
        optimizer = cls(groups, _make_torch_optimizer(t), clip_grad=t.clip_grad, grad_scaler=build_grad_scaler(t),
                        log_num_zeros_in_grad=log_num_zeros_in_grad)
    if report_memory and (not dist.is_initialized() or dist.get_rank() == 0):
        from megalm.optimizer.memory_accounting import format_memory_report, optimizer_memory

        print(format_memory_report(optimizer_memory(optimizer, model_chunks)), flush=True)
    return optimizer
