"""Local SGD and DiLoCo (``--local-sgd-interval H``, ``--outer-lr``, ``--outer-momentum``).

Data-parallel replicas step independently, each with its own optimizer (the gradient is the
replica's own mean: DDP reduces nothing, or with ``--hierarchical-grad-reduce`` only inside the
node: exact intra-node data parallelism every step), and every ``H`` iterations the replicas'
parameters are synchronised over the outer group (the data-parallel group, or with
``--hierarchical-grad-reduce`` the inter-node group: one replica per node):

* average ``x_bar = (1/n) sum_k x_k``: one SUM all-reduce of every fp32 main parameter over the
  outer group of ``n`` replicas (``2 (n-1)/n x 4 P`` bytes per rank for ``P`` local parameters,
  once per ``H`` steps; kind ``local_sgd_param_all_reduce``); hierarchical, the ``L`` ranks of a
  node hold the same replica, so rank ``i`` averages chunk ``i`` of ``L`` across nodes
  (``2 (n-1)/n x 4 P / L``) and the node all-gathers the chunks;
* plain averaging (``--outer-lr 1 --outer-momentum 0``, the default): ``x <- x_bar`` (Local SGD);
* DiLoCo (Douillard et al. 2023): with ``x_0`` the parameters at the last sync, the
  pseudo-gradient ``D = x_0 - x_bar``, the outer SGD with Nesterov momentum ``mu``, learning
  rate ``eta``: ``m <- mu m + D``, ``x <- x_0 - eta (D + mu m)``; then ``x_0 <- x``.

The inner optimizer's state (moments) stays local.  The outer state (``x_0``, ``m``) is the same on
every replica; between syncs each replica's parameters and optimizer state differ, so a checkpoint
keeps them per rank (``local_sgd/rank_*.pt``, see :func:`megalm.checkpointing.save_checkpoint`):
resume is exact under the same layout; under another one every replica restarts from the
checkpoint's (data-parallel rank 0's) parameters and the outer state from them, with a warning.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalm.distributed import comm
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.param_info import param_info


def inner_group(pg: ProcessGroups, hierarchical: bool, expert: bool):
    """The group DDP reduces gradients over every step under local SGD (None: this rank alone)."""
    return (pg.expt_dp_intra if expert else pg.dp_cp_intra) if hierarchical else None


def outer_group(pg: ProcessGroups, hierarchical: bool, expert: bool):
    """The group the replicas' parameters are averaged over every H steps."""
    if hierarchical:
        return pg.expt_dp_inter if expert else pg.dp_cp_inter
    return pg.expt_dp if expert else pg.dp_cp


class OuterSync:
    """The every-``H``-steps synchronisation of the ``optimizer``'s main parameters.

    ``optimizer``: a plain :class:`megalm.optimizer.optimizer.MegatronOptimizer` (its
    ``main_params``, ``names`` and ``model_params``); ``interval``: H; ``outer_lr``,
    ``outer_momentum``: eta, mu; ``process_groups``, ``hierarchical``: which groups (see
    :func:`outer_group`).
    """

    def __init__(
        self,
        optimizer,
        interval: int,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        process_groups: Optional[ProcessGroups] = None,
        hierarchical: bool = False,
    ):
        self.optimizer = optimizer
        self.interval = interval
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.plain = self.outer_lr == 1.0 and self.outer_momentum == 0.0
        pg = process_groups
        self.groups: List[tuple] = []  # (outer group, intra-node group, [main params]) in a fixed order
        for expert in (False, True):
            params = [
                m for m, p in zip(optimizer.main_params, optimizer.model_params) if param_info(p).expert == expert
            ]
            if params:
                groups = (outer_group(pg, hierarchical, expert), inner_group(pg, hierarchical, expert))
                self.groups.append((*groups, params))
        self.anchor: Dict[str, torch.Tensor] = {}
        self.momentum: Dict[str, torch.Tensor] = {}
        self.reset()

    @property
    def _named(self):
        return zip(self.optimizer.names, self.optimizer.main_params)

    @torch.no_grad()
    def reset(self) -> None:
        """Outer state from the current parameters: ``x_0 <- x``, ``m <- 0``."""
        if self.plain:
            return
        self.anchor = {n: m.detach().clone() for n, m in self._named}
        if self.outer_momentum:
            self.momentum = {n: torch.zeros_like(m) for n, m in self._named}

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def step(self, iteration: int) -> bool:
        """After the optimizer step of ``iteration`` (1-based): synchronise when it is a multiple of H."""
        if not self.due(iteration):
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Average the main parameters over the outer groups, then the outer update (see the module)."""
        for outer, intra, params in self.groups:
            if group_size(outer) > 1:
                flat = _average(_flatten_dense_tensors([p.data for p in params]), outer, intra)
                for p, avg in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                    p.data.copy_(avg)
        if not self.plain:
            mu, eta = self.outer_momentum, self.outer_lr
            for name, p in self._named:
                x0 = self.anchor[name]
                delta = x0 - p.data
                if mu:
                    m = self.momentum[name].mul_(mu).add_(delta)
                    delta = delta.add(m, alpha=mu)
                p.data.copy_(x0 - eta * delta)
                x0.copy_(p.data)
        self.optimizer._copy_main_to_model()

    # --- per-rank checkpoint state --------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's replica (model weights, inner optimizer state) and the outer state."""
        return {
            "model": {
                n: p.detach().to("cpu", copy=True) for n, p in zip(self.optimizer.names, self.optimizer.model_params)
            },
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "anchor": {k: v.to("cpu", copy=True) for k, v in self.anchor.items()},
            "momentum": {k: v.to("cpu", copy=True) for k, v in self.momentum.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for n, p in zip(self.optimizer.names, self.optimizer.model_params):
            p.data.copy_(state["model"][n])
        self.optimizer.load_state_dict(state["optimizer"])  # with mixed precision: the fp32 main weights too
        self.reset()  # then the saved outer state where it has one (it may have been saved without DiLoCo)
        device = self.optimizer.main_params[0].device
        for mine, saved in ((self.anchor, state["anchor"]), (self.momentum, state["momentum"])):
            for k in mine:
                if k in saved:
                    mine[k] = saved[k].to(device)


def _average(flat: torch.Tensor, outer, intra) -> torch.Tensor:
    """Mean of ``flat`` over ``outer``.  With an ``intra`` group of ``L > 1`` ranks (hierarchical: the
    node's ranks, which hold the same replica), rank ``i`` of the node averages only chunk ``i`` of
    ``L`` across nodes and the node all-gathers the chunks: ``1/L`` of the bytes cross nodes per rank."""
    n, L = group_size(outer), group_size(intra)
    if L == 1:
        comm.all_reduce(flat, group=outer, kind="local_sgd_param_all_reduce")
        return flat.div_(n)
    c = -(-flat.numel() // L)
    padded = torch.zeros(c * L, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    i = group_rank(intra)
    chunk = padded[i * c : (i + 1) * c].clone()
    comm.all_reduce(chunk, group=outer, kind="local_sgd_param_all_reduce_inter")
    chunk.div_(n)
    comm.all_gather_into_tensor(padded, chunk, group=intra, kind="local_sgd_param_all_gather_intra")
    return padded[: flat.numel()]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def build_outer_sync(cfg, optimizer, process_groups: ProcessGroups) -> Optional[OuterSync]:
    """The :class:`OuterSync` ``--local-sgd-interval`` asks for, or None."""
    p = cfg.parallel
    if not p.local_sgd_interval:
        return None
    return OuterSync(
        optimizer, p.local_sgd_interval, p.outer_lr, p.outer_momentum, process_groups, p.hierarchical_grad_reduce
    )
