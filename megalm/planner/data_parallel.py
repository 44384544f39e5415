"""The data-parallel part of a step: gradient reduction per bucket, parameter gathers, compression, the
optimizer step (on the device or offloaded to the host).

**Buckets.**  megalm's :class:`~megalm.distributed.DistributedDataParallel` reduces each gradient bucket with
its own collective (:mod:`megalm.distributed.param_and_grad_buffer`): a bucket closes once it holds
``--ddp-bucket-size`` elements (default ``max(40M, 1M x DP)`` with ``--overlap-grad-reduce``, else one bucket
per buffer), so a stage of ``N`` parameters issues ``ceil(N / size)`` reductions (dense and expert buffers
apart; the distributed optimizer gives a tied embedding copy under PP its own bucket).  Every call pays the
ring's latency steps and ``collective_call_us``; the bytes are the same as one call of the whole buffer.
``--hierarchical-grad-reduce`` is three calls per bucket (intra reduce-scatter, inter all-reduce of ``1 / L``,
intra all-gather); with the distributed optimizer two (intra and inter reduce-scatter), and the parameters'
all-gather is hierarchical too (inter all-gather of ``1 / L``, intra all-gather).

**Distributed-optimizer instances** (``--num-distributed-optimizer-instances N``, dense buffers only: MoE is
refused): the distributed optimizer shards over one instance of ``K = DP x CP / N`` consecutive ranks (a node
when ``K`` is the ranks per node).  Per bucket of ``n`` elements: a reduce-scatter inside the instance (group
``instance``: intra-node when the instance fits a node), then the SUM all-reduce of the rank's shard ``n / K``
across the ``N`` instances (group ``across_instances``: the only traffic between them, ``2 (N-1)/N x n / K``
elements per rank; all ``K`` ranks of a node send at once over its link); the parameters are all-gathered
inside the instance (every microbatch's forward and backward too with ``optim_grads_params``); the optimizer
step updates ``1 / K`` of the elements.

**Compression** (``--grad-compression int8|fp8``, :mod:`megalm.distributed.compression.int8`): per bucket of
``n`` elements the payload is ``P = n + 4 ceil(n / C)`` bytes (one byte per value, an fp32 scale per chunk of
``C``); without the distributed optimizer an all-gather of every rank's ``P``, with it an all-to-all of the
shards (``(K-1)/K P`` sent); hierarchically only the inter-node leg is compressed.  The codec's time is
memory traffic at ``memory_bandwidth_gbps``: encode reads the gradient and the residual and writes the
residual and the payload (``13 n`` bytes), decode reads each received payload and accumulates in fp32 (``9 n``
per rank's payload gathered: ``9 K n``; all-to-all: ``9 n``).

**Optimizer step** on the ``local`` elements a rank updates (its shard with the distributed optimizer):
``local x optimizer_s_per_param`` on the device; with ``--optimizer-cpu-offload`` the fraction ``f`` runs on the
host at ``host_optimizer_ns_per_param`` after its gradients (``grads`` bytes each) go down and before its
updated weights (``weights`` bytes) come back over ``host_link_gbps`` (overlapped with the host step bucket by
bucket under ``--overlap-cpu-optimizer-d2h-h2d``: the larger of the two).

**Memory** beyond :func:`megalm.estimate.planner.plan` (:func:`memory_change`): ``--optimizer-cpu-offload`` takes
its fraction of the rank's optimizer state (main weights and moments) off the device; compression keeps an fp32
residual per element of the rank's buffers and, while a bucket reduces, its compensated fp32 copy and the ``K``
gathered payloads.
"""

from __future__ import annotations

import math
from typing import Dict

from megalm.estimate.parameters import all_stages
from megalm.planner.links import GroupLinks, ring_time

COMPRESSED = ("int8", "fp8")


def bucket_elements(p) -> float:
    """Elements per gradient bucket (``inf``: one bucket per buffer)."""
    from megalm.distributed.data_parallel import default_bucket_size

    if p.ddp_bucket_size is not None:
        return p.ddp_bucket_size
    return default_bucket_size(p.data_parallel_size) if p.overlap_grad_reduce else math.inf


def num_buckets(params: int, size: float) -> int:
    return 0 if params <= 0 else (1 if size == math.inf else max(1, math.ceil(params / size)))


def payload_bytes(n: float, chunk: int) -> float:
    return n + 4 * math.ceil(n / chunk)


def _chunk(p) -> int:
    return p.int8_chunk_size if p.grad_compression == "int8" else p.grad_fp8_chunk_size


def reduce_grads(s, kind: str, sharded: bool, params: int, per: Dict[str, float]) -> float:
    """Seconds of one step's gradient reduction of ``params`` elements over the ``kind`` groups (flat), per
    bucket, compressed or not; the codec's memory traffic included."""
    p = s.p
    size = bucket_elements(p)
    n_b = num_buckets(params, size)
    if not n_b:
        return 0.0
    n = params / n_b  # elements per bucket (the model: equal buckets)
    k = s.links[kind].size
    if p.grad_compression in COMPRESSED and k > 1:
        payload = payload_bytes(n, _chunk(p))
        if sharded:
            one = s.a2a(kind, payload, n_b) + 9 * n / s.bw
        else:
            one = s.ring(kind, "all_gather", k * payload, n_b) + 9 * k * n / s.bw
        return n_b * (one + 13 * n / s.bw)
    return n_b * s.ring(kind, "reduce_scatter" if sharded else "all_reduce", n * per["grads"], n_b)


def _node_legs(links: GroupLinks):
    """The two legs of a hierarchical collective over ``links``: the ``L`` ranks of a node (intra-node), and one
    rank per node across the ``nodes`` (inter-node, sharing the node's link with ``L x ring_senders`` rings)."""
    L, nodes = links.per_node, links.nodes
    intra = GroupLinks(L, False, 0, 0.0, L, 1)
    inter = GroupLinks(nodes, True, L * max(1, links.ring_senders), 0.0, 1, nodes)
    return intra, inter


def hierarchical(s, sharded: bool, params: int, per: Dict[str, float], links: GroupLinks) -> float:
    """Per bucket: intra reduce-scatter, inter all-reduce (distributed optimizer: reduce-scatter) of ``1 / L``
    of it (compressed when asked), intra all-gather (not with the distributed optimizer)."""
    L, nodes = links.per_node, links.nodes
    n_b = num_buckets(params, bucket_elements(s.p))
    if not n_b:
        return 0.0
    nbytes = params / n_b * per["grads"]
    intra, inter = _node_legs(links)
    wire = 2.0 if s.gloo else 1.0
    t = ring_time(s.c, intra, "reduce_scatter", nbytes, wire)[0]
    if s.p.grad_compression in COMPRESSED:
        n = params / n_b / L
        sec, sent = ring_time(s.c, inter, "all_gather", nodes * payload_bytes(n, _chunk(s.p)))
        sec += (13 + 9 * nodes) * n / s.bw
    else:
        # gloo's reduce-scatter is an all-reduce on the wire, the inter-node one too
        op = "reduce_scatter" if sharded else "all_reduce"
        sec, sent = ring_time(s.c, inter, op, nbytes / L, wire if sharded else 1.0)
    s.inter += n_b * sent
    t += sec
    if not sharded:
        t += ring_time(s.c, intra, "all_gather", nbytes)[0]
    return n_b * t


def instance_reduce(s, params: int, per: Dict[str, float]) -> float:
    """``--num-distributed-optimizer-instances``: per bucket, the reduce-scatter inside the instance and the
    all-reduce of the rank's ``1 / K`` shard across the instances (module docstring)."""
    n_b = num_buckets(params, bucket_elements(s.p))
    if not n_b:
        return 0.0
    nbytes = params / n_b * per["grads"]
    k = s.links["instance"].size
    inside = s.ring("instance", "reduce_scatter", nbytes, n_b)
    return n_b * (inside + s.ring("across_instances", "all_reduce", nbytes / k, n_b))


def hierarchical_gather(s, params: int, per: Dict[str, float], links: GroupLinks) -> float:
    """The distributed optimizer's parameter all-gather under ``--hierarchical-grad-reduce``, per bucket: the
    inter-node all-gather of the shards into ``N / L``, then the intra-node all-gather into ``N``."""
    L = links.per_node
    n_b = num_buckets(params, bucket_elements(s.p))
    if not n_b:
        return 0.0
    nbytes = params / n_b * per["weights"]
    intra, inter = _node_legs(links)
    sec, sent = ring_time(s.c, inter, "all_gather", nbytes / L)
    s.inter += n_b * sent
    return n_b * (sec + ring_time(s.c, intra, "all_gather", nbytes)[0])


def optimizer_step(s, local: float, per: Dict[str, float]) -> float:
    """Seconds of the optimizer step of ``local`` elements (module docstring)."""
    t, c = s.t, s.c
    f = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
    device = (1 - f) * local * c.optimizer_s_per_param()
    if not f:
        return device
    transfer = f * local * (per["grads"] + per["weights"]) / (c.host_link_gbps * 1e9)
    host = f * local * c.host_optimizer_ns_per_param * 1e-9
    return device + (max(transfer, host) if t.overlap_cpu_optimizer_d2h_h2d else transfer + host)


def data_parallel(s, cfg, pp_rank: int, n_micro: int, backward: float) -> Dict[str, float]:
    """Exposed data-parallel seconds (gradient reduction, parameter gathers, embedding sync) and the
    optimizer step of pipeline rank ``pp_rank`` (``s``: the cost model's per-layout helper; ``backward``:
    the compute seconds of one microbatch's backward there, which can hide the reduction)."""
    from megalm.estimate.planner import state_bytes_per_param

    m, p, t = s.m, s.p, s.t
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    per = state_bytes_per_param(precision, t.optimizer, t.sgd_momentum, p.accumulate_allreduce_grads_in_fp32)
    st = all_stages(cfg)[pp_rank]
    strategy = p.data_parallel_sharding_strategy
    sharded = strategy != "no_shard"
    dp_links = s.links["data_context"]
    hier = p.hierarchical_grad_reduce and dp_links.crosses and dp_links.size > dp_links.per_node
    instances = sharded and s.instances > 1
    if instances:
        grad = instance_reduce(s, st.dense, per)
    elif hier:
        grad = hierarchical(s, sharded, st.dense, per, dp_links)
    else:
        grad = reduce_grads(s, "data_context", sharded, st.dense, per)
    grad += reduce_grads(s, "expert_data", sharded, st.expert, per) if st.expert else 0.0
    gather = 0.0
    if sharded:
        size = bucket_elements(p)
        for kind, n in (("data_context", st.dense), ("expert_data", st.expert)):
            n_b = num_buckets(n, size)
            # optim_grads_params: gathered for every microbatch's forward and backward, and after the step
            again = 1 + 2 * n_micro if strategy == "optim_grads_params" else 1
            if kind == "data_context" and hier:
                gather += again * hierarchical_gather(s, n, per, dp_links)
            elif n_b:
                group = "instance" if kind == "data_context" and instances else kind
                gather += n_b * again * s.ring(group, "all_gather", n / n_b * per["weights"], n_b * again)
    hidden = s.c.dp_overlap * backward if p.overlap_grad_reduce else 0.0
    exposed_grad = max(grad - hidden, grad * 0.1 if hidden else grad)
    hidden_gather = s.c.dp_overlap * backward / 2 * n_micro if p.overlap_param_gather else 0.0
    exposed_gather = max(gather - hidden_gather, 0.0)
    emb = 0.0
    if s.pp > 1 and not m.untie_embeddings_and_output_weights:
        emb = s.ring("embedding", "all_reduce", m.padded_vocab_size // s.tp * m.hidden_size * per["grads"])
    shards = p.data_parallel_size * s.cp // (s.instances if instances else 1) if sharded else 1
    local = st.dense / shards + st.expert / (max(1, _edp(s)) if sharded else 1)
    return {"dp_comm": exposed_grad + exposed_gather + emb, "optimizer": optimizer_step(s, local, per)}


def _edp(s) -> int:
    from megalm.parallel_layout import expert_data_parallel_size

    return expert_data_parallel_size(s.tp, s.cp, s.p.data_parallel_size, s.ep, s.etp)


def memory_change(cfg, stage: dict) -> float:
    """Bytes to add to :func:`megalm.estimate.planner.plan`'s ``stage`` total for optimizer offload and gradient
    compression (module docstring)."""
    p, t = cfg.parallel, cfg.training
    out = 0.0
    if t.optimizer_cpu_offload:
        optim = (
            stage["optimizer"] if p.data_parallel_sharding_strategy == "no_shard" else stage["optimizer_distributed"]
        )
        out -= t.optimizer_offload_fraction * optim
    k = p.data_parallel_size * p.context_parallel_size
    if p.grad_compression in COMPRESSED and k > 1:
        params = stage["parameters"]
        bucket = min(bucket_elements(p), params)
        out += 4 * params + 4 * bucket + k * payload_bytes(bucket, _chunk(p))
    return out
