"""Interleaved 1F1B with virtual pipeline stages (Megatron's ``forward_backward_pipelining_with_interleaving``).

Each of the ``p`` ranks holds ``v`` model chunks; chunk ``c`` of rank ``r`` is virtual stage
``c p + r``.  The ``v m`` (microbatch, chunk) forward steps of a rank are numbered ``k = 0 ..
v m - 1`` in groups of ``p`` microbatches per chunk:

    chunk(k)      = (k mod p v) // p            (backward: v - 1 - that)
    microbatch(k) = (k // p v) p + k mod p

* warm-up: ``w = (p - r - 1) 2 + (v - 1) p`` forwards (all ``v m`` when ``m == p`` or forward only);
* steady state: forward ``k + w`` then backward ``k``;
* cool-down: the remaining backwards.

At most ``w + 1`` microbatch-chunks of activations are alive on rank ``r``.  ``m`` must be a
multiple of ``p``.

Communication: every step ends in one batched isend/irecv (activation to the next rank and/or
gradient to the previous one, batched with the receives the next steps need; the last rank's
chunk ``c`` feeds chunk ``c + 1`` on rank 0, so ``next`` of the last rank is rank 0).
Data-parallel grad sync is off except for a chunk's last backward (its last microbatch).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.pipeline_parallel.p2p_communication import P2PCommunicator
from megalm.pipeline_parallel.steps import (
    GradSyncControl,
    MicrobatchReports,
    ScheduleTrace,
    SharedMicrobatches,
    backward_step,
    chunk_data_iterators,
    deallocate_output_tensor,
    forward_step,
)
from megalm.timers import NULL_TIMERS


def check_interleaving(num_microbatches: int, pipeline_size: int, num_chunks: int) -> None:
    """Megatron's constraints on the interleaved schedule, with a clear message."""
    if pipeline_size < 2:
        raise ValueError("the interleaved schedule needs --pipeline-model-parallel-size >= 2")
    if num_chunks < 2:
        raise ValueError("the interleaved schedule needs at least 2 model chunks (virtual stages) per rank")
    if num_microbatches < 1 or num_microbatches % pipeline_size:
        raise ValueError(
            f"the interleaved pipeline schedule needs the number of microbatches ({num_microbatches}) to be a "
            f"positive multiple of --pipeline-model-parallel-size ({pipeline_size}); the number of microbatches "
            f"is global batch / (micro batch x data-parallel size)"
        )


def interleaved_warmup(
    pipeline_size: int, pipeline_rank: int, num_microbatches: int, num_chunks: int, forward_only: bool
) -> int:
    """Forward steps before the first backward on ``pipeline_rank`` (Megatron's rule)."""
    total = num_microbatches * num_chunks
    if forward_only or num_microbatches == pipeline_size:
        return total
    return min((pipeline_size - pipeline_rank - 1) * 2 + (num_chunks - 1) * pipeline_size, total)


class _Interleaved:
    """State of one run on this rank; ``k`` below is a virtual microbatch (step) index."""

    def __init__(
        self,
        forward_step_func,
        data_iterators,
        shared: Optional[SharedMicrobatches],
        model,
        num_microbatches,
        forward_only,
        loss_scale,
        per_token,
        comm: P2PCommunicator,
        groups: ProcessGroups,
        trace,
        timers=NULL_TIMERS,
    ):
        self.forward_step_func = forward_step_func
        self.data_iterators = data_iterators
        self.shared = shared
        self.model = list(model)
        self.v = len(self.model)
        self.m = num_microbatches
        self.total = self.m * self.v
        self.p = group_size(groups.pp)
        self.rank = group_rank(groups.pp)
        self.first_rank = self.rank == 0
        self.last_rank = self.rank == self.p - 1
        self.forward_only = forward_only
        self.loss_scale = loss_scale
        self.per_token = per_token
        self.comm = comm
        self.trace = trace
        self.timers = timers
        self.collect = MicrobatchReports()
        self.inputs: List[List] = [[] for _ in range(self.v)]
        self.outputs: List[List] = [[] for _ in range(self.v)]
        self.grads: List[List] = [[] for _ in range(self.v)]
        self.sync = GradSyncControl(self.model)

    # --- index arithmetic ---
    def chunk(self, k: int, forward: bool) -> int:
        c = (k % (self.p * self.v)) // self.p
        return c if forward else self.v - 1 - c

    def microbatch(self, k: int) -> int:
        return (k // (self.p * self.v)) * self.p + k % self.p

    def is_last_microbatch_of_chunk(self, k: int) -> bool:
        return self.microbatch(k) == self.m - 1

    def first_stage(self, chunk: int) -> bool:
        return self.first_rank and chunk == 0

    def last_stage(self, chunk: int) -> bool:
        return self.last_rank and chunk == self.v - 1

    # --- steps ---
    def forward(self, k: int):
        c, mb = self.chunk(k, True), self.microbatch(k)
        if self.first_stage(c):
            self.inputs[c].append(None)
        input_tensor = self.inputs[c][-1]
        if self.shared is not None:
            self.shared.current = mb
        ctx = torch.no_grad() if self.forward_only else torch.enable_grad()
        with ctx, self.timers("forward-compute"):
            output = forward_step(
                self.forward_step_func,
                self.data_iterators[c],
                self.model[c],
                self.m,
                input_tensor,
                self.collect,
                self.last_stage(c),
                self.per_token,
            )
        if self.forward_only:
            self.inputs[c].pop()
        else:
            self.outputs[c].append(output)
        if self.trace is not None:
            self.trace.forward(mb, c, keeps_activations=not self.forward_only)
        return output

    def backward(self, k: int):
        c = self.chunk(k, False)
        if self.is_last_microbatch_of_chunk(k):
            self.sync.enable(c)  # this chunk's last backward: let its DP reductions start
        if self.last_stage(c):
            self.grads[c].append(None)
        input_tensor, output = self.inputs[c].pop(0), self.outputs[c].pop(0)
        with self.timers("backward-compute"):
            input_grad = backward_step(input_tensor, output, self.grads[c].pop(0), self.loss_scale)
        self.sync.disable(c)
        if self.trace is not None:
            self.trace.backward(self.microbatch(k), c)
        return input_grad

    def sent(self, output) -> None:
        """The next stage has ``output``: free its data, keep its graph."""
        deallocate_output_tensor(output)
        if self.trace is not None:
            self.trace.held_outputs(self.outputs)

    # --- phases ---
    def run(self) -> MicrobatchReports:
        warmup = interleaved_warmup(self.p, self.rank, self.m, self.v, self.forward_only)
        all_warmup = warmup == self.total and not self.forward_only
        if not self.forward_only:
            self.sync.disable_all()
        try:
            if not self.first_rank:
                self.inputs[0].append(self.comm.recv_forward(requires_grad=not self.forward_only))
            self.warmup(warmup, all_warmup)
            self.steady(warmup)
            if not self.forward_only:
                self.cooldown(warmup, all_warmup)
        finally:
            self.sync.enable_all()
        return self.collect

    def warmup(self, warmup: int, all_warmup: bool) -> None:
        for k in range(warmup):
            output = self.forward(k)
            next_chunk = self.chunk(k + 1, True)
            recv_prev = not (self.first_rank and next_chunk == 0) and k != self.total - 1
            if self.last_stage(self.chunk(k, True)):
                output = None  # the loss stays here
            if k == warmup - 1 and not self.forward_only and not all_warmup:
                recv_next = not self.last_rank
                input_tensor, grad = self.comm.send_forward_backward_recv_forward_backward(
                    output, None, recv_prev=recv_prev, recv_next=recv_next
                )
                if recv_next:
                    self.grads[self.v - 1].append(grad)
            else:
                input_tensor = self.comm.send_forward_recv_forward(
                    output, recv_prev=recv_prev, requires_grad=not self.forward_only
                )
            if recv_prev:
                self.inputs[next_chunk].append(input_tensor)
            self.sent(output)

    def steady(self, warmup: int) -> None:
        remaining = self.total - warmup
        for k in range(remaining):
            forward_k = k + warmup
            output = self.forward(forward_k)
            input_grad = self.backward(k)
            if self.last_stage(self.chunk(forward_k, True)):
                output = None
            if self.first_stage(self.chunk(k, False)):
                input_grad = None
            recv_prev, next_forward_chunk = self._next_forward(forward_k)
            recv_next, next_backward_chunk = self._next_backward(k)
            if k == remaining - 1:
                recv_prev = False
            input_tensor, grad = self.comm.send_forward_backward_recv_forward_backward(
                output, input_grad, recv_prev=recv_prev, recv_next=recv_next
            )
            self.sent(output)
            if recv_prev:
                self.inputs[next_forward_chunk].append(input_tensor)
            if recv_next:
                self.grads[next_backward_chunk].append(grad)

    def _next_forward(self, forward_k: int):
        """Whether an activation arrives from the previous rank now, and for which chunk.

        Rank 0 receives from the last rank, which is ``p - 1`` steps behind it."""
        if self.first_rank:
            c = self.chunk(forward_k - (self.p - 1), True)
            return c != self.v - 1, c + 1
        return True, self.chunk(forward_k + 1, True)

    def _next_backward(self, backward_k: int):
        """Whether a gradient arrives from the next rank now, and for which chunk.

        The last rank receives from rank 0, which is ``p - 1`` backward steps behind it."""
        if self.last_rank:
            c = self.chunk(backward_k - (self.p - 1), False)
            return c != 0, c - 1
        return True, self.chunk(backward_k + 1, False)

    def cooldown(self, warmup: int, all_warmup: bool) -> None:
        remaining = self.total - warmup
        if all_warmup and not self.last_rank:
            self.grads[self.v - 1].append(self.comm.recv_backward())
        for k in range(remaining, self.total):
            input_grad = self.backward(k)
            next_chunk = self.chunk(k + 1, False)
            recv_next = not (self.last_rank and next_chunk == self.v - 1) and k != self.total - 1
            grad = self.comm.send_backward_recv_backward(input_grad, recv_next=recv_next)
            if recv_next:
                self.grads[next_chunk].append(grad)


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator,
    model: Sequence[torch.nn.Module],
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
    """Run the interleaved schedule over ``model`` (this rank's chunks, virtual stage order);
    returns the last stage's reported values (empty elsewhere).  Keywords as
    :func:`megalm.pipeline_parallel.schedules.forward_backward_no_pipelining`.

    ``data_iterator``: one iterator shared by the chunks (each microbatch is read once and
    handed to every chunk that reads it), or one per chunk."""
    if not isinstance(model, (list, tuple)):
        raise TypeError("the interleaved schedule takes the list of this rank's model chunks")
    check_interleaving(num_microbatches, group_size(groups.pp), len(model))
    iterators, shared = chunk_data_iterators(data_iterator, len(model))
    comm = communicator or P2PCommunicator.from_config(config, seq_length, micro_batch_size, timers, groups=groups)
    return _Interleaved(
        forward_step_func,
        iterators,
        shared,
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
