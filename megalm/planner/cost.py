"""Step time of one layout: compute per op class + communication per group over its links - overlap + bubble.

For a validated config (``validate_config`` with the world size, vocabulary set) on a :class:`Cluster`,
per microbatch on the busiest pipeline stage, ``T = b s / CP`` tokens, ``B`` the model dtype's bytes:

* **GEMMs** (forward; the backward runs two GEMMs of each size): QKV ``2 T h (n + 2g) d / TP``, projection
  ``2 T n d h / TP``, MLP ``2 T h f (2 or 3 with SwiGLU) / TP``, MoE experts ``k`` routed copies of the rank's
  ``T / TP`` tokens (the router ``2 T h E``), logits ``2 T h V / TP`` on the last stage; each at the
  cluster's GEMM rate for its size (:meth:`Cluster.gemm_flops_per_s`).  Full recompute runs the forward
  again (selective: the attention core).
* **attention core**: ``4 b (s / CP) s n d / TP`` forward (QK^T and AV, causal counted whole as
  Megatron-LM does), x3 with the backward, at ``attention_efficiency`` x peak.
* **elementwise** (norms, residuals, activation function, RoPE, dropout; memory-bound): ``~ (14 h + 3 f')``
  values of ``B`` bytes per token and layer forward, x3 with the backward, at ``memory_bandwidth``; the
  optimizer step reads and writes ``36`` bytes per (sharded) parameter.
* **overhead**: ``layer_overhead_us`` per layer and microbatch (kernel launches, Python), ``step_overhead_ms``.
* **TP** per layer and microbatch: forward two all-reduces of ``T h B`` (attention and MLP outputs),
  backward two (the inputs' gradients); with sequence parallelism each becomes an all-gather + a
  reduce-scatter, and the backward gathers the QKV / fc1 inputs again; the embedding's all-reduce and the
  output layer's; not overlapped.
* **CP** per layer and microbatch: p2p ring ``CP - 1`` exchanges of the K/V chunk ``2 T g d B / TP`` forward,
  K/V and their gradients backward; a2a four all-to-alls forward (q, k, v in; the output back) and backward;
  allgather: the K/V all-gather forward, their gradients' reduce-scatter backward.
* **EP** per MoE layer and microbatch: dispatch and combine all-to-alls of ``k T h B / TP``, forward and
  backward.
* **PP**: one send of the stage's output ``T h B`` (``/ TP`` under sequence parallelism) per microbatch and
  chunk forward, one of its gradient backward; the schedule runs ``(m v + p - 1)`` chunk slots, so the
  bubble is ``(p - 1) / v`` microbatch times of the stage: ``(p-1)/(v m + p - 1)`` of the pipelined time.
* **DP** (over data x context ranks; experts over expert-DP): no_shard all-reduces the gradients (``grads``
  bytes per parameter, fp32 by default); the distributed optimizer reduce-scatters them and all-gathers the
  weights; ZeRO-3 gathers the weights again for every microbatch's forward and backward;
  ``--hierarchical-grad-reduce`` is an intra reduce-scatter, an inter all-reduce of ``1 / L`` of the bucket
  and an intra all-gather.  ``--overlap-grad-reduce`` hides up to ``dp_overlap`` x the last microbatch's
  backward; the embedding's gradient all-reduce between the first and last stage (tied, PP > 1) is exposed.

The result's ``terms`` are seconds per step; ``dominant`` names the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from megalm.estimate.parameters import all_stages, moe_layers
from megalm.models.layer_split import layers_for_stage, virtual_stages
from megalm.planner.links import a2a_time, layout_links, p2p_time, ring_time

OPTIMIZER_BYTES_PER_PARAM = 36  # Adam: read grad, weight, two moments, write weight, moments; norm; zeroing


@dataclass
class StepCost:
    step_s: float
    terms: Dict[str, float]  # seconds per step by term (compute, tp_comm, cp_comm, ep_comm, pp_comm, dp_comm, ...)
    dp_inter_node_bytes: float  # bytes the busiest node sends across nodes per step for data parallelism
    detail: Dict[str, float] = field(default_factory=dict)

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def _dtype_bytes(t) -> int:
    return 2 if (t.bf16 or t.fp16) else 4


class _Step:
    """Per-microbatch costs of one layout (a helper of :func:`step_cost`)."""

    def __init__(self, cfg, cluster):
        self.cfg, self.c = cfg, cluster
        m, p, t = cfg.model, cfg.parallel, cfg.training
        self.m, self.p, self.t = m, p, t
        self.tp, self.pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        self.cp = p.context_parallel_size
        self.ep, self.etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or 1
        self.vpp = virtual_stages(p, m.num_layers) or 1
        self.B = _dtype_bytes(t)
        self.T = t.micro_batch_size * m.seq_length // self.cp  # tokens per rank per microbatch
        self.sp = p.sequence_parallel and self.tp > 1
        self.world = p.world_size
        per_node = min(cluster.devices_per_node, self.world)
        self.links = layout_links(self.world, per_node, self.tp, self.pp, self.cp, self.ep, self.etp)
        self.inter = 0.0
        self.gloo = cluster.backend == "gloo"

    # --- collectives (seconds; inter-node bytes accumulated) --------------------------------------------
    def ring(self, kind: str, op: str, nbytes: float) -> float:
        wire = 2.0 if (op == "reduce_scatter" and self.gloo) else 1.0
        sec, inter = ring_time(self.c, self.links[kind], op, nbytes, wire)
        self.inter += inter
        return sec

    def a2a(self, kind: str, nbytes: float) -> float:
        sec, inter = a2a_time(self.c, self.links[kind], nbytes)
        self.inter += inter
        return sec

    # --- compute -------------------------------------------------------------------------------------
    def gemm(self, flops: float) -> float:
        """Forward + backward seconds of one forward GEMM of ``flops``."""
        return 3 * flops / self.c.gemm_flops_per_s(flops) if flops > 0 else 0.0

    def layer(self, is_moe: bool) -> Dict[str, float]:
        """Seconds of one layer for one microbatch, forward + backward, by term."""
        m, T, tp = self.m, self.T, self.tp
        h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
        g = m.num_query_groups if m.group_query_attention else n
        gemm = self.gemm(2 * T * h * (n + 2 * g) * d / tp) + self.gemm(2 * T * n * d * h / tp)
        mats = 3 if m.swiglu else 2
        if is_moe:
            f = m.moe_ffn_hidden_size or m.ffn_hidden_size
            routed = (m.moe_router_topk or 1) * T / tp
            experts_here = m.num_experts // self.ep
            per_expert = routed / m.num_experts * self.ep  # tokens one local expert sees (balanced routing)
            gemm += experts_here * mats * self.gemm(2 * per_expert * h * f / max(1, self.etp))
            gemm += self.gemm(2 * T / tp * h * m.num_experts)
            shared = m.moe_shared_expert_intermediate_size or 0
            gemm += mats * self.gemm(2 * T * h * shared / tp) if shared else 0.0
            ffn = (m.moe_router_topk or 1) * f
        else:
            f = m.ffn_hidden_size
            gemm += mats * self.gemm(2 * T * h * f / tp)
            ffn = f / tp
        attn_flops = 4 * self.t.micro_batch_size * (m.seq_length // self.cp) * m.seq_length * n * d / tp
        attention = 3 * attn_flops / (self.c.attention_efficiency * self.c.peak_tflops * 1e12)
        tokens_e = T / tp if self.sp else T
        elem = 3 * self.B * (tokens_e * 14 * h + T * (3 * ffn + 2 * (n + g) * d / tp))
        elementwise = elem / (self.c.memory_bandwidth_gbps * 1e9)
        if m.recompute_granularity == "full":
            gemm, attention, elementwise = gemm * 4 / 3, attention * 4 / 3, elementwise * 4 / 3
        elif m.recompute_granularity == "selective":
            attention *= 4 / 3
        out = {"gemm": gemm, "attention": attention, "elementwise": elementwise}
        out["overhead"] = self.c.layer_overhead_us * 1e-6 * (4 / 3 if m.recompute_granularity == "full" else 1)
        out.update(self.layer_comm(is_moe))
        return out

    def layer_comm(self, is_moe: bool) -> Dict[str, float]:
        m, T, B, tp = self.m, self.T, self.B, self.tp
        h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
        g = m.num_query_groups if m.group_query_attention else n
        out = {"tp_comm": 0.0, "cp_comm": 0.0, "ep_comm": 0.0}
        again = 2 if m.recompute_granularity == "full" else 1  # forward collectives run again in the backward
        if tp > 1:
            act = T * h * B
            if self.sp:  # forward AG + RS per block; backward RS + AG, and the inputs gathered again
                ag, rs = self.ring("tensor", "all_gather", act), self.ring("tensor", "reduce_scatter", act)
                out["tp_comm"] = 2 * again * (ag + rs) + 2 * (ag + rs) + 2 * ag
            else:
                ar = self.ring("tensor", "all_reduce", act)
                out["tp_comm"] = 2 * again * ar + 2 * ar
        if self.cp > 1:
            kv = 2 * T * g * d * B / tp
            if self.p.cp_comm_type == "p2p":
                one = p2p_time(self.c, self.links["context"], kv)[0]
                self.inter += 3 * (self.cp - 1) * kv * self.links["context"].crosses
                out["cp_comm"] = (self.cp - 1) * one * (again + 2)
            elif self.p.cp_comm_type == "a2a":
                qkv = T * (n + 2 * g) * d * B / tp
                ctx = T * n * d * B / tp
                out["cp_comm"] = (again + 1) * (self.a2a("context", qkv) + self.a2a("context", ctx))
            else:  # allgather: gather K/V forward (and recompute), reduce-scatter their gradients
                full = kv * self.cp
                ag = self.ring("context", "all_gather", full)
                out["cp_comm"] = again * ag + self.ring("context", "reduce_scatter", full)
        if is_moe and self.ep > 1:
            tokens = (m.moe_router_topk or 1) * T / tp * h * B
            out["ep_comm"] = 2 * (again + 1) * self.a2a("expert", tokens)
        return out

    def stage_micro(self, pp_rank: int) -> Dict[str, float]:
        """Seconds of one microbatch (all chunks) on pipeline rank ``pp_rank``, by term."""
        pattern = moe_layers(self.m)
        totals: Dict[str, float] = {}
        cache: Dict[bool, Dict[str, float]] = {}
        for v in range(self.vpp):
            for i in layers_for_stage(self.cfg, pp_rank, v):
                if pattern[i] not in cache:
                    cache[pattern[i]] = self.layer(pattern[i])
                for k, x in cache[pattern[i]].items():
                    totals[k] = totals.get(k, 0.0) + x
        m, T, tp, B = self.m, self.T, self.tp, self.B
        vocab = m.padded_vocab_size
        if pp_rank == self.pp - 1:
            totals["gemm"] = totals.get("gemm", 0.0) + self.gemm(2 * T * m.hidden_size * vocab / tp)
            totals["elementwise"] = totals.get("elementwise", 0.0) + 3 * 4 * T * vocab / tp / (
                self.c.memory_bandwidth_gbps * 1e9
            )
            if tp > 1:
                op = "all_gather" if self.sp else "all_reduce"
                totals["tp_comm"] += 2 * self.ring("tensor", op, T * m.hidden_size * B)
        if pp_rank == 0 and tp > 1:
            op = "reduce_scatter" if self.sp else "all_reduce"
            totals["tp_comm"] += self.ring("tensor", op, T * m.hidden_size * B)
        return totals


COMPUTE_TERMS = ("gemm", "attention", "elementwise", "overhead")


def step_cost(cfg, cluster) -> StepCost:
    """:class:`StepCost` of ``cfg`` (validated with its world size, vocabulary set) on ``cluster``."""
    s = _Step(cfg, cluster)
    m, p, t = s.m, s.p, s.t
    dp = p.data_parallel_size
    n_micro = t.global_batch_size // (t.micro_batch_size * dp)
    stages = [s.stage_micro(r) for r in range(s.pp)]
    per_micro = [sum(st.values()) for st in stages]
    busiest = max(range(s.pp), key=lambda r: per_micro[r])
    tau = per_micro[busiest]
    # Pipeline: p2p per microbatch and chunk, forward activation and backward gradient.
    p2p = 0.0
    if s.pp > 1:
        act = s.T * m.hidden_size * s.B / (s.tp if s.sp else 1)
        one, inter = p2p_time(s.c, s.links["pipeline"], act)
        p2p = 2 * s.vpp * one
        s.inter += 2 * s.vpp * n_micro * inter
    slot = tau + p2p
    bubble = (s.pp - 1) / s.vpp * (sum(per_micro) / s.pp + p2p) if s.pp > 1 else 0.0
    terms = {k: n_micro * stages[busiest].get(k, 0.0) for k in (*COMPUTE_TERMS, "tp_comm", "cp_comm", "ep_comm")}
    terms["pp_comm"] = n_micro * p2p
    terms["bubble"] = bubble
    s.inter = 0.0  # from here on: the data-parallel collectives' inter-node bytes
    dp_terms = _data_parallel(s, cfg, busiest, n_micro, stages[busiest])
    terms.update(dp_terms)
    terms["overhead"] += cluster.step_overhead_ms * 1e-3
    step = n_micro * slot + bubble + sum(dp_terms.values()) + cluster.step_overhead_ms * 1e-3
    detail = {"microbatches": n_micro, "per_microbatch_s": tau, "busiest_pp_rank": busiest}
    return StepCost(step, terms, s.inter, detail)


def _data_parallel(s: _Step, cfg, pp_rank: int, n_micro: int, stage_terms: Dict[str, float]) -> Dict[str, float]:
    """Exposed data-parallel seconds (gradient reduction, parameter gathers, embedding sync) and the
    optimizer step of pipeline rank ``pp_rank``."""
    from megalm.estimate.planner import state_bytes_per_param

    m, p, t = s.m, s.p, s.t
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    per = state_bytes_per_param(precision, t.optimizer, t.sgd_momentum, p.accumulate_allreduce_grads_in_fp32)
    st = all_stages(cfg)[pp_rank]
    strategy = p.data_parallel_sharding_strategy
    sharded = strategy != "no_shard"
    dense_g, expert_g = st.dense * per["grads"], st.expert * per["grads"]
    red = "reduce_scatter" if sharded else "all_reduce"
    dp_links = s.links["data_context"]
    if p.hierarchical_grad_reduce and dp_links.crosses and dp_links.size > dp_links.per_node:
        grad = _hierarchical(s, red, dense_g, dp_links)
    else:
        grad = s.ring("data_context", red, dense_g)
    grad += s.ring("expert_data", red, expert_g) if st.expert else 0.0
    gather = 0.0
    if sharded:
        gather = s.ring("data_context", "all_gather", st.dense * per["weights"])
        gather += s.ring("expert_data", "all_gather", st.expert * per["weights"]) if st.expert else 0.0
    if strategy == "optim_grads_params":
        gather *= 1 + 2 * n_micro  # gathered for every microbatch's forward and backward, and after the step
    backward = (2 / 3) * sum(stage_terms.get(k, 0.0) for k in COMPUTE_TERMS)
    hidden = s.c.dp_overlap * backward if p.overlap_grad_reduce else 0.0
    exposed_grad = max(grad - hidden, grad * 0.1 if hidden else grad)
    hidden_gather = s.c.dp_overlap * backward / 2 * n_micro if p.overlap_param_gather else 0.0
    exposed_gather = max(gather - hidden_gather, 0.0)
    emb = 0.0
    if s.pp > 1 and not m.untie_embeddings_and_output_weights:
        emb = s.ring("embedding", "all_reduce", m.padded_vocab_size // s.tp * m.hidden_size * per["grads"])
    shards = p.data_parallel_size * s.cp if sharded else 1
    local = st.dense / shards + st.expert / (max(1, _edp(s)) if sharded else 1)
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM / (s.c.memory_bandwidth_gbps * 1e9)
    return {"dp_comm": exposed_grad + exposed_gather + emb, "optimizer": optimizer}


def _edp(s: _Step) -> int:
    from megalm.parallel_layout import expert_data_parallel_size

    return expert_data_parallel_size(s.tp, s.cp, s.p.data_parallel_size, s.ep, s.etp)


def _hierarchical(s: _Step, op: str, nbytes: float, links) -> float:
    """Intra reduce-scatter, inter all-reduce (or reduce-scatter) of ``1 / L``, intra all-gather."""
    from megalm.planner.links import GroupLinks

    L, n = links.per_node, links.nodes
    intra = GroupLinks(L, False, 0, 0.0, L, 1)
    inter = GroupLinks(n, True, L * max(1, links.ring_senders), 0.0, 1, n)
    wire = 2.0 if s.gloo else 1.0
    t = ring_time(s.c, intra, "reduce_scatter", nbytes, wire)[0]
    sec, sent = ring_time(s.c, inter, "all_reduce" if op == "all_reduce" else "reduce_scatter", nbytes / L, 1.0)
    s.inter += sent
    t += sec
    if op == "all_reduce":
        t += ring_time(s.c, intra, "all_gather", nbytes)[0]
    return t
