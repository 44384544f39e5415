"""The layout planner (megalm/planner/): cost terms against hand counts, search completeness, refusal
reasons, the cluster file, and the flags it prints starting a real run on 2 ranks."""

import dataclasses
import os
import subprocess
import sys

import pytest

from megalm.config import ConfigError
from megalm.planner.cluster import Cluster, ClusterFileError, dump_cluster, load_cluster
from megalm.planner.cost import _Step, step_cost
from megalm.planner.links import layout_links, ring_time
from megalm.planner.search import Layout, SearchOptions, apply_layout, divisors, layouts, search
from tests.configs import tiny_flags_config
from tests.distributed_harness import run_distributed
from tests.training_runs import records, run_trainings, tiny_flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))

# Round numbers, no latency: every term is bytes / rate or FLOPs / rate.
FLAT = Cluster(
    name="flat",
    nodes=2,
    devices_per_node=2,
    memory_gb=10.0,
    peak_tflops=1.0,
    gemm_efficiency=1.0,
    attention_efficiency=0.5,
    memory_bandwidth_gbps=100.0,
    intra_node_bandwidth_gbps=10.0,
    intra_node_latency_us=0.0,
    inter_node_bandwidth_gbps=1.0,
    inter_node_latency_us=0.0,
    backend="nccl",
    reserve_gb=0.0,
    layer_overhead_us=0.0,
    step_overhead_ms=0.0,
    dp_overlap=0.0,
    device="cpu",
)


# The tiny GPT of tests.training_runs with a global batch of 8, and mock data's 501 ids as the trainer records them.
TINY8 = dict(global_batch_size=8)
VOCAB = 501


def _layout_cfg(layout, **flags):
    return apply_layout(tiny_flags_config(TINY8, tokenizer_vocab=VOCAB, **flags), layout, 4)


def test_ring_collectives_against_hand_counts():
    links = layout_links(4, 2, 1, 1, 1, 1, 1)  # DP 4 over 2 nodes: each node has one hop leaving it
    dp = links["data_context"]
    assert (dp.size, dp.crosses, dp.ring_senders) == (4, True, 1)
    # all-reduce of 8 MB: 2 (K-1)/K x 8e6 bytes at the slower (inter) link, 1 GB/s
    assert ring_time(FLAT, dp, "all_reduce", 8e6)[0] == pytest.approx(2 * 3 / 4 * 8e6 / 1e9)
    # gloo's reduce-scatter sends an all-reduce's bytes
    gloo = dataclasses.replace(FLAT, backend="gloo")
    cfg = _layout_cfg(Layout(strategy="optim"))
    assert _Step(cfg, gloo).ring("data_context", "reduce_scatter", 8e6) == pytest.approx(2 * 3 / 4 * 8e6 / 1e9)
    assert _Step(cfg, FLAT).ring("data_context", "reduce_scatter", 8e6) == pytest.approx(3 / 4 * 8e6 / 1e9)
    # TP 2 inside a node: 2 groups, intra link only; latency 2 (K-1) steps
    lat = dataclasses.replace(FLAT, intra_node_latency_us=10.0)
    tp = layout_links(4, 2, 2, 1, 1, 1, 1)["tensor"]
    assert not tp.crosses
    assert ring_time(lat, tp, "all_reduce", 1e6)[0] == pytest.approx(1e6 / 10e9 + 2 * 10e-6)
    # TP 2 x DP 2: both DP groups cross from each node: the node link is shared by two hops
    dp2 = layout_links(4, 2, 2, 1, 1, 1, 1)["data_context"]
    assert dp2.ring_senders == 2
    assert ring_time(FLAT, dp2, "all_reduce", 1e6)[0] == pytest.approx(1e6 / (1e9 / 2))


def test_layer_terms_against_hand_counts():
    """One layer, one microbatch: GEMM FLOPs, attention FLOPs and the TP all-reduces, counted by hand."""
    cfg = _layout_cfg(Layout(tp=2, micro_batch=2))  # DP 2: 8 / (2 x 2) = 2 microbatches
    s = _Step(cfg, FLAT)
    h, f, T, tp = 64, 256, 2 * 32, 2
    layer = s.layer(False)
    gemm = 3 * 2 * T * (3 * h * h + h * h + 2 * h * f) / tp  # QKV, proj, fc1, fc2: forward + 2 backward
    assert layer["gemm"] == pytest.approx(gemm / 1e12)
    attention = 3 * 4 * 2 * 32 * 32 * 4 * 16 / tp  # 4 b s s n d / TP, x3
    assert layer["attention"] == pytest.approx(attention / (0.5 * 1e12))
    # 4 all-reduces of T h fp32 bytes over the intra link: 2 (K-1)/K = 1 x bytes
    assert layer["tp_comm"] == pytest.approx(4 * T * h * 4 / 10e9)
    # sequence parallel: forward AG + RS twice, backward RS + AG twice and the inputs gathered again (2 AG)
    sp = _Step(_layout_cfg(Layout(tp=2, sp=True, micro_batch=2)), FLAT).layer(False)
    assert sp["tp_comm"] == pytest.approx((2 * 2 + 2 * 2 + 2) * 0.5 * T * h * 4 / 10e9)
    # full recompute: the forward's GEMMs and collectives run again
    full = _Step(_layout_cfg(Layout(tp=2, micro_batch=2, recompute="full")), FLAT).layer(False)
    assert full["gemm"] == pytest.approx(layer["gemm"] * 4 / 3)
    assert full["tp_comm"] == pytest.approx(layer["tp_comm"] * 6 / 4)


def test_data_parallel_and_pipeline_terms():
    # DP 4 over 2 nodes, no overlap: one all-reduce of every fp32 gradient over the inter link
    cfg = _layout_cfg(Layout(micro_batch=2))
    cost = step_cost(cfg, FLAT)
    from megalm.estimate.parameters import total_parameters

    grads = total_parameters(cfg) * 4
    assert cost.terms["dp_comm"] == pytest.approx(2 * 3 / 4 * grads / 1e9)
    assert cost.dp_inter_node_bytes == pytest.approx(2 * 3 / 4 * grads)  # comm.py's per-node count
    # distributed optimizer: reduce-scatter of the gradients + all-gather of the (fp32) weights
    dist = step_cost(_layout_cfg(Layout(micro_batch=2, strategy="optim")), FLAT)
    assert dist.terms["dp_comm"] == pytest.approx((3 / 4 * grads + 3 / 4 * grads) / 1e9)
    # PP 2 (DP 2), 4 microbatches of 1: bubble = (p - 1) x the mean stage time plus its two sends
    pp = _layout_cfg(Layout(pp=2, micro_batch=1))
    s = _Step(pp, FLAT)
    stages = [sum(s.stage_micro(r).values()) for r in range(2)]
    c = step_cost(pp, FLAT)
    act = 32 * 64 * 4
    send = act / 1e9  # the stage boundary crosses nodes (ranks 0,1 | 2,3): inter link shared by the 2 pipelines
    assert c.terms["pp_comm"] == pytest.approx(4 * 2 * act / (1e9 / 2))
    assert c.terms["bubble"] == pytest.approx(sum(stages) / 2 + 2 * 2 * send)
    # interleaving (v = 2 chunks of one layer) halves the bubble's stage time
    v = step_cost(_layout_cfg(Layout(pp=2, vpp=2, micro_batch=1), num_layers=4), FLAT)
    nv = step_cost(_layout_cfg(Layout(pp=2, micro_batch=1), num_layers=4), FLAT)
    assert v.terms["bubble"] < 0.75 * nv.terms["bubble"]


def test_buckets_call_costs_and_optimizer_step_against_hand_counts():
    """Per-bucket gradient reductions, the per-call cost, the optimizer step per element, sharded and not."""
    from megalm.estimate.parameters import total_parameters
    from megalm.planner.data_parallel import bucket_elements, num_buckets

    lat = dataclasses.replace(FLAT, inter_node_latency_us=100.0, collective_call_us=1000.0)
    one = _layout_cfg(Layout(micro_batch=2))  # --overlap-grad-reduce, default bucket (40M): one bucket
    n = total_parameters(one)
    assert bucket_elements(one.parallel) == 40_000_000 and num_buckets(n, 40e6) == 1
    size = -(-n // 3)  # three buckets
    three = _layout_cfg(Layout(micro_batch=2), ddp_bucket_size=size)
    assert num_buckets(n, bucket_elements(three.parallel)) == 3
    ar = 2 * 3 / 4 * n * 4 / 1e9  # the bytes over the inter link, the same in one call or three
    steps = 2 * 3 * 100e-6  # all-reduce over 4 ranks: 2 (K-1) latency steps per call
    assert step_cost(one, lat).terms["dp_comm"] == pytest.approx(ar + steps + 1e-3)
    assert step_cost(three, lat).terms["dp_comm"] == pytest.approx(ar + 3 * (steps + 1e-3))
    # the optimizer step: every element on one rank (no_shard), a quarter with the distributed optimizer
    opt = dataclasses.replace(FLAT, optimizer_ns_per_param=10.0)
    assert step_cost(one, opt).terms["optimizer"] == pytest.approx(n * 10e-9)
    sharded = _layout_cfg(Layout(micro_batch=2, strategy="optim"))
    assert step_cost(sharded, opt).terms["optimizer"] == pytest.approx(n / 4 * 10e-9)
    # uncalibrated: Adam's 36 bytes per element at memory bandwidth
    assert step_cost(one, FLAT).terms["optimizer"] == pytest.approx(n * 36 / 100e9)


def _dp_only(cluster, **kw):
    """World 2 (one device on each of 2 nodes), DP only: the search's choice is the strategy, offload, compression."""
    opts = SearchOptions(max_tp=1, max_pp=1, max_cp=1, recompute=("none",), strategies=("no_shard", "optim"), **kw)
    return search(
        tiny_flags_config(TINY8, tokenizer_vocab=VOCAB), dataclasses.replace(cluster, devices_per_node=1), opts
    )


def test_compression_picked_on_a_slow_link_with_its_reason():
    from megalm.estimate.parameters import total_parameters
    from megalm.planner.cli import compression_methods, format_result

    slow = dataclasses.replace(FLAT, inter_node_bandwidth_gbps=0.01)
    result = _dp_only(slow, compression=("none", "int8"))
    best = result.candidates[0]
    assert best.layout.compression == "int8"
    n = total_parameters(tiny_flags_config(TINY8, tokenizer_vocab=VOCAB))
    payload = n + 4 * -(-n // 1024)  # int8 values + an fp32 scale per 1024: one bucket (40M default)
    codec = (13 + 9 * 2) * n / 100e9  # encode + decoding 2 gathered payloads at memory bandwidth
    if best.layout.strategy == "no_shard":  # all-gather over 2 ranks: each sends its payload once
        assert best.cost.terms["dp_comm"] == pytest.approx(payload / 0.01e9 + codec)
    text = format_result(tiny_flags_config(TINY8, tokenizer_vocab=VOCAB), slow, result, [], 1)
    assert "--grad-compression int8: dp_comm" in text and "the same layout uncompressed is" in text
    assert "--grad-compression int8" in text.split("terms (ms per step)")[1]  # in the printed command
    # a fast link: the codec costs more than the bytes it saves, and the output says so
    fast = dataclasses.replace(FLAT, inter_node_bandwidth_gbps=10.0, memory_bandwidth_gbps=1.0)
    plain = _dp_only(fast, compression=("none", "int8"))
    assert plain.candidates[0].layout.compression == "none"
    assert "the codec costs more than the exposed bytes it saves" in format_result(
        tiny_flags_config(TINY8, tokenizer_vocab=VOCAB), fast, plain, [], 1
    )
    assert compression_methods("int8,fp8") == ("none", "int8", "fp8")
    with pytest.raises(ConfigError, match="powersgd not searchable"):
        compression_methods("powersgd")
    # a --grad-compression in the model flags is kept: every layout with data parallelism uses it
    assert compression_methods("none", "int8") == ("int8",)
    with pytest.raises(ConfigError, match="--grad-compression topk: the planner models int8 and fp8 only"):
        compression_methods("none", "topk")
    opts = SearchOptions(max_tp=4, recompute=("none",), compression=("int8",), max_micro_batch=1)
    kept = list(layouts(tiny_flags_config(TINY8, tokenizer_vocab=VOCAB, num_layers=4), FLAT, opts))
    # int8 wherever there is data parallelism (optim_grads*: not generated); none only where there is none
    assert kept and all((c.compression == "int8") == (4 // (c.tp * c.pp) > 1) for c in kept)
    assert all(c.strategy in ("no_shard", "optim") for c in kept if 4 // (c.tp * c.pp) > 1)


def test_offload_picked_at_a_tiny_memory_budget_with_its_reason():
    from megalm.estimate.parameters import total_parameters

    roomy = _dp_only(FLAT)
    assert roomy.dominated > 0 and not any(c.layout.opt_offload or c.layout.act_offload for c in roomy.candidates)
    smallest = min(roomy.candidates, key=lambda c: c.memory_bytes)
    n = total_parameters(tiny_flags_config(TINY8, tokenizer_vocab=VOCAB))
    # just below every layout without offload: fp32 Adam keeps 8 bytes of moments per parameter (no_shard)
    budget = smallest.memory_bytes - 1e3
    tight = _dp_only(dataclasses.replace(FLAT, memory_gb=budget / 1e9))
    assert tight.candidates and all(c.layout.opt_offload or c.layout.act_offload for c in tight.candidates)
    best = tight.candidates[0]
    assert "without offload" in best.note and best.memory_bytes <= budget
    by = {c.layout: c for c in tight.candidates}
    opt = by.get(dataclasses.replace(smallest.layout, opt_offload=True))
    shards = 2 if smallest.layout.strategy == "optim" else 1
    assert opt is not None and opt.memory_bytes == pytest.approx(smallest.memory_bytes - 8 * n / shards)
    # its time: gradients down (4 B) and weights back (4 B) over the host link, the host's Adam step
    host = n / shards * (8 / 50e9 + 2e-9)
    assert opt.cost.terms["optimizer"] == pytest.approx(host)
    act = [c for c in tight.candidates if c.layout.act_offload]
    assert act and all("--cpu-offloading-num-layers" in c.layout.flags() for c in act)
    assert all(c.cost.terms["offload"] > 0 for c in act)  # the device is "cpu": synchronous copies


def test_search_is_complete_and_legal():
    """World 4: every (TP, PP, CP) factorisation megalm accepts appears, each layout once, and every
    considered layout is ranked, refused with a reason, or too big."""
    base = tiny_flags_config(TINY8, tokenizer_vocab=VOCAB, num_layers=4)
    opts = SearchOptions(max_tp=4, recompute=("none",), strategies=("no_shard", "optim"), max_micro_batch=2)
    result = search(base, FLAT, opts)
    seen = [c.layout for c in result.candidates]
    assert len(seen) == len(set(seen))
    assert result.considered == len(seen) + sum(result.refused.values()) + result.too_big
    shapes = {(c.layout.tp, c.layout.pp, c.layout.cp) for c in result.candidates}
    legal = set()
    for tp in divisors(4):
        for pp in divisors(4):
            for cp in divisors(4):
                if 4 % (tp * pp * cp) == 0:
                    try:
                        apply_layout(base, Layout(tp=tp, pp=pp, cp=cp, sp=tp > 1, micro_batch=1), 4)
                        legal.add((tp, pp, cp))
                    except ConfigError:
                        pass
    assert shapes == legal and (4, 1, 1) in legal and (1, 4, 1) in legal and (1, 1, 4) in legal
    assert all(c.dp == 4 // (c.layout.tp * c.layout.pp * c.layout.cp) for c in result.candidates)
    steps = [c.cost.step_s for c in result.candidates]
    assert steps == sorted(steps)
    # every generated layout is distinct too
    all_layouts = list(layouts(base, FLAT, opts))
    assert len(all_layouts) == len(set(all_layouts)) == result.considered
    # one distributed-optimizer instance per node (2) where legal: sharded, flat, DP x CP a multiple of 2; its
    # memory from the estimate (the optimizer sharded over 2 ranks, not 4); TP 4 (DP 1) refused with the reason
    inst = [c for c in result.candidates if c.layout.instances == 2]
    assert inst and {c.layout.strategy for c in inst} == {"optim"} and not any(c.layout.hierarchical for c in inst)
    assert all((c.dp * c.layout.cp) % 2 == 0 for c in inst)
    assert any(x.instances == 2 and x.tp == 4 for x in all_layouts)
    assert result.refused["--num-distributed-optimizer-instances N must divide the data-parallel (x context) size N"]
    by_layout = {c.layout: c for c in result.candidates}
    for c in inst:
        one = by_layout[dataclasses.replace(c.layout, instances=1)]
        assert c.memory_bytes > one.memory_bytes if c.dp * c.layout.cp == 4 else c.memory_bytes >= one.memory_bytes
        i = c.layout.flags().index("--num-distributed-optimizer-instances")
        assert c.layout.flags()[i + 1] == "2" and "inst2" in c.layout.short()


def test_refusal_reasons_are_megalms_own():
    # 3 layers cannot split over 2 or 4 stages; 4 heads cannot split over TP 8 (world 8)
    base = tiny_flags_config(TINY8, tokenizer_vocab=VOCAB, num_layers=3)
    result = search(base, dataclasses.replace(FLAT, nodes=4), SearchOptions(recompute=("none",), max_micro_batch=1))
    reasons = dict(result.refused)
    assert reasons["--num-layers N is not divisible by --pipeline-model-parallel-size N"] > 0
    assert any("optim_grads" in r and "not built yet" in r for r in reasons)
    assert all(c.layout.pp in (1,) or 3 % c.layout.pp == 0 for c in result.candidates)
    with pytest.raises(ConfigError, match="not divisible by --pipeline-model-parallel-size 2"):
        apply_layout(base, Layout(pp=2), 8)
    # memory: a 100 kB device leaves every legal layout out, and says so
    tiny = search(
        tiny_flags_config(TINY8, tokenizer_vocab=VOCAB),
        dataclasses.replace(FLAT, memory_gb=0.0001),
        SearchOptions(recompute=("none",)),
    )
    assert not tiny.candidates and tiny.too_big > 0 and tiny.smallest_too_big[0] > 1e5


def test_cluster_file_round_trip_and_errors(tmp_path):
    c = dataclasses.replace(load_cluster("h100"), nodes=8, gemm_tflops={"1e+06": 10.0, "1e+12": 700.0})
    path = tmp_path / "c.toml"
    path.write_text(dump_cluster(c))
    back = load_cluster(str(path))
    assert back == c and back.world_size == 64
    # log-interpolated between the calibrated points, clamped outside
    assert back.gemm_flops_per_s(1e9) == pytest.approx(355e12)
    assert back.gemm_flops_per_s(1e3) == pytest.approx(10e12)
    assert load_cluster("h100", {"nodes": 64}).nodes == 64
    path.write_text("nodes = 2\nbogus = 1\n")
    with pytest.raises(ClusterFileError, match="unknown cluster key 'bogus'"):
        load_cluster(str(path))
    with pytest.raises(ClusterFileError, match="no cluster preset or file"):
        load_cluster(str(tmp_path / "missing.toml"))
    with pytest.raises(ClusterFileError, match="backend must be nccl or gloo"):
        load_cluster("h100", {"backend": "mpi"})


def _train_planned(flags, auto, tmp):
    """The printed flags, then pretrain_gpt.py --auto-layout: two short runs in one spawned group."""
    runs = [flags + ["--metrics-file", os.path.join(tmp, "plan.jsonl")]]
    return run_trainings(runs + [auto + ["--metrics-file", os.path.join(tmp, "auto.jsonl")]])


def test_printed_flags_start_a_run(tmp_path):
    """tools/plan.py on a tiny model for 2 CPU ranks; its first layout's flags train 2 iterations."""
    model = tiny_flags(global_batch_size=4, train_iters=2)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plan.py"), *model, "--cluster", "cpu", "--devices-per-node"]
        + ["2", "--top-k", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "pretrain_gpt.py" in x)
    flags = line.split("pretrain_gpt.py ", 1)[1].split()
    assert "--tensor-model-parallel-size" in flags and "--micro-batch-size" in flags
    assert " 1 node(s) x 2 devices" in out.stdout and "refused by megalm's validation" in out.stdout
    # --auto-layout takes the same first choice for 2 ranks of the cpu cluster; explicit layout flags refused
    from megalm.planner.auto import auto_layout_argv

    auto = model + ["--auto-layout", "--cluster-config", "cpu"]
    chosen = auto_layout_argv(auto, 2, 2, log=lambda *_: None)
    assert chosen == model + flags[flags.index("--tensor-model-parallel-size") :]
    with pytest.raises(ConfigError, match="--auto-layout chooses the layout: drop --micro-batch-size"):
        auto_layout_argv(auto + ["--micro-batch-size", "1"], 2, 2)
    codes = run_distributed(_train_planned, 2, args=(flags, auto, str(tmp_path)), timeout=300)
    assert codes == [[0, 0], [0, 0]]
    assert len(records(str(tmp_path), "plan")) == 2 and len(records(str(tmp_path), "auto")) == 2
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plan.py"), *model, "--cluster", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no cluster preset or file 'nope'" in bad.stderr


def test_token_bucket_link_and_step_floor_against_hand_counts():
    """A token-bucket node link (the simulated cluster's tc tbf): a call's bytes up to the burst pass at the
    device link's rate; the step lasts at least the busiest node's bytes of the step at the link's rate."""
    from megalm.planner.links import node_link_s

    bucket = dataclasses.replace(FLAT, inter_node_bandwidth_gbps=0.001, inter_node_burst_bytes=30000.0)
    dp = layout_links(4, 2, 1, 1, 1, 1, 1)["data_context"]  # one ring hop leaves each node
    assert node_link_s(bucket, 80000.0) == pytest.approx(50000.0 / 1e6)
    # 8 MB all-reduce: 1.5 x 8 MB leave the node, less the burst, at 1 MB/s; 16 kB: all within the burst
    assert ring_time(bucket, dp, "all_reduce", 8e6)[0] == pytest.approx((1.5 * 8e6 - 3e4) / 1e6)
    assert ring_time(bucket, dp, "all_reduce", 16384)[0] == pytest.approx(1.5 * 16384 / 10e9)
    # TP 4 over 2 nodes, 4 microbatches of 2: per microbatch 2 layers x 4 all-reduces + the embedding's and
    # the output layer's 3, each of T h fp32 bytes (1.5 x 16 kB leave a node, under the burst), and the step's
    # two small all-reduces over the world (NaN check, gradient norm over TP: 8 x 2 x 4 bytes each)
    cfg = _layout_cfg(Layout(tp=4, micro_batch=2))
    cost = step_cost(cfg, bucket)
    node_bytes = 4 * (2 * 4 + 3) * 1.5 * (64 * 64 * 4) + 2 * 1.5 * 64
    assert cost.detail["node_bytes"] == pytest.approx(node_bytes)
    assert cost.terms["node_link"] > 0
    assert cost.step_s == pytest.approx((node_bytes - 3e4) / 1e6)
    # without a bucket the per-call times already exceed the floor: no node_link term
    plain = step_cost(cfg, dataclasses.replace(bucket, inter_node_burst_bytes=0.0))
    assert plain.terms["node_link"] == 0 and plain.step_s > cost.step_s


def test_step_sync_dispatchers_shared_cores_and_hierarchical_sharding_against_hand_counts():
    from megalm.estimate.parameters import total_parameters

    # the step's small all-reduces, 1 ms per call (no latency, negligible bytes): DP 4 no_shard: NaN check
    # (world) + losses (DP); the gradient norm's model-parallel group is one rank; sharded: the norm over the world
    call = dataclasses.replace(FLAT, collective_call_us=1000.0)
    assert step_cost(_layout_cfg(Layout(micro_batch=2)), call).terms["step_sync"] == pytest.approx(2e-3, rel=1e-3)
    sharded = _layout_cfg(Layout(micro_batch=2, strategy="optim"))
    assert step_cost(sharded, call).terms["step_sync"] == pytest.approx(3e-3, rel=1e-3)
    tp2 = _layout_cfg(Layout(tp=2, micro_batch=2))  # world, TP (the model group), DP
    assert step_cost(tp2, call).terms["step_sync"] == pytest.approx(3e-3, rel=1e-3)

    # MoE, EP 2 inside a node (10 GB/s), one microbatch of 2 x 32 tokens: T h fp32 = 16 kB
    T, h, E = 64, 64, 4
    moe = dict(num_experts=E, moe_router_topk=2)
    gathered = _Step(_layout_cfg(Layout(ep=2, micro_batch=2), **moe), FLAT).dispatch(1)
    hidden, routing = 2 * T * h * 4, 2 * T * 2 * E * 4  # [EP T, h] and [EP T, 2E] fp32
    # forward AG tokens + AG routing + RS output; backward AG output grad + RS tokens' and routing's grads
    assert gathered == pytest.approx((4 * hidden / 2 + 2 * routing / 2) / 10e9)
    a2a = _Step(_layout_cfg(Layout(ep=2, micro_batch=2), moe_token_dispatcher_type="alltoall", **moe), FLAT)
    # the counts' all-gather (EP x E int64), then 4 all-to-alls of k T h bytes, half of each to the peer
    assert a2a.dispatch(1) == pytest.approx((2 * E * 8 / 2 + 4 * 2 * T * h * 4 / 2) / 10e9)

    # 4 ranks sharing 2 cores: PP 2 with 4 microbatches, an idle stage's core serves the busy one
    pp = _layout_cfg(Layout(pp=2, micro_batch=1))
    own = step_cost(pp, FLAT)
    shared = step_cost(pp, dataclasses.replace(FLAT, host_cores=2))
    assert own.terms["bubble"] > 0 and shared.terms["bubble"] == 0
    # PP 4, 2 microbatches of 4: the critical path at a whole core's rate (half the shared one) is longer
    pp4 = _layout_cfg(Layout(pp=4, micro_batch=4), num_layers=4)
    own4, shared4 = step_cost(pp4, FLAT), step_cost(pp4, dataclasses.replace(FLAT, host_cores=2))
    rest = sum(own4.terms[k] for k in ("dp_comm", "optimizer", "step_sync", "node_link"))
    piped = own4.step_s - own4.terms["bubble"] - rest  # n x slot
    assert shared4.terms["bubble"] == pytest.approx((piped + own4.terms["bubble"]) / 2 - piped)
    assert 0 < shared4.terms["bubble"] < own4.terms["bubble"]

    # distributed optimizer + --hierarchical-grad-reduce on gloo, DP 4 = 2 nodes x 2, one bucket of N bytes:
    # intra RS (an all-reduce's 1/2 N on gloo's wire), inter RS of N/2 (gloo: 2 x 1/2 x N/2, two ranks
    # per node share the node link), parameters: inter AG of N/2 (1/2 x N/2 per rank), intra AG of N
    gloo = dataclasses.replace(FLAT, backend="gloo")
    hier = _layout_cfg(Layout(micro_batch=2, strategy="optim", hierarchical=True))
    N = total_parameters(hier) * 4
    grad = N / 10e9 + (N / 2) / (1e9 / 2)
    gather = (N / 4) / (1e9 / 2) + (N / 2) / 10e9
    assert step_cost(hier, gloo).terms["dp_comm"] == pytest.approx(grad + gather)


def test_distributed_optimizer_instances_against_hand_counts():
    """--num-distributed-optimizer-instances 2 at DP 4 = 2 nodes x 2, one bucket of N bytes: reduce-scatter and
    parameter all-gather inside the node (the instance), the shard's all-reduce across the instances, the
    optimizer step on a half; the bytes the real run counts (tests/test_hierarchical_reduce.py
    test_distributed_optimizer_instances_equal_flat_and_count_bytes: 2 (2-1)/2 x N/2 per rank across nodes)."""
    from megalm.estimate.parameters import total_parameters

    inst = _layout_cfg(Layout(micro_batch=2, strategy="optim", instances=2))
    assert inst.parallel.num_distributed_optimizer_instances == 2
    links = _Step(inst, FLAT).links
    assert (links["instance"].size, links["instance"].crosses) == (2, False)
    assert (links["across_instances"].size, links["across_instances"].ring_senders) == (2, 2)
    N = total_parameters(inst) * 4  # fp32 gradients and weights
    opt = dataclasses.replace(FLAT, optimizer_ns_per_param=10.0)
    cost = step_cost(inst, opt)
    # RS inside: 1/2 N at 10 GB/s; across: 2 x 1/2 x N/2 per rank, both ranks of a node over its 1 GB/s link;
    # AG inside: 1/2 N at 10 GB/s
    assert cost.terms["dp_comm"] == pytest.approx(N / 2 / 10e9 + N / 1e9 + N / 2 / 10e9)
    assert cost.dp_inter_node_bytes == pytest.approx(2 * N / 2)
    assert cost.terms["optimizer"] == pytest.approx(N / 4 / 2 * 10e-9)
    # the flat distributed optimizer over the 4 ranks: RS and AG of 3/4 N across nodes (one hop per node)
    flat = step_cost(_layout_cfg(Layout(micro_batch=2, strategy="optim")), opt)
    assert flat.terms["dp_comm"] == pytest.approx(2 * 3 / 4 * N / 1e9)
    assert flat.terms["optimizer"] == pytest.approx(N / 4 / 4 * 10e-9)
    # gloo: the reduce-scatter inside is an all-reduce on the wire; ZeRO-3 (one microbatch): gathered 3 times
    gloo = dataclasses.replace(FLAT, backend="gloo")
    assert step_cost(inst, gloo).terms["dp_comm"] == pytest.approx(N / 10e9 + N / 1e9 + N / 2 / 10e9)
    z3 = _layout_cfg(Layout(micro_batch=2, strategy="optim_grads_params", instances=2))
    assert step_cost(z3, FLAT).terms["dp_comm"] == pytest.approx(N / 2 / 10e9 + N / 1e9 + 3 * N / 2 / 10e9)
    # two buckets: the same bytes, each call pays the across-instance ring's 2 (2-1) latency steps
    lat = dataclasses.replace(FLAT, inter_node_latency_us=100.0)
    two = _layout_cfg(Layout(micro_batch=2, strategy="optim", instances=2), ddp_bucket_size=-(-N // 4 // 2))
    assert step_cost(two, lat).terms["dp_comm"] == pytest.approx(N / 10e9 + N / 1e9 + 2 * 2 * 100e-6)
    # the printed flags are the trainer's; --auto-layout chooses them (given, they are refused)
    from megalm.config import parse_config
    from megalm.planner.auto import auto_layout_argv

    model = tiny_flags(global_batch_size=8)
    flags = Layout(micro_batch=2, strategy="optim_grads", instances=2).flags()
    parsed = parse_config(model + flags, world_size=4).parallel
    assert (parsed.num_distributed_optimizer_instances, parsed.data_parallel_sharding_strategy) == (2, "optim_grads")
    auto = model + ["--auto-layout", "--cluster-config", "cpu", "--num-distributed-optimizer-instances", "2"]
    with pytest.raises(ConfigError, match="drop --num-distributed-optimizer-instances"):
        auto_layout_argv(auto, 4, 2)
