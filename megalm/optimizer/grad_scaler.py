"""Loss scalers for fp16 training (Megatron's semantics).

The scaler is the one owner of the loss scale.  In training, :func:`megalm.training.step.train_step`
reads ``scale`` once per step and hands it to the schedule, whose
:func:`megalm.pipeline_parallel.steps.backward_step` multiplies the last stage's loss by it (the
only such multiplication), and to the MoE auxiliary losses; the optimizer divides the gradients by
it and reports whether any gradient overflowed (``found_inf``) to :meth:`update`.

:class:`DynamicGradScaler` (Megatron):

* overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one; when it
  reaches 0 the scale is multiplied by ``backoff_factor`` (floored at ``min_scale``) — so with
  ``hysteresis = 2`` the second overflow (consecutive or not, since the last growth) halves;
  further overflows keep halving, one per overflow, until a growth resets the tracker.
* no overflow: the growth tracker increments; after ``growth_interval`` clean iterations in a
  row the scale is multiplied by ``growth_factor`` and the hysteresis tracker is restored.

Every scaler counts :attr:`GradScaler.overflows_at_min_scale`: consecutive overflowing steps
whose scale was already the minimum (``min_scale``; the constant scale of
:class:`ConstantGradScaler`), reset by a clean step.  The trainer stops after
``--max-overflows-at-min-loss-scale`` of them (:mod:`megalm.training.loss_checks`): at the
minimum no back-off can help.  The count is not checkpointed (a resumed run starts at 0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from megalm.errors import MegalmError


class LossScaleError(MegalmError, ValueError):
    """Loss-scaling settings that cannot work (--loss-scale, --initial-loss-scale, --min-loss-scale,
    --loss-scale-window, --hysteresis)."""


class GradScaler(ABC):
    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise LossScaleError(f"loss scale must be positive, got {initial_scale}")
        self._scale = float(initial_scale)
        self.overflows_at_min_scale = 0

    def _count_overflow(self, found_inf: bool, at_min: bool) -> None:
        """Before :meth:`update` changes the scale: ``at_min`` says this step used the minimum scale."""
        self.overflows_at_min_scale = self.overflows_at_min_scale + 1 if found_inf and at_min else 0

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    @abstractmethod
    def update(self, found_inf: bool) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None: ...


class ConstantGradScaler(GradScaler):
    """A fixed scale (``--loss-scale``); overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        self._count_overflow(found_inf, at_min=True)

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])


class DynamicGradScaler(GradScaler):
    """Grow after ``growth_interval`` clean steps, back off after ``hysteresis`` overflows."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise LossScaleError(f"min_scale must be in (0, initial_scale={initial_scale}], got {min_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise LossScaleError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, {backoff_factor}"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise LossScaleError(f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        self._count_overflow(found_inf, at_min=self._scale <= self.min_scale)
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_grad_scaler(training_cfg):
    """fp16: constant with ``--loss-scale``, else dynamic; bf16/fp32: a constant scale only
    if ``--loss-scale`` is given, else None (no scaling)."""
    t = training_cfg
    if t.loss_scale is not None:
        return ConstantGradScaler(t.loss_scale)
    if t.fp16:
        return DynamicGradScaler(
            initial_scale=t.initial_loss_scale,
            min_scale=t.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=t.loss_scale_window,
            hysteresis=t.hysteresis,
        )
    return None
