"""Stops on bad numerics: non-finite losses or gradients, fp16 overflows at the minimum loss
scale, spiky losses (Megatron-LM's ``--check-for-nan-in-loss-and-grad``, on by default, and
``--check-for-spiky-loss``).

* ``--check-for-nan-in-loss-and-grad`` (bf16/fp32): at the first iteration whose loss is not
  finite on some rank, or whose gradient norm is not finite, every rank raises
  :class:`NonFiniteLossOrGrad` before anything of that iteration is saved; the message names the
  iteration and the ranks whose own loss (their microbatches, before the data-parallel
  reduction) was not finite.  fp16 keeps Megatron's overflow skips (a non-finite gradient is an
  overflow) and stops with :class:`LossScaleOverflowStop` after
  ``--max-overflows-at-min-loss-scale`` consecutive overflows at the minimum scale.
* ``--check-for-spiky-loss``: lm loss > ``--spiky-loss-factor`` x the mean of the previous
  ``--spiky-loss-window`` finite iterations: a warning, or :class:`SpikyLossStop` with
  ``--spiky-loss-action stop`` (a spike is left out of the running mean).

Communication: :func:`launch_loss_flags` is one all-reduce (SUM) over the world of one float32
per rank (each rank sets its own slot), issued right after the forward-backward pass; its
result is read on the host (:func:`flagged_ranks`) after the optimizer step, whose gradient
norm the step reads on the host already, so no extra synchronization point.  Every rank takes
the same decision: the flags are global, the gradient norm is reduced over every rank that
holds a distinct gradient and the overflow flag likewise.  ``--check-for-spiky-loss`` adds
one device-to-host copy of the reduced losses and their broadcast over the pipeline group per
step (off by default).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.distributed import comm
from megalm.errors import MegalmError
from megalm.log import get_logger
from megalm.pipeline_parallel.reporting import losses_to_floats

logger = get_logger(__name__)


class NumericsStop(MegalmError):
    """Training stopped on bad numerics; nothing of the offending iteration was saved."""


class NonFiniteLossOrGrad(NumericsStop):
    """A non-finite loss or gradient norm under ``--check-for-nan-in-loss-and-grad``."""


class LossScaleOverflowStop(NumericsStop):
    """fp16: too many consecutive overflows at the minimum loss scale."""


class SpikyLossStop(NumericsStop):
    """``--check-for-spiky-loss --spiky-loss-action stop``: a loss spike."""


# --- per-rank loss flags ---------------------------------------------------------------------


def launch_loss_flags(
    reported: List[Dict],
    local_grads_nonfinite: Optional[torch.Tensor] = None,
    comm_stats: Optional[comm.CommStats] = None,
) -> torch.Tensor:
    """``[2, world]`` float32: row 0 is 1 where that rank's own reported values (its microbatches on the
    last pipeline stage, before any reduction) hold a non-finite number, row 1 where its own gradients
    did before the data-parallel reduction (``local_grads_nonfinite``, from DDP); all-reduced (SUM)
    over the world here (counted in ``comm_stats`` unless None), left on the device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = get_device()
    flags = torch.zeros(2, world, dtype=torch.float32, device=device)
    values = [
        torch.as_tensor(v).to(device=device, dtype=torch.float64).reshape(-1) for r in reported for v in r.values()
    ]
    if values:
        flags[0, rank] = (~torch.isfinite(torch.cat(values))).any().to(torch.float32)
    if local_grads_nonfinite is not None:
        flags[1, rank] = local_grads_nonfinite.to(device=device, dtype=torch.float32)
    if world > 1:
        comm.all_reduce(flags, group=dist.group.WORLD, kind="nan_check", stats=comm_stats)
    return flags


def flagged_ranks(flags: Optional[torch.Tensor]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Host read of :func:`launch_loss_flags`'s result: (ranks with a non-finite loss, ranks whose own
    gradients were non-finite)."""
    if flags is None:
        return (), ()
    rows = flags.tolist()
    return tuple(r for r, f in enumerate(rows[0]) if f > 0), tuple(r for r, f in enumerate(rows[1]) if f > 0)


# --- the checks after a step -------------------------------------------------------------------


def _ranks(ranks: Tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def nonfinite_message(
    iteration: int, loss_ranks: Tuple[int, ...], grad_norm: Optional[float], grad_ranks: Tuple[int, ...] = ()
) -> Optional[str]:
    """The stop message of a step, or None when its loss and gradient norm are finite."""
    norm_bad = grad_norm is not None and not math.isfinite(grad_norm)
    if not loss_ranks and not norm_bad:
        return None
    if loss_ranks:
        what = f"non-finite loss at iteration {iteration} on {_ranks(loss_ranks)}"
        if norm_bad:
            what += f" (gradient norm {grad_norm})"
    elif grad_ranks:
        what = (
            f"non-finite gradient norm ({grad_norm}) at iteration {iteration}; the loss was finite on every rank, "
            f"the gradients were not finite on {_ranks(grad_ranks)} before the data-parallel reduction"
        )
    else:
        what = (
            f"non-finite gradient norm ({grad_norm}) at iteration {iteration}; the loss was finite on every "
            f"rank and every rank's gradients before the data-parallel reduction (it appeared after them)"
        )
    return what + (
        "; stopped without saving this iteration (--check-for-nan-in-loss-and-grad; "
        "--no-check-for-nan-in-loss-and-grad skips such iterations instead)"
    )


class SpikyLossDetector:
    """Running mean of the last ``window`` finite lm losses; a loss above ``factor`` x that mean
    (once there is one) is a spike and stays out of the mean."""

    def __init__(self, factor: float, window: int):
        self.factor = float(factor)
        self.history: deque = deque(maxlen=int(window))

    def spike(self, iteration: int, loss: float) -> Optional[str]:
        """A message when ``loss`` is a spike, else None (the loss joins the mean when finite)."""
        if self.history:
            mean = sum(self.history) / len(self.history)
            if loss > self.factor * mean:
                return (
                    f"spiky loss at iteration {iteration}: lm loss {loss:.6E} > {self.factor:g} x the running "
                    f"mean {mean:.6E} of the previous {len(self.history)} iteration(s) (--check-for-spiky-loss)"
                )
        if math.isfinite(loss):
            self.history.append(loss)
        return None


class NumericsChecks:
    """The checks of ``--check-for-nan-in-loss-and-grad``, ``--max-overflows-at-min-loss-scale``
    and ``--check-for-spiky-loss`` after each step; ``grad_scaler``: the optimizer's (fp16) or None."""

    def __init__(self, training_cfg, grad_scaler, groups=None):
        self.t = training_cfg
        self.grad_scaler = grad_scaler
        self.groups = groups
        self.spiky = (
            SpikyLossDetector(training_cfg.spiky_loss_factor, training_cfg.spiky_loss_window)
            if training_cfg.check_for_spiky_loss
            else None
        )

    def check(self, iteration: int, result) -> None:
        """Raise a :class:`NumericsStop` (the same on every rank) or log a spike warning;
        ``result``: the step's :class:`megalm.training.step.StepResult`.  Collective under
        ``--check-for-spiky-loss`` (every rank calls it)."""
        if self.grad_scaler is None and self.t.check_for_nan_in_loss_and_grad:
            message = nonfinite_message(
                iteration, result.nonfinite_loss_ranks, result.grad_norm, result.nonfinite_grad_ranks
            )
            if message:
                raise NonFiniteLossOrGrad(message)
        self._check_overflows(iteration)
        if self.spiky is not None and not result.skipped:
            self._check_spike(iteration, result)

    def _check_overflows(self, iteration: int) -> None:
        k, scaler = self.t.max_overflows_at_min_loss_scale, self.grad_scaler
        if scaler is None or k == 0 or scaler.overflows_at_min_scale < k:
            return
        raise LossScaleOverflowStop(
            f"fp16: the last {scaler.overflows_at_min_scale} iterations (through iteration {iteration}) overflowed "
            f"at the minimum loss scale {scaler.scale:g} and were skipped: the gradients are not finite at any "
            f"scale; iteration {iteration} not saved (--max-overflows-at-min-loss-scale {k}; 0 never stops)"
        )

    def _check_spike(self, iteration: int, result) -> None:
        loss = losses_to_floats(result.losses, self.groups).get("lm loss")
        message = self.spiky.spike(iteration, loss) if loss is not None else None
        if message is None:
            return
        if self.t.spiky_loss_action == "stop":
            raise SpikyLossStop(message + "; stopped without saving this iteration (--spiky-loss-action stop)")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if (dist.get_rank() if dist.is_initialized() else 0) == world - 1:
            logger.warning(message)
