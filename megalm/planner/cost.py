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
  values of ``B`` bytes per token and layer forward, x3 with the backward, at ``memory_bandwidth``.
* **overhead**: ``layer_overhead_us`` per layer and microbatch (kernel launches, Python), ``step_overhead_ms``.
* **TP** per layer and microbatch: forward two all-reduces of ``T h B`` (attention and MLP outputs),
  backward two (the inputs' gradients); with sequence parallelism each becomes an all-gather + a
  reduce-scatter, and the backward gathers the QKV / fc1 inputs again; the embedding's all-reduce and the
  output layer's; not overlapped.
* **CP** per layer and microbatch: p2p ring ``CP - 1`` exchanges of the K/V chunk ``2 T g d B / TP`` forward,
  K/V and their gradients backward; a2a four all-to-alls forward (q, k, v in; the output back) and backward;
  allgather: the K/V all-gather forward, their gradients' reduce-scatter backward.
* **EP** per MoE layer and microbatch, by ``--moe-token-dispatcher-type``: ``alltoall`` (and ``flex``)
  an all-gather of the per-expert counts, then dispatch and combine all-to-alls of ``k T h B / TP``,
  forward and backward; ``allgather`` (the default) all-gathers the ``EP T / TP`` tokens ``[EP T, h]`` and
  their routing ``[EP T, 2 E]`` (fp32) and reduce-scatters the experts' sums, forward; all-gathers the
  output's gradient and reduce-scatters the tokens' and the routing's gradients, backward.
* **PP**: one send of the stage's output ``T h B`` (``/ TP`` under sequence parallelism) per microbatch and
  chunk forward, one of its gradient backward; the schedule runs ``(m v + p - 1)`` chunk slots, so the
  bubble is ``(p - 1) / v`` microbatch times of the stage: ``(p-1)/(v m + p - 1)`` of the pipelined time.
  Where the ranks share a host's ``host_cores`` (the simulated cluster), an idle stage lends its core to
  the busy ones: the pipelined time is the larger of every rank's own work at the shared rate (no bubble)
  and the whole schedule's critical path at a full core's rate (``host_cores / world`` of it).
* **activation offload** (``--cpu-offloading``): the first ``N`` layers of each chunk send what they save
  (:func:`megalm.estimate.activations.layer_bytes`) to the host in forward and back in backward over
  ``host_link_gbps``; on CUDA on side streams (exposed: what exceeds the layer's own compute), on a CPU device
  synchronous (all exposed).  Term ``offload``.
* **DP and the optimizer step**: :mod:`megalm.planner.data_parallel` (per bucket, compressed or not,
  hierarchical or across distributed-optimizer instances, overlap with the last microbatch's backward; the
  optimizer on the device or offloaded).

The result's ``terms`` are seconds per step; ``dominant`` names the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from megalm.estimate.parameters import moe_layers
from megalm.models.layer_split import layers_for_stage, virtual_stages
from megalm.planner.data_parallel import data_parallel
from megalm.planner.links import a2a_time, layout_links, p2p_time, ring_time


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
        self.instances = p.num_distributed_optimizer_instances
        links = (self.world, per_node, self.tp, self.pp, self.cp, self.ep, self.etp, self.instances)
        self.links = layout_links(*links)
        self.inter = 0.0
        self.stage_inter: Dict[int, float] = {}  # inter-node bytes of one microbatch per pipeline rank
        self.gloo = cluster.backend == "gloo"
        self.bw = cluster.memory_bandwidth_gbps * 1e9  # elementwise bytes/s

    # --- collectives (seconds; inter-node bytes accumulated) --------------------------------------------
    def ring(self, kind: str, op: str, nbytes: float, calls: float = 1) -> float:
        """Seconds of one call; the inter-node bytes of ``calls`` of them are accumulated."""
        wire = 2.0 if (op == "reduce_scatter" and self.gloo) else 1.0
        sec, inter = ring_time(self.c, self.links[kind], op, nbytes, wire)
        self.inter += calls * inter
        return sec

    def a2a(self, kind: str, nbytes: float, calls: float = 1) -> float:
        sec, inter = a2a_time(self.c, self.links[kind], nbytes)
        self.inter += calls * inter
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
                ag = self.ring("tensor", "all_gather", act, calls=2 * again + 4)
                rs = self.ring("tensor", "reduce_scatter", act, calls=2 * again + 2)
                out["tp_comm"] = 2 * again * (ag + rs) + 2 * (ag + rs) + 2 * ag
            else:
                ar = self.ring("tensor", "all_reduce", act, calls=2 * again + 2)
                out["tp_comm"] = 2 * again * ar + 2 * ar
        if self.cp > 1:
            kv = 2 * T * g * d * B / tp
            if self.p.cp_comm_type == "p2p":
                one = p2p_time(self.c, self.links["context"], kv)[0]
                self.inter += (again + 2) * (self.cp - 1) * kv * self.links["context"].crosses
                out["cp_comm"] = (self.cp - 1) * one * (again + 2)
            elif self.p.cp_comm_type == "a2a":
                qkv = T * (n + 2 * g) * d * B / tp
                ctx = T * n * d * B / tp
                both = self.a2a("context", qkv, again + 1) + self.a2a("context", ctx, again + 1)
                out["cp_comm"] = (again + 1) * both
            else:  # allgather: gather K/V forward (and recompute), reduce-scatter their gradients
                full = kv * self.cp
                ag = self.ring("context", "all_gather", full, calls=again)
                out["cp_comm"] = again * ag + self.ring("context", "reduce_scatter", full)
        if is_moe and self.ep > 1:
            out["ep_comm"] = self.dispatch(again)
        return out

    def dispatch(self, again: int) -> float:
        """EP seconds of one MoE layer and microbatch, by ``--moe-token-dispatcher-type`` (the module
        docstring of :mod:`megalm.transformer.moe.token_dispatcher`)."""
        m, B, ep = self.m, self.B, self.ep
        tokens = self.T / self.tp  # this rank's tokens (its sequence slice under sequence parallelism)
        if m.moe_token_dispatcher_type == "allgather":
            hidden = ep * tokens * m.hidden_size * B  # the gathered [EP T, h]
            routing = ep * tokens * 2 * m.num_experts * 4  # probabilities + routing map, fp32
            ag = self.ring("expert", "all_gather", hidden, calls=again + 1)
            rs = self.ring("expert", "reduce_scatter", hidden, calls=again + 1)
            ag_r = self.ring("expert", "all_gather", routing, calls=again)
            rs_r = self.ring("expert", "reduce_scatter", routing)
            # forward (again under full recompute): AG tokens, AG routing, RS output; backward: AG of the
            # output's gradient, RS of the tokens' and of the routing's gradients
            return again * (ag + ag_r + rs) + ag + rs + rs_r
        pairs = (m.moe_router_topk or 1) * tokens * m.hidden_size * B
        counts = self.ring("expert", "all_gather", ep * m.num_experts * 8, calls=again)  # split sizes, int64
        return again * counts + 2 * (again + 1) * self.a2a("expert", pairs, 2 * (again + 1))

    def offload(self, is_moe: bool, layer: Dict[str, float]) -> float:
        """Exposed seconds of one offloaded layer's saved tensors to the host and back (one microbatch)."""
        from megalm.estimate.activations import Shape, layer_bytes

        t, p = self.t, self.p
        sh = Shape(
            self.m.seq_length, t.micro_batch_size, self.tp, self.sp, self.B, self.c.device, self.cp, p.cp_comm_type
        )
        copy = 2 * sum(layer_bytes(self.m, sh, is_moe).values()) / (self.c.host_link_gbps * 1e9)
        if self.c.device == "cpu":
            return copy
        return max(0.0, copy - sum(layer.get(k, 0.0) for k in COMPUTE_TERMS))

    def stage_micro(self, pp_rank: int) -> Dict[str, float]:
        """Seconds of one microbatch (all chunks) on pipeline rank ``pp_rank``, by term."""
        pattern = moe_layers(self.m)
        totals: Dict[str, float] = {}
        cache: Dict[bool, Dict[str, float]] = {}
        offloaded = self.m.cpu_offloading_num_layers if self.m.cpu_offloading else 0
        sent: Dict[bool, float] = {}  # inter-node bytes of one layer's collectives (busiest node)
        start = self.inter
        for v in range(self.vpp):
            for j, i in enumerate(layers_for_stage(self.cfg, pp_rank, v)):
                if pattern[i] not in cache:
                    before = self.inter
                    cache[pattern[i]] = self.layer(pattern[i])
                    sent[pattern[i]] = self.inter - before
                else:
                    self.inter += sent[pattern[i]]
                for k, x in cache[pattern[i]].items():
                    totals[k] = totals.get(k, 0.0) + x
                if j < offloaded:
                    totals["offload"] = totals.get("offload", 0.0) + self.offload(pattern[i], cache[pattern[i]])
        m, T, tp, B = self.m, self.T, self.tp, self.B
        vocab = m.padded_vocab_size
        if pp_rank == self.pp - 1:
            totals["gemm"] = totals.get("gemm", 0.0) + self.gemm(2 * T * m.hidden_size * vocab / tp)
            totals["elementwise"] = totals.get("elementwise", 0.0) + 3 * 4 * T * vocab / tp / (
                self.c.memory_bandwidth_gbps * 1e9
            )
            if tp > 1:
                op = "all_gather" if self.sp else "all_reduce"
                totals["tp_comm"] += 2 * self.ring("tensor", op, T * m.hidden_size * B, calls=2)
        if pp_rank == 0 and tp > 1:
            op = "reduce_scatter" if self.sp else "all_reduce"
            totals["tp_comm"] += self.ring("tensor", op, T * m.hidden_size * B)
        self.stage_inter[pp_rank] = self.inter - start
        return totals


COMPUTE_TERMS = ("gemm", "attention", "elementwise", "overhead")


def step_sync(s) -> float:
    """Seconds of the step's small all-reduces (a few values each: latency, not bandwidth), outside the
    pipeline: the loss / gradient NaN check over the world (``--check-for-nan-in-loss-and-grad``, not fp16),
    the gradient norm's sum of squares over the model-parallel group (the world with a sharded optimizer; the
    expert part over the expert-model group), the token count over data x context parallelism with the
    per-token loss (and its pipeline broadcast), and the reported losses over data parallelism."""
    m, p, t = s.m, s.p, s.t
    tiny = 8 * 2 * s.world  # bytes: a few float64 values per rank, whatever the kind
    calls = []
    if t.check_for_nan_in_loss_and_grad and not t.fp16:
        calls.append("world")
    calls.append("world" if p.data_parallel_sharding_strategy != "no_shard" else "model")
    if m.num_experts and s.ep > 1:
        calls.append("expert_model")
    if t.calculate_per_token_loss:
        calls += ["pipeline", "data_context"]
    calls.append("data_context" if t.calculate_per_token_loss else "data")
    return sum(s.ring(kind, "all_reduce", tiny) for kind in calls)


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
    if bubble and 0 < cluster.host_cores < s.world:
        # Ranks sharing a host's cores (the calibrated rates are each rank's share with every rank busy):
        # an idle stage's core serves the busy ones, so the schedule takes the larger of two lower bounds,
        # every rank's own work at the shared rate and the critical path at the whole core's rate.
        share = cluster.host_cores / s.world
        bubble = min(bubble, max(0.0, (n_micro * slot + bubble) * share - n_micro * slot))
    terms = {k: n_micro * stages[busiest].get(k, 0.0) for k in (*COMPUTE_TERMS, "tp_comm", "cp_comm", "ep_comm")}
    if "offload" in stages[busiest]:
        terms["offload"] = n_micro * stages[busiest]["offload"]
    terms["pp_comm"] = n_micro * p2p
    terms["bubble"] = bubble
    sync = step_sync(s)
    once = s.inter - sum(s.stage_inter.values())  # the p2p sends' and the step's small all-reduces' bytes
    s.inter = 0.0  # from here on: the data-parallel collectives' inter-node bytes
    backward = (2 / 3) * sum(stages[busiest].get(k, 0.0) for k in COMPUTE_TERMS)
    dp_terms = data_parallel(s, cfg, busiest, n_micro, backward)
    terms.update(dp_terms)
    terms["overhead"] += cluster.step_overhead_ms * 1e-3
    terms["step_sync"] = sync
    step = n_micro * slot + bubble + sum(dp_terms.values()) + cluster.step_overhead_ms * 1e-3 + sync
    # A token-bucket node link (inter_node_burst_bytes > 0) lets each call's burst through at once but
    # refills at its rate: the step lasts at least the busiest node's bytes of the step at that rate.
    node_bytes = n_micro * s.stage_inter.get(busiest, 0.0) + once + s.inter
    floor = 0.0
    if cluster.nodes > 1 and node_bytes > 0:
        floor = max(0.0, node_bytes - cluster.inter_node_burst_bytes) / (cluster.inter_node_bandwidth_gbps * 1e9)
    terms["node_link"] = max(0.0, floor - step)
    step += terms["node_link"]
    detail = {"microbatches": n_micro, "per_microbatch_s": tau, "busiest_pp_rank": busiest, "node_bytes": node_bytes}
    return StepCost(step, terms, s.inter, detail)
