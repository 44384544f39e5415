"""Forward/backward schedules over the microbatches of one iteration.

A schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` and
``loss_func(output) -> (loss, {name: value})`` or ``(loss_sum, num_tokens, {name: value})`` as
in Megatron-LM, through the one :func:`megalm.pipeline_parallel.steps.forward_step`; multiplies
the last stage's loss by ``loss_scale`` before backward
(:func:`megalm.pipeline_parallel.steps.backward_step`), and returns a
:class:`megalm.pipeline_parallel.steps.MicrobatchReports` (the per-microbatch reported values,
still on the device, on the stage that computes the loss; empty elsewhere).

Every schedule takes the same keyword arguments (:func:`forward_backward_no_pipelining` lists
them); ``groups`` is the rank's :class:`megalm.parallel_state.ProcessGroups` (the pipeline group
and its ranks are read from it).

:func:`get_forward_backward_func` picks the schedule for this rank's layout:

* no pipeline parallelism: :func:`forward_backward_no_pipelining` (below);
* pipeline parallelism: 1F1B,
  :func:`megalm.pipeline_parallel.schedule_1f1b.forward_backward_pipelining_without_interleaving`;
* with virtual stages: interleaved 1F1B,
  :func:`megalm.pipeline_parallel.schedule_interleaved.forward_backward_pipelining_with_interleaving`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Union

import torch

from megalm.parallel_state import ProcessGroups, group_size
from megalm.pipeline_parallel.steps import MicrobatchReports, ScheduleTrace, backward_step, forward_step
from megalm.timers import NULL_TIMERS


def _no_sync(model):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator,
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    num_microbatches: int,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    calculate_per_token_loss: bool = False,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    config=None,
    groups: ProcessGroups,
    trace: Optional[ScheduleTrace] = None,
    communicator=None,
    timers=NULL_TIMERS,
) -> MicrobatchReports:
    """Gradient accumulation on one stage: no communication except in the last microbatch's backward.

    Backward of microbatches 0..m-2 runs under ``model.no_sync()``; the last one lets the
    data-parallel wrapper launch its bucket reductions (overlapped with that backward).

    The keywords every schedule takes: ``loss_scale`` multiplies the last stage's loss before
    backward; ``calculate_per_token_loss`` back-propagates loss sums (see ``forward_step``);
    ``seq_length`` / ``micro_batch_size`` / ``config`` give the exchanged shape and dtype
    (pipelined schedules, unless ``communicator`` is given); ``groups`` the process groups;
    ``trace`` records the order of steps; ``timers`` Megatron's schedule timers.  Here
    ``seq_length``, ``micro_batch_size``, ``config``, ``groups`` and ``communicator`` are unused.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("no-pipelining schedule takes a single model chunk")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    collect = MicrobatchReports()
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        ctx = contextlib.nullcontext() if (last or forward_only) else _no_sync(model)
        with ctx, torch.no_grad() if forward_only else contextlib.nullcontext():
            with timers("forward-compute"):
                loss = forward_step(
                    forward_step_func,
                    data_iterator,
                    model,
                    num_microbatches,
                    None,
                    collect,
                    True,
                    calculate_per_token_loss,
                )
            if trace is not None:
                trace.forward(i, 0, keeps_activations=not forward_only)
            if not forward_only:
                with timers("backward-compute"):
                    backward_step(None, loss, None, loss_scale)
                if trace is not None:
                    trace.backward(i, 0)
    return collect


def get_forward_backward_func(groups: ProcessGroups, vp_size: Optional[int] = None) -> Callable:
    """The schedule for this rank's layout: no pipelining (``groups.pp`` of one stage), 1F1B, or
    interleaved 1F1B (``vp_size`` > 1 virtual stages per rank: ``--num-layers-per-virtual-pipeline-stage``)."""
    from megalm.pipeline_parallel.schedule_1f1b import forward_backward_pipelining_without_interleaving
    from megalm.pipeline_parallel.schedule_interleaved import forward_backward_pipelining_with_interleaving

    if group_size(groups.pp) == 1:
        return forward_backward_no_pipelining
    if vp_size is not None and vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
