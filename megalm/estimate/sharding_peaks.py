"""Model-state bytes the sharded strategies hold above their steady share during a step (upper bounds).

The per-parameter formulas (``2 + 16/d`` for ZeRO-2, ``18/d`` for ZeRO-3 in bf16) are what a rank holds
between steps.  During the backward more is alive (megalm's buckets, :mod:`megalm.distributed.sharded_grad_buffer`
and :mod:`megalm.distributed.unsharder`).  With ``U`` a layer bucket's bound, ``--ddp-bucket-size`` (with
``--overlap-grad-reduce`` and no size, Megatron's default ``max(40M, 1M x DP)``) plus the largest layer
parameter it can close on, ``E`` the stage's embedding and output weights (``V h / TP`` each, the
position table; a bucket holding one of them is at most ``U`` plus it) and ``E_1`` the larger of the two,
in elements:

* ``optim_grads`` and ``optim_grads_params``, gradients: each bucket's full storage lives from its first
  gradient to its reduce-scatter.  With several microbatches, or without ``--overlap-grad-reduce``
  (reduced after the backward: one bucket holds the stage when no size is given), every bucket's: the
  whole stage's gradient bytes; with one microbatch and overlap, the bucket being filled and the two whose
  reductions may be in flight (gradients arriving in bucket order): ``3 U + E_1``, the embedding's and the
  output layer's buckets being the two ends of the order (with at most three buckets, ``stage <= 3 U + E``,
  all of them);
* ``optim_grads_params``, weights: the gathered buckets: one (two with ``--overlap-param-gather``'s
  prefetch), at least a recomputed region's (``--recompute-granularity full``: its layers plus the two
  buckets at its ends), plus ``E`` (a tied embedding's bucket is pinned, an untied output layer's is
  gathered for the whole forward, the embedding's while it runs).  Gathered weights and gradient buckets
  are not alive at their largest at the same time.  With several microbatches (or without overlap) every
  gradient bucket lives on into the next forward, which gathers its weights: their sum.  With one
  microbatch and overlap, the largest of three moments: the forward (the weights above, no gradient
  yet); the backward's start (the output layer's bucket, gathered and its gradient storage allocated: its
  weight alone, ``E_1``, when tied (a bucket of its own) or when it fills a bucket alone, else ``U``; a
  tied embedding is gathered with the last layer's bucket; plus a prefetched bucket); later in the
  backward (the gathered buckets and a tied embedding, plus the three gradient buckets above; by then the
  output layer's weight is freed).
  The activations are counted whole at each (:mod:`megalm.estimate.activations`), which they are only at
  the backward's start.
  MoE expert weights are sharded too (over the expert-data-parallel group, buckets of their own): while an MoE
  layer's experts run (forward, and backward where it unpacks their weights) one expert bucket is gathered
  besides the dense ones, ``U_e`` (``--ddp-bucket-size`` plus the largest expert parameter; the stage's
  experts when no size is given): added to the forward's and the later backward's weights.

Each is capped by the stage's own bytes.  ``no_shard`` and ``optim`` hold everything all the time: 0, except on
gloo (``gloo``: the CPU), whose reduce-scatter and all-gather copy their whole (unsharded) buffer while they run
(measured: a temporary of the full buffer's bytes each; its all-reduce works in place): ``optim`` launches
every bucket's reduce-scatter without waiting for the earlier ones (with ``--overlap-grad-reduce`` during the
backward, else all at its end), so up to the stage's gradient bytes are copied at once.  ZeRO-2/3 keep at most
two reductions in flight, inside the bounds above.
"""

from __future__ import annotations

from typing import Dict

from megalm.distributed.data_parallel import default_bucket_size
from megalm.estimate.parameters import layer_parameters


def _bucket_size(cfg, dp: int):
    """Elements at which DDP closes a bucket (None: one bucket per buffer)."""
    p = cfg.parallel
    size = p.ddp_bucket_size
    if size is None and p.overlap_grad_reduce:
        size = default_bucket_size(dp)
    return size


def _layer_bucket(cfg, stage, dp: int) -> int:
    """``U``: elements of a layer bucket (bucket size plus the largest layer parameter), capped by the stage."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    size = _bucket_size(cfg, dp)
    if size is None:
        return stage.total
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    groups = m.num_query_groups if m.group_query_attention else n
    fc1 = (2 if m.gated_linear_unit else 1) * (m.ffn_hidden_size or 4 * h) // tp
    return min(stage.total, size + max((n + 2 * groups) * d // tp * h, fc1 * h))


def _expert_bucket(cfg, stage, dp: int) -> int:
    """``U_e``: elements of an expert bucket (bucket size plus the largest expert parameter), capped by the
    stage's expert parameters (0 without experts)."""
    m, p = cfg.model, cfg.parallel
    size = _bucket_size(cfg, dp)
    if not stage.expert or size is None:
        return stage.expert
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    fc1 = (2 if m.gated_linear_unit else 1) * f // (p.expert_tensor_parallel_size or 1)
    return min(stage.expert, size + fc1 * m.hidden_size)


def transient_bytes(
    cfg, stage, per_param: Dict[str, float], dp: int, num_micro: int, gloo: bool = False
) -> Dict[str, float]:
    """``{strategy: bytes}`` above the steady formula at the peak of a step on ``stage`` (see the module
    docstring; ``gloo``: the collectives' copies of the CPU backend)."""
    m, p = cfg.model, cfg.parallel
    unit, whole = _layer_bucket(cfg, stage, dp), stage.embedding
    one = 0  # E_1: the word embedding with the position table, or the output layer's weight
    if whole:
        one = m.padded_vocab_size // p.tensor_model_parallel_size * m.hidden_size
        if stage.pp_rank == 0 and m.position_embedding_type == "learned_absolute":
            one += m.max_position_embeddings * m.hidden_size
    several = num_micro > 1 or not p.overlap_grad_reduce
    full = several or stage.total <= 3 * unit + whole
    grads = per_param["grads"] * (stage.total if full else 3 * unit + one)
    prefetch = unit if p.overlap_param_gather else 0
    gathered = unit + prefetch
    if m.recompute_granularity == "full":
        region = (m.recompute_num_layers or 1) * layer_parameters(m, p.tensor_model_parallel_size, 1, False)[0]
        gathered = max(gathered, region + 2 * unit)
    experts = _expert_bucket(cfg, stage, dp)
    weights = per_param["weights"] * min(stage.total, gathered + whole + experts)
    copies = per_param["grads"] * stage.total if gloo and dp > 1 else 0.0
    zero3 = grads + weights  # several microbatches: every gradient bucket is alive in the next forward
    if not several:  # one microbatch: the largest of three moments, not their sum (see the module docstring)
        w, g, cap = per_param["weights"], per_param["grads"], stage.total
        tied = not m.untie_embeddings_and_output_weights
        pinned = whole if tied else 0
        # The output weight is first in bucket order: a bucket of its own when tied (isolated) or when it
        # fills one alone, else the first layer bucket (U) holds it.
        first = min(cap, one if tied or one >= (_bucket_size(cfg, dp) or cap) else unit)
        held = (pinned + unit) if tied else first  # tied: the last layer bucket is still gathered from the forward
        zero3 = max(
            weights,  # the forward: gathered buckets and E, no gradients yet
            w * min(cap, held + prefetch) + g * first,  # the backward's first bucket, its gradient storage
            w * min(cap, gathered + pinned + experts) + grads,  # later: gathered buckets, three gradient buckets
        )
    return {"no_shard": 0.0, "optim": copies, "optim_grads": grads, "optim_grads_params": zero3}
