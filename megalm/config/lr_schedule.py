"""The learning-rate and weight-decay schedule's flags (fields of
:class:`~megalm.config.training.TrainingConfig`): their own checks, and once the global batch
size is known, the schedule's lengths in samples (what the scheduler is built from)."""

from __future__ import annotations

from typing import Optional, Tuple

from megalm.config.fields import check

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine")


def _validate_weight_decay_schedule(t) -> None:
    """As Megatron: constant takes --weight-decay and neither start nor end; linear/cosine need both
    (and then set the starting --weight-decay)."""
    if t.weight_decay_incr_style == "constant":
        check(
            t.start_weight_decay is None and t.end_weight_decay is None,
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine",
        )
        return
    check(
        t.start_weight_decay is not None and t.end_weight_decay is not None,
        f"--weight-decay-incr-style {t.weight_decay_incr_style} needs --start-weight-decay and --end-weight-decay",
    )
    check(t.start_weight_decay >= 0 and t.end_weight_decay >= 0, "weight decay must be >= 0")
    t.weight_decay = t.start_weight_decay


def validate_lr_schedule_flags(t) -> None:
    """The learning-rate schedule's flags against each other."""
    _validate_weight_decay_schedule(t)
    if t.decoupled_lr is not None:
        check(t.decoupled_lr > 0, "--decoupled-lr must be positive")
        check(
            t.decoupled_min_lr is None or 0 <= t.decoupled_min_lr <= t.decoupled_lr,
            "--decoupled-min-lr must be in [0, --decoupled-lr]",
        )
        check(t.min_lr <= t.decoupled_lr, "--min-lr is larger than --decoupled-lr: give --decoupled-min-lr")
    else:
        check(t.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr")
    check(t.lr_decay_style in DECAY_STYLES, f"--lr-decay-style {t.lr_decay_style!r} is not one of {DECAY_STYLES}")
    check(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is larger than --lr {t.lr}")
    check(t.min_lr >= 0.0, f"--min-lr must be >= 0, got {t.min_lr}")
    check(t.lr_warmup_init <= t.lr, f"--lr-warmup-init {t.lr_warmup_init} is larger than --lr {t.lr}")
    check(
        t.lr_warmup_fraction is None or (t.lr_warmup_iters == 0 and t.lr_warmup_samples is None),
        "give only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction",
    )
    check(
        t.lr_warmup_fraction is None or 0.0 <= t.lr_warmup_fraction < 1.0,
        f"--lr-warmup-fraction {t.lr_warmup_fraction} must be in [0, 1)",
    )
    if t.train_iters is not None and t.lr_decay_style != "constant" and t.lr_warmup_fraction is None:
        decay = t.lr_decay_iters or t.train_iters
        check(
            t.lr_warmup_iters < decay,
            f"--lr-warmup-iters {t.lr_warmup_iters} must be shorter than the decay "
            f"({decay} iterations: --lr-decay-iters or --train-iters)",
        )
    check(
        not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
        "give only one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler",
    )
    for name, value in (
        ("lr_decay_samples", t.lr_decay_samples),
        ("lr_warmup_samples", t.lr_warmup_samples),
        ("lr_wsd_decay_samples", t.lr_wsd_decay_samples),
    ):
        check(
            value is None or t.train_samples is not None,
            f"--{name.replace('_', '-')} needs --train-samples (with --train-iters use the *-iters flags)",
        )
    if t.lr_decay_style == "WSD":
        check(
            t.lr_wsd_decay_style in WSD_DECAY_STYLES,
            f"--lr-wsd-decay-style {t.lr_wsd_decay_style!r} is not one of {WSD_DECAY_STYLES}",
        )
        check(
            t.lr_wsd_decay_iters or t.lr_wsd_decay_samples,
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)",
        )


def validate_lr_schedule_lengths(t) -> None:
    """With the global batch size known (set by the step schedule or the world size): warm-up, decay
    and WSD decay in samples."""
    if t.global_batch_size is None or (t.train_iters is None and t.train_samples is None):
        return
    warmup, decay, wsd = lr_schedule_samples(t)
    check(decay > 0, f"the learning-rate decay must be positive, got {decay} samples")
    check(
        t.lr_decay_style == "constant" or warmup < decay,
        f"lr warm-up ({warmup} samples) must be shorter than the decay ({decay} samples): check "
        f"--lr-warmup-* and --lr-decay-*",
    )
    check(
        t.lr_decay_style != "WSD" or (wsd and 0 < wsd <= decay),
        f"--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) in (0, decay]; got {wsd} of {decay} samples",
    )


def lr_schedule_samples(t) -> Tuple[float, float, Optional[float]]:
    """``(warm-up, decay, WSD decay)`` lengths of the learning-rate schedule in samples, converted
    from iterations as Megatron does (x ``--global-batch-size``); ``--lr-warmup-fraction`` is a
    fraction of the decay.  Needs ``--train-iters`` or ``--train-samples`` and the global batch size."""
    gbs = t.global_batch_size
    if t.train_iters is not None:
        decay = (t.lr_decay_iters or t.train_iters) * gbs
        warmup = t.lr_warmup_iters * gbs
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters else None
    else:
        decay = t.lr_decay_samples or (t.lr_decay_iters * gbs if t.lr_decay_iters else t.train_samples)
        warmup = t.lr_warmup_samples or t.lr_warmup_iters * gbs
        wsd = t.lr_wsd_decay_samples or (t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters else None)
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return warmup, decay, wsd
