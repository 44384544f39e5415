"""Every layout megalm can run for a model on a cluster, ranked by predicted step time.

A candidate is one choice of TP, PP, virtual stages, CP (and ``--cp-comm-type``), EP / ETP (MoE), sequence
parallelism, ``--data-parallel-sharding-strategy`` (which implies the distributed optimizer), recompute,
micro-batch size, ``--hierarchical-grad-reduce`` and, with the distributed optimizer on more than one node,
``--num-distributed-optimizer-instances`` 1 or one per node (HSDP); DP is what is left of the world.  Then,
per legal layout:

* **offload** (``--cpu-offloading`` of every layer but the last, ``--optimizer-cpu-offload``, or both) only where
  the layout does not fit without it: in the cost model offload only adds time (the copies, the host's optimizer
  step), so an offloaded variant of a layout that fits is never faster (counted as ``dominated``).  Activation
  offload where megalm runs it (PP, CP, EP 1, no recompute, not ZeRO-3; other combinations are not generated).
* **gradient compression** (``--grad-compression``, :attr:`SearchOptions.compression`; none by default: it
  changes the numerics, so the user asks for it) on layouts with data parallelism and the strategies it is
  built for (no_shard, optim).  Legality is megalm's
own: each candidate's config is validated by :func:`megalm.config.validate_config` with the world size, and
a :class:`ConfigError` leaves it out with its message (numbers blanked, so that reasons count together).
A legal layout whose largest rank does not fit the device memory (:func:`megalm.estimate.planner.plan`)
is left out for that reason.  The rest are costed (:func:`megalm.planner.cost.step_cost`) and sorted.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from megalm.config import ConfigError, validate_config
from megalm.estimate.planner import PlannerOptions, plan
from megalm.planner.cost import StepCost, step_cost

RECOMPUTE = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "selective": dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual stages per pipeline rank (None: not interleaved)
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    etp: int = 1
    sp: bool = False
    strategy: str = "no_shard"
    recompute: str = "none"
    micro_batch: int = 1
    hierarchical: bool = False
    act_offload: int = 0  # --cpu-offloading-num-layers (0: no activation offload)
    opt_offload: bool = False  # --optimizer-cpu-offload (all of the optimizer)
    compression: str = "none"  # --grad-compression
    instances: int = 1  # --num-distributed-optimizer-instances (1: the distributed optimizer over all of DP x CP)

    def flags(self) -> List[str]:
        """pretrain_gpt.py's flags of this layout (every one spelled out, defaults included)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp), "--cp-comm-type", self.cp_comm_type]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp > 1:
            out += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.sp:
            out.append("--sequence-parallel")
        if self.strategy != "no_shard":
            out += ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", self.strategy]
            out += ["--overlap-param-gather"] if self.strategy != "optim_grads_params" else []
        if self.instances > 1:
            out += ["--num-distributed-optimizer-instances", str(self.instances)]
        out.append("--overlap-grad-reduce")
        rc = RECOMPUTE[self.recompute]
        if rc["recompute_granularity"]:
            out += ["--recompute-granularity", rc["recompute_granularity"]]
        if rc["recompute_method"]:
            out += ["--recompute-method", rc["recompute_method"]]
            out += ["--recompute-num-layers", str(rc["recompute_num_layers"])]
        out += ["--micro-batch-size", str(self.micro_batch)]
        if self.hierarchical:
            out.append("--hierarchical-grad-reduce")
        if self.act_offload:
            out += ["--cpu-offloading", "--cpu-offloading-num-layers", str(self.act_offload)]
        if self.opt_offload:
            out.append("--optimizer-cpu-offload")
        if self.compression != "none":
            out += ["--grad-compression", self.compression]
        return out

    def short(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}" + (f"v{self.vpp}" if self.vpp else "")]
        parts += [f"CP{self.cp}:{self.cp_comm_type}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"ETP{self.etp}"] if self.etp > 1 else []
        parts += ["SP"] if self.sp else []
        parts += [self.strategy] + ([f"inst{self.instances}"] if self.instances > 1 else [])
        parts += [f"rc:{self.recompute}", f"mb{self.micro_batch}"]
        parts += ["hier"] if self.hierarchical else []
        parts += [f"offload:act{self.act_offload}"] if self.act_offload else []
        parts += ["offload:optim"] if self.opt_offload else []
        parts += [f"gc:{self.compression}"] if self.compression != "none" else []
        return " ".join(parts)


@dataclass
class Candidate:
    layout: Layout
    dp: int
    cost: StepCost
    memory_bytes: float  # the largest rank's
    tokens_per_s: float
    note: str = ""  # why an offloaded layout: the memory it needs without


@dataclass
class SearchResult:
    candidates: List[Candidate]  # fitting, fastest first
    refused: Counter = field(default_factory=Counter)  # megalm's validation message -> count
    too_big: int = 0  # legal but larger than the device memory
    dominated: int = 0  # offloaded variants of layouts that fit without offload (never faster)
    smallest_too_big: Optional[Tuple[float, Layout]] = None
    considered: int = 0


@dataclass
class SearchOptions:
    max_tp: Optional[int] = None  # default: devices per node
    max_cp: int = 8
    max_micro_batch: int = 8
    max_vpp: int = 8
    sequence_parallel: str = "both"  # "on": with TP always; "both": also without
    recompute: Tuple[str, ...] = ("none", "selective", "full")
    strategies: Tuple[str, ...] = STRATEGIES
    cp_comm_types: Tuple[str, ...] = ("p2p", "a2a", "allgather")
    max_pp: Optional[int] = None  # default: the world
    offload: bool = True  # try activation / optimizer offload on layouts that do not fit without
    compression: Tuple[str, ...] = ("none",)  # --grad-compression values tried (int8, fp8)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg, cluster, options: SearchOptions) -> Iterator[Layout]:
    """Every combination of the searched flags for ``cfg``'s model on ``cluster`` (legal or not)."""
    m, t = cfg.model, cfg.training
    world = cluster.world_size
    max_tp = options.max_tp or cluster.devices_per_node
    moe = bool(m.num_experts)
    for tp, pp, cp in itertools.product(divisors(world), repeat=3):
        if tp > max_tp or cp > options.max_cp or pp > (options.max_pp or world) or world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        per_rank = m.num_layers // pp if m.num_layers % pp == 0 else 0
        vpps = [None] + ([v for v in divisors(per_rank) if 1 < v <= options.max_vpp] if pp > 1 and per_rank else [])
        cp_types = options.cp_comm_types if cp > 1 else ("p2p",)
        eps = [e for e in divisors(dp * cp) if not moe or m.num_experts % e == 0] if moe else [1]
        etps = sorted({1, tp}) if moe else [1]
        sps = (False, True) if tp > 1 and options.sequence_parallel == "both" else (tp > 1,)
        gbs = t.global_batch_size
        mbs = [b for b in divisors(max(1, gbs // dp)) if b <= options.max_micro_batch] if gbs % dp == 0 else [1]
        hier = (False, True) if dp * cp > 1 and cluster.nodes > 1 else (False,)
        for vpp, cpt, ep, etp, sp, strat, rc, mb, h in itertools.product(
            vpps, cp_types, eps, etps, sps, options.strategies, options.recompute, mbs, hier
        ):
            for gc in _compressions(options.compression, dp * cp, strat):
                for n in _instances(cluster.nodes, strat, h, gc):
                    yield Layout(tp, pp, vpp, cp, cpt, ep, etp, sp, strat, rc, mb, h, compression=gc, instances=n)


def _instances(nodes: int, strategy: str, hierarchical: bool, compression: str) -> Tuple[int, ...]:
    """The ``--num-distributed-optimizer-instances`` values of a layout: 1, and one instance per node on more
    than one node with the distributed optimizer; not with ``--hierarchical-grad-reduce`` or compression (the
    other two ways of keeping traffic inside the node, which megalm does not combine with instances).  Whether
    ``nodes`` divides DP x CP, MoE and the optimizer are megalm's validation's to refuse (counted)."""
    several = nodes > 1 and strategy != "no_shard" and not hierarchical and compression == "none"
    return (1, nodes) if several else (1,)


def _compressions(asked: Tuple[str, ...], dp_cp: int, strategy: str) -> Tuple[str, ...]:
    """The ``--grad-compression`` values of a layout: none without data parallelism (nothing to compress);
    the strategies compression is not built for only uncompressed, and not at all when it is required
    (``asked`` without ``none``: the user's ``--grad-compression``)."""
    if dp_cp == 1:
        return ("none",)
    if strategy in ("no_shard", "optim"):
        return asked
    return ("none",) if "none" in asked else ()


def offloaded(layout: Layout, num_layers: int) -> List[Layout]:
    """The offload variants of ``layout``: optimizer offload, and where megalm runs it activation offload of
    every layer but the last (alone and with the optimizer's)."""
    out = [dataclasses.replace(layout, opt_offload=True)]
    act = layout.pp == 1 and layout.cp == 1 and layout.ep == 1 and layout.recompute == "none"
    if act and layout.strategy != "optim_grads_params" and num_layers > 1:
        with_act = dataclasses.replace(layout, act_offload=num_layers - 1)
        out += [with_act, dataclasses.replace(with_act, opt_offload=True)]
    return out


def apply_layout(base, layout: Layout, world: int):
    """A validated copy of ``base`` (a MegalmConfig, vocabulary set) with ``layout``; raises ConfigError."""
    cfg = copy.deepcopy(base)
    p, m, t = cfg.parallel, cfg.model, cfg.training
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout.tp, layout.pp
    p.num_virtual_stages_per_pipeline_rank, p.num_layers_per_virtual_pipeline_stage = layout.vpp, None
    p.virtual_pipeline_model_parallel_size = None
    p.context_parallel_size, p.cp_comm_type = layout.cp, layout.cp_comm_type
    p.expert_model_parallel_size = layout.ep
    p.expert_tensor_parallel_size = layout.etp if layout.etp > 1 else None
    p.sequence_parallel = layout.sp
    p.use_distributed_optimizer = layout.strategy != "no_shard"
    p.data_parallel_sharding_strategy = layout.strategy
    p.overlap_grad_reduce = True
    p.overlap_param_gather = layout.strategy in ("optim", "optim_grads")
    p.hierarchical_grad_reduce = layout.hierarchical
    p.num_distributed_optimizer_instances = layout.instances
    p.data_parallel_size, p.world_size = None, None
    for k, v in RECOMPUTE[layout.recompute].items():
        setattr(m, k, v)
    t.micro_batch_size = layout.micro_batch
    m.cpu_offloading, m.cpu_offloading_num_layers = layout.act_offload > 0, layout.act_offload
    t.optimizer_cpu_offload, t.optimizer_offload_fraction = layout.opt_offload, 1.0
    p.grad_compression = layout.compression
    validate_config(cfg, world_size=world)
    return cfg


def reason(message: str) -> str:
    """A refusal message with its numbers blanked (``N``), so that one rule's refusals count together."""
    return re.sub(r"\d+(\.\d+)?", "N", message)


def search(base, cluster, options: Optional[SearchOptions] = None) -> SearchResult:
    """Cost every legal, fitting layout of ``base`` (a MegalmConfig with the vocabulary set; its layout
    flags are replaced) on ``cluster``; see the module docstring."""
    options = options or SearchOptions()
    result = SearchResult([])
    budget = cluster.memory_gb * 1e9
    for layout in layouts(base, cluster, options):
        sized = _sized(base, layout, cluster, result)
        if sized is None:
            continue
        cfg, memory = sized
        if memory <= budget:
            result.candidates.append(_candidate(cfg, layout, cluster, memory))
            result.dominated += len(offloaded(layout, base.model.num_layers)) if options.offload else 0
            continue
        result.too_big += 1
        if result.smallest_too_big is None or memory < result.smallest_too_big[0]:
            result.smallest_too_big = (memory, layout)
        for variant in offloaded(layout, base.model.num_layers) if options.offload else ():
            vsized = _sized(base, variant, cluster, result)
            if vsized is None:
                continue
            vcfg, vmem = vsized
            if vmem > budget:
                result.too_big += 1
                continue
            note = f"without offload {memory / 1e9:.3g} GB > {cluster.memory_gb:g} GB; with it {vmem / 1e9:.3g} GB"
            result.candidates.append(_candidate(vcfg, variant, cluster, vmem, note))
    result.candidates.sort(key=lambda c: c.cost.step_s)
    return result


def _sized(base, layout: Layout, cluster, result: SearchResult):
    """``(config, largest rank's bytes)`` of a legal ``layout``; ``None`` for an illegal one, whose refusal is
    counted in ``result`` (as every layout tried is counted in ``result.considered``)."""
    from megalm.parallel_layout import NodeLayoutError

    result.considered += 1
    try:
        cfg = _legal(base, layout, cluster)
    except (ConfigError, NodeLayoutError) as e:
        result.refused[reason(str(e))] += 1
        return None
    return cfg, largest_rank_bytes(cfg, cluster)


def _legal(base, layout: Layout, cluster):
    """The validated config of ``layout`` (raises ConfigError / NodeLayoutError with megalm's reason)."""
    from megalm.parallel_layout import compute_layout, node_layout

    world = cluster.world_size
    cfg = apply_layout(base, layout, world)
    if layout.hierarchical:  # the node split the trainer makes at start-up
        lay = compute_layout(world, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp)
        node = node_layout(lay, cluster.devices_per_node)
        if not node["dp_cp_inter"] or len(node["dp_cp_inter"][0]) < 2:
            raise ConfigError("--hierarchical-grad-reduce needs a data-parallel group spanning nodes")
    return cfg


def _candidate(cfg, layout: Layout, cluster, memory: float, note: str = "") -> Candidate:
    cost = step_cost(cfg, cluster)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length / cost.step_s
    return Candidate(layout, cfg.parallel.data_parallel_size, cost, memory, tokens, note)


def largest_rank_bytes(cfg, cluster) -> float:
    """The largest rank's bytes (:func:`megalm.estimate.planner.plan`, its configured sharding strategy)."""
    from megalm.config import replace_config

    cfg = replace_config(cfg, logging={"device_peak_flops": 1.0})  # the memory plan only: no peak measurement
    options = PlannerOptions(
        world_size=cluster.world_size,
        gpu_memory_gb=cluster.memory_gb,
        device="cpu" if cluster.device == "cpu" else "h100",
        reserve_gb=cluster.reserve_gb,
    )
    from megalm.planner.data_parallel import memory_change

    r = plan(cfg, options)
    key = f"total_{cfg.parallel.data_parallel_sharding_strategy}"
    return max(st[key] + memory_change(cfg, st) for st in r["stages"])


def explain(result: SearchResult, top: int = 5) -> List[str]:
    """Why the first choice beats the rest: the best layout of every other (TP, PP, CP, EP) shape, its
    step time against the winner's and its dominant term."""
    if not result.candidates:
        return []
    best = result.candidates[0]
    seen: Dict[tuple, Candidate] = {}
    for c in result.candidates:
        key = (c.layout.tp, c.layout.pp, c.layout.cp, c.layout.ep)
        seen.setdefault(key, c)
    lines = []
    for key, c in list(seen.items())[1 : top + 1]:
        terms = c.cost.terms
        worse = max(terms, key=lambda k: terms[k] - best.cost.terms.get(k, 0.0))
        lines.append(
            f"  best TP{key[0]} PP{key[1]} CP{key[2]} EP{key[3]}: {c.cost.step_s * 1e3:.1f} ms "
            f"(+{(c.cost.step_s / best.cost.step_s - 1) * 100:.0f}%), dominant {c.cost.dominant}, "
            f"loses most on {worse} (+{(terms[worse] - best.cost.terms.get(worse, 0.0)) * 1e3:.1f} ms)"
        )
    return lines + choices(result)


def choices(result: SearchResult) -> List[str]:
    """Why the first choice offloads or compresses (or, when compression was searched, does not)."""
    best = result.candidates[0]
    lay, lines = best.layout, []
    if best.note:
        what = " and ".join(x for x, on in (("activations", lay.act_offload), ("optimizer", lay.opt_offload)) if on)
        lines.append(f"  offload ({what}): {best.note}; it costs {best.cost.terms.get('offload', 0.0) * 1e3:.1f} ms")
    by_layout = {c.layout: c for c in result.candidates}
    plain = by_layout.get(dataclasses.replace(lay, compression="none"))
    if lay.compression != "none" and plain is not None:
        t, p = best.cost.terms, plain.cost.terms
        lines.append(
            f"  --grad-compression {lay.compression}: dp_comm {p['dp_comm'] * 1e3:.1f} -> {t['dp_comm'] * 1e3:.1f} ms "
            f"(codec included); the same layout uncompressed is {plain.cost.step_s * 1e3:.1f} ms "
            f"(+{(plain.cost.step_s / best.cost.step_s - 1) * 100:.0f}%)"
        )
    elif lay.compression == "none":
        twins = [by_layout.get(dataclasses.replace(lay, compression=m)) for m in ("int8", "fp8")]
        twin = next((c for c in twins if c is not None), None)
        if twin is not None:
            t, p = twin.cost.terms, best.cost.terms
            lines.append(
                f"  --grad-compression {twin.layout.compression} on #1: {twin.cost.step_s * 1e3:.1f} ms "
                f"(+{(twin.cost.step_s / best.cost.step_s - 1) * 100:.0f}%), dp_comm {p['dp_comm'] * 1e3:.1f} -> "
                f"{t['dp_comm'] * 1e3:.1f} ms: the codec costs more than the exposed bytes it saves"
            )
    return lines
