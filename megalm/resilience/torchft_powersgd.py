"""``--grad-compression powersgd`` across torchft replica groups: the cross-group gradient average as
megalm's PowerSGD (:class:`megalm.distributed.compression.PowerSGD`, the same stages), its two
payloads SUM-all-reduced over the groups of the quorum by torchft's manager.

PowerSGD's collectives are sums by design (``P = sum_k M_k Q``, then ``sum_k M_k^T P^``), so unlike
int8 nothing has to be rescaled to add up.  One step, over the ``n`` groups of the quorum, of this
rank's reduced gradients ``g`` (every piece of :func:`~megalm.resilience.torchft_replicas.gradient_pieces`
concatenated, with the matrices of each piece; one P and one Q all-reduce per step in all):

1. ``a = g + n r`` (``r``: this rank's residual, kept as its share of the average, as for int8, so
   that it weighs the same under another quorum);
2. PowerSGD's stages on ``a`` (``M_k = a``): ``sent`` is what this rank's rank-``r`` encoding
   decodes to, ``out = sum_k sent_k``;
3. ``g <- out / n`` and ``r <- (a - sent) / n``; ``Q <- sum_k Q_k`` (the warm start of the next step).

With ``n = 2`` this is megalm's PowerSGD over 2 data-parallel ranks whose gradients are pre-scaled
by ``1/2``: every quantity is twice the data-parallel one (a power of two: the same bits), the
orthogonalized ``P^`` is the same.  A group alone in its quorum sends nothing: ``g <- a``, ``r <- 0``,
``Q`` unchanged.  A NaN/inf in any group's ``a`` is added to the P payload (PowerSGD's poison), so
every group's result is non-finite and the residuals and ``Q`` stay as they were.

The new residual and ``Q`` are kept aside until :meth:`CrossGroupPowerSGD.commit` (a step the
groups did not commit, because one died in it, sent nothing and is redone by the survivors).

**The warm start is the same on every group.**  It starts from PowerSGD's seeded draw (the same on
every group) and is then the result of an all-reduce (the same on every group of the quorum),
committed with the step.  A group that rejoins receives it from the healthy peer with the weights
(:meth:`peer_state` / :meth:`rejoin`), so its ``P`` adds up with the others' from its first step.
(Even a mismatched ``Q`` would not break the average, only its quality for one step: ``P^`` is
orthogonalized from the all-reduced sum, the same on every group.)  **A rejoining group's residual
is zero**: a peer's residual is what *that* peer still owes; copying it would send it twice.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from megalm.distributed.compression.powersgd import PowerSGD
from megalm.distributed.compression.segments import Segment
from megalm.log import get_logger

logger = get_logger(__name__)

KEY = "ft"  # the one job per step: its warm starts are PowerSGD's "ft/<matrix index>"


class _CrossGroupJob:
    """The fields :meth:`PowerSGD.stages` reads and writes (as
    :class:`~megalm.distributed.compression.CompressionJob`), its collectives SUM-all-reduced over the
    quorum by ``all_reduce(tensor, op)``."""

    def __init__(self, a: torch.Tensor, matrices: List[Segment], all_reduce):
        self.key, self.a, self.matrices = KEY, a, matrices
        self.numel, self.device = a.numel(), a.device
        self.poison = torch.where(torch.isfinite(a).all(), 0.0, float("nan")).to(a.device)
        self.sent: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self._all_reduce, self._sum = all_reduce, dist.ReduceOp.SUM

    def all_reduce(self, tensor: torch.Tensor, what: str):
        return self._all_reduce(tensor, self._sum)


class CrossGroupPowerSGD:
    """Error-feedback PowerSGD average of a rank's gradients across the replica groups (see the module).

    ``rank``: ``--powersgd-rank``."""

    wants_matrices = True  # average() is given each tensor's matrices

    def __init__(self, rank: int):
        self.method = PowerSGD(int(rank))
        self.signature = f"powersgd rank {int(rank)} across replica groups"
        self.residual: Optional[torch.Tensor] = None
        self.qs: dict = {}  # the committed warm starts (self.method.qs during a step)
        self._next = None  # (residual, qs) of the step in flight, until commit()

    def average(
        self,
        all_reduce,
        n: int,
        tensors: Sequence[torch.Tensor],
        matrices: Optional[Sequence[List[Segment]]] = None,
    ) -> None:
        """Replace ``tensors`` (this rank's reduced gradients) by their compressed mean over the ``n``
        groups of the quorum; ``matrices[i]``: the matrices of ``tensors[i]`` (flat coordinates; None:
        a 2-D tensor is one matrix, others are sent uncompressed); ``all_reduce(tensor, op)`` runs over
        the groups (torchft's manager; a failed collective is not raised here: the vote says no)."""
        self._next = None
        a = torch.cat([t.detach().reshape(-1).float() for t in tensors])  # a copy
        # a step redone starts from the committed warm starts (on the gradients' device: a peer's or a
        # checkpoint's arrive on the CPU)
        self.method.qs = {k: v.to(a.device) for k, v in self.qs.items()}
        if self.residual is not None and self.residual.numel() == a.numel():
            a += self.residual.to(a.device) * n
        if n == 1:  # a group alone sends nothing: its gradient and what it still owed, exactly
            self._next = (torch.zeros_like(a), self.qs)
            _copy_flat(a, tensors)
            return
        job = _CrossGroupJob(a, _concatenated(tensors, matrices), all_reduce)
        for stage in self.method.stages(job):
            work = stage()
            if work is not None:
                work.wait()
        if not torch.isfinite(job.out).all():  # some group's gradients were not finite: NaN everywhere
            for t in tensors:
                t.fill_(float("nan"))
            return
        self._next = ((a - job.sent) / n, self.method.qs)
        _copy_flat(job.out / n, tensors)

    def commit(self) -> None:
        """The step of the last :meth:`average` was committed: its residual and warm starts become the ones."""
        if self._next is not None:
            (self.residual, self.qs), self._next = self._next, None

    def reset(self) -> None:
        """A zero residual (the warm starts are kept)."""
        self.residual = self._next = None

    # --- what a rejoining group receives from its healthy peer --------------------------------
    def peer_state(self) -> dict:
        return {"signature": self.signature, "qs": {k: v.detach().to("cpu", copy=True) for k, v in self.qs.items()}}

    def rejoin(self, received: dict) -> None:
        """A group recovered from a peer: the peer's warm starts, a zero residual."""
        self.reset()
        if received.get("signature") == self.signature:
            self.qs = dict(received.get("qs", {}))
        else:  # never with a matching layout (the peer's flags are this group's): its own seeded draw
            logger.warning(f"torchft powersgd: the peer's warm starts are {received.get('signature')!r}: not used")
            self.qs = {}

    # --- per-rank checkpoint state ("ft_grad_compression") ------------------------------------
    def state_dict(self) -> dict:
        residual = None if self.residual is None else self.residual.detach().to("cpu", copy=True)
        return {"signature": self.signature, "residual": residual, **self.peer_state()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("signature") != self.signature:
            logger.warning(
                f"torchft powersgd state not restored: saved with {state.get('signature')!r}, this run is "
                f"{self.signature!r}; the residuals restart from zero, the warm starts from the seeded draw"
            )
            self.residual, self.qs = None, {}
            return
        self.residual, self.qs = state.get("residual"), dict(state.get("qs", {}))

    def not_restored(self, info, reason: str) -> None:
        self.residual, self.qs = None, {}
        logger.warning(f"torchft powersgd state not restored from {info.path} ({reason}): it restarts from zero")


def _concatenated(tensors: Sequence[torch.Tensor], matrices) -> List[Segment]:
    """The matrices of every tensor, in the coordinates of their concatenation."""
    out, offset = [], 0
    for i, t in enumerate(tensors):
        if matrices is None or matrices[i] is None:
            mats = [Segment(0, t.numel(), tuple(t.shape))] if t.dim() == 2 else []
        else:
            mats = matrices[i]
        out.extend(Segment(s.start + offset, s.end + offset, s.shape) for s in mats)
        offset += t.numel()
    return out


def _copy_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """``tensors`` <- the consecutive pieces of ``flat`` (torch's unflatten, as local SGD uses it)."""
    for t, piece in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(piece)
