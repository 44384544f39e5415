"""Memory and speed plan of a training layout: per-rank bytes, FLOPs, expected step time.

Bytes of model state per parameter on a rank (``d`` = data x context parallel size, ``d_e`` the
expert-data-parallel size for expert parameters; shared/README's formulas, megalm's dtypes):

=====================================  ===========  =========================  ===============
precision                              weights      gradients (``main_grad``)  optimizer (Adam)
=====================================  ===========  =========================  ===============
fp32                                   4            4                          8 (moments)
bf16/fp16, fp32 grads (the default)    2            4                          4 main + 8
bf16/fp16, half grads                  2            2                          4 main + 4 main grad + 8
=====================================  ===========  =========================  ===============

so 16 / 18 / 20 bytes; the distributed optimizer divides the optimizer column by ``d``
(``d_e`` for experts): ``8 + 8/d``, ``6 + 12/d``, ``4 + 16/d``.  SGD keeps 4 bytes of momentum
instead of Adam's 8 (0 without momentum).  Per ``--data-parallel-sharding-strategy``
(:func:`strategy_bytes_per_param`): ``no_shard`` divides nothing, ``optim`` the optimizer column, ``optim_grads``
(ZeRO-2) also the gradients (bf16: ``2 + 16/d``), ``optim_grads_params`` (ZeRO-3) all three (``18/d``; the
expert parameters' columns over ``d_e``: ``18/d_e``), steady between steps; the largest rank per strategy adds
what ZeRO-2/3 hold above that during a step (full gradient buckets, gathered weight buckets, an expert bucket and
the vocabulary weight kept whole: :mod:`.sharding_peaks`, upper bounds).  The data-parallel gradient traffic
per step is the same for the first three (all-reduce = reduce-scatter + all-gather, ``2 (d-1)/d`` x
the gradient bytes) and more for ZeRO-3 (parameters gathered for forward and again for backward,
each microbatch: 1.5x with one microbatch and one dtype), so the recommendation is the first
strategy of that order whose largest rank fits.

Per rank: parameters of its pipeline stage (:mod:`.parameters`), activations of the
microbatches in flight (:mod:`.activations`), transient buffers (logits next to the loss, the
chunk being recomputed), plus ``reserve_gb`` for the CUDA context, communication buffers and
allocator fragmentation.  FLOPs per iteration are :func:`megalm.flops.num_floating_point_operations`
of the global batch; time = FLOPs / (world x peak x MFU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megalm.estimate.activations import Shape, stage_activation_bytes
from megalm.estimate.parameters import all_stages, stage_tensors, total_parameters
from megalm.estimate.sharding_peaks import transient_bytes
from megalm.parallel_layout import expert_data_parallel_size

GB = 1e9

# Peak dense FLOP/s per device by name (megalm.flops' table), and aliases for the flag.
DEVICE_ALIASES = {
    "h100": "H100 SXM",
    "h100-sxm": "H100 SXM",
    "h100-pcie": "H100 PCIe",
    "h200": "H200",
    "a100": "A100",
    "cpu": "cpu",
}


@dataclass
class PlannerOptions:
    """Flags of tools/estimate.py beyond the training flags."""

    world_size: Optional[int] = field(
        default=None, metadata={"help": "Number of GPUs (default: TP x PP x CP x EP... i.e. data-parallel size 1)."}
    )
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "Memory of one GPU in GB (1e9 bytes)."})
    mfu: float = field(default=0.4, metadata={"help": "Assumed model FLOPs utilization for the time estimate."})
    device: str = field(
        default="h100",
        metadata={
            "help": "Device for the peak FLOP/s (and kernels): h100 (SXM), h100-pcie, h200, a100, cpu.",
            "choices": sorted(DEVICE_ALIASES),
        },
    )
    reserve_gb: float = field(
        default=4.0, metadata={"help": "GB per GPU kept for the CUDA context, communication buffers and fragmentation."}
    )


def moment_bytes(optimizer: str, sgd_momentum: float) -> int:
    """Optimizer state bytes per parameter beyond the fp32 main weights."""
    # adam, lamb: two moments; lars: the momentum buffer (as sgd); lion: one moment; muon: one moment
    # (the matrices' momentum; its AdamW's second moment for the others: plan() adds muon_adam_parameters x 4).
    return {"adam": 8, "lamb": 8, "lion": 4, "muon": 4}.get(optimizer, 4 if sgd_momentum else 0)


def offload_bytes_per_param(t) -> Dict[str, float]:
    """Optimizer offload (``--optimizer-cpu-offload``, ``--optimizer-offload-device nvme``), per parameter whose
    state the rank holds: ``fraction`` offloaded (by elements); ``device`` the state bytes that leave the device
    (the moments of that fraction ``f``); ``host`` what the CPU offload keeps in host memory
    (``f x (4 copy + 4 gradient + moments)``); ``disk`` what the NVMe offload keeps in its swap files
    (``f x (4 copy + moments)``, also read and written once per step; its host memory:
    :func:`nvme_staging_bytes`)."""
    nvme = t.optimizer_offload_device == "nvme"
    f = t.optimizer_offload_fraction if (t.optimizer_cpu_offload or nvme) else 0.0
    moments = moment_bytes(t.optimizer, t.sgd_momentum)
    return {
        "fraction": f,
        "device": f * moments,
        "host": 0.0 if nvme else f * (8 + moments),
        "disk": f * (4 + moments) if nvme else 0.0,
    }


def nvme_staging_bytes(
    t, offloaded_elements: float, largest_tensor: float, ranks: Optional[List[List[int]]] = None
) -> float:
    """Host bytes of the NVMe offload's two staging slots (:mod:`megalm.optimizer.nvme_offload`): a slot holds
    the largest bucket's copy, moments and gradients.  ``ranks``: per data-parallel rank, the element counts of
    its main parameters in the optimizer's order (:func:`offloaded_tensor_order`): the offloaded ones are cut
    into buckets as the optimizer cuts them, the largest rank's counts.  Else an upper bound from
    ``offloaded_elements`` and ``largest_tensor``: buckets of whole tensors cut at ``n / count`` elements
    (``count`` at least 8, more to keep ~64 MiB a bucket) hold at most that plus one tensor."""
    from megalm.optimizer.cpu_offload import OVERLAP_BUCKETS, bucket_starts
    from megalm.optimizer.nvme_offload import BUCKET_BYTES

    if t.optimizer_offload_device != "nvme" or offloaded_elements <= 0:
        return 0.0
    per_element = 8 + moment_bytes(t.optimizer, t.sgd_momentum)
    if ranks is None:
        count = max(OVERLAP_BUCKETS, -(-16 * offloaded_elements // BUCKET_BYTES))
        return 2 * min(offloaded_elements, -(-offloaded_elements // count) + largest_tensor) * per_element
    largest = 0
    for tensors in ranks:  # whole tensors in order while fewer than fraction x total went (NvmeOffload)
        threshold, done, chosen = t.optimizer_offload_fraction * sum(tensors), 0, []
        for n in tensors:
            if done >= threshold:
                break
            chosen.append(n)
            done += n
        starts = bucket_starts(chosen, max(OVERLAP_BUCKETS, -(-16 * done // BUCKET_BYTES))) + [len(chosen)]
        largest = max([largest] + [sum(chosen[a:b]) for a, b in zip(starts, starts[1:])])
    return 2 * largest * per_element


def _shard_pieces(order: List[Tuple[int, bool]], bucket_size: Optional[int], shards: int) -> List[list]:
    """Per rank of ``shards``, its pieces ``(elements, is 2-D)`` of tensors laid out in ``order`` as DDP's buffer
    lays them for the distributed optimizer (:mod:`megalm.distributed.param_and_grad_buffer`: a bucket closes
    once it holds ``bucket_size`` elements, is padded to a multiple of ``shards`` and split into equal shards)."""
    ranks: List[list] = [[] for _ in range(shards)]
    placed, spans, cursor, start = [], [], 0, 0
    for n, matrix in order:
        placed.append((cursor, cursor + n, matrix, len(spans)))
        cursor += n
        if bucket_size is not None and cursor - start >= bucket_size:
            spans.append((start, -(-cursor // shards) * shards))
            cursor = start = spans[-1][1]
    if cursor > start:
        spans.append((start, -(-cursor // shards) * shards))
    for lo, hi, matrix, k in placed:
        begin, width = spans[k][0], (spans[k][1] - spans[k][0]) // shards
        for r in range((lo - begin) // width, (hi - 1 - begin) // width + 1):
            piece = min(hi, begin + (r + 1) * width) - max(lo, begin + r * width)
            ranks[r].append((piece, matrix))
    return ranks


def offloaded_tensor_order(cfg, pp_rank: int, shards: int) -> Optional[List[List[int]]]:
    """Per data-parallel rank, the element counts of its main parameters in the optimizer's order (see
    :func:`nvme_staging_bytes`): the 2-D weights (the decay group) then the 1-D ones; whole tensors in the model's
    order for the plain optimizer; for the distributed optimizer (``shards`` ranks) each rank's pieces of the
    gradient buffer, which holds the tensors in reverse order.  None where the model's tensors are not listed
    (:func:`megalm.estimate.parameters.stage_tensors`) or other groups reorder them (Muon, ``--decoupled-lr``)."""
    from megalm.estimate.sharding_peaks import _bucket_size

    t, p = cfg.training, cfg.parallel
    listed = stage_tensors(cfg, pp_rank)
    if listed is None or t.optimizer == "muon" or t.decoupled_lr is not None:
        return None
    sharded = p.use_distributed_optimizer or p.data_parallel_sharding_strategy != "no_shard"
    ranks = _shard_pieces(listed[::-1], _bucket_size(cfg, shards), shards) if sharded else [listed]
    return [[n for n, m in pieces if m] + [n for n, m in pieces if not m] for pieces in ranks]


def state_bytes_per_param(precision: str, optimizer: str, sgd_momentum: float, fp32_grads: bool) -> Dict[str, float]:
    """``{"weights", "grads", "optimizer"}`` bytes per parameter without the distributed optimizer."""
    moments = moment_bytes(optimizer, sgd_momentum)
    if precision == "fp32":
        return {"weights": 4, "grads": 4, "optimizer": moments}
    if fp32_grads:
        return {"weights": 2, "grads": 4, "optimizer": 4 + moments}
    return {"weights": 2, "grads": 2, "optimizer": 8 + moments}


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_SHARDED = {
    "no_shard": (),
    "optim": ("optimizer",),
    "optim_grads": ("optimizer", "grads"),
    "optim_grads_params": ("optimizer", "grads", "weights"),
}


def muon_adam_parameters(st) -> tuple:
    """``(dense, expert)`` parameters of a stage that ``--optimizer muon`` gives to its AdamW (embeddings,
    output layer, norms, biases), each with 4 bytes more state (a second moment) than its matrices."""
    return st.embedding + st.vectors, st.expert_vectors


def strategy_bytes_per_param(per_param: Dict[str, float], d: int, strategy: str) -> Dict[str, float]:
    """``{"weights", "grads", "optimizer"}`` bytes per parameter on a rank when ``strategy`` shards
    its columns over ``d`` data-parallel ranks (``per_param`` from :func:`state_bytes_per_param`)."""
    return {k: v / d if k in _SHARDED[strategy] else v for k, v in per_param.items()}


def _precision(t) -> str:
    return "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"


def data_parallel_sizes(cfg, world_size: int) -> tuple:
    p = cfg.parallel
    dp = p.data_parallel_size or world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    tp, cp, ep, etp = (
        p.tensor_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size or 1,
    )
    return dp, max(1, expert_data_parallel_size(tp, cp, dp, ep, etp))


def device_peak(options: PlannerOptions, precision: str, override: Optional[float]) -> tuple:
    from megalm.flops import DEVICE_PEAK_FLOPS, measure_matmul_flops

    if override:
        return float(override), "override"
    name = DEVICE_ALIASES[options.device]
    if name == "cpu":
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        return measure_matmul_flops(dtype), "cpu: measured 1024^3 matmul"
    table = DEVICE_PEAK_FLOPS[name]
    key = precision if precision in table else "tf32"
    return table[key], f"{name} {key} dense peak"


def optimizer_shards(cfg, dp: int) -> int:
    """The ranks the distributed optimizer shards dense state over: data x context parallel, divided by
    ``--num-distributed-optimizer-instances`` (each instance holds a whole copy)."""
    p = cfg.parallel
    return dp * p.context_parallel_size // p.num_distributed_optimizer_instances


def plan(cfg, options: PlannerOptions) -> dict:
    """Everything the report prints, as numbers (bytes, FLOPs, seconds)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    world = p.world_size or options.world_size
    dp, edp = data_parallel_sizes(cfg, world)
    precision = _precision(t)
    per_param = state_bytes_per_param(
        precision, t.optimizer, t.sgd_momentum, p.accumulate_allreduce_grads_in_fp32 or precision == "fp32"
    )
    offload = offload_bytes_per_param(t)
    per_param["optimizer"] -= offload["device"]  # the offloaded moments are on the host or on disk
    gbs = t.global_batch_size or t.micro_batch_size * dp
    num_micro = gbs // (t.micro_batch_size * dp)
    shape = Shape(
        m.seq_length,
        t.micro_batch_size,
        p.tensor_model_parallel_size,
        p.sequence_parallel,
        4 if precision == "fp32" else 2,
        "cpu" if options.device == "cpu" else "cuda",
        cp=p.context_parallel_size,
        cp_comm_type=p.cp_comm_type,
        packed=cfg.data.reset_attention_mask and cfg.data.qkv_format == "thd",
    )
    stages = []
    for st in all_stages(cfg):
        weights = st.total * per_param["weights"]
        grads = st.total * per_param["grads"]
        optim_plain = st.total * per_param["optimizer"]
        dense_shards = optimizer_shards(cfg, dp)
        optim_dist = st.dense * per_param["optimizer"] / dense_shards + st.expert * per_param["optimizer"] / edp
        adam_dense, adam_expert = muon_adam_parameters(st) if t.optimizer == "muon" else (0, 0)
        optim_plain += 4 * (adam_dense + adam_expert)
        optim_dist += 4 * (adam_dense / dense_shards + adam_expert / edp)
        f = offload["fraction"]
        extra = {"weights": 0, "grads": 0, "optimizer": 4 * (1 - f)}  # Muon's AdamW second moment, if not offloaded
        # the parameters whose optimizer state this rank holds (a fraction f of it offloaded)
        sharded = p.use_distributed_optimizer or p.data_parallel_sharding_strategy != "no_shard"
        owned = st.dense / dense_shards + st.expert / edp if sharded else st.total
        largest = max(m.padded_vocab_size, 2 * (m.ffn_hidden_size or 4 * m.hidden_size)) * m.hidden_size
        nvme = f > 0 and t.optimizer_offload_device == "nvme" and not st.expert
        order = offloaded_tensor_order(cfg, st.pp_rank, dense_shards) if nvme else None
        offload_stage = {
            "offload_host": owned * offload["host"]
            + nvme_staging_bytes(t, owned * f, largest / p.tensor_model_parallel_size, order),
            "offload_disk": owned * offload["disk"],
        }
        act = stage_activation_bytes(cfg, st.pp_rank, shape, num_micro)
        rest = act["activations"] + act["transient"] + options.reserve_gb * GB
        # ZeRO-2/3: buckets alive in a step.  Every strategy shards dense state over the dp x cp ranks.
        peaks = transient_bytes(cfg, st, per_param, dense_shards, num_micro, gloo=options.device == "cpu")
        by_strategy = {
            f"total_{s}": sum(
                st.dense * v + st.expert * strategy_bytes_per_param(per_param, edp, s)[k]
                for k, v in strategy_bytes_per_param(per_param, dense_shards, s).items()
            )
            + peaks[s]
            + adam_dense * strategy_bytes_per_param(extra, dense_shards, s)["optimizer"]
            + adam_expert * strategy_bytes_per_param(extra, edp, s)["optimizer"]
            + rest
            for s in STRATEGIES
        }
        by_strategy.update({f"transient_{s}": peaks[s] for s in STRATEGIES})
        stages.append(
            {
                "pp_rank": st.pp_rank,
                "layers": len(st.layers),
                "parameters": st.total,
                "expert_parameters": st.expert,
                "weights": weights,
                "grads": grads,
                "optimizer": optim_plain,
                "optimizer_distributed": optim_dist,
                **act,
                "total": weights + grads + optim_plain + rest,
                "total_distributed": weights + grads + optim_dist + rest,
                **by_strategy,
                **offload_stage,
            }
        )
    from megalm.flops import num_floating_point_operations

    flops = num_floating_point_operations(cfg, gbs)
    peak, peak_source = device_peak(options, precision, cfg.logging.device_peak_flops)
    step = flops / (world * peak * options.mfu)
    key = f"total_{p.data_parallel_sharding_strategy}"
    worst = max(stages, key=lambda s: s[key])
    budget = options.gpu_memory_gb * GB
    fitting = [s for s in STRATEGIES if max(st[f"total_{s}"] for st in stages) <= budget]
    return {
        "world_size": world,
        "data_parallel_size": dp,
        "expert_data_parallel_size": edp,
        "precision": precision,
        "bytes_per_param": per_param,
        "total_parameters": total_parameters(cfg),
        "global_batch_size": gbs,
        "num_microbatches": num_micro,
        "stages": stages,
        "flops_per_iteration": flops,
        "peak_flops": peak,
        "peak_source": peak_source,
        "mfu": options.mfu,
        "step_time_s": step,
        "tokens_per_s": gbs * m.seq_length / step,
        "distributed_optimizer": p.use_distributed_optimizer,
        "largest_rank_bytes": worst[key],
        "largest_pp_rank": worst["pp_rank"],
        "gpu_memory_bytes": options.gpu_memory_gb * GB,
        "reserve_bytes": options.reserve_gb * GB,
        "fits": worst[key] <= budget,
        "sharding_strategy": p.data_parallel_sharding_strategy,
        "bytes_per_param_by_strategy": {
            s: sum(strategy_bytes_per_param(per_param, optimizer_shards(cfg, dp), s).values()) for s in STRATEGIES
        },
        "largest_rank_bytes_by_strategy": {s: max(st[f"total_{s}"] for st in stages) for s in STRATEGIES},
        "recommended_strategy": fitting[0] if fitting else None,
    }


def _recommendation(r: dict) -> str:
    """Why the first strategy (in order of data-parallel traffic) whose largest rank fits."""
    sizes = r["largest_rank_bytes_by_strategy"]
    told = ", ".join(f"{s} {sizes[s] / GB:.1f}" for s in STRATEGIES)
    best = r["recommended_strategy"]
    if best is None:
        return f"no --data-parallel-sharding-strategy fits (largest rank, GB: {told}): add TP/PP or GPUs"
    why = {
        "no_shard": "it fits without sharding",
        "optim": "the least sharding that fits, at no_shard's data-parallel traffic",
        "optim_grads": "the least sharding that fits, at no_shard's data-parallel traffic",
        "optim_grads_params": "only ZeRO-3 fits, at more data-parallel traffic (weights gathered twice per microbatch)",
    }[best]
    return f"recommended --data-parallel-sharding-strategy {best}: {why} (largest rank, GB: {told})"


def format_plan(cfg, r: dict) -> str:
    m, p = cfg.model, cfg.parallel
    g = lambda x: f"{x / GB:8.2f}"  # noqa: E731
    virtual = f" (virtual {p.virtual_pipeline_model_parallel_size})" if p.virtual_pipeline_model_parallel_size else ""
    cp = f" x CP {p.context_parallel_size}" if p.context_parallel_size > 1 else ""
    shards = optimizer_shards(cfg, r["data_parallel_size"])  # what the distributed optimizer shards over
    n = p.num_distributed_optimizer_instances
    instances = f" / {n} distributed-optimizer instances" if n > 1 else ""
    experts = (
        f" | EP {p.expert_model_parallel_size}, expert DP {r['expert_data_parallel_size']}"
        if p.expert_model_parallel_size > 1
        else ""
    )
    lines = [
        f"model: {r['total_parameters'] / 1e9:.3f}B parameters (padded vocabulary {m.padded_vocab_size}), "
        f"{m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}",
        f"layout: world {r['world_size']} = TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size}"
        f"{virtual}{cp} x DP {r['data_parallel_size']}{experts}"
        f" | SP {'on' if p.sequence_parallel else 'off'} | recompute {m.recompute_granularity or 'none'}"
        f" | {r['precision']} | micro {cfg.training.micro_batch_size} x {r['num_microbatches']} microbatches"
        f" = global {r['global_batch_size']}",
        "bytes per parameter (weights + grads + optimizer): "
        + " + ".join(f"{v:g}" for v in r["bytes_per_param"].values())
        + f" = {sum(r['bytes_per_param'].values()):g}; distributed optimizer: optimizer / {shards}",
        "",
        "GB per rank (1e9 B)  params(M)  weights    grads optim(plain) optim(dist)  act/micro  in-flight "
        "activations transient   total(plain) total(dist)",
    ]
    for s in r["stages"]:
        lines.append(
            f"  pp rank {s['pp_rank']:<3} {s['layers']:3d} layers {s['parameters'] / 1e6:9.1f} "
            f"{g(s['weights'])} "
            f"{g(s['grads'])} {g(s['optimizer'])}  {g(s['optimizer_distributed'])}   {g(s['per_microbatch'])}"
            f"  {s['in_flight']:6.2f}  {g(s['activations'])} {g(s['transient'])}   {g(s['total'])}"
            f"    {g(s['total_distributed'])}"
        )
    which = "with" if r["distributed_optimizer"] else "without"
    lines += [
        f"(totals include {r['reserve_bytes'] / GB:.1f} GB reserved for the CUDA context, communication buffers "
        f"and fragmentation)",
        f"largest rank ({which} the distributed optimizer, as configured): pp rank {r['largest_pp_rank']}, "
        f"{r['largest_rank_bytes'] / GB:.1f} GB of {r['gpu_memory_bytes'] / GB:.0f} GB -> "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'}",
        f"bytes per parameter by --data-parallel-sharding-strategy (d = {'DP x CP' if cp else 'DP'}{instances} = "
        f"{shards}): " + " | ".join(f"{s} {v:g}" for s, v in r["bytes_per_param_by_strategy"].items()),
        _recommendation(r),
        f"FLOPs per iteration: {r['flops_per_iteration']:.4e} | peak {r['peak_flops'] / 1e12:.1f} TFLOP/s "
        f"({r['peak_source']}) | at MFU {r['mfu']:.0%}: {r['step_time_s']:.3f} s per iteration, "
        f"{r['tokens_per_s']:,.0f} tokens/s, {r['tokens_per_s'] / r['world_size']:,.0f} tokens/s per GPU",
    ]
    return "\n".join(lines)
