"""``--grad-compression int8`` across torchft replica groups: the cross-group gradient average in
8 bits, with error feedback (:mod:`megalm.resilience.torchft_replicas`).

Across replica groups the slow link is between the groups, so that is where the gradients are
compressed; inside a group the reduction stays exact (as ``--hierarchical-grad-reduce`` compresses
only the inter-node leg).  torchft's fault-tolerant collective is an all-reduce, so the encoding
must add up in flight: every group of the quorum quantizes with the *same* per-chunk scale, and its
codes are small enough that their sum over the most groups fits in int8.

One step, over the ``n`` groups of the quorum, of this rank's reduced gradients (concatenated into
``g``, ``N`` elements, chunks of ``C = --int8-chunk-size``), with ``L = floor(127 / G)`` levels for
``G = --ft-num-replica-groups``:

1. ``a = g + n r`` (``r``: this rank's residual, what it did not send yet, kept as its share of the
   average, so that it weighs the same when the quorum's size changes);
2. the per-chunk maximum ``m_c = max |a_c|`` is all-reduced with MAX (``4 ceil(N/C)`` bytes, plus one
   flag that is set when any group's ``a`` holds a NaN/inf: then every group's result is NaN and the
   residuals stay as they were, so the loss scaler / NaN check sees it on every group);
3. ``s_c = m_c / L``, ``q = round(a / s_c)`` in ``[-L, L]`` (nearest, or stochastic with
   ``--int8-rounding stochastic``), one int8 code per element, SUM-all-reduced: ``N`` bytes instead of
   ``4 N`` (``|sum_k q_k| <= n L <= 127``);
4. ``g <- s sum_k q_k / n`` and ``r <- (a - s q) / n``.

A group alone in its quorum (``n = 1``) communicates nothing: ``g <- a``, ``r <- 0``.

So over the steps, what the groups averaged plus the sum of their residuals is the sum of the
exact averages: nothing is lost, only delayed.  With 2 groups
each code has 63 levels each side, with 8 groups 15: the more groups, the coarser each group's
codes (error feedback carries what they miss to the next steps).

A group that dies takes its residual with it (what it had not sent yet is lost).  A group that
rejoins starts from a zero residual: a peer's residual is what *that* peer still owes, and
copying it would send it twice.  The residual is a per-rank checkpoint state
(``ft_grad_compression/rank_*.pt``), restored under the same layout and settings.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from megalm.distributed.compression.int8 import round_to_integers
from megalm.log import get_logger

logger = get_logger(__name__)

AllReduce = Callable[[torch.Tensor, "dist.ReduceOp"], object]  # (tensor, op) -> a work with wait()


def copy_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """``tensors`` <- the consecutive pieces of ``flat`` (their concatenation, in ``flat``'s dtype)."""
    for t, piece in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(piece)


class CrossGroupInt8:
    """Error-feedback int8 average of a rank's gradients across the replica groups (see the module).

    ``chunk``: elements per scale; ``max_groups``: ``--ft-num-replica-groups`` (the levels are
    ``127 // max_groups``); ``seed``: the stochastic rounding's generator, None for nearest rounding."""

    def __init__(self, chunk: int, max_groups: int, seed: Optional[int] = None, device=None):
        self.chunk = int(chunk)
        self.levels = 127 // int(max_groups)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=device or "cpu")
            self.generator.manual_seed(int(seed))
        self.signature = f"int8 across {max_groups} replica groups, chunk {self.chunk}, " + (
            "stochastic" if seed is not None else "nearest"
        )
        self.residual: Optional[torch.Tensor] = None
        self._next_residual: Optional[torch.Tensor] = None  # of the step in flight, until commit()

    def average(self, all_reduce: AllReduce, n: int, tensors: Sequence[torch.Tensor]) -> None:
        """Replace ``tensors`` (this rank's reduced gradients) by their compressed mean over the ``n``
        groups of the quorum; ``all_reduce(tensor, op)`` runs over them (torchft's manager).  A
        failed collective is not raised here: the groups' vote says no and the step is redone.  The
        new residual is kept aside until :meth:`commit` (a step not committed sent nothing)."""
        self._next_residual = None
        a = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        if self.residual is not None and self.residual.numel() == a.numel():
            a += self.residual.to(a.device) * n  # its share of the average: the same under another quorum
        if n == 1:  # a group alone sends nothing: its gradient and what it still owed, exactly
            self._next_residual = torch.zeros_like(a)
            copy_flat(a, tensors)
            return
        numel, c = a.numel(), self.chunk
        blocks = torch.nn.functional.pad(a, (0, -numel % c)).view(-1, c)
        finite = torch.isfinite(blocks)
        header = torch.cat([torch.where(finite, blocks, 0.0).abs().amax(1), (~finite.all()).float().reshape(1)])
        all_reduce(header, dist.ReduceOp.MAX).wait()
        if header[-1] > 0:  # a NaN/inf in some group's gradients: every group's result is non-finite
            for t in tensors:
                t.fill_(float("nan"))
            return
        scale = header[:-1] / self.levels
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = round_to_integers(blocks * inverse[:, None], self.generator, self.levels)
        codes = q.reshape(-1)[:numel].to(torch.int8)  # the padding is not sent
        all_reduce(codes, dist.ReduceOp.SUM).wait()
        self._next_residual = (blocks - q * scale[:, None]).reshape(-1)[:numel] / n
        copy_flat(codes.float() * scale.repeat_interleave(c)[:numel] / n, tensors)

    def commit(self) -> None:
        """The step the last :meth:`average` belongs to was committed: its residual becomes the one."""
        if self._next_residual is not None:
            self.residual, self._next_residual = self._next_residual, None

    def reset(self) -> None:
        """A zero residual (a group that rejoins from a peer)."""
        self.residual = self._next_residual = None

    def peer_state(self) -> dict:
        """What a rejoining group receives from its peer: nothing (no shared state)."""
        return {}

    def rejoin(self, received: dict) -> None:
        """A group recovered from a peer: a zero residual."""
        self.reset()

    # --- per-rank checkpoint state ("ft_grad_compression") ------------------------------------
    def state_dict(self) -> dict:
        residual = None if self.residual is None else self.residual.detach().to("cpu", copy=True)
        return {"signature": self.signature, "residual": residual}

    def load_state_dict(self, state: dict) -> None:
        if state.get("signature") != self.signature:
            logger.warning(
                f"torchft int8 residuals not restored: saved with {state.get('signature')!r}, this run is "
                f"{self.signature!r}; they restart from zero"
            )
            self.residual = None
            return
        self.residual = state.get("residual")

    def not_restored(self, info, reason: str) -> None:
        self.residual = None
        logger.warning(f"torchft int8 residuals not restored from {info.path} ({reason}): they restart from zero")


def build_cross_group_compressor(cfg, rank: int, device=None):
    """``--grad-compression int8`` / ``powersgd`` with ``--ft-replica-group-id``: this rank's
    :class:`CrossGroupInt8` (``rank``: its rank in its group, which with the group id seeds stochastic
    rounding) or :class:`~megalm.resilience.torchft_powersgd.CrossGroupPowerSGD`, else None."""
    p = cfg.parallel
    if p.ft_replica_group_id is None:
        return None
    if p.grad_compression == "powersgd":
        from megalm.resilience.torchft_powersgd import CrossGroupPowerSGD

        return CrossGroupPowerSGD(p.powersgd_rank)
    if p.grad_compression != "int8":
        return None
    seed = None
    if p.int8_rounding == "stochastic":
        seed = 1_000_003 + rank + 100_003 * p.ft_replica_group_id
    return CrossGroupInt8(p.int8_chunk_size, p.ft_num_replica_groups, seed, device)
