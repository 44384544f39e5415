"""Forward/backward schedules over the microbatches of one iteration.

A schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` and
``loss_func(output) -> (loss, {name: value})`` as in Megatron-LM, scales each microbatch's
loss by ``1 / num_microbatches`` (and the loss scale), runs backward, and returns the list of
per-microbatch reported values (on the stage that computes the loss).

:func:`get_forward_backward_func` picks the schedule for this rank's layout:

* no pipeline parallelism: :func:`forward_backward_no_pipelining` (below);
* pipeline parallelism: 1F1B,
  :func:`megalm.pipeline_parallel.schedule_1f1b.forward_backward_pipelining_without_interleaving`;
* with virtual stages: interleaved 1F1B,
  :func:`megalm.pipeline_parallel.schedule_interleaved.forward_backward_pipelining_with_interleaving`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from megalm import parallel_state
from megalm.timers import NULL_TIMERS


def _no_sync(model):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def forward_step(forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                 forward_only: bool, collect: List[Dict], timers=NULL_TIMERS):
    with timers("forward-compute"):
        output, loss_func = forward_step_func(data_iterator, model)
        loss, reported = loss_func(output)
    collect.append({k: v.detach() if torch.is_tensor(v) else v for k, v in reported.items()})
    return loss / num_microbatches


def forward_backward_no_pipelining(forward_step_func: Callable, data_iterator, model: Union[torch.nn.Module, Sequence],
                                   num_microbatches: int, forward_only: bool = False,
                                   loss_scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                                   timers=NULL_TIMERS, **_unused) -> List[Dict]:
    """Gradient accumulation on one stage: no communication except in the last microbatch's backward.

    Backward of microbatches 0..m-2 runs under ``model.no_sync()``; the last one lets the
    data-parallel wrapper launch its bucket reductions (overlapped with that backward).
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("no-pipelining schedule takes a single model chunk")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    collect: List[Dict] = []
    scale = loss_scale or (lambda x: x)
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        ctx = contextlib.nullcontext() if (last or forward_only) else _no_sync(model)
        with ctx:
            if forward_only:
                with torch.no_grad():
                    forward_step(forward_step_func, data_iterator, model, num_microbatches, True, collect, timers)
            else:
                loss = forward_step(forward_step_func, data_iterator, model, num_microbatches, False, collect,
                                    timers)
                with timers("backward-compute"):
                    scale(loss).backward()
    return collect


def get_forward_backward_func() -> Callable:
    """The schedule for this rank's layout: no pipelining, 1F1B, or interleaved 1F1B (virtual stages)."""
    from megalm.pipeline_parallel.schedule_1f1b import forward_backward_pipelining_without_interleaving
    from megalm.pipeline_parallel.schedule_interleaved import forward_backward_pipelining_with_interleaving

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return forward_backward_no_pipelining
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
