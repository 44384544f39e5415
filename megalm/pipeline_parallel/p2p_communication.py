"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Every exchange is one ``torch.distributed.batch_isend_irecv`` call over the pipeline group,
waited on before returning (so a sent tensor may be freed at once):

* activations travel forward: this stage sends to ``next`` rank, receives from ``prev``
  rank, with tag :data:`TAG_ACTIVATION`;
* gradients travel backward: sends to ``prev``, receives from ``next``, tag :data:`TAG_GRADIENT`.

Separate tags keep the two streams apart when ``prev == next`` (two stages with virtual stages:
rank 0 sends rank 1 both activations and gradients); within one stream messages between a pair of
ranks match in the order they were posted, which the schedules keep identical on both sides.

Shapes are known ahead: ``[s / cp (/ tp under sequence parallelism), micro batch, hidden]`` in
the parameters' dtype (bf16 / fp16 / fp32), so a receive is a pre-allocated buffer and no shape
is exchanged.  With ``variable_seq_lengths`` each exchange is preceded by one of 3 int64 shapes
(tags :data:`TAG_SHAPE_ACTIVATION` / :data:`TAG_SHAPE_GRADIENT`) and buffers are sized from them.

Which peer to talk to is decided by the schedule (``recv_prev`` / ``recv_next`` flags and
``None`` tensors); this module never looks at the virtual pipeline rank.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.timers import NULL_TIMERS

TAG_ACTIVATION = 1
TAG_GRADIENT = 2
TAG_SHAPE_ACTIVATION = 3
TAG_SHAPE_GRADIENT = 4


def pipeline_dtype(cfg) -> torch.dtype:
    """Dtype of the hidden states between stages: the parameters' dtype."""
    t = cfg.training
    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32


def pipeline_tensor_shape(
    cfg,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    *,
    groups: ProcessGroups,
) -> Tuple[int, int, int]:
    """``(s / cp [/ tp under SP], b, h)``: the hidden-state shape one stage hands the next."""
    seq = cfg.model.seq_length if seq_length is None else seq_length
    mbs = cfg.training.micro_batch_size if micro_batch_size is None else micro_batch_size
    cp = group_size(groups.cp)
    tp = group_size(groups.tp)
    seq //= cp
    if cfg.parallel.sequence_parallel and tp > 1:
        if seq % tp:
            raise ValueError(
                f"sequence length {seq} is not divisible by tensor-parallel size {tp} (sequence parallelism)"
            )
        seq //= tp
    return seq, mbs, cfg.model.hidden_size


def _as_shape(t: Optional[torch.Tensor]) -> Optional[Tuple[int, ...]]:
    return tuple(int(x) for x in t.tolist()) if t is not None else None


def neighbour_ranks(groups: ProcessGroups) -> Tuple[int, int]:
    """Global ranks of the previous and next pipeline stage (wrapping around, as Megatron's)."""
    ranks = groups.ranks.get("pp")
    if not ranks or groups.pp is None:
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return me, me
    i = group_rank(groups.pp)
    return ranks[(i - 1) % len(ranks)], ranks[(i + 1) % len(ranks)]


class P2PCommunicator:
    """Sends and receives one tensor per direction per call (see the module docstring).

    Args:
        tensor_shape: shape of every activation / gradient exchanged (ignored for receives when
            ``variable_seq_lengths``).
        dtype: their dtype.
        variable_seq_lengths: exchange shapes before each transfer.
        timers: level-2 timers of Megatron's exchange names (:mod:`megalm.timers`).
        groups: the rank's :class:`megalm.parallel_state.ProcessGroups`: the pipeline group
            ``groups.pp`` and its ranks ``groups.ranks["pp"]``.
    """

    def __init__(
        self,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        variable_seq_lengths: bool = False,
        timers=NULL_TIMERS,
        *,
        groups: ProcessGroups,
    ):
        self.timers = timers
        self.tensor_shape = tuple(int(s) for s in tensor_shape)
        self.dtype = dtype
        self.variable_seq_lengths = variable_seq_lengths
        self.group = groups.pp
        self.prev_rank, self.next_rank = neighbour_ranks(groups)
        self.device = get_device()

    @classmethod
    def from_config(
        cls,
        cfg,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        timers=NULL_TIMERS,
        *,
        groups: ProcessGroups,
    ) -> "P2PCommunicator":
        if cfg is None:
            raise ValueError(
                "a pipelined schedule needs config= (a MegalmConfig: exchanged shape and dtype) or communicator="
            )
        return cls(
            pipeline_tensor_shape(cfg, seq_length, micro_batch_size, groups=groups),
            pipeline_dtype(cfg),
            bool(cfg.parallel.variable_seq_lengths),
            timers,
            groups=groups,
        )

    # --- the one primitive -----------------------------------------------------------------
    def _run(self, ops: List[dist.P2POp]) -> None:
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def _exchange_shapes(self, send_next, send_prev, recv_prev: bool, recv_next: bool):
        """One batched exchange of int64 shapes; returns (shape from prev, shape from next)."""
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            shape = torch.tensor(send_next.shape, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.isend, shape, self.next_rank, self.group, tag=TAG_SHAPE_ACTIVATION))
        if send_prev is not None:
            shape = torch.tensor(send_prev.shape, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.isend, shape, self.prev_rank, self.group, tag=TAG_SHAPE_GRADIENT))
        if recv_prev:
            from_prev = torch.empty(3, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group, tag=TAG_SHAPE_ACTIVATION))
        if recv_next:
            from_next = torch.empty(3, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group, tag=TAG_SHAPE_GRADIENT))
        self._run(ops)
        return _as_shape(from_prev), _as_shape(from_next)

    def _buffer(self, shape, requires_grad: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad)

    def communicate(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        requires_grad: bool = True,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Send ``send_next`` to the next stage and ``send_prev`` to the previous stage, receive
        an activation from the previous stage (``recv_prev``) and a gradient from the next stage
        (``recv_next``), all in one ``batch_isend_irecv``; returns (from prev, from next).

        Received activations have ``requires_grad = requires_grad`` so the backward pass yields
        the gradient to send back.
        """
        shape_prev = shape_next = self.tensor_shape
        if self.variable_seq_lengths:
            shape_prev, shape_next = self._exchange_shapes(send_next, send_prev, recv_prev, recv_next)
        ops: List[dist.P2POp] = []
        from_prev = self._buffer(shape_prev, requires_grad) if recv_prev else None
        from_next = self._buffer(shape_next, False) if recv_next else None
        for tensor, peer, tag, op in (
            (send_prev, self.prev_rank, TAG_GRADIENT, dist.isend),
            (from_prev, self.prev_rank, TAG_ACTIVATION, dist.irecv),
            (send_next, self.next_rank, TAG_ACTIVATION, dist.isend),
            (from_next, self.next_rank, TAG_GRADIENT, dist.irecv),
        ):
            if tensor is not None:
                if op is dist.isend:
                    tensor = self._checked(tensor)
                ops.append(dist.P2POp(op, tensor, peer, self.group, tag=tag))
        self._run(ops)
        return from_prev, from_next

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != self.dtype:
            raise TypeError(f"pipeline tensor has dtype {tensor.dtype}, the pipeline exchanges {self.dtype}")
        if not self.variable_seq_lengths and tuple(tensor.shape) != self.tensor_shape:
            raise ValueError(
                f"pipeline tensor has shape {tuple(tensor.shape)}, expected {self.tensor_shape} "
                f"(give --variable-seq-lengths for changing shapes)"
            )
        return tensor.detach().contiguous()

    # --- Megatron's named exchanges ---------------------------------------------------------
    def recv_forward(self, requires_grad: bool = True) -> torch.Tensor:
        """Receive an activation from the previous stage."""
        with self.timers("forward-recv"):
            return self.communicate(recv_prev=True, requires_grad=requires_grad)[0]

    def recv_backward(self) -> torch.Tensor:
        """Receive an output gradient from the next stage."""
        with self.timers("backward-recv"):
            return self.communicate(recv_next=True)[1]

    def send_forward(self, output: Optional[torch.Tensor]) -> None:
        """Send an activation to the next stage (nothing when ``output`` is None)."""
        with self.timers("forward-send"):
            self.communicate(send_next=output)

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        """Send an input gradient to the previous stage (nothing when None)."""
        with self.timers("backward-send"):
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(
        self, output: Optional[torch.Tensor], recv_next: bool = True
    ) -> Optional[torch.Tensor]:
        """Send an activation to the next stage and receive its gradient from it, batched."""
        with self.timers("forward-send-backward-recv"):
            return self.communicate(send_next=output, recv_next=recv_next)[1]

    def send_backward_recv_forward(
        self, input_grad: Optional[torch.Tensor], recv_prev: bool = True, requires_grad: bool = True
    ) -> Optional[torch.Tensor]:
        """Send an input gradient to the previous stage and receive the next activation from it."""
        with self.timers("backward-send-forward-recv"):
            return self.communicate(send_prev=input_grad, recv_prev=recv_prev, requires_grad=requires_grad)[0]

    def send_forward_recv_forward(
        self, output: Optional[torch.Tensor], recv_prev: bool, requires_grad: bool = True
    ) -> Optional[torch.Tensor]:
        """Send an activation to the next stage, receive one from the previous stage."""
        with self.timers("forward-send-forward-recv"):
            return self.communicate(send_next=output, recv_prev=recv_prev, requires_grad=requires_grad)[0]

    def send_backward_recv_backward(
        self, input_grad: Optional[torch.Tensor], recv_next: bool
    ) -> Optional[torch.Tensor]:
        """Send a gradient to the previous stage, receive one from the next stage."""
        with self.timers("backward-send-backward-recv"):
            return self.communicate(send_prev=input_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(
        self,
        output: Optional[torch.Tensor],
        input_grad: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        requires_grad: bool = True,
    ):
        """All four at once: activation to next, gradient to prev, activation from prev,
        gradient from next; returns (activation, gradient) received."""
        with self.timers("forward-backward-send-forward-backward-recv"):
            return self.communicate(
                send_next=output,
                send_prev=input_grad,
                recv_prev=recv_prev,
                recv_next=recv_next,
                requires_grad=requires_grad,
            )
