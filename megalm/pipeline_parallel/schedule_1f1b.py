"""1F1B pipeline schedule (PipeDream-Flush, Megatron's ``forward_backward_pipelining_without_interleaving``).

Stage ``r`` of ``p`` runs over ``m`` microbatches:

* warm-up: ``w = min(p - r - 1, m)`` forwards (receive activation, forward, send activation);
* steady state: ``m - w`` times one forward then one backward (oldest microbatch first);
* cool-down: the ``w`` remaining backwards.

So at most ``min(p - r, m)`` microbatches of activations are alive on stage ``r``.

Communication per microbatch (one batched isend/irecv per arrow, see
:mod:`megalm.pipeline_parallel.p2p_communication`): the activation from stage r-1 and to stage
r+1; the output gradient from stage r+1 and the input gradient to r-1.  In the steady state the
send of an activation is batched with the receive of a gradient and vice versa.  Data-parallel
gradient reduction is held back (``no_sync``) until the last microbatch's backward.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch

from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.pipeline_parallel.p2p_communication import P2PCommunicator
from megalm.pipeline_parallel.steps import (
    GradSyncControl,
    MicrobatchReports,
    ScheduleTrace,
    backward_step,
    chunk_data_iterators,
    deallocate_output_tensor,
    forward_step,
)
from megalm.timers import NULL_TIMERS


def num_warmup_microbatches(pipeline_size: int, pipeline_rank: int, num_microbatches: int) -> int:
    """Forwards before the first backward on stage ``pipeline_rank``."""
    return min(pipeline_size - pipeline_rank - 1, num_microbatches)


class _OneFOneB:
    """State of one run of the schedule on this rank (one method per phase)."""

    def __init__(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        forward_only,
        loss_scale,
        per_token,
        comm: P2PCommunicator,
        groups: ProcessGroups,
        trace: Optional[ScheduleTrace],
        timers=NULL_TIMERS,
    ):
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.model = model
        self.m = num_microbatches
        self.forward_only = forward_only
        self.loss_scale = loss_scale
        self.per_token = per_token
        self.comm = comm
        self.trace = trace
        self.timers = timers
        self.pp, self.rank = group_size(groups.pp), group_rank(groups.pp)
        self.first = self.rank == 0
        self.last = self.rank == self.pp - 1
        self.collect = MicrobatchReports()
        self.inputs: List[Optional[torch.Tensor]] = []
        self.outputs: List[torch.Tensor] = []
        self.next_forward = 0
        self.next_backward = 0
        self.sync = GradSyncControl([model])

    # --- communication, skipping the ends of the pipeline ---
    def recv_forward(self):
        return None if self.first else self.comm.recv_forward(requires_grad=not self.forward_only)

    def recv_backward(self):
        return None if self.last else self.comm.recv_backward()

    def send_forward(self, output):
        if not self.last:
            self.comm.send_forward(output)

    def send_backward(self, input_grad):
        if not self.first:
            self.comm.send_backward(input_grad)

    def send_forward_recv_backward(self, output):
        return None if self.last else self.comm.send_forward_recv_backward(output)

    def send_backward_recv_forward(self, input_grad):
        if self.first:
            return None
        return self.comm.send_backward_recv_forward(input_grad, requires_grad=not self.forward_only)

    # --- steps ---
    def forward(self, input_tensor):
        mb = self.next_forward
        self.next_forward += 1
        ctx = torch.no_grad() if self.forward_only else torch.enable_grad()
        with ctx, self.timers("forward-compute"):
            output = forward_step(
                self.forward_step_func,
                self.data_iterator,
                self.model,
                self.m,
                input_tensor,
                self.collect,
                self.last,
                self.per_token,
            )
        if self.trace is not None:
            self.trace.forward(mb, 0, keeps_activations=not self.forward_only)
        return output

    def keep(self, input_tensor, output) -> None:
        """Hold a microbatch's input/output for its backward; the output's data is freed (already sent)."""
        self.inputs.append(input_tensor)
        self.outputs.append(output)
        if not self.last:
            deallocate_output_tensor(output)
        if self.trace is not None:
            self.trace.held_outputs([self.outputs])

    def backward(self, grad_output):
        input_tensor, output = self.inputs.pop(0), self.outputs.pop(0)
        with self.timers("backward-compute"):
            input_grad = backward_step(input_tensor, output, grad_output, self.loss_scale)
        if self.trace is not None:
            self.trace.backward(self.next_backward, 0)
        self.next_backward += 1
        return input_grad

    # --- phases ---
    def run(self) -> MicrobatchReports:
        warmup = num_warmup_microbatches(self.pp, self.rank, self.m)
        remaining = self.m - warmup
        if not self.forward_only:
            self.sync.disable_all()
        try:
            self.warmup(warmup)
            self.steady(remaining, warmup)
            if not self.forward_only:
                self.cooldown(warmup)
        finally:
            self.sync.enable_all()
        return self.collect

    def warmup(self, n: int) -> None:
        for _ in range(n):
            input_tensor = self.recv_forward()
            output = self.forward(input_tensor)
            self.send_forward(output)
            if not self.forward_only:
                self.keep(input_tensor, output)

    def steady(self, n: int, warmup: int) -> None:
        input_tensor = self.recv_forward() if n > 0 else None
        for i in range(n):
            last_iteration = i == n - 1
            output = self.forward(input_tensor)
            if self.forward_only:
                self.send_forward(output)
                if not last_iteration:
                    input_tensor = self.recv_forward()
                continue
            grad_output = self.send_forward_recv_backward(output)
            self.keep(input_tensor, output)
            if warmup == 0 and last_iteration:
                self.sync.enable(0)  # the batch's last backward: let DP reductions start
            input_grad = self.backward(grad_output)
            if last_iteration:
                self.send_backward(input_grad)
            else:
                input_tensor = self.send_backward_recv_forward(input_grad)

    def cooldown(self, n: int) -> None:
        for i in range(n):
            if i == n - 1:
                self.sync.enable(0)
            grad_output = self.recv_backward()
            input_grad = self.backward(grad_output)
            self.send_backward(input_grad)


def forward_backward_pipelining_without_interleaving(
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
    communicator: Optional[P2PCommunicator] = None,
    timers=NULL_TIMERS,
) -> MicrobatchReports:
    """Run 1F1B over ``num_microbatches`` on this stage; returns the last stage's reported values
    (empty on other stages).  ``config`` (a :class:`megalm.config.MegalmConfig`) gives the
    exchanged shape and dtype unless ``communicator`` is passed; the other keywords are those of
    :func:`megalm.pipeline_parallel.schedules.forward_backward_no_pipelining`."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("the 1F1B schedule takes one model chunk; virtual stages use the interleaved schedule")
        model = model[0]
    if num_microbatches < 1:
        raise ValueError(f"need at least one microbatch, got {num_microbatches}")
    iterators, _ = chunk_data_iterators(data_iterator, 1)
    comm = communicator or P2PCommunicator.from_config(config, seq_length, micro_batch_size, timers, groups=groups)
    return _OneFOneB(
        forward_step_func,
        iterators[0],
        model,
        num_microbatches,
        forward_only,
        loss_scale,
        calculate_per_token_loss,
        comm,
        groups,
        trace,
        timers,
    ).run()
