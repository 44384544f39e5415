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

Overlap (``--local-sgd-overlap-steps D`` > 0): at a sync the main parameters are snapshotted
(``s``, one flat fp32 copy per group) and their average is all-reduced in the background
(``async_op``; the hierarchical intra-node all-gather runs when it is applied) while training goes
on; ``D`` iterations later (after that iteration's optimizer step; waiting if the reduction is not
done) the outer update is computed from the snapshot's average, ``x_new = outer(avg(s))`` (plain:
``avg(s)``; DiLoCo: the update above with ``x_0``), and applied as a correction that keeps the
replica's own progress since the snapshot: ``x <- x + (x_new - s)``, ``x_0 <- x_new``.  Replicas
then differ by their last ``D`` steps, as they will anyway until the next sync.  ``D = H`` applies
the correction just before the next snapshot; a sync due at the run's last iteration (and any
correction still pending there) is completed then, blocking, so a finished run ends averaged.
Same bytes as the blocking sync, hidden behind ``D`` steps of compute when the link allows; memory:
the snapshot and the reduction buffer (2 x 4 bytes per local parameter).  A checkpoint taken while a
correction is pending waits for its reduction and stores the snapshot, the average and the
iteration it applies at: resume is exact.

Warm-up (``--local-sgd-warmup-iters W``): iterations ``1..W`` are synchronous data parallelism (DDP
all-reduces the gradients over the data-parallel group, :meth:`DistributedDataParallel.begin_step`),
so every replica holds the same weights and optimizer state after them, bit for bit the run without
local SGD; after the step of iteration ``W`` the outer state restarts from them (``x_0 <- x``,
``m <- 0``, no communication) and the syncs fall at iterations ``W + k H``.

Streaming (``--local-sgd-fragments F``, Streaming DiLoCo, Douillard et al. 2025): the parameters are
split into ``F`` fragments of contiguous parameters (about equal element counts, in the optimizer's
order, i.e. by layer), each synchronised every ``H`` iterations as above but staggered: fragment ``f``
at iterations ``W + k H + (f + 1) H / F``, so each sync sends ``1/F`` of the bytes and, with
``--local-sgd-overlap-steps D <= H / F``, is hidden behind the next ``D`` iterations (one fragment in
flight at a time); the run's last iteration synchronises every fragment (blocking), so it ends with
one model.  The outer state is per parameter, so each fragment's outer step is DiLoCo's.

Quantized outer gradients (``--outer-grad-int8-chunk C``, > 0): instead of the fp32 parameters, each
replica sends its pseudo-gradient ``D_k = x_0 - x_k`` in 8 bits with one fp32 scale per ``C`` elements
(:mod:`megalm.distributed.compression.int8`, nearest rounding, no error feedback, as Streaming DiLoCo's
4-bit outer gradients), one all-gather over the outer group: ``(n-1) (N + 4 ceil(N/C))`` bytes per rank
instead of the all-reduce's ``2 (n-1)/n 4 N`` (kind ``local_sgd_outer_grad_int8_all_gather``, ``_inter``
hierarchically, where ``N`` is the node's chunk); the average is ``x_0 - mean_k dequant(D_k)``.  Plain
averaging then keeps ``x_0`` too (the parameters at the last sync of each fragment).

Across torchft replica groups (``--ft-replica-group-id``, :mod:`megalm.resilience.torchft_replicas`)
the replicas are the groups, not the data-parallel ranks: inside a group DDP reduces every step
(synchronous), and the outer group is a :class:`FaultTolerantOuter` (torchft's process group of the
current quorum): rank ``i`` of the group averages chunk ``i`` of ``d`` of the parameters with rank
``i`` of the other groups (a SUM all-reduce through torchft's manager) and the group all-gathers the
chunks.  Then the groups vote: if a group died during the sync, the survivors form a new quorum
among themselves (no group joins mid-sync) and redo the average without it; the parameters are
changed only once a sync is committed.

The inner optimizer's state (moments) stays local.  The outer state (``x_0``, ``m``) is the same on
every replica; between syncs each replica's parameters and optimizer state differ, so a checkpoint
keeps them per rank: :class:`OuterSync` is a registered checkpoint state (``"local_sgd"``, saved to
``local_sgd/rank_*.pt``, see :mod:`megalm.checkpoint.stateful`): resume is exact under the same
layout; under another one (:meth:`OuterSync.not_restored`) every replica restarts from the
checkpoint's (data-parallel rank 0's) parameters and the outer state from them, with a warning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalm.distributed import comm
from megalm.distributed.compression import int8
from megalm.errors import MegalmError
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.param_info import param_info

logger = get_logger(__name__)


class LocalSGDStateError(MegalmError, ValueError):
    """A checkpoint's local-SGD state does not fit this run's parameters."""


class LocalSGDSyncError(MegalmError):
    """The replica groups' outer sync was not committed after many attempts."""


MAX_SYNC_ATTEMPTS = 20  # a torchft outer sync redone this many times in a row stops the run


class FaultTolerantOuter(ABC):
    """The outer group of torchft replica groups (one rank of each group of the quorum), as
    :class:`OuterSync` uses it instead of a process group."""

    @abstractmethod
    def size(self) -> int:
        """Replica groups in the current quorum."""

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor):
        """Start a SUM all-reduce of ``tensor`` in place over the quorum; returns a work with ``wait()``
        (a failure is not raised: :meth:`commit` says no)."""

    @abstractmethod
    def commit(self) -> bool:
        """Every group's vote on the sync just reduced; on no the survivors' new quorum is formed
        (:meth:`size` then counts them) and the sync is redone."""

    @abstractmethod
    def synced(self, iteration: int, weights: List[torch.Tensor]) -> None:
        """A committed sync of ``iteration``, its new parameters ``weights`` (for the log)."""


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
    :func:`outer_group`); ``overlap_steps``: D (see the module); ``last_iteration``: the run's last
    iteration (its sync is blocking), or None; ``comm_stats``: where its collectives are counted;
    ``replicas``: the :class:`FaultTolerantOuter` of torchft replica groups (then the outer group, and
    the inner one is the group's data-parallel group), or None.
    """

    def __init__(
        self,
        optimizer,
        interval: int,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        *,
        process_groups: ProcessGroups,
        hierarchical: bool = False,
        overlap_steps: int = 0,
        last_iteration: Optional[int] = None,
        comm_stats: Optional[comm.CommStats] = None,
        warmup_iters: int = 0,
        fragments: int = 1,
        outer_grad_int8_chunk: int = 0,
        replicas: Optional[FaultTolerantOuter] = None,
    ):
        self.optimizer = optimizer
        self.replicas = replicas
        self.comm_stats = comm_stats  # where the averaging collectives are counted (None: not counted)
        self.interval = interval
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.plain = self.outer_lr == 1.0 and self.outer_momentum == 0.0
        self.int8_chunk = int(outer_grad_int8_chunk)  # > 0: the pseudo-gradients are sent in 8 bits
        pg = process_groups
        self.groups: List[tuple] = []  # (outer group, intra-node group, [main params]) in a fixed order
        for expert in (False, True):
            params = [
                m for m, p in zip(optimizer.main_params, optimizer.model_params) if param_info(p).expert == expert
            ]
            if params:
                groups = (outer_group(pg, hierarchical, expert), inner_group(pg, hierarchical, expert))
                if replicas is not None:  # the groups' ranks hold one replica: each averages 1/d of it
                    groups = (replicas, pg.expt_dp if expert else pg.dp_cp)
                self.groups.append((*groups, params))
        self.fragments = [_fragment(self.groups, f, fragments) for f in range(fragments)]
        self.fragments = [frag for frag in self.fragments if frag] or [self.groups]
        self.anchor: Dict[str, torch.Tensor] = {}
        self.momentum: Dict[str, torch.Tensor] = {}
        self.overlap_steps = int(overlap_steps)
        self.last_iteration = last_iteration
        self.warmup_iters = int(warmup_iters)
        self.pending: Optional[_PendingSync] = None
        self._name_of = {id(m): n for n, m in zip(optimizer.names, optimizer.main_params)}
        self.reset()

    @property
    def _named(self):
        return zip(self.optimizer.names, self.optimizer.main_params)

    @torch.no_grad()
    def reset(self) -> None:
        """Outer state from the current parameters: ``x_0 <- x``, ``m <- 0``; no pending correction."""
        self.pending = None
        if self.plain and not self.int8_chunk:
            return
        self.anchor = {n: m.detach().clone() for n, m in self._named}
        if self.outer_momentum and not self.plain:
            self.momentum = {n: torch.zeros_like(m) for n, m in self._named}

    def synchronous(self, iteration: int) -> bool:
        """Whether ``iteration`` is in the warm-up (its gradients are reduced over every replica)."""
        return iteration <= self.warmup_iters

    def due(self, iteration: int) -> Optional[int]:
        """The fragment to synchronise after ``iteration`` (0 without streaming), or None."""
        if iteration <= self.warmup_iters:
            return None
        phase, n = (iteration - self.warmup_iters) % self.interval, len(self.fragments)
        for f in range(n):
            if phase == (f + 1) * self.interval // n % self.interval:
                return f
        return None

    def step(self, iteration: int) -> bool:
        """After the optimizer step of ``iteration`` (1-based): apply a pending correction that is due,
        then synchronise when ``iteration`` is ``W + k H`` (in the background with overlap); at the end
        of the warm-up (``iteration == W``) restart the outer state from the (identical) replicas."""
        if iteration <= self.warmup_iters:
            if iteration == self.warmup_iters:
                self.reset()
            return False
        last = iteration == self.last_iteration
        if self.pending is not None and (iteration >= self.pending.apply_at or last):
            self.apply_pending()
        fragment = self.due(iteration)
        if last and len(self.fragments) > 1:  # streaming: the run ends with one model
            for f in range(len(self.fragments)):
                self.sync(f, iteration)
            return True
        if fragment is None:
            return False
        if self.overlap_steps and not last:
            self.pending = self._start(iteration + self.overlap_steps, fragment)
        else:
            self.sync(fragment, iteration)
        return True

    @torch.no_grad()
    def sync(self, fragment: int = 0, iteration: Optional[int] = None) -> None:
        """Average the main parameters of ``fragment`` over the outer groups, then the outer update
        (see the module).  Across torchft replica groups the average is redone until the groups
        commit it (a group that died during it is left out of the next attempt)."""
        groups = self.fragments[fragment]
        for _ in range(MAX_SYNC_ATTEMPTS):
            averages = [
                self._flight(_flatten_dense_tensors([p.data for p in params]), outer, intra, params).result()
                if _outer_size(outer) > 1
                else None
                for outer, intra, params in groups
            ]
            if self.replicas is None or self.replicas.commit():
                break
        else:
            raise LocalSGDSyncError(
                f"the outer sync of the torchft replica groups was not committed {MAX_SYNC_ATTEMPTS} times in a row"
            )
        for (_, _, params), flat in zip(groups, averages):
            if flat is not None:
                for p, avg in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                    p.data.copy_(avg)
            for p in params:
                p.data.copy_(self._outer_step(self._name_of[id(p)], p.data))
        self.optimizer._copy_main_to_model()
        if self.replicas is not None:
            self.replicas.synced(iteration, [p.data for _, _, params in groups for p in params])

    def _flight(self, snapshot: torch.Tensor, outer, intra, params) -> "_AverageInFlight":
        """The average of ``snapshot`` (the flat ``params``) started: fp32, or the anchors' minus the mean
        of the 8-bit pseudo-gradients."""
        anchor = None
        if self.int8_chunk:
            anchor = torch.cat([self.anchor[self._name_of[id(p)]].reshape(-1) for p in params])
        return _AverageInFlight(snapshot, outer, intra, self.comm_stats, anchor, self.int8_chunk)

    def _outer_step(self, name: str, average: torch.Tensor) -> torch.Tensor:
        """DiLoCo's outer step of parameter ``name`` from the replicas' ``average``: ``D = x_0 - average``,
        ``m <- mu m + D``, ``x_0 <- x_0 - eta (D + mu m)``; returns the new ``x_0``.  Plain averaging:
        ``average`` (kept as ``x_0`` when the pseudo-gradients are quantized)."""
        if self.plain:
            if self.int8_chunk:
                self.anchor[name].copy_(average)
            return average
        x0, mu = self.anchor[name], self.outer_momentum
        delta = x0 - average
        if mu:
            m = self.momentum[name].mul_(mu).add_(delta)
            delta = delta.add(m, alpha=mu)
        return x0.copy_(x0 - self.outer_lr * delta)

    # --- overlapped sync (--local-sgd-overlap-steps) --------------------------------------------
    @torch.no_grad()
    def _start(self, apply_at: int, fragment: int = 0) -> "_PendingSync":
        """Snapshot the main parameters of ``fragment``'s groups and start averaging the snapshot in the
        background."""
        groups = []
        for outer, intra, params in self.fragments[fragment]:
            snapshot = torch.cat([p.data.reshape(-1) for p in params])  # a copy (flattening one tensor is a view)
            groups.append(self._flight(snapshot, outer, intra, params))
        return _PendingSync(apply_at, groups, fragment)

    @torch.no_grad()
    def apply_pending(self) -> None:
        """Wait for the pending average and apply ``x <- x + (outer(avg(s)) - s)`` (see the module)."""
        pending, self.pending = self.pending, None
        for (_, _, params), flight in zip(self.fragments[pending.fragment], pending.groups):
            shapes = [p.data for p in params]
            snaps = _unflatten_dense_tensors(flight.snapshot, shapes)
            for p, s, avg in zip(params, snaps, _unflatten_dense_tensors(flight.result(), shapes)):
                new = self._outer_step(self._name_of[id(p)], avg)
                p.data.add_(new - s)
        self.optimizer._copy_main_to_model()

    def _pending_state(self) -> dict:
        if self.pending is None:
            return {}
        return {
            "apply_at": self.pending.apply_at,
            "fragment": self.pending.fragment,
            "snapshot": [f.snapshot.to("cpu", copy=True) for f in self.pending.groups],
            "average": [f.result().to("cpu", copy=True) for f in self.pending.groups],
        }

    def _load_pending(self, saved: dict) -> None:
        if not saved:
            return
        device = self.optimizer.main_params[0].device
        flights, fragment = [], int(saved.get("fragment", 0))
        if fragment >= len(self.fragments):
            raise LocalSGDStateError(f"the checkpoint's pending local-SGD correction is of fragment {fragment}, "
                                     f"this run has {len(self.fragments)}")  # fmt: skip
        groups = self.fragments[fragment]
        if len(groups) != len(saved["snapshot"]):
            raise LocalSGDStateError("the checkpoint's pending local-SGD correction does not fit the parameters")
        for (outer, intra, params), snap, avg in zip(groups, saved["snapshot"], saved["average"]):
            if snap.numel() != sum(p.numel() for p in params) or avg.numel() != snap.numel():
                raise LocalSGDStateError("the checkpoint's pending local-SGD correction does not fit the parameters")
            flights.append(_AverageInFlight.done(snap.to(device), avg.to(device)))
        self.pending = _PendingSync(int(saved["apply_at"]), flights, fragment)

    # --- per-rank checkpoint state --------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's replica (model weights, inner optimizer state), the outer state and a pending
        correction (waited for: collective over the node's ranks when hierarchical)."""
        return {
            "pending": self._pending_state(),
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
        self._load_pending(state.get("pending", {}))

    def not_restored(self, info, reason: str) -> None:
        """The checkpoint has no replica for this rank under this layout (``reason``): every replica
        keeps the loaded weights and the outer state restarts from them (a warning).  No communication."""
        self.reset()
        logger.warning(
            f"local SGD: the replicas' own weights and optimizer states are not restored from {info.path} ({reason}, "
            f"now {info.layout}): every replica starts from the checkpoint's weights, the outer state from them"
        )


@dataclass
class _PendingSync:
    """A sync started in the background: applied after the optimizer step of ``apply_at``."""

    apply_at: int
    groups: list  # one _AverageInFlight per entry of the fragment's groups
    fragment: int = 0


def _fragment(groups: List[tuple], f: int, n: int) -> List[tuple]:
    """Fragment ``f`` of ``n`` of ``groups`` (``(outer, intra, [params])``): of each group, the
    parameters whose first element falls in its ``f``-th ``1/n`` of the elements (in order; whole
    parameters, so a fragment can be empty when a group has fewer parameters than fragments)."""
    out = []
    for outer, intra, params in groups:
        total, start, mine = sum(p.numel() for p in params), 0, []
        for p in params:
            if f * total <= start * n < (f + 1) * total:
                mine.append(p)
            start += p.numel()
        if mine:
            out.append((outer, intra, mine))
    return out


class _AverageInFlight:
    """The mean of ``snapshot`` over ``outer``, started at construction (async), read by :meth:`result`.

    With an ``intra`` group of ``L > 1`` ranks (hierarchical: the node's ranks, which hold the same
    replica), rank ``i`` of the node averages only chunk ``i`` of ``L`` across nodes (the async part)
    and :meth:`result` all-gathers the chunks over the node: ``1/L`` of the bytes cross nodes per rank.
    ``snapshot`` is not modified."""

    def __init__(self, snapshot, outer, intra, stats: Optional[comm.CommStats], anchor=None, int8_chunk: int = 0):
        self.stats = stats
        self.snapshot, self.outer, self.intra = snapshot, outer, intra
        self._average: Optional[torch.Tensor] = None
        self.n, self.L = _outer_size(outer), group_size(intra)
        if self.n == 1:
            self._average = snapshot
            return
        self.chunk = -(-snapshot.numel() // self.L)
        i = group_rank(intra) if self.L > 1 else 0
        self.buffer = self._part(snapshot, i)
        suffix = "" if self.L == 1 else "_inter"
        self.anchor, self.int8_chunk = None, int8_chunk
        if isinstance(outer, FaultTolerantOuter):  # torchft: over the quorum's replica groups
            self.anchor, self.work = None, outer.all_reduce_sum(self.buffer)
            return
        if anchor is None:
            kind = f"local_sgd_param_all_reduce{suffix}"
            self.work = comm.all_reduce(self.buffer, group=outer, async_op=True, kind=kind, stats=stats)
            return
        self.anchor = self._part(anchor, i)  # quantized: all-gather the 8-bit pseudo-gradients D = x_0 - s
        no_poison = torch.zeros((), dtype=torch.float32, device=snapshot.device)
        payload, _ = int8.encode(self.anchor - self.buffer, int8_chunk, no_poison)
        self.gathered = torch.empty(self.n, payload.numel(), dtype=torch.uint8, device=snapshot.device)
        kind = f"local_sgd_outer_grad_int8_all_gather{suffix}"
        self.work = comm.all_gather_into_tensor(
            self.gathered.view(-1), payload, group=outer, async_op=True, kind=kind, stats=stats
        )

    def _part(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of ``L`` of ``flat`` (zero-padded; the whole of it, copied, when ``L == 1``)."""
        if self.L == 1:
            return flat.clone()
        part = torch.zeros(self.chunk, dtype=flat.dtype, device=flat.device)
        mine = flat[i * self.chunk : (i + 1) * self.chunk]
        part[: mine.numel()] = mine
        return part

    @classmethod
    def done(cls, snapshot: torch.Tensor, average: torch.Tensor) -> "_AverageInFlight":
        """A finished one (from a checkpoint)."""
        flight = cls.__new__(cls)
        flight.snapshot, flight._average = snapshot, average
        return flight

    def result(self) -> torch.Tensor:
        """The mean (waits for the reduction the first time)."""
        if self._average is None:
            self.work.wait()
            if self.anchor is None:
                self.buffer.div_(self.n)
            else:
                mean = int8.decode(self.gathered, self.chunk, self.int8_chunk).div_(self.n)
                self.buffer = self.anchor - mean
            if self.L == 1:
                self._average = self.buffer
            else:
                padded = torch.empty(self.chunk * self.L, dtype=self.buffer.dtype, device=self.buffer.device)
                comm.all_gather_into_tensor(
                    padded, self.buffer, group=self.intra, kind="local_sgd_param_all_gather_intra", stats=self.stats
                )
                self._average = padded[: self.snapshot.numel()]
        return self._average


def _outer_size(outer) -> int:
    """Replicas in ``outer`` (a process group, None, or a :class:`FaultTolerantOuter`)."""
    return outer.size() if isinstance(outer, FaultTolerantOuter) else group_size(outer)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def build_outer_sync(
    cfg,
    optimizer,
    process_groups: ProcessGroups,
    last_iteration: Optional[int] = None,
    comm_stats: Optional[comm.CommStats] = None,
    replicas: Optional[FaultTolerantOuter] = None,
) -> Optional[OuterSync]:
    """The :class:`OuterSync` ``--local-sgd-interval`` asks for, or None; ``last_iteration``: the
    run's last iteration (default --train-iters; the trainer's count under --train-samples);
    ``replicas``: torchft replica groups' outer group (``--ft-replica-group-id``), or None."""
    p = cfg.parallel
    if not p.local_sgd_interval:
        return None
    return OuterSync(
        optimizer,
        p.local_sgd_interval,
        p.outer_lr,
        p.outer_momentum,
        process_groups=process_groups,
        hierarchical=p.hierarchical_grad_reduce,
        overlap_steps=p.local_sgd_overlap_steps,
        last_iteration=cfg.training.train_iters if last_iteration is None else last_iteration,
        comm_stats=comm_stats,
        warmup_iters=p.local_sgd_warmup_iters,
        fragments=p.local_sgd_fragments,
        outer_grad_int8_chunk=p.outer_grad_int8_chunk,
        replicas=replicas,
    )
