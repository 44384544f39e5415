"""The pieces every schedule is made of: one forward step, one backward step, freeing a sent
output, gradient-sync control, per-chunk data iterators, and an optional trace.

No communication here except what the model and ``forward_step_func`` do themselves (and the
data-parallel bucket reductions a backward may launch once grad sync is enabled).

Freeing sent outputs (Megatron's ``deallocate_output_tensor``): once the next stage has a
stage's output, only its ``grad_fn`` is still needed, so ``.data`` is replaced by a one-element
tensor.  The backward then cannot go through ``torch.autograd.backward(output, grad)`` (the shape
check would see one element), so :func:`custom_backward` starts from the output's gradient
edge, whose recorded metadata keeps the original shape.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megalm.errors import MegalmError


class LossFunctionError(MegalmError):
    """``loss_func`` returned something the schedule cannot use."""


# --- forward / backward ------------------------------------------------------------------------


def unwrap_for_input(model: torch.nn.Module) -> torch.nn.Module:
    """The module under data-parallel / precision wrappers that has ``set_input_tensor``."""
    while not hasattr(model, "set_input_tensor") and hasattr(model, "module"):
        model = model.module
    return model


def set_input_tensor(model: torch.nn.Module, input_tensor: Optional[torch.Tensor]) -> None:
    target = unwrap_for_input(model)
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor(input_tensor)
    elif input_tensor is not None:
        raise TypeError(f"{type(target).__name__} has no set_input_tensor(); it cannot be a non-first pipeline stage")


class MicrobatchReports(list):
    """What a schedule returns: one ``{name: value}`` per microbatch (the last stage's
    ``loss_func`` reports, detached, still on the device: no host sync per microbatch), plus
    ``num_tokens``, the sum of the token counts ``loss_func`` returned (a device tensor on the
    last stage when ``loss_func`` returns three values, else None)."""

    def __init__(self):
        super().__init__()
        self.num_tokens: Optional[torch.Tensor] = None

    def add(self, reported: Dict, num_tokens: Optional[torch.Tensor]) -> None:
        self.append({k: v.detach() if torch.is_tensor(v) else v for k, v in reported.items()})
        if num_tokens is not None:
            n = num_tokens.detach() if torch.is_tensor(num_tokens) else torch.tensor(float(num_tokens))
            self.num_tokens = n if self.num_tokens is None else self.num_tokens + n


def forward_step(
    forward_step_func: Callable,
    data_iterator,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Optional[torch.Tensor],
    collect: MicrobatchReports,
    is_last_stage: bool,
    calculate_per_token_loss: bool = False,
) -> torch.Tensor:
    """Run one microbatch through one model chunk (the one forward step of every schedule).

    ``loss_func(output)`` returns ``(loss, {name: value})`` or, as Megatron's, ``(loss_sum,
    num_tokens, {name: value})``.  On the last stage its reported values are added to
    ``collect`` and the loss to back-propagate is returned:

    * ``calculate_per_token_loss``: the token sum as is (the trainer divides the gradients by
      the global token count after the step's gradient reduction);
    * otherwise the microbatch mean (``loss_sum / max(num_tokens, 1)`` for three values)
      divided by ``num_microbatches``.

    Elsewhere the output (hidden states) is returned and the loss function is not called.
    No communication, no host synchronization.
    """
    set_input_tensor(model, input_tensor)
    output, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output
    outputs = loss_func(output)
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
    else:
        (loss, reported), num_tokens = outputs, None
    collect.add(reported, num_tokens)
    if calculate_per_token_loss:
        if num_tokens is None:
            raise LossFunctionError(
                "--calculate-per-token-loss needs loss_func to return (loss_sum, num_tokens, reported) as Megatron-LM's"
            )
        return loss
    if num_tokens is not None:
        loss = loss / torch.clamp(torch.as_tensor(num_tokens, dtype=loss.dtype, device=loss.device), min=1.0)
    return loss / num_microbatches


def deallocate_output_tensor(output: Optional[torch.Tensor]) -> None:
    """Keep ``output.grad_fn`` but free its data (after the next stage received it).

    Views and leaves are left alone: freeing a view frees nothing, and a leaf (a stage with no
    layers passing its input on) has no graph to keep.
    """
    if output is None or output.grad_fn is None or output._base is not None:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backward from ``output`` with ``grad_output``, valid after :func:`deallocate_output_tensor`.

    A scalar loss (``grad_output`` None) goes through ``torch.autograd.backward``; otherwise the
    backward starts at ``output``'s gradient edge (grad_fn, output number), checked against the
    shape autograd recorded when ``output`` was made rather than the tensor's current data.
    """
    if grad_output is None:
        torch.autograd.backward(output)
        return
    if output.grad_fn is None:  # a leaf: its input was passed through unchanged
        if output.requires_grad:
            output.grad = grad_output if output.grad is None else output.grad + grad_output
        return
    edge = torch.autograd.graph.get_gradient_edge(output)
    torch.autograd.backward(edge, grad_tensors=grad_output)


def backward_step(
    input_tensor: Optional[torch.Tensor],
    output: torch.Tensor,
    grad_output: Optional[torch.Tensor],
    loss_scale: float = 1.0,
) -> Optional[torch.Tensor]:
    """Backward of one microbatch on one chunk; returns the gradient of its input (None on the first stage).

    On the last stage (``grad_output`` None) the loss is first multiplied by ``loss_scale``:
    the only place where the loss scale enters the backward pass (see
    :mod:`megalm.training.step`, "Loss scaling").
    """
    if grad_output is None and loss_scale != 1.0:
        output = output * loss_scale
    custom_backward(output, grad_output)
    if input_tensor is None:
        return None
    return input_tensor.grad


# --- gradient synchronization ------------------------------------------------------------------


class GradSyncControl:
    """Megatron's no_sync protocol over model chunks: grad sync off except where enabled.

    Uses each chunk's ``no_sync()`` context (megalm's and torch's DistributedDataParallel both
    have one); chunks without it are ignored.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        self.chunks = list(chunks)
        self._contexts: Dict[int, contextlib.AbstractContextManager] = {}

    def disable(self, chunk: int) -> None:
        if chunk in self._contexts or not hasattr(self.chunks[chunk], "no_sync"):
            return
        ctx = self.chunks[chunk].no_sync()
        ctx.__enter__()
        self._contexts[chunk] = ctx

    def enable(self, chunk: int) -> None:
        ctx = self._contexts.pop(chunk, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def disable_all(self) -> None:
        for c in range(len(self.chunks)):
            self.disable(c)

    def enable_all(self) -> None:
        for c in list(self._contexts):
            self.enable(c)


# --- data --------------------------------------------------------------------------------------


class SharedMicrobatches:
    """One data iterator shared by the model chunks of a rank (interleaved schedule).

    Every chunk that reads data for microbatch ``i`` gets the same item: the first read of ``i``
    pulls it from the source (in order), later reads of ``i`` by other chunks reuse it.  The
    schedule sets :attr:`current` before each forward step; an item is dropped once every chunk
    has read it.  No communication.
    """

    def __init__(self, source: Iterator, num_chunks: int):
        self.source = source
        self.num_chunks = num_chunks
        self.current = 0
        self._next_to_pull = 0
        self._items: Dict[int, object] = {}
        self._reads: Dict[int, int] = {}

    def read(self):
        mb = self.current
        if mb not in self._items:
            if mb != self._next_to_pull:
                raise RuntimeError(f"microbatch {mb} read before microbatch {self._next_to_pull}")
            self._items[mb] = next(self.source)
            self._reads[mb] = 0
            self._next_to_pull += 1
        item = self._items[mb]
        self._reads[mb] += 1
        if self._reads[mb] == self.num_chunks:
            del self._items[mb], self._reads[mb]
        return item

    def view(self) -> "_MicrobatchView":
        return _MicrobatchView(self)


class _MicrobatchView:
    def __init__(self, shared: SharedMicrobatches):
        self.shared = shared

    def __iter__(self):
        return self

    def __next__(self):
        return self.shared.read()


def chunk_data_iterators(data_iterator, num_chunks: int) -> Tuple[List, Optional[SharedMicrobatches]]:
    """Per-chunk iterators: a list of ``num_chunks`` is used as given (Megatron's convention);
    a single iterator (or None) is shared through :class:`SharedMicrobatches`."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) == num_chunks:
            return list(data_iterator), None
        if len(data_iterator) != 1:
            raise ValueError(f"got {len(data_iterator)} data iterators for {num_chunks} model chunks")
        data_iterator = data_iterator[0]
    if num_chunks == 1 or data_iterator is None:
        return [data_iterator] * num_chunks, None
    shared = SharedMicrobatches(data_iterator, num_chunks)
    return [shared.view() for _ in range(num_chunks)], shared


# --- trace -------------------------------------------------------------------------------------


class ScheduleTrace:
    """What a schedule did on this rank, for tests and benchmarks.

    ``events``: ``("F", microbatch, chunk)`` / ``("B", microbatch, chunk)`` in execution order.
    ``peak_live``: most microbatches whose activations were held at once (forward done, backward
    not yet), over all chunks.  ``peak_held_output_numel``: most elements held at once in stored
    output tensors (1 per microbatch when sent outputs are freed).
    """

    def __init__(self):
        self.events: List[Tuple[str, int, int]] = []
        self.live = 0
        self.peak_live = 0
        self.peak_held_output_numel = 0

    def forward(self, microbatch: int, chunk: int, keeps_activations: bool) -> None:
        self.events.append(("F", microbatch, chunk))
        if keeps_activations:
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)

    def backward(self, microbatch: int, chunk: int) -> None:
        self.events.append(("B", microbatch, chunk))
        self.live -= 1

    def held_outputs(self, outputs: Sequence[Sequence[Optional[torch.Tensor]]]) -> None:
        numel = sum(t.numel() for per_chunk in outputs for t in per_chunk if t is not None)
        self.peak_held_output_numel = max(self.peak_held_output_numel, numel)
