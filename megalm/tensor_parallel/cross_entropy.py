"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds the logits of its vocabulary slice ``[..., V/tp]``.  The loss needs
three scalars per token, each obtained with one all-reduce of a ``[...]`` tensor (not of
the logits): the max logit (MAX), the target's logit (SUM, only its owner contributes)
and the sum of exponentials (SUM).  Backward is local: ``softmax - one_hot(target)``
restricted to this rank's slice, scaled by the incoming gradient.

Padded vocabulary rows take part in the softmax through their logits (the model sets them
to -inf, see :class:`megalm.models.gpt.GPTModel`); they are never targets.

This is the loss of ``--no-cross-entropy-loss-fusion`` and of callers holding logits; the
model's default fuses it with the output layer (:mod:`megalm.tensor_parallel.linear_cross_entropy`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm.parallel_state import group_rank, group_size


def all_reduce_over_vocab(x: torch.Tensor, op, group) -> torch.Tensor:
    """In-place all-reduce of per-token statistics over ``group`` (the vocabulary shards' TP group)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def target_on_rank(target: torch.Tensor, per_rank: int, group):
    """``(column of the target on this rank of ``group`` (0 where outside), outside mask)``."""
    vocab_start = group_rank(group) * per_rank
    outside = (target < vocab_start) | (target >= vocab_start + per_rank)
    return (target - vocab_start).masked_fill(outside, 0), outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        per_rank = logits.shape[-1]
        logits_max = logits.max(dim=-1).values.float()
        all_reduce_over_vocab(logits_max, dist.ReduceOp.MAX, group)
        # A new contiguous fp32 buffer: becomes exp(logits) and then the saved softmax.
        shifted = (logits.float() - logits_max.unsqueeze(-1)).contiguous()

        local_target, outside = target_on_rank(target, per_rank, group)
        flat = shifted.view(-1, per_rank)
        rows = torch.arange(flat.shape[0], device=flat.device)
        predicted = flat[rows, local_target.reshape(-1)].view(target.shape).masked_fill(outside, 0.0)
        all_reduce_over_vocab(predicted, dist.ReduceOp.SUM, group)

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        all_reduce_over_vocab(sum_exp, dist.ReduceOp.SUM, group)
        loss = torch.log(sum_exp) - predicted

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.logits_dtype = logits.dtype
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:
            raise RuntimeError("vocab_parallel_cross_entropy reuses its softmax buffer: backward runs once")
        ctx.backward_done = True
        softmax, outside, local_target = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad = softmax  # reused in place: no second [..., V/tp] buffer
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(flat.dtype)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token fp32 loss ``-log softmax(logits)[target]`` from vocabulary-parallel logits.

    ``logits_shard``: ``[..., V/tp]`` (any float dtype; computed in fp32), this rank's slice
    of the padded vocabulary in rank order.  ``target``: int64 ``[...]`` full-vocabulary ids
    in ``[0, V)`` (no ignore index: multiply the returned losses by a loss mask instead).
    Forward sends three all-reduces of ``[...]`` (max, target logit, sum of exps) over
    ``tp_group`` (``None``: this rank alone);
    backward sends nothing.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and target {tuple(target.shape)} do not match")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group)
