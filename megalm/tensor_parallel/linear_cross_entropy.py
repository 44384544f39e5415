"""Output layer and vocabulary-parallel cross entropy fused, in chunks of tokens
(``--cross-entropy-loss-fusion``, on by default).

Per token ``i`` with input row ``x_i`` (``[N, h]``, ``N = s b``) and this TP rank's slice
``W`` (``[V/tp, h]``) of the output weight::

    z_i = x_i W^T                                   (this rank's logits, never stored whole)
    loss_i = logsumexp_v(z_i) - z_i[target_i]       (the max and the sums run over all ranks)
    dz_i = w_i (softmax(z_i) - one_hot(target_i))   (w_i: the per-token loss weight)
    dx_i = dz_i W,   dW = sum_i dz_i^T x_i

The tokens are processed ``C`` at a time.  For each chunk the forward computes its
``[V/tp, C]`` logits into one reused buffer, the loss, and (when gradients are needed) the
logit gradient in place and at once its two products: ``dx`` rows and an fp32 ``dW``
accumulator.  So the ``[N, V/tp]`` logits, their softmax and their gradient never exist
(for Llama-3's 128k vocabulary that is 2 GB per 4k tokens in fp32), the chunk stays in cache
on a CPU, and no large buffer is allocated per step.  The GEMMs are the unfused layer's
(three of ``2 N h V/tp`` FLOPs); nothing is recomputed.

Backward receives ``grad_loss`` and only scales: when it equals ``c w`` for one scalar ``c``
(the training loss is a masked mean of the per-token losses, times the loss scale and
``1 / microbatches``; ``w`` is the loss mask passed in) the saved ``dx`` and ``dW`` are
multiplied by ``c``.  Any other use of the per-token losses is still exact: the gradients are
then recomputed chunk by chunk with the real ``grad_loss`` (one extra GEMM per chunk).

Padded vocabulary columns (ids ``>= vocab_size``) get logit ``-inf`` (see
:class:`megalm.models.gpt.GPTModel`), so they take no part and get zero gradient.

Communication (TP group): forward all-gathers the ``[s/tp, b, h]`` input along the sequence
under sequence parallelism (once); per chunk two all-reduces of ``[C]``-sized vectors (MAX of
the per-token maxima; SUM of ``[sum of exps ; target logit]``).  Backward all-reduces the input
gradient (reduce-scatters it along the sequence under SP), as
:class:`~megalm.tensor_parallel.layers.ColumnParallelLinear` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.cross_entropy import all_reduce_over_vocab, target_on_rank
from megalm.tensor_parallel.mappings import all_gather_first_dim, all_reduce, reduce_scatter_first_dim

# Bytes of one fp32 logits chunk (a GPU wants large chunks: few kernel launches and all-reduces)
# and the fewest tokens per chunk (below that the GEMMs lose efficiency; measured on CPU).
CHUNK_BYTES = {"cpu": 16 << 20, "cuda": 512 << 20}
MIN_CHUNK_ROWS = 512


def chunk_rows(num_rows: int, vocab_local: int, device: torch.device) -> int:
    """Tokens per chunk: :data:`CHUNK_BYTES` of fp32 logits but at least :data:`MIN_CHUNK_ROWS`,
    at most ``num_rows``."""
    budget = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
    return max(1, min(num_rows, max(MIN_CHUNK_ROWS, budget // (4 * vocab_local))))


class _Chunks:
    """Shared per-call state: the rank's vocabulary slice, targets, and the reusable buffers.
    ``x`` is ``[N, h]``; ``shape`` the ``[s, b, h]`` it came from.

    A chunk's logits are held transposed, ``[V/tp, C]`` (``W x_c^T``): the three GEMMs then take
    their operands as stored and ran ~5% faster than the ``[C, V/tp]`` layout on CPU; the
    reductions over the vocabulary run down the columns."""

    def __init__(
        self, x: torch.Tensor, shape: torch.Size, weight: torch.Tensor, target: torch.Tensor, vocab_size: int, group
    ):
        self.x, self.shape, self.weight, self.group = x, shape, weight, group
        self.vocab_local = weight.shape[0]
        start = group_rank(group) * self.vocab_local
        self.valid = min(self.vocab_local, max(0, vocab_size - start))  # unpadded columns on this rank
        self.local_target, self.outside = target_on_rank(target, self.vocab_local, group)
        self.rows = chunk_rows(x.shape[0], self.vocab_local, x.device)
        self._buffers = {}

    def buffers(self, n: int):
        """``(fp32 logits [V/tp, n], the same in the compute dtype)``, reused for every chunk of ``n``
        tokens (the GEMM buffer is the fp32 one for fp32 models)."""
        if n not in self._buffers:
            logits = torch.empty(self.vocab_local, n, dtype=torch.float32, device=self.x.device)
            gemm = logits if self.x.dtype == torch.float32 else torch.empty_like(logits, dtype=self.x.dtype)
            self._buffers[n] = (logits, gemm)
        return self._buffers[n]

    def ranges(self):
        for start in range(0, self.x.shape[0], self.rows):
            yield start, min(start + self.rows, self.x.shape[0])

    def exp_logits(self, start: int, end: int):
        """Fill the fp32 buffer with ``exp(z - max)`` of tokens ``start:end``; return
        ``(buffer [V/tp, n], global max, global sum of exps, global target logit)``."""
        z, gemm = self.buffers(end - start)
        torch.mm(self.weight, self.x[start:end].t(), out=gemm)
        if gemm is not z:
            z.copy_(gemm)
        if self.valid < self.vocab_local:
            z[self.valid :] = float("-inf")
        token_max = all_reduce_over_vocab(z.amax(dim=0), dist.ReduceOp.MAX, self.group)
        outside = self.outside[start:end]
        target_logit = z.gather(0, self.local_target[None, start:end]).squeeze(0).masked_fill(outside, 0.0)
        z.sub_(token_max[None, :]).exp_()
        sums = all_reduce_over_vocab(torch.stack([z.sum(dim=0), target_logit]), dist.ReduceOp.SUM, self.group)
        return z, token_max, sums[0], sums[1]

    def logit_grad(self, e: torch.Tensor, sum_exp: torch.Tensor, weight: torch.Tensor, start: int, end: int):
        """``weight (softmax - one_hot)`` in place of ``e = exp(z - max)``; returned in the compute dtype."""
        e.mul_((weight / sum_exp)[None, :])
        inside = (~self.outside[start:end]).to(e.dtype)
        e.scatter_add_(0, self.local_target[None, start:end], -(weight * inside)[None, :])
        gemm = self.buffers(end - start)[1]
        if gemm is not e:
            gemm.copy_(e)
        return gemm

    def accumulate(
        self, grad_logits: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, start: int, end: int, first: bool
    ):
        """``dx[start:end] = g^T W`` and ``dW += g x[start:end]`` for ``g`` ``[V/tp, n]`` (fp32 ``dW``)."""
        torch.mm(grad_logits.t(), self.weight, out=dx[start:end])
        x = self.x[start:end]
        if dw.dtype == grad_logits.dtype:
            if first:
                torch.mm(grad_logits, x, out=dw)
            else:
                dw.addmm_(grad_logits, x)
        else:
            product = torch.mm(grad_logits, x)
            dw.copy_(product) if first else dw.add_(product)


def _chunks_for(hidden, weight, target, vocab_size: int, sequence_parallel: bool, group) -> _Chunks:
    """The chunk state for ``hidden`` (all-gathered along the sequence over ``group`` under SP)."""
    x = all_gather_first_dim(hidden, group)[0] if sequence_parallel else hidden  # [s, b, h]
    return _Chunks(x.reshape(-1, x.shape[-1]), x.shape, weight, target.reshape(-1), vocab_size, group)


def _losses_and_grads(chunks: _Chunks, token_weight: Optional[torch.Tensor], with_grads: bool):
    """Per-token losses (fp32 ``[N]``), and ``(dx, dW)`` for per-token loss weights ``token_weight``."""
    x = chunks.x
    losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    dx = dw = None
    if with_grads:
        dx = torch.empty_like(x)
        dw = torch.empty(chunks.weight.shape, dtype=torch.float32, device=x.device)
    for start, end in chunks.ranges():
        e, token_max, sum_exp, target_logit = chunks.exp_logits(start, end)
        losses[start:end] = token_max + torch.log(sum_exp) - target_logit
        if with_grads:
            grad_logits = chunks.logit_grad(e, sum_exp, token_weight[start:end], start, end)
            chunks.accumulate(grad_logits, dx, dw, start, end, first=start == 0)
    return losses, dx, dw


def _common_scale(grad: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``c`` (0-dim) with ``grad == c * weight`` (to fp32 rounding), else None."""
    nonzero = torch.nonzero(weight).flatten()
    if nonzero.numel() == 0:
        return grad.new_zeros(()) if not bool(grad.any()) else None
    first = nonzero[0]
    scale = grad[first] / weight[first]
    return scale if torch.allclose(grad, scale * weight, rtol=1e-6, atol=0.0) else None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, target, token_weight, vocab_size: int, sequence_parallel: bool, with_grads: bool, group
    ):
        chunks = _chunks_for(hidden, weight, target, vocab_size, sequence_parallel, group)
        token_weight = token_weight.reshape(-1).float()
        losses, dx, dw = _losses_and_grads(chunks, token_weight, with_grads)
        # The inputs are kept for the rare backward whose grad_loss is not proportional to token_weight.
        ctx.save_for_backward(dx, dw, token_weight, hidden, weight, target)
        ctx.vocab_size, ctx.sequence_parallel, ctx.gathered_shape = vocab_size, sequence_parallel, chunks.shape
        ctx.group = group
        ctx.done = False
        return losses.view(chunks.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.done:
            raise RuntimeError("the fused linear cross entropy scales its saved gradients in place: backward runs once")
        ctx.done = True
        dx, dw, token_weight, hidden, weight, target = ctx.saved_tensors
        if dx is None:
            raise RuntimeError("the fused linear cross entropy ran without gradients (grad mode was off)")
        grad = grad_loss.reshape(-1).float()
        scale = _common_scale(grad, token_weight)
        if scale is not None:
            dx.mul_(scale.to(dx.dtype))
            dw.mul_(scale)
        else:  # grad_loss is not proportional to the loss weights: redo the chunks with it
            chunks = _chunks_for(hidden, weight, target, ctx.vocab_size, ctx.sequence_parallel, ctx.group)
            _, dx, dw = _losses_and_grads(chunks, grad, with_grads=True)
        dx = dx.view(ctx.gathered_shape)
        dx = reduce_scatter_first_dim(dx, ctx.group)[0] if ctx.sequence_parallel else all_reduce(dx, ctx.group)[0]
        return dx, dw.to(weight.dtype), None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    token_weight: Optional[torch.Tensor] = None,
    sequence_parallel: bool = False,
    *,
    tp_group,
) -> torch.Tensor:
    """Per-token fp32 losses ``[s, b]`` of ``hidden`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallelism) through this rank's output-weight slice ``weight`` ``[V/tp, h]``.

    ``target``: int64 ``[s, b]`` ids in ``[0, vocab_size)``.  ``token_weight``: ``[s, b]`` weights
    the loss will apply to the per-token losses (the loss mask; default ones): backward is
    fastest when the incoming gradient is proportional to it.  Gradients are computed in
    the forward when grad mode is on and ``hidden`` or ``weight`` requires them.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the output weight {tuple(weight.shape)}")
    group = tp_group
    tokens = hidden.shape[0] * (group_size(group) if sequence_parallel else 1)
    if tuple(target.shape) != (tokens,) + tuple(hidden.shape[1:-1]):
        raise ValueError(f"target {tuple(target.shape)} does not match hidden {tuple(hidden.shape)}")
    if token_weight is None:
        token_weight = torch.ones(target.shape, dtype=torch.float32, device=target.device)
    elif token_weight.shape != target.shape:
        raise ValueError(f"token_weight {tuple(token_weight.shape)} does not match target {tuple(target.shape)}")
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(
        hidden, weight, target, token_weight, vocab_size, sequence_parallel, with_grads, group
    )
