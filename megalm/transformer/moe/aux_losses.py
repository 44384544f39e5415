"""Router auxiliary losses and how their gradient enters the backward pass.

Formulas (``T`` tokens, ``E`` experts, top-``k`` routing, ``p[t, i]`` the router's score of
expert ``i`` over ALL experts: softmax of the logits, or normalized sigmoid):

* switch load-balancing loss (``aux_loss``, Megatron's ``switch_load_balancing_loss_func``)::

      E * sum_i f_i * P_i,   f_i = count_i / (T k),   P_i = sum_t p[t, i] / T

  (count_i: tokens whose top-k includes expert ``i``, before capacity dropping);
* sequence load-balancing loss (``seq_aux_loss``): the same per sequence, averaged over the
  ``b`` sequences of the micro-batch (``T`` replaced by the sequence length ``s``);
* z-loss: ``mean_t logsumexp(logits[t])^2``.

Each is multiplied by its coefficient (``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``) before
it enters the backward pass; logged values are without the coefficient (Megatron logs
``loss / coeff``).

Under sequence parallelism each tensor-parallel rank holds a slice of every sequence.  The
counts are summed over TP first (by the router), and each rank's loss is the *partial* sum
of its own tokens' probabilities against the full counts, so the partial losses of the TP
ranks add up to the loss of the whole sequence and each rank's backward gives the gradient of
its own tokens (the router weight's gradient is then summed over TP like a norm's).

:class:`MoEAuxLossAutoScaler` attaches a loss to an activation: forward is the identity;
backward passes the activation's gradient through and gives the loss the gradient
``main_loss_backward_scale`` = loss scale / number of micro-batches, exactly the factor the
main loss gets from the schedule.  So the auxiliary gradient is right under fp16 loss scaling,
gradient accumulation and pipeline parallelism (where the loss of a layer on an earlier stage
never reaches the last stage's loss function).  The factor lives in the model's
:class:`~megalm.transformer.moe.state.MoEState`, read at backward time; the trainer sets it
once per step (``GPTModel.set_aux_loss_scale``).  No communication here.
"""

from __future__ import annotations

import torch


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``apply(activation, aux_loss, state) -> activation``; backward adds
    ``d aux_loss = state.aux_loss_scale`` (``state``: the model's ``MoEState``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, state) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.state = state
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.state.aux_loss_scale), None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, state) -> torch.Tensor:
    """``activation`` unchanged; ``aux_loss`` joins the backward pass with the main loss's scale
    (``state.aux_loss_scale``)."""
    return MoEAuxLossAutoScaler.apply(activation, aux_loss, state)


# --- formulas -----------------------------------------------------------------------------------


def switch_load_balancing_loss(
    probs_sum: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, topk: int
) -> torch.Tensor:
    """``E * sum_i (count_i / (T k)) * (probs_sum_i / T)`` without the coefficient.

    ``probs_sum`` ``[E]``: sum over tokens of the router scores (a partial sum under sequence
    parallelism); ``tokens_per_expert`` ``[E]``: top-k counts of all ``num_tokens`` tokens.
    """
    num_experts = probs_sum.shape[-1]
    f = tokens_per_expert.to(probs_sum.dtype) / (num_tokens * topk)
    return num_experts * torch.sum(f * probs_sum / num_tokens)


def sequence_load_balancing_loss(
    probs_sum: torch.Tensor, tokens_per_expert: torch.Tensor, seq_length: int, topk: int
) -> torch.Tensor:
    """Switch loss per sequence, averaged over sequences, without the coefficient.

    ``probs_sum``, ``tokens_per_expert``: ``[b, E]`` sums over each sequence's ``seq_length``
    tokens (``probs_sum`` partial under sequence parallelism).
    """
    num_experts = probs_sum.shape[-1]
    f = tokens_per_expert.to(probs_sum.dtype) / (seq_length * topk)
    return num_experts * torch.sum(f * probs_sum / seq_length, dim=-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits[t])^2`` (fp32), without the coefficient."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
