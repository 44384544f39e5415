"""``megalm-plan`` / ``tools/plan.py``: the fastest layouts of a model on a cluster, with the flags to run them.

    python3 tools/plan.py --preset llama3_8b --cluster h100 --nodes 8
    python3 tools/plan.py <pretrain_gpt.py model flags> --global-batch-size 64 --cluster my_cluster.toml --top-k 5
    python3 tools/plan.py --cluster sim.toml --calibrate --nodes 2 --devices-per-node 2 --inter-node-rate 1gbit

Model flags are pretrain_gpt.py's (megalm's parser; ``--preset NAME`` puts a preset's first); the layout flags
among them (TP, PP, CP, EP, micro batch, sharding, recompute ...) are searched, not taken.  ``--calibrate``
measures the cluster (:mod:`megalm.planner.calibrate`) and writes its rates into the ``--cluster`` file: on a
CPU host as the simulated cluster of ``tools/cluster/run.py`` (``--nodes`` x ``--devices-per-node`` processes,
links at ``--inter-node-rate``); elsewhere it prints the torchrun command to run on the real nodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from megalm.config import build_parser, config_from_args, set_vocab_size
from megalm.estimate.cli import _vocab_size, expand_preset
from megalm.planner.cluster import PRESETS, load_cluster
from megalm.planner.search import SearchOptions, explain, search

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir))


@dataclass
class PlanOptions:
    """Flags of megalm-plan beyond the model's."""

    cluster: str = field(
        default="cpu-sim",
        metadata={"help": f"Cluster preset ({', '.join(PRESETS)}) or a TOML file (docs/planner.md's format)."},
    )
    nodes: Optional[int] = field(default=None, metadata={"help": "Nodes (overrides the cluster's)."})
    devices_per_node: Optional[int] = field(default=None, metadata={"help": "Devices (ranks) per node."})
    memory_gb: Optional[float] = field(default=None, metadata={"help": "Memory per device, GB (1e9 bytes)."})
    peak_tflops: Optional[float] = field(default=None, metadata={"help": "Peak dense TFLOP/s per device."})
    intra_node_bandwidth_gbps: Optional[float] = field(
        default=None, metadata={"help": "Intra-node GB/s per device, per direction."}
    )
    inter_node_bandwidth_gbps: Optional[float] = field(
        default=None, metadata={"help": "Inter-node GB/s per node (all its NICs), per direction."}
    )
    intra_node_latency_us: Optional[float] = field(default=None, metadata={"help": "Intra-node latency, us."})
    inter_node_latency_us: Optional[float] = field(default=None, metadata={"help": "Inter-node latency, us."})
    top_k: int = field(default=5, metadata={"help": "Layouts to print."})
    max_tp: Optional[int] = field(default=None, metadata={"help": "Largest TP searched (default: devices per node)."})
    max_cp: int = field(default=8, metadata={"help": "Largest CP searched."})
    max_micro_batch: int = field(default=8, metadata={"help": "Largest micro-batch size searched."})
    max_vpp: int = field(default=8, metadata={"help": "Most virtual stages per pipeline rank searched."})
    max_pp: Optional[int] = field(default=None, metadata={"help": "Largest PP searched (default: the world size)."})
    no_offload_search: bool = field(
        default=False,
        metadata={"help": "Do not try activation / optimizer offload on layouts that do not fit without it."},
    )
    search_grad_compression: str = field(
        default="none",
        metadata={
            "help": "Comma-separated --grad-compression methods to search besides none (int8, fp8): they change "
            "the numerics, so only when asked.",
        },
    )
    sequence_parallel_always: bool = field(
        default=False, metadata={"help": "Search TP > 1 with --sequence-parallel only (halves the search)."}
    )
    calibrate: bool = field(
        default=False, metadata={"help": "Measure the cluster and write its rates into the --cluster file."}
    )
    inter_node_rate: Optional[str] = field(
        default=None, metadata={"help": "--calibrate on the simulated cluster: its link rate in tc units (1gbit)."}
    )
    json: bool = field(default=False, metadata={"help": "Print the result as JSON."})


CLUSTER_KEYS = (
    "nodes",
    "devices_per_node",
    "memory_gb",
    "peak_tflops",
    "intra_node_bandwidth_gbps",
    "inter_node_bandwidth_gbps",
    "intra_node_latency_us",
    "inter_node_latency_us",
)


def parse(argv: List[str]):
    """``(config with the vocabulary set, PlanOptions, the model flags as given)``."""
    argv = expand_preset(argv)
    parser = build_parser(
        "megalm layout planner: the fastest parallel layouts of a model on a cluster (docs/planner.md)",
        extra_sections={"plan": PlanOptions},
        exit_on_error=False,
    )
    if "--world-size" in argv:  # a preset's world size: the cluster decides here
        i = argv.index("--world-size")
        argv = argv[:i] + argv[i + 2 :]
    args = parser.parse_args(argv)
    values = vars(args)
    options = PlanOptions(**{f.name: values[f"plan.{f.name}"] for f in dataclasses.fields(PlanOptions)})
    cfg = config_from_args(args)
    if options.calibrate:
        return cfg, options, []
    if cfg.training.global_batch_size is None:
        from megalm.config import ConfigError

        raise ConfigError("give --global-batch-size: the planner keeps it and searches the rest")
    set_vocab_size(cfg, _vocab_size(cfg))
    return cfg, options, model_flags(argv, parser)


# Flags the search sets: dropped from the user's flags when printing a layout's command.
SEARCHED = {
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--num-layers-per-virtual-pipeline-stage": 1,
    "--num-virtual-stages-per-pipeline-rank": 1,
    "--context-parallel-size": 1,
    "--cp-comm-type": 1,
    "--expert-model-parallel-size": 1,
    "--expert-tensor-parallel-size": 1,
    "--sequence-parallel": 0,
    "--use-distributed-optimizer": 0,
    "--data-parallel-sharding-strategy": 1,
    "--overlap-grad-reduce": 0,
    "--overlap-param-gather": 0,
    "--recompute-granularity": 1,
    "--recompute-method": 1,
    "--recompute-num-layers": 1,
    "--micro-batch-size": 1,
    "--hierarchical-grad-reduce": 0,
    "--num-distributed-optimizer-instances": 1,
    "--cpu-offloading": 0,
    "--cpu-offloading-num-layers": 1,
    "--optimizer-cpu-offload": 0,
    "--optimizer-offload-fraction": 1,
    "--grad-compression": 1,  # kept when given (the search uses it), searched with --search-grad-compression
}


def model_flags(argv: List[str], parser) -> List[str]:
    """``argv`` without the planner's own flags and the searched layout flags."""
    own = {"--" + f.name.replace("_", "-"): (f.type != "bool") for f in dataclasses.fields(PlanOptions)}
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=")[0]
        if flag in own or flag in SEARCHED:
            takes = own[flag] if flag in own else SEARCHED[flag]
            i += 1 + (takes if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def cluster_of(options: PlanOptions):
    spec = options.cluster
    if options.calibrate and spec not in PRESETS and not os.path.exists(spec):
        spec = "cpu-sim"  # a new file: the simulated cluster's keys, then what is measured
    return load_cluster(spec, {k: getattr(options, k) for k in CLUSTER_KEYS})


def launch_command(cluster, flags: List[str]) -> str:
    nodes = f"--nnodes {cluster.nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR " if cluster.nodes > 1 else ""
    return f"torchrun --nproc-per-node {cluster.devices_per_node} {nodes}pretrain_gpt.py " + " ".join(flags)


def format_result(cfg, cluster, result, base_flags: List[str], top_k: int) -> str:
    world = cluster.world_size
    lines = [
        f"cluster: {cluster.name}: {cluster.nodes} node(s) x {cluster.devices_per_node} devices = {world}, "
        f"{cluster.memory_gb:g} GB each, GEMM {cluster.gemm_flops_per_s(1e12) / 1e12:.3g} TFLOP/s, "
        f"intra {cluster.intra_node_bandwidth_gbps:g} GB/s, inter {cluster.inter_node_bandwidth_gbps:g} GB/s per node",
        f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, seq {cfg.model.seq_length}, "
        f"global batch {cfg.training.global_batch_size}"
        + (f", {cfg.model.num_experts} experts top-{cfg.model.moe_router_topk}" if cfg.model.num_experts else ""),
        f"layouts: {result.considered} considered, {sum(result.refused.values())} refused by megalm's validation, "
        f"{result.too_big} do not fit in memory, {len(result.candidates)} ranked"
        + (
            f" ({result.dominated} offloaded variants of fitting layouts not tried: never faster)"
            if result.dominated
            else ""
        ),
        "",
        f"{'#':>2} {'step ms':>9} {'tokens/s':>11} {'GB/rank':>8}  {'dominant':<11} layout (DP = world / TP PP CP)",
    ]
    for i, c in enumerate(result.candidates[:top_k]):
        lines.append(
            f"{i + 1:2d} {c.cost.step_s * 1e3:9.1f} {c.tokens_per_s:11,.0f} {c.memory_bytes / 1e9:8.2f}  "
            f"{c.cost.dominant:<11} {c.layout.short()} DP{c.dp}"
        )
    for i, c in enumerate(result.candidates[:top_k]):
        terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(c.cost.terms.items(), key=lambda kv: -kv[1]) if v)
        command = launch_command(cluster, base_flags + c.layout.flags())
        lines += ["", f"#{i + 1} terms (ms per step): {terms}", "   " + command]
    why = explain(result)
    if why:
        lines += ["", "why #1 beats the best layout of each other shape (and its offload / compression):"] + why
    if result.refused:
        lines += ["", "left out by megalm's validation (count, reason):"]
        lines += [f"  {n:6d}  {r[:160]}" for r, n in result.refused.most_common(12)]
        if len(result.refused) > 12:
            lines.append(f"  ... and {len(result.refused) - 12} other reasons")
    if result.too_big:
        mem, lay = result.smallest_too_big
        lines.append(
            f"  {result.too_big:6d}  legal but larger than {cluster.memory_gb:g} GB per rank "
            f"(smallest: {lay.short()}, {mem / 1e9:.2f} GB)"
        )
    if not result.candidates:
        lines.append("no layout fits: add devices, memory, or shrink the model / batch")
    return "\n".join(lines)


def as_json(result) -> dict:
    return {
        "considered": result.considered,
        "refused": dict(result.refused),
        "too_big": result.too_big,
        "dominated": result.dominated,
        "candidates": [
            {
                "layout": dataclasses.asdict(c.layout),
                "flags": c.layout.flags(),
                "dp": c.dp,
                "step_s": c.cost.step_s,
                "tokens_per_s": c.tokens_per_s,
                "memory_bytes": c.memory_bytes,
                "dominant": c.cost.dominant,
                "terms": c.cost.terms,
                "note": c.note,
            }
            for c in result.candidates
        ],
    }


def calibrate(options: PlanOptions, cluster) -> int:
    """Measure the cluster into ``options.cluster`` (a file path)."""
    if options.cluster in PRESETS:
        from megalm.planner.cluster import ClusterFileError

        raise ClusterFileError("--calibrate writes the --cluster file: give a path (e.g. --cluster my.toml)")
    out = os.path.abspath(options.cluster)
    base = ["--out", out, "--base", out if os.path.exists(out) else "cpu-sim"]
    worker = [sys.executable, "-m", "megalm.planner.calibrate"] + base
    if cluster.device != "cpu":
        print(
            "run on every node (then megalm-plan reads the file):\n  torchrun --nnodes N --nproc-per-node G "
            f"--node-rank $NODE_RANK --master-addr $MASTER_ADDR -m megalm.planner.calibrate --out {out} --dtype bf16"
        )
        return 0
    if cluster.nodes == 1:
        return subprocess.call(worker, cwd=ROOT)
    if options.inter_node_rate:
        from megalm.launch.netns import rate_bits, tbf_burst_bytes

        base += ["--inter-node-burst-bytes", str(tbf_burst_bytes(rate_bits(options.inter_node_rate)))]
    from megalm.launch.cluster import ClusterOptions, run_cluster

    options_ = ClusterOptions(
        nodes=cluster.nodes,
        procs_per_node=cluster.devices_per_node,
        inter_node_bandwidth=options.inter_node_rate or None,
        name="mlccal",
        timeout=600,
        raw=True,
        command=["bash", "-c", _torchrun_line(base)],
    )
    return run_cluster(options_)


def _torchrun_line(base: List[str]) -> str:
    return (
        f"cd {ROOT} && {sys.executable} -m torch.distributed.run --nnodes $NNODES --node-rank $NODE_RANK "
        "--nproc-per-node $GPUS_PER_NODE --master-addr $MASTER_ADDR --master-port $MASTER_PORT "
        "-m megalm.planner.calibrate " + " ".join(base)
    )


def compression_methods(text: str, given: str = "none") -> tuple:
    """``--search-grad-compression`` as the search's tuple (``none`` first); an unknown method is a ConfigError.
    ``given``: the model flags' ``--grad-compression``; without a search asked, that one method is kept."""
    from megalm.config import ConfigError

    if given != "none" and text == "none":
        if given not in ("int8", "fp8"):
            raise ConfigError(f"--grad-compression {given}: the planner models int8 and fp8 only")
        return (given,)
    methods = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    bad = [x for x in methods if x not in ("int8", "fp8")]
    if bad:
        raise ConfigError(f"--search-grad-compression: {', '.join(bad)} not searchable (int8, fp8)")
    return ("none", *dict.fromkeys(methods))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, options, flags = parse(argv)
    cluster = cluster_of(options)
    if options.calibrate:
        return calibrate(options, cluster)
    search_options = SearchOptions(
        max_tp=options.max_tp,
        max_cp=options.max_cp,
        max_micro_batch=options.max_micro_batch,
        max_vpp=options.max_vpp,
        sequence_parallel="on" if options.sequence_parallel_always else "both",
        max_pp=options.max_pp,
        offload=not options.no_offload_search,
        compression=compression_methods(options.search_grad_compression, cfg.parallel.grad_compression),
    )
    result = search(cfg, cluster, search_options)
    if options.json:
        print(json.dumps(as_json(result), indent=1))
    else:
        print(format_result(cfg, cluster, result, flags, options.top_k))
    return 0 if result.candidates else 1
