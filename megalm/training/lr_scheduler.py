"""Learning-rate schedule (Megatron's OptimizerParamScheduler), counted in samples.

With ``n`` = samples consumed so far (``num_steps``), ``W`` warm-up steps, ``D`` decay steps,
``lr0`` = ``--lr-warmup-init``, ``M`` = ``--lr``, ``m`` = ``--min-lr``:

* warm-up, ``W > 0`` and ``n <= W``:  ``lr0 + (M - lr0) n / W``
* ``constant``:                       ``M``
* ``n > D``:                          ``m``
* ``inverse-square-root``:            ``max(m, M sqrt(max(W, 1)) / sqrt(max(n, 1)))``
* otherwise, with ``r = (n - W) / (D - W)``: ``m + c (M - m)`` where ``c`` is
  ``linear`` ``1 - r``; ``cosine`` ``(1 + cos(pi r)) / 2``; ``WSD``: 1 until ``D - S`` (``S`` =
  WSD decay steps), then with ``q = (n - (D - S)) / S``: ``exponential`` ``2 * 0.5**q - 1``,
  ``linear`` ``1 - q``, ``cosine`` ``(1 + cos(pi q)) / 2``.

``--lr-batch-scaling`` (megalm's; the batch changes under ``--rampup-batch-size`` or
``--step-batch-size-schedule``): the schedule above is for the global batch size ``G`` (the largest
batch); the trainer calls ``set_global_batch_size(b)`` before each iteration's update, and every value
is multiplied by ``b / G`` (``linear``) or ``sqrt(b / G)`` (``sqrt``) until the next call (``none``: 1).
:meth:`get_lr` includes the factor, so the logged lr is the scaled one.

``from_config`` converts iterations to samples as Megatron does (x global batch size);
``--lr-warmup-fraction`` is a fraction of the decay steps.  The trainer calls
``step(increment=global_batch_size)`` after every *successful* optimizer step.  Each param
group's lr is the schedule's value times its ``lr_mult`` (default 1).

Weight decay (Megatron's ``--weight-decay-incr-style``) runs over ``I`` = the whole training in
samples, from ``s`` = ``--start-weight-decay`` to ``e`` = ``--end-weight-decay``: with ``r = n / I``,
``linear`` ``s + r (e - s)``, ``cosine`` ``s + (1 + cos(pi (1 - r))) / 2 (e - s)``, ``e`` once ``n > I``;
``constant`` ``--weight-decay``.  A group with ``wd_mult`` gets ``wd_mult`` x that value.
"""

from __future__ import annotations

import math
from typing import Optional

from megalm.config.sections import ConfigError
from megalm.config.validation import lr_schedule_samples

BATCH_SCALINGS = ("none", "linear", "sqrt")


def batch_lr_factor(batch: int, reference: int, rule: str) -> float:
    """``--lr-batch-scaling``: ``batch / reference`` (linear), its square root (sqrt), or 1 (none)."""
    if rule == "linear":
        return batch / reference
    if rule == "sqrt":
        return math.sqrt(batch / reference)
    if rule == "none":
        return 1.0
    raise ConfigError(f"unknown --lr-batch-scaling {rule!r} (choose {', '.join(BATCH_SCALINGS)})")


class OptimizerParamScheduler:
    """The schedule of :mod:`this module <megalm.training.lr_scheduler>`.  Its settings are checked
    once, with the rest of the configuration, by :func:`megalm.config.validate_config`
    (``_validate_lr_schedule``); build it with :meth:`from_config` from a validated config."""

    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: float,
        lr_decay_style: str,
        wsd_decay_steps: Optional[float] = None,
        lr_wsd_decay_style: str = "exponential",
        override_opt_param_scheduler: bool = False,
        use_checkpoint_opt_param_scheduler: bool = False,
        start_wd: Optional[float] = None,
        end_wd: Optional[float] = None,
        wd_incr_steps: float = 0,
        wd_incr_style: str = "constant",
        lr_batch_scaling: str = "none",
        reference_batch_size: Optional[int] = None,
    ):
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.lr_batch_scaling, self.reference_batch_size = lr_batch_scaling, reference_batch_size
        batch_lr_factor(1, 1, lr_batch_scaling)  # checks the rule
        self.batch_factor = 1.0
        self.num_steps = 0
        self.step(0)

    @classmethod
    def from_config(cls, cfg, optimizer) -> "OptimizerParamScheduler":
        """Build from a validated :class:`megalm.config.MegalmConfig` (global batch size set):
        lengths in samples from :func:`megalm.config.validation.lr_schedule_samples`."""
        t = cfg.training
        if t.global_batch_size is None:
            raise ConfigError("global batch size is unknown: validate the config with the world size first")
        if t.train_iters is None and t.train_samples is None:
            if not t.skip_train:
                raise ConfigError("the learning-rate schedule needs --train-iters or --train-samples")
            # evaluation only: the schedule is never stepped
            return cls(
                optimizer,
                init_lr=t.lr,
                max_lr=t.lr,
                min_lr=t.min_lr,
                lr_warmup_steps=0,
                lr_decay_steps=1,
                lr_decay_style="constant",
            )
        warmup, decay, wsd = lr_schedule_samples(t)
        return cls(
            optimizer,
            init_lr=t.lr_warmup_init,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=decay,
            lr_decay_style=t.lr_decay_style,
            wsd_decay_steps=wsd,
            lr_wsd_decay_style=t.lr_wsd_decay_style,
            override_opt_param_scheduler=t.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
            start_wd=t.start_weight_decay if t.start_weight_decay is not None else t.weight_decay,
            end_wd=t.end_weight_decay if t.end_weight_decay is not None else t.weight_decay,
            wd_incr_steps=t.train_iters * t.global_batch_size if t.train_iters is not None else t.train_samples,
            wd_incr_style=t.weight_decay_incr_style,
            lr_batch_scaling=t.lr_batch_scaling,
            reference_batch_size=t.global_batch_size,
        )

    # --- the schedule ----------------------------------------------------------------------
    def get_lr(self, param_group: Optional[dict] = None) -> float:
        """Learning rate at ``num_steps`` for the last batch set (before the group's ``lr_mult``)."""
        return self._scheduled_lr(param_group) * self.batch_factor

    def _scheduled_lr(self, param_group: Optional[dict] = None) -> float:
        """The schedule's value at ``num_steps`` (for the global batch size)."""
        max_lr = (param_group or {}).get("max_lr", self.max_lr)
        min_lr = (param_group or {}).get("min_lr", self.min_lr)
        n, warmup, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warmup)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
        ratio = float(n - warmup) / float(decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> Optional[float]:
        """Weight decay at ``num_steps`` (None: no schedule was given; groups keep theirs)."""
        if self.start_wd is None or self.end_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _wsd_coeff(self, n: float) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        q = float(n - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - q
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * q) + 1.0)
        return 2.0 * math.pow(0.5, q) - 1.0

    def set_global_batch_size(self, batch: int) -> None:
        """The batch of the coming update: ``--lr-batch-scaling``'s factor, applied to every param group."""
        if self.lr_batch_scaling == "none":
            return
        self.batch_factor = batch_lr_factor(batch, self.reference_batch_size, self.lr_batch_scaling)
        self.step(0)

    def step(self, increment: int) -> float:
        """Advance by ``increment`` samples and set every param group's lr; returns the base lr."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            if wd is not None and "wd_mult" in group:
                group["weight_decay"] = wd * group["wd_mult"]
        return self.get_lr()

    # --- checkpointing -------------------------------------------------------------------
    _CHECKED = (
        "max_lr",
        "min_lr",
        "init_lr",
        "lr_warmup_steps",
        "lr_decay_steps",
        "lr_decay_style",
        "wsd_decay_steps",
        "lr_wsd_decay_style",
        "start_wd",
        "end_wd",
        "wd_incr_steps",
        "wd_incr_style",
    )

    def state_dict(self) -> dict:
        """JSON-serializable: the schedule's settings and ``num_steps``."""
        return {"num_steps": self.num_steps, **{k: getattr(self, k) for k in self._CHECKED}}

    def _check_and_set(self, name: str, cls_value, sd_value):
        if self.override_opt_param_scheduler or sd_value is None:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ConfigError(
                f"OptimizerParamScheduler: {name} is {cls_value} on the command line but {sd_value} in the "
                f"checkpoint; pass --override-opt-param-scheduler to use the command line or "
                f"--use-checkpoint-opt-param-scheduler to use the checkpoint"
            )
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``num_steps`` (and, per the two flags, the settings); re-applies the lr."""
        for name in self._CHECKED:
            setattr(self, name, self._check_and_set(name, getattr(self, name), state_dict.get(name)))
        self.num_steps = 0
        self.step(state_dict["num_steps"])
