"""One training iteration and one evaluation pass, as Megatron-LM's ``train_step`` and ``evaluate``.

:func:`train_step` owns the whole step: batch size for this iteration (ramp-up), zero the
gradient buffers, run the schedule over the microbatches (backward of all but the last
microbatch without communication), finalize gradients (data-parallel bucket reduction,
sequence-parallel and tied-embedding reductions), divide them by the global token count under
``--calculate-per-token-loss``, optimizer step (loss-scale check, clipping), learning-rate step
and the counters of :class:`TrainState`; each phase under its Megatron timer
(:mod:`megalm.timers`).  It returns a :class:`StepResult`.

Communication of the step itself, besides the model's, the schedule's and the optimizer's:
one all-reduce (SUM, float64, one element pair per reported value) over the data-parallel
group of the last pipeline stage's reported values, once per step; under
``--calculate-per-token-loss`` also a broadcast of the token count from the last pipeline
stage and its all-reduce over data x context parallel ranks; under
``--check-for-nan-in-loss-and-grad`` without a loss scaler (bf16/fp32) one all-reduce of one
float32 per rank over the world (which ranks saw a non-finite loss,
:mod:`megalm.training.loss_checks`), read on the host after the optimizer step has read the
gradient norm.  Reported values stay on the device: nothing in the step synchronizes with the
host per microbatch.

Loss scaling (fp16, or ``--loss-scale``) has one owner, the optimizer's
:class:`megalm.optimizer.grad_scaler.GradScaler`: its scale is read once per step here
(:attr:`StepResult.loss_scale`) and handed, as a number, to the schedule, which multiplies
the last stage's loss by it in :func:`megalm.pipeline_parallel.steps.backward_step` (the only
multiplication of a loss by the scale in training), and to the MoE auxiliary losses' backward
factor; the optimizer divides the gradients by the same scale, checks them for inf/nan and
updates the scaler.  ``optimizer.scale_loss`` is for hand-written loops, not used here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.config import MegalmConfig
from megalm.device import get_device
from megalm.parallel_state import ProcessGroups, group_size
from megalm.pipeline_parallel import get_forward_backward_func
from megalm.pipeline_parallel.reporting import losses_to_floats
from megalm.timers import NULL_TIMERS, timed_iterator
from megalm.training.loss_checks import flagged_ranks, launch_loss_flags


@dataclass
class TrainState:
    """The counters of a run (saved in checkpoints), advanced by :func:`train_step`."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    start_time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class StepResult:
    """What one :func:`train_step` did.

    ``losses``: each reported value reduced over the step's microbatches and data-parallel
    ranks, as 0-dim float64 tensors on the device (``{}`` off the last pipeline stage); read
    them with :func:`losses_to_floats` when logging.  ``grad_norm`` / ``num_zeros``: from the
    optimizer (None when skipped or not asked for).  ``loss_scale``: the scale this step's
    backward used.  ``skipped``: no update (loss-scale overflow, or a non-finite gradient
    norm); ``nan``: the gradient norm was not finite.  ``nonfinite_loss_ranks``: the ranks whose
    own loss was not finite, ``nonfinite_grad_ranks`` those whose own gradients were (before the
    data-parallel reduction; checked under ``--check-for-nan-in-loss-and-grad`` without a loss
    scaler only; else ``()``).
    """

    losses: Dict[str, torch.Tensor]
    grad_norm: Optional[float]
    num_zeros: Optional[float]
    loss_scale: float
    skipped: bool
    nan: bool
    global_batch_size: int
    num_microbatches: int
    nonfinite_loss_ranks: Tuple[int, ...] = ()
    nonfinite_grad_ranks: Tuple[int, ...] = ()

    @property
    def update_successful(self) -> bool:
        return not self.skipped


# --- one iteration -----------------------------------------------------------------------


def train_step(
    cfg: MegalmConfig,
    forward_step_func: Callable,
    data_iterator,
    model: List[torch.nn.Module],
    optimizer,
    scheduler,
    state: TrainState,
    microbatches,
    groups: ProcessGroups,
    timers=NULL_TIMERS,
    outer_sync=None,
    rebalancer=None,
    replicas=None,
    comm_stats=None,
) -> StepResult:
    """One iteration on this rank (collective over every rank); advances ``state`` and the
    learning-rate ``scheduler``.  ``microbatches``: the run's
    :class:`megalm.training.microbatches.MicrobatchCalculator`; ``groups``: the rank's process
    groups; ``outer_sync``: the
    :class:`megalm.distributed.local_sgd.OuterSync` of ``--local-sgd-interval`` (averages the
    replicas' parameters after the optimizer step of every H-th iteration), or None;
    ``rebalancer``: the :class:`megalm.training.rebalance.StragglerRebalancer` of
    ``--straggler-rebalance-interval`` (this rank runs its replica's share of the micro-batches,
    timed), or None; ``replicas``: the :class:`megalm.resilience.torchft_replicas.ReplicaGroups` of
    ``--ft-replica-group-id`` (this group's share of the micro-batches; gradients and losses averaged
    over the replica groups; the step is committed only if they all vote so, else
    :class:`~megalm.resilience.torchft_replicas.StepNotCommitted` is raised before anything changed), or None;
    ``comm_stats``: the
    :class:`megalm.distributed.comm.CommStats` the collectives of finalizing the gradients and of the loss
    check are counted in (the Trainer's; None: not counted)."""
    from megalm.distributed.finalize_model_grads import finalize_model_grads
    from megalm.transformer.moe import begin_training_step as begin_moe_step

    microbatches.update(state.consumed_train_samples)
    gbs, m = microbatches.current_global_batch_size, microbatches.num_microbatches
    if rebalancer is not None:  # this replica's share (per-token loss: the gradient is the same)
        m = rebalancer.local_microbatches
    if replicas is not None:  # this group's share of the global batch under the current quorum
        m = replicas.local_microbatches
    scheduler.set_global_batch_size(gbs)  # --lr-batch-scaling: this iteration's lr follows its batch
    per_token = cfg.training.calculate_per_token_loss
    for chunk in model:
        chunk.zero_grad_buffer()
        if hasattr(chunk, "begin_step"):  # DDP: the warm-ups of --grad-compression / --local-sgd-interval
            chunk.begin_step(state.iteration + 1)
    optimizer.zero_grad()
    loss_scale = optimizer.get_loss_scale()
    begin_moe_step(model, loss_scale, 1 if per_token else m)  # aux-loss backward factor (MoE)
    forward_backward = get_forward_backward_func(groups, cfg.parallel.virtual_pipeline_model_parallel_size)

    def run_schedule():
        return forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=timed_iterator(data_iterator, timers("batch-generator")),
            model=model,
            num_microbatches=m,
            forward_only=False,
            loss_scale=loss_scale,
            calculate_per_token_loss=per_token,
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.training.micro_batch_size,
            config=cfg,
            groups=groups,
            timers=timers,
        )

    with timers("forward-backward"):
        reported = run_schedule() if rebalancer is None else rebalancer.timed(run_schedule)
    check_loss = cfg.training.check_for_nan_in_loss_and_grad and optimizer.grad_scaler is None
    # every bucket checked its own gradients before reducing them
    finalize_model_grads(model, timers=timers, process_groups=groups, comm_stats=comm_stats)
    loss_flags = launch_loss_flags(reported, _local_nonfinite_grads(model), comm_stats) if check_loss else None
    if per_token:
        tokens = global_token_count(reported.num_tokens, groups)
        if replicas is not None:  # this group's gradient sums / the groups' mean count, then averaged:
            tokens = replicas.average(tokens)  # the sum over groups / the sum of their counts
        scale_gradients_by_token_count(model, tokens)
    losses = None
    if replicas is not None:  # across replica groups, then their vote (raises when not committed)
        if outer_sync is None or outer_sync.synchronous(state.iteration + 1):  # local SGD: its warm-up only
            replicas.reduce_gradients(model)
        losses = reported_ratios(replicas.average(reported_totals(reported, per_token, groups)))
        replicas.commit()
    with timers("optimizer"):
        update_successful, grad_norm, num_zeros = optimizer.step(timers)
    if update_successful:
        scheduler.step(increment=gbs)
    nan = grad_norm is not None and not math.isfinite(grad_norm)
    nonfinite_ranks, nonfinite_grad_ranks = flagged_ranks(loss_flags)  # after the optimizer read the norm
    state.iteration += 1
    if outer_sync is not None:
        with timers("local-sgd-sync"):
            outer_sync.step(state.iteration)
    state.consumed_train_samples += gbs
    state.skipped_iterations += 0 if update_successful else 1
    state.nan_iterations += 1 if nan else 0
    return StepResult(
        losses=losses if losses is not None else reduce_reported(reported, per_token, groups),
        grad_norm=grad_norm,
        num_zeros=num_zeros,
        loss_scale=loss_scale,
        skipped=not update_successful,
        nan=nan,
        global_batch_size=gbs,
        num_microbatches=m,
        nonfinite_loss_ranks=nonfinite_ranks,
        nonfinite_grad_ranks=nonfinite_grad_ranks,
    )


def _local_nonfinite_grads(model) -> Optional[torch.Tensor]:
    """OR over the chunks' DDP flags: this rank's own gradients held a NaN/inf (None without DDP)."""
    flags = [f for c in model if (f := getattr(c, "local_nonfinite_grads", None)) is not None]
    if not flags:
        return None
    return torch.stack(flags).any()


# --- per-token loss ------------------------------------------------------------------------


def global_token_count(local: Optional[torch.Tensor], groups: ProcessGroups) -> torch.Tensor:
    """Tokens of the step over all microbatches and data x context parallel ranks, on every rank:
    a broadcast from the last pipeline stage (the one that saw the loss masks) over the
    pipeline group, then an all-reduce (SUM) over ``groups.dp_cp``."""
    n = torch.zeros(1, dtype=torch.float64, device=get_device())
    if local is not None:
        n += local.to(n.device, torch.float64)
    if groups.pp is not None and group_size(groups.pp) > 1:
        dist.broadcast(n, groups.ranks["pp"][-1], group=groups.pp)
    if groups.dp_cp is not None and group_size(groups.dp_cp) > 1:
        dist.all_reduce(n, group=groups.dp_cp)
    return n


def scale_gradients_by_token_count(model: Sequence[torch.nn.Module], num_tokens: torch.Tensor) -> None:
    """Turn reduced gradients of loss sums into gradients of the per-token mean: each gradient
    buffer is multiplied by ``1 / (its data-parallel scaling factor x num_tokens)`` (the buffers
    averaged over data-parallel ranks; here the ranks' contributions must add up).  No
    communication; ``num_tokens`` stays on the device (clamped to at least 1)."""
    inv = 1.0 / num_tokens.clamp(min=1.0)
    for chunk in model:
        buffers = getattr(chunk, "all_buffers", None)
        if buffers is None:  # not data-parallel wrapped: a single process
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.dtype))
            continue
        for buf in buffers:
            grads = buf.reduced_grad_data  # the whole buffer, or this rank's shard (ZeRO-2)
            grads.mul_((inv / buf.gradient_scaling_factor).to(grads.dtype))


# --- reported values -------------------------------------------------------------------------


def _as_pair(value, device) -> torch.Tensor:
    """``(numerator, denominator)`` of one reported value: a 2-element tensor is Megatron's
    ``[loss_sum, num_tokens]``; anything else is ``(value, 1)``."""
    t = torch.as_tensor(value).to(device=device, dtype=torch.float64).reshape(-1)
    if t.numel() == 2:
        return t
    if t.numel() != 1:
        raise ValueError(f"a reported value must be a scalar or [sum, count], got {t.numel()} elements")
    return torch.cat([t, torch.ones_like(t)])


def reduce_reported(reported: List[Dict], per_token: bool, groups: ProcessGroups) -> Dict[str, torch.Tensor]:
    """Each reported value over the microbatches and data-parallel ranks, on the device.

    ``[sum, count]`` values under ``per_token``: total sum / total count (Megatron's per-token
    mean).  Otherwise: mean over microbatches of ``sum / max(count, 1)`` (scalars as they
    are), then mean over data-parallel ranks.  One all-reduce over ``groups.dp_cp`` (per token)
    or ``groups.dp``; no host synchronization.  ``{}`` when nothing was reported (not the last
    pipeline stage).
    """
    return reported_ratios(reported_totals(reported, per_token, groups))


def reported_totals(reported: List[Dict], per_token: bool, groups: ProcessGroups) -> Dict[str, torch.Tensor]:
    """:func:`reduce_reported` before its division: each key's ``[numerator, denominator]`` summed
    over the microbatches and data-parallel ranks (torchft replica groups average these, so
    per-token values divide the groups' total sum by their total count)."""
    if not reported:
        return {}
    device = get_device()
    keys = sorted(reported[0])
    totals = []
    for k in keys:
        pairs = torch.stack([_as_pair(r[k], device) for r in reported])  # [microbatches, 2]
        if not per_token:
            ratio = pairs[:, 0] / pairs[:, 1].clamp(min=1.0)
            pairs = torch.stack([ratio, torch.ones_like(ratio)], dim=1)
        totals.append(pairs.sum(0))
    totals = torch.stack(totals)  # [keys, 2]: numerator, denominator
    group = groups.dp_cp if per_token else groups.dp
    if group is not None and group_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return {k: totals[i] for i, k in enumerate(keys)}


def reported_ratios(totals: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``numerator / denominator`` of each of :func:`reported_totals`."""
    return {k: t[0] / t[1] for k, t in totals.items()}


# --- evaluation ------------------------------------------------------------------------------


def evaluate(
    cfg: MegalmConfig,
    forward_step_func: Callable,
    data_iterator,
    model: List[torch.nn.Module],
    eval_iters: int,
    num_microbatches: int,
    groups: ProcessGroups,
) -> Dict[str, float]:
    """Forward-only over ``eval_iters`` global batches; mean of each reported value (per-token
    values summed over all batches first under ``--calculate-per-token-loss``)."""
    per_token = cfg.training.calculate_per_token_loss
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func(groups, cfg.parallel.virtual_pipeline_model_parallel_size)
    batches: List[Dict] = []
    with torch.no_grad():
        for _ in range(eval_iters):
            batches.extend(
                forward_backward(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_microbatches,
                    forward_only=True,
                    calculate_per_token_loss=per_token,
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.training.micro_batch_size,
                    config=cfg,
                    groups=groups,
                )
            )
    for chunk in model:
        chunk.train()
    return losses_to_floats(reduce_reported(batches, per_token, groups), groups)
