"""Hierarchical (intra-node / inter-node) data-parallel reduction against the flat collectives,
and the inter-node byte count against the ring formulas, on 4 real gloo ranks grouped as
2 nodes x 2 ranks (``ranks_per_node=2``; correctness does not need shaped links).

Layout DP 4: dp_cp [0, 1, 2, 3], intra-node [0, 1] / [2, 3], inter-node [0, 2] / [1, 3].  Layout
TP 2 x DP 2: dp_cp [0, 2] / [1, 3] cross nodes, so the intra-node half is this rank alone.

The DP 4 group also builds --num-distributed-optimizer-instances 2 (instances [0, 1] / [2, 3], one per
node; across instances [0, 2] / [1, 3]): the distributed optimizer over an instance against the flat one,
its optimizer-state bytes and its collectives' bytes against the formulas.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.config.sections import ConfigError
from megalm.distributed import CommStats, DistributedDataParallel, comm, finalize_model_grads
from megalm.parallel_state import (
    NodeLayoutError,
    ProcessGroups,
    compute_layout,
    get_process_groups,
    instance_layout,
    node_split,
)
from tests.configs import make_config, optimizer_config
from tests.distributed_harness import run_distributed
from tests.training_runs import tiny_flags

BATCH, NUM_MICRO, STEPS, BUCKET = 16, 2, 3, 100
LOCAL = 2  # ranks per node


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 3)  # 99 elements: padded buckets

    def forward(self, x):
        return self.out(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def make_model(expert_last_layer=False):
    torch.manual_seed(0)
    model = TinyMLP()
    if expert_last_layer:
        for p in model.out.parameters():
            p.allreduce = False  # reduced over expt_dp
    return model


def batch(step, dp_rank, dp):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
    mb = BATCH // dp // NUM_MICRO
    return x.view(dp, NUM_MICRO, mb, 8)[dp_rank], y.view(dp, NUM_MICRO, mb, 3)[dp_rank]


def backward_step(ddp, step, dp_rank, dp):
    """Gradient accumulation over NUM_MICRO microbatches; returns the summed loss."""
    x, y = batch(step, dp_rank, dp)
    total = 0.0
    for k in range(NUM_MICRO):
        loss = F.mse_loss(ddp(x[k]), y[k]) / NUM_MICRO
        if k < NUM_MICRO - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.item()
    return total


def padded_bucket_bytes(ddp):
    return sum(4 * b.numel for buf in ddp.all_buffers for b in buf.buckets)


def ddp_grads(hierarchical, overlap, expert, pg):
    """main_grads after one step with grad accumulation, and the inter-node bytes per node."""
    cfg = ParallelConfig(overlap_grad_reduce=overlap, ddp_bucket_size=BUCKET, hierarchical_grad_reduce=hierarchical)
    model = make_model(expert)
    stats = CommStats(LOCAL)
    ddp = DistributedDataParallel(model, cfg, process_groups=pg, comm_stats=stats)
    dp, dp_rank = parallel_state.group_size(pg.dp_cp), parallel_state.group_rank(pg.dp_cp)
    ddp.zero_grad_buffer()
    backward_step(ddp, 0, dp_rank, dp)
    finalize_model_grads([ddp], process_groups=pg, comm_stats=stats)
    per_node = comm.inter_node_bytes_per_node(stats)
    return {
        "grads": [p.main_grad.clone() for p in model.parameters()],
        "per_node": per_node,
        "bucket_bytes": padded_bucket_bytes(ddp),
        "ranges": ddp.bucket_ranges(),
        "kinds": sorted(stats.get()),
    }


def train_distopt(hierarchical, overlap, pg, instances=1):
    """STEPS steps of the distributed optimizer; losses, params, shard layout, bytes per node."""
    from megalm.optimizer import build_optimizer

    distopt = dict(use_distributed_optimizer=True, ddp_bucket_size=BUCKET, hierarchical_grad_reduce=hierarchical)
    distopt["num_distributed_optimizer_instances"] = instances
    overlapped = dict(overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    cfg = optimizer_config(distopt, overlapped, lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    p = cfg.parallel
    model = make_model()
    stats = CommStats(LOCAL)
    ddp = DistributedDataParallel(model, p, process_groups=pg, comm_stats=stats)
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=pg, comm_stats=stats)
    dp, dp_rank = parallel_state.group_size(pg.dp_cp), parallel_state.group_rank(pg.dp_cp)
    losses, grad_shards, norms = [], [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(backward_step(ddp, step, dp_rank, dp))
        finalize_model_grads([ddp], process_groups=pg, comm_stats=stats)
        grad_shards.append([r.grad.clone() for r in optimizer.ranges])
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    ddp.finish_param_sync()
    grad_kinds = {k: v["inter_node_bytes"] for k, v in stats.get().items()}
    owned = sum(r.numel for r in optimizer.ranges)
    return {
        "losses": losses,
        "params": [q.detach().clone() for q in model.parameters()],
        "grad_shards": grad_shards,
        "layout": optimizer.describe(),
        "inter": grad_kinds,
        "bucket_bytes": padded_bucket_bytes(ddp),
        "norms": norms,
        "wire": {k: v["wire_bytes"] for k, v in stats.get().items()},
        "owned": owned,
        "memory": optimizer.memory_breakdown(),
    }


def instance_state_bf16(pg):
    """bf16 weights, distributed optimizer over 2 instances: the state bytes of this rank, built (no step)."""
    from megalm.optimizer import build_optimizer

    distopt = dict(use_distributed_optimizer=True, ddp_bucket_size=BUCKET, num_distributed_optimizer_instances=2)
    cfg = optimizer_config(distopt, bf16=True, lr=1e-2)
    ddp = DistributedDataParallel(make_model().to(torch.bfloat16), cfg.parallel, process_groups=pg)
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=pg)
    return {"owned": sum(r.numel for r in optimizer.ranges), "memory": optimizer.memory_breakdown()}


def dp4_worker():
    parallel_state.initialize_model_parallel(ranks_per_node=LOCAL, num_distributed_optimizer_instances=2)
    pg = parallel_state.get_process_groups()
    out = {"ranks": {k: pg.ranks[k] for k in ("dp_cp", "dp_cp_intra", "dp_cp_inter", "expt_dp_inter")}}
    for overlap, expert in ((False, False), (True, False), (True, True)):
        out[("ddp", overlap, expert)] = {h: ddp_grads(h, overlap, expert, pg) for h in (False, True)}
    for overlap in (False, True):
        out[("distopt", overlap)] = {h: train_distopt(h, overlap, pg) for h in (False, True)}
        out[("instances", overlap)] = train_distopt(False, overlap, pg, instances=2)
    out["ranks"].update({k: pg.ranks[k] for k in ("dp_cp_instance", "dp_cp_across_instances")})
    out["instances_bf16"] = instance_state_bf16(pg)
    # A bundle without the node halves (built by hand) is refused, naming the flag.
    bare = ProcessGroups(dp_cp=pg.dp_cp, expt_dp=pg.expt_dp, ranks={"dp_cp": pg.ranks["dp_cp"]})
    try:
        DistributedDataParallel(make_model(), ParallelConfig(hierarchical_grad_reduce=True), process_groups=bare)
        out["refused"] = None
    except NodeLayoutError as e:
        out["refused"] = str(e)
    return out


def tp2_worker():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, ranks_per_node=LOCAL)
    pg = parallel_state.get_process_groups()
    out = {"intra": pg.dp_cp_intra, "ranks": pg.ranks["dp_cp_inter"]}
    out["ddp"] = {h: ddp_grads(h, True, False, pg) for h in (False, True)}
    out["distopt"] = {h: train_distopt(h, False, pg) for h in (False, True)}
    return out


def _close(a, b, what):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6 * max(y.abs().max().item(), 1e-30), msg=what)


@pytest.fixture(scope="module")
def dp4():
    return run_distributed(dp4_worker, 4, timeout=240)


def test_node_groups_of_the_layout(dp4):
    for rank, r in enumerate(dp4):
        assert r["ranks"]["dp_cp"] == (0, 1, 2, 3)
        assert r["ranks"]["dp_cp_intra"] == ((0, 1) if rank < 2 else (2, 3))
        assert r["ranks"]["dp_cp_inter"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert r["ranks"]["expt_dp_inter"] == r["ranks"]["dp_cp_inter"]
        assert "hierarchical-grad-reduce" in r["refused"] and "dp_cp" in r["refused"]


def test_ddp_hierarchical_equals_flat_and_counts_inter_node_bytes(dp4):
    for key in [k for k in dp4[0] if k[0] == "ddp"]:
        _, overlap, expert = key
        for r in dp4:
            flat, hier = r[key][False], r[key][True]
            _close(hier["grads"], flat["grads"], f"grads {key}")
            assert hier["ranges"] == flat["ranges"]  # same buffer layout: checkpoints unchanged
            assert any(k.endswith("_all_reduce_inter") for k in hier["kinds"])
            assert not any(k.endswith("_inter") or k.endswith("_intra") for k in flat["kinds"])
        # every rank holds the same (reduced) gradients
        for r in dp4[1:]:
            _close(r[key][True]["grads"], dp4[0][key][True]["grads"], f"replicas {key}")
        # ring all-reduce of B bytes over 4 ranks: ranks 1 and 3 send 2*3/4*B across nodes (one per
        # node); hierarchical: each rank all-reduces B/2 with its peer on the other node, 2*1/2*B/2.
        b = dp4[0][key][False]["bucket_bytes"]
        assert b >= 4 * sum(p.numel() for p in make_model().parameters()) and b % (4 * 4) == 0
        for r in dp4:
            assert r[key][False]["per_node"] == [pytest.approx(1.5 * b)] * 2
            assert r[key][True]["per_node"] == [pytest.approx(1.0 * b)] * 2


def test_distributed_optimizer_hierarchical_equals_flat(dp4):
    for key in [k for k in dp4[0] if k[0] == "distopt"]:
        for r in dp4:
            flat, hier = r[key][False], r[key][True]
            assert hier["losses"] == pytest.approx(flat["losses"], rel=1e-6)
            for gf, gh in zip(flat["grad_shards"], hier["grad_shards"]):
                _close(gh, gf, f"grad shards {key}")
            _close(hier["params"], flat["params"], f"params {key}")
            assert hier["layout"] == flat["layout"]  # each rank owns exactly its flat shard
            assert flat["losses"][-1] < flat["losses"][0]
            b = flat["bucket_bytes"]
            # flat: the all-gather sends 3/4 B per rank and gloo's reduce-scatter (an all-reduce) 6/4 B, ranks 1
            # and 3 across nodes; hierarchical: the inter-node all-gather of the node's B/2 over 2 sends B/4 and
            # the inter-node reduce-scatter B/2.
            crossing = r is dp4[1] or r is dp4[3]
            assert flat["inter"]["grad_reduce_scatter"] == pytest.approx(1.5 * b * STEPS if crossing else 0.0)
            assert flat["inter"]["param_all_gather"] == pytest.approx(0.75 * b * STEPS if crossing else 0.0)
            assert hier["inter"]["grad_reduce_scatter_inter"] == pytest.approx(0.5 * b * STEPS)
            assert hier["inter"]["param_all_gather_inter"] == pytest.approx(0.25 * b * STEPS)
            assert hier["inter"]["grad_reduce_scatter_intra"] == 0.0


def test_distributed_optimizer_instances_equal_flat_and_count_bytes(dp4):
    """--num-distributed-optimizer-instances 2 at DP 4: the same training as the flat distributed
    optimizer (losses, grad norms, weights), the optimizer state sharded over 2 ranks, and the bytes:
    reduce-scatter and all-gather inside the node, only the shard's all-reduce across nodes."""
    params = sum(p.numel() for p in make_model().parameters())
    for rank, r in enumerate(dp4):
        assert r["ranks"]["dp_cp_instance"] == ((0, 1) if rank < 2 else (2, 3))
        assert r["ranks"]["dp_cp_across_instances"] == ((0, 2) if rank % 2 == 0 else (1, 3))
    for overlap in (False, True):
        key = ("instances", overlap)
        for rank, r in enumerate(dp4):
            flat, inst = r[("distopt", overlap)][False], r[key]
            assert inst["losses"] == pytest.approx(flat["losses"], rel=1e-6)
            assert inst["norms"] == pytest.approx(flat["norms"], rel=1e-6)
            assert min(flat["norms"]) > 0.05  # --clip-grad 0.05 acts in every step
            _close(inst["params"], flat["params"], f"params {key}")
            assert inst["layout"] == dp4[rank % 2][key]["layout"]  # the other instance holds the same shard
            # fp32 AdamW: exp_avg + exp_avg_sq, 8 B per element of this rank's shard; no fp32 copy
            assert inst["memory"]["optimizer_state"] == 8 * inst["owned"]
            assert inst["memory"]["main_params"] == 0
            b = inst["bucket_bytes"]  # padded to a multiple of the instance's 2 ranks
            wire, inter = inst["wire"], inst["inter"]
            assert wire["grad_reduce_scatter"] == pytest.approx(0.5 * b * STEPS)  # (2-1)/2 B inside the node
            assert wire["param_all_gather"] == pytest.approx(0.5 * b * STEPS)
            assert wire["grad_all_reduce_across_instances"] == pytest.approx(0.5 * b * STEPS)  # 2 (2-1)/2 x B/2
            assert inter == {
                "grad_reduce_scatter": 0.0,
                "param_all_gather": 0.0,
                "grad_all_reduce_across_instances": pytest.approx(0.5 * b * STEPS),
                "grad_norm_all_reduce": inter["grad_norm_all_reduce"],
            }
        # each instance's two ranks own every parameter element once: 8 P bytes per instance, twice the flat DP 4
        # rank's share
        for instance in ((0, 1), (2, 3)):
            assert sum(dp4[i][key]["owned"] for i in instance) == params
        assert sum(r[("distopt", overlap)][False]["owned"] for r in dp4) == params
    # bf16 weights: fp32 main weight + two fp32 moments, 12 B x P / (DP/N) per instance rank (up to the shard cut)
    for instance in ((0, 1), (2, 3)):
        bf = [dp4[i]["instances_bf16"] for i in instance]
        state = [b["memory"]["main_params"] + b["memory"]["optimizer_state"] for b in bf]
        assert state == [12 * b["owned"] for b in bf]
        assert sum(b["owned"] for b in bf) == params


def test_tp2_dp2_across_nodes():
    ranks = run_distributed(tp2_worker, 4, timeout=180)
    for rank, r in enumerate(ranks):
        assert r["intra"] is None and r["ranks"] == ((0, 2) if rank % 2 == 0 else (1, 3))
        _close(r["ddp"][True]["grads"], r["ddp"][False]["grads"], "tp2 ddp grads")
        b = r["ddp"][False]["bucket_bytes"]
        # DP 2 across nodes: flat and hierarchical alike send 2*1/2*B from each of the node's 2 ranks
        assert r["ddp"][False]["per_node"] == [pytest.approx(2 * b)] * 2
        assert r["ddp"][True]["per_node"] == [pytest.approx(2 * b)] * 2
        flat, hier = r["distopt"][False], r["distopt"][True]
        assert hier["losses"] == pytest.approx(flat["losses"], rel=1e-6)
        _close(hier["params"], flat["params"], "tp2 params")


def test_node_split_refuses_uneven_layouts():
    assert node_split([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert node_split([0, 2, 4, 6], 4) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert node_split([1, 3], 2) == ([[1], [3]], [[1, 3]])
    with pytest.raises(NodeLayoutError, match=r"does not split evenly.*members per node: \[2, 1\]"):
        node_split([0, 2, 4], 3)  # world 6, 3 ranks per node, TP 2: DP group [0, 2, 4]
    with pytest.raises(NodeLayoutError, match="divide the world size"):
        parallel_state._ranks_per_node(6, 4)


def test_single_process_flag_is_a_no_op():
    model = make_model()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(
        model, ParallelConfig(hierarchical_grad_reduce=True), process_groups=get_process_groups()
    )
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    ref(x).sum().backward()
    _close([p.main_grad for p in model.parameters()], [p.grad for p in ref.parameters()], "dp 1")


def test_instance_layout_cuts_each_data_parallel_group():
    # TP 2 x DP 4: dp_cp [0, 2, 4, 6] / [1, 3, 5, 7]; 2 instances of 2 consecutive members each
    layout = compute_layout(8, tp=2)
    got = instance_layout(layout, 2)
    assert got["dp_cp_instance"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert got["dp_cp_across_instances"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert instance_layout(layout, 4)["dp_cp_instance"] == [[0], [2], [4], [6], [1], [3], [5], [7]]
    assert instance_layout(layout, 1) == {}
    with pytest.raises(NodeLayoutError, match="--num-distributed-optimizer-instances 3 must divide"):
        instance_layout(layout, 3)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_distributed_optimizer_instances": 2}, "instances 2 needs --use-distributed-optimizer"),
        ({"num_distributed_optimizer_instances": 0}, "must be >= 1, got 0"),
        ({"hierarchical_grad_reduce": True}, "2 with --hierarchical-grad-reduce is not built yet"),
        ({"grad_compression": "int8"}, "2 with --grad-compression int8 is not built yet"),
        ({"ft_replica_group_id": 0, "ft_num_replica_groups": 2}, "2 with --ft-replica-group-id is not built yet"),
        ({"num_experts": 4}, "2 with --num-experts is not built yet"),
        ({"optimizer": "muon"}, "2 with --optimizer muon is not built yet"),
        ({"world_size": 3}, "instances 2 must divide the data-parallel \\(x context\\) size 3"),
    ],
)
def test_instances_refusals(fields, message):
    base = {"num_distributed_optimizer_instances": 2, "use_distributed_optimizer": True}
    if "num_distributed_optimizer_instances" in fields:
        base = {}
    fields = dict(fields)
    world = fields.pop("world_size", 4)
    with pytest.raises(ConfigError, match=message):
        make_config(base, fields, world_size=world)


def test_ddp_refuses_a_bundle_without_instance_groups():
    cfg = ParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(NodeLayoutError, match="num_distributed_optimizer_instances=2"):
        DistributedDataParallel(make_model(), cfg, process_groups=get_process_groups())


# --- through the trainer: the flag, and inter_node_bytes in the metrics file -----------------------

TRAIN = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="200",
    lr="3e-3",
    seed="5",
    micro_batch_size="1",
    global_batch_size="8",
    train_iters="3",
    use_distributed_optimizer=True,
    overlap_grad_reduce=True,
    ddp_bucket_size="4000",
)


def trainer_worker(tmp):
    """Every run of RUNS through ``pretrain_gpt.main``; returns the exit codes and, per run, the
    counted collectives and the DP gradient buckets (element counts) of this rank's model chunk."""
    import os

    import pretrain_gpt

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # torchrun's view of 2 nodes x 2 ranks
    codes, seen = [], {}
    for name, extra in RUNS:
        chunk = {}

        def forward_step(data_iterator, model, chunk=chunk):
            chunk.setdefault("model", model)
            return pretrain_gpt.forward_step(data_iterator, model)

        pretrain_gpt.main(TRAIN + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")] + extra, forward_step)
        parallel_state.destroy_model_parallel()
        model = chunk["model"]
        seen[name] = {
            "stats": model.comm_stats.get(),  # the Trainer's CommStats, held by its DDP wrapper
            "buckets": [(b.numel, b.numel_unpadded) for buf in model.all_buffers for b in buf.buckets],
            "dp": model.data_parallel_world_size,
            "params": sum(p.numel() for p in model.module.parameters() if p.requires_grad),
        }
        codes.append(0)
    return codes, seen


PP2 = ["--pipeline-model-parallel-size", "2"]  # PP across nodes, DP 2 inside each node (no inter-node half)
INT8 = ["--grad-compression", "int8", "--int8-chunk-size", "64"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # TP inside nodes, DP 2 across
RUNS = (
    ("flat", []),
    ("hier", ["--hierarchical-grad-reduce"]),
    ("pp_flat", PP2),
    ("pp_hier", PP2 + ["--hierarchical-grad-reduce"]),
    ("tp_int8", TP2 + INT8),
    ("pp_int8", PP2 + INT8),
    ("inst", ["--num-distributed-optimizer-instances", "2"]),
)


def test_trainer_logs_inter_node_bytes(tmp_path):
    import json

    ranks = run_distributed(trainer_worker, 4, args=(str(tmp_path),), timeout=300)
    assert [codes for codes, _ in ranks] == [[0] * len(RUNS)] * 4
    _check_compressed_runs(tmp_path, [seen for _, seen in ranks])
    flat, hier = ([json.loads(line) for line in open(tmp_path / f"{name}.jsonl")] for name in ("flat", "hier"))
    assert [r["lm_loss"] for r in hier] == pytest.approx([r["lm_loss"] for r in flat], rel=1e-5)
    assert len(flat) == 3 and all(r["inter_node_bytes"] > 0 for r in flat + hier)
    # Per iteration, B bytes of gradient buckets (= of parameter buckets, fp32): flat, the one rank per
    # node whose ring successor is on the other node sends 6/4 B (gloo's reduce-scatter, an all-reduce) +
    # 3/4 B (all-gather); hierarchical, both ranks of a node send 2/4 B + 1/4 B across: 2.25 B vs 1.5 B per
    # node (the norm's few bytes aside).
    for f, h in zip(flat, hier):
        assert h["inter_node_bytes"] / f["inter_node_bytes"] == pytest.approx(2 / 3, rel=1e-3)
    # --num-distributed-optimizer-instances 2 (one per node): the same training; only the shard's all-reduce
    # across the instances leaves the node, 2 (2-1)/2 x B/2 from each of its 2 ranks = B per node (flat: 2.25 B);
    # the planner's count of the data-parallel bytes (megalm.planner) is the run's, for both
    inst = [json.loads(line) for line in open(tmp_path / "inst.jsonl")]
    assert [r["lm_loss"] for r in inst] == pytest.approx([r["lm_loss"] for r in flat], rel=1e-5)
    for f, i in zip(flat, inst):
        assert i["inter_node_bytes"] / f["inter_node_bytes"] == pytest.approx(1 / 2.25, rel=2e-3)
    from megalm.config import parse_config, with_vocab_size
    from megalm.planner.cluster import load_cluster
    from megalm.planner.cost import step_cost

    cluster = load_cluster("cpu", {"nodes": 2, "devices_per_node": 2, "backend": "gloo"})
    for name, rows in (("flat", flat), ("inst", inst)):
        cfg = with_vocab_size(parse_config(TRAIN + dict(RUNS)[name], world_size=4), 201)  # mock data: 200 + 1
        assert step_cost(cfg, cluster).dp_inter_node_bytes == pytest.approx(rows[-1]["inter_node_bytes"], rel=2e-3)
    # PP 2 (tied embeddings over the stages, distributed optimizer) with DP inside the node: same losses
    pp_flat, pp_hier = (
        [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")] for name in ("pp_flat", "pp_hier")
    )
    assert len(pp_flat) == 3
    assert [r["lm_loss"] for r in pp_hier] == pytest.approx([r["lm_loss"] for r in pp_flat], rel=1e-5)


def _check_compressed_runs(tmp_path, seen):
    """int8 compression (with the distributed optimizer: the all-to-all reduce-scatter) under TP 2 x DP 2
    and PP 2 x DP 2 trains close to the uncompressed runs, and compresses the DP gradients only: per
    step each DP bucket of N elements (K = 2 ranks, shards S = N/2) sends (K-1) (S + 4 M) bytes, and
    the buckets hold exactly the rank's trainable (TP-local / stage-local) parameters; nothing else
    is compressed (TP and sequence-parallel reductions stay exact)."""
    import json

    from megalm.distributed.compression import int8

    def losses(name):
        return [json.loads(line)["lm_loss"] for line in open(tmp_path / f"{name}.jsonl")]

    for name, reference in (("tp_int8", "flat"), ("pp_int8", "pp_flat")):
        got, want = losses(name), losses(reference)
        assert len(got) == 3 and got != want  # it compressed
        assert got == pytest.approx(want, rel=1e-2)  # and trains like the exact run
        for rank in seen:
            run = rank[name]
            k = run["dp"]
            assert k == 2
            assert sum(unpadded for _, unpadded in run["buckets"]) == run["params"]
            per_step = sum((k - 1) * (n // k + 4 * int8.shard_chunks(n // k, 64, k)[1]) for n, _ in run["buckets"])
            a2a = run["stats"]["grad_int8_all_to_all"]
            assert (a2a["calls"], a2a["wire_bytes"]) == (3 * len(run["buckets"]), 3 * per_step)
            assert [kind for kind in run["stats"] if "int8" in kind] == ["grad_int8_all_to_all"]
            assert "grad_reduce_scatter" not in run["stats"]  # the exact DP reduction is gone
