"""Gradient compression with error feedback (``--grad-compression``) on 4 real gloo ranks grouped
as 2 nodes x 2 ranks, against exact all-reduces, analytic byte counts and a single-process
simulation of the same compression.

Layout DP 4: dp_cp [0, 1, 2, 3], intra-node [0, 1] / [2, 3], inter-node [0, 2] / [1, 3].
"""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ConfigError, ParallelConfig
from megalm.distributed import CommStats, DistributedDataParallel
from megalm.distributed.compression import (
    FP8,
    GradCompressor,
    Int4,
    Int8,
    PowerSGD,
    Segment,
    TopK,
    fp8,
    int4,
    int8,
    powersgd,
    reshard,
    topk,
)
from megalm.distributed.compression.segments import matrix_segments
from megalm.distributed.local_sgd import OuterSync
from megalm.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megalm.parallel_state import ProcessGroups
from tests.configs import make_config, parallel_config
from tests.distributed_harness import run_distributed

K, LOCAL = 4, 2
BATCH, NUM_MICRO, STEPS, BUCKET, LR = 16, 2, 3, 700, 0.1
SETTINGS = dict(powersgd_rank=2, topk_ratio=0.3, int8_chunk_size=16, grad_fp8_chunk_size=16)
ZERO = torch.tensor(0.0)
METHODS = ("topk", "int8", "int4", "fp8", "powersgd")
# (method, hierarchical)
DISTOPT_CASES = [("int8", False), ("int8", True), ("fp8", False), ("powersgd", False), ("int4", False)]
ZERO2_CASES = ("fp8", "powersgd")  # ZeRO-2's sharded gradients: the all-to-all, and an all-reduce then the shard
E4M3 = fp8.FP8Codec("e4m3")


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.out(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def make_model():
    torch.manual_seed(0)
    return TinyMLP()


def batch(step, dp_rank):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
    mb = BATCH // K // NUM_MICRO
    return x.view(K, NUM_MICRO, mb, 8)[dp_rank], y.view(K, NUM_MICRO, mb, 3)[dp_rank]


def accumulate(model, step, dp_rank, no_sync):
    """Backward of NUM_MICRO microbatches (all but the last inside ``no_sync``); the summed loss."""
    x, y = batch(step, dp_rank)
    total = 0.0
    for k in range(NUM_MICRO):
        loss = F.mse_loss(model(x[k]), y[k]) / NUM_MICRO
        if k < NUM_MICRO - 1:
            with no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.item()
    return total


# --- pieces each rank runs ------------------------------------------------------------------------


def method_of(name, chunk=16, ratio=1.0, rank=2):
    methods = {"topk": lambda: TopK(ratio), "int8": lambda: Int8(chunk, False), "fp8": lambda: FP8(chunk, False),
               "int4": lambda: Int4(chunk, False)}  # fmt: skip
    return methods.get(name, lambda: PowerSGD(rank))()


def reduce_once(comp, key, flat, matrices, group):
    comp.comm_stats = stats = CommStats(LOCAL)
    comp.all_reduce(key, flat, matrices, group).wait()
    return {k: v["wire_bytes"] for k, v in stats.get().items()}


def low_rank_input(rank_of_sum, me):
    """A 12x10 matrix whose sum over the 4 ranks has rank ``rank_of_sum``, then a 5-vector."""
    shared = torch.randn(12, rank_of_sum, generator=torch.Generator().manual_seed(7))
    mine = torch.randn(rank_of_sum, 10, generator=torch.Generator().manual_seed(20 + me))
    return torch.cat([(shared @ mine).view(-1), torch.randn(5, generator=torch.Generator().manual_seed(30 + me))])


def exact_checks(group, me):
    """Compressed vs exact all-reduce where the compression is lossless, with the bytes sent."""
    out = {}
    ints = torch.randint(-50, 50, (37,), generator=torch.Generator().manual_seed(me)).float()
    dyadic = torch.randint(-127, 128, (40,), generator=torch.Generator().manual_seed(me)).float()
    dyadic[::16] = 127.0 * (1 - 2 * (me % 2))  # one |k| = 127 per chunk of 16: scale 2^-3 exactly
    dyadic = dyadic / 8
    # fp8 e4m3 values (3 mantissa bits), one |v| = 448 per chunk of 16 (scale 2^-3 exactly), times 2^-3
    e4m3 = (torch.rand(40, generator=torch.Generator().manual_seed(me)) * 800 - 400).to(torch.float8_e4m3fn).float()
    e4m3[5::16] = 448.0 * (1 - 2 * (me % 2))
    e4m3 = e4m3 / 8
    nibble = torch.randint(-7, 8, (40,), generator=torch.Generator().manual_seed(me)).float()
    nibble[3::16] = 7.0 * (1 - 2 * (me % 2))  # one |k| = 7 per chunk of 16: scale 2^-3 exactly
    nibble = nibble / 8
    cases = {"topk": (ints, []), "int8": (dyadic, []), "fp8": (e4m3, []), "int4": (nibble, [])}
    for r in (2, 3):
        cases[f"powersgd{r}"] = (low_rank_input(2, me), [Segment(0, 120, (12, 10))])
    for name, (g, mats) in cases.items():
        exact = g.clone()
        dist.all_reduce(exact, group=group)
        flat = g.clone()
        comp = GradCompressor(method_of(name.rstrip("23"), rank=int(name[-1]) if name[-1].isdigit() else 2))
        out[name] = {"exact": exact, "got": flat, "bytes": reduce_once(comp, "x", flat, mats, group)}
    # int8's / fp8's compressed reduce-scatter (distributed optimizer): shard me of 10 of the exact sum
    for name, g in (("int8", dyadic), ("fp8", e4m3)):
        flat, shard = g.clone(), (10 * me, 10 * me + 10)
        counted = CommStats(LOCAL)
        GradCompressor(method_of(name), comm_stats=counted).reduce_scatter("x", flat, shard, [], group).wait()
        stats = counted.get()[f"grad_{name}_all_to_all"]
        exact = out[name]["exact"][10 * me : 10 * me + 10]
        out[f"{name}_rs"] = {"exact": exact, "got": flat[10 * me : 10 * me + 10]}
        out[f"{name}_rs"]["bytes"] = (stats["wire_bytes"], stats["inter_node_bytes"])
    return out


def conservation(group, me, name, ratio):
    """Four steps; returns (sum of results, sum of this rank's grads, final residual)."""
    comp = GradCompressor(method_of(name, ratio=ratio))
    mats = [Segment(0, 120, (12, 10))] if name == "powersgd" else []
    sum_out, sum_g = torch.zeros(125), torch.zeros(125)
    for t in range(4):
        g = torch.randint(-20, 20, (125,), generator=torch.Generator().manual_seed(10 * t + me)).float()
        flat = g.clone()
        comp.all_reduce("x", flat, mats, group).wait()
        sum_out += flat
        sum_g += g
    return sum_out, sum_g, comp.residuals["x"].clone()


def non_finite(group, me, name):
    """Step 1 finite, step 2 with an inf on rank 1 only: every rank's result is non-finite and its
    residual is what it was after step 1."""
    comp = GradCompressor(method_of(name, ratio=0.5))
    mats = [Segment(0, 120, (12, 10))] if name == "powersgd" else []
    g = torch.randn(125, generator=torch.Generator().manual_seed(me))
    comp.all_reduce("x", g.clone(), mats, group).wait()
    before = comp.residuals["x"].clone()
    bad = g.clone()
    if me == 1:
        bad[3] = float("inf")
    comp.all_reduce("x", bad, mats, group).wait()
    return {"finite": bool(torch.isfinite(bad).all()), "kept": torch.equal(before, comp.residuals["x"])}


# The DDP settings of the compressed runs (overlapped reduction, BUCKET-sized buckets); the tests add the method.
COMPRESSED = dict(SETTINGS, ddp_bucket_size=BUCKET, overlap_grad_reduce=True)


def whole_grads(ddp, group, distopt):
    """Each buffer's reduced gradient, whole: as DDP holds it, or all-gathered (uncounted) from the
    distributed optimizer's shards (ZeRO-1: in the bucket; ZeRO-2: in the sharded gradient)."""
    out = []
    for buf in ddp.all_buffers:
        if not distopt:
            out.append(buf.grad_data.clone())
            continue
        whole = torch.zeros(buf.numel)
        for bucket in buf.buckets:
            mine = buf.reduced_grad(bucket, *bucket.shard_range(buf.data_parallel_rank)).clone()
            dist.all_gather_into_tensor(whole[bucket.offset : bucket.offset + bucket.numel], mine, group=group)
        out.append(whole)
    return out


def ddp_run(name, hierarchical, pg, distopt=False, keep=None, strategy="no_shard"):
    """STEPS steps of SGD through DDP (overlap, accumulation) with ``name`` compression; ``distopt``:
    buffers of the distributed optimizer (``strategy`` optim_grads: ZeRO-2's sharded gradients),
    whose reduced shards are then all-gathered (uncounted).  ``keep``: a dict that gets the DDP
    wrapper (by method and hierarchical)."""
    cfg = parallel_config(
        COMPRESSED,
        grad_compression=name,
        hierarchical_grad_reduce=hierarchical,
        use_distributed_optimizer=distopt,
        data_parallel_sharding_strategy=strategy,
    )
    counted = CommStats(LOCAL)
    ddp = DistributedDataParallel(make_model(), cfg, process_groups=pg, comm_stats=counted)
    if keep is not None:
        keep[(name, hierarchical)] = ddp
    me = parallel_state.group_rank(pg.dp_cp)
    losses, grads = [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        losses.append(accumulate(ddp, step, me, ddp.no_sync))
        ddp.finish_grad_sync()
        whole = whole_grads(ddp, pg.dp_cp, distopt)
        grads.append(torch.cat(whole))
        with torch.no_grad():
            for buf, g in zip(ddp.all_buffers, whole):
                for p, (s, e, _) in buf.param_index_map.items():
                    p -= LR * g[s:e].view(p.shape)
    stats = {k: (v["calls"], v["wire_bytes"]) for k, v in counted.get().items()}
    return {"losses": losses, "grads": grads, "stats": stats}


class FakeOptimizer:
    """What :class:`OuterSync` reads of an optimizer (fp32: main params are the model's)."""

    def __init__(self, params):
        self.names = [f"p{i}" for i in range(len(params))]
        self.main_params = self.model_params = params

    def _copy_main_to_model(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def outer_values(me, rnd):
    """Rank ``me``'s parameters before sync ``rnd``: the synced value minus a rank-dependent step."""
    g = torch.Generator().manual_seed(50 + rnd)
    return torch.randn(6, generator=g, dtype=torch.float64).float() * (me + 1)


def diloco_run(pg, hierarchical):
    """Two DiLoCo syncs (H = 2) of one parameter; the values after each, and the bytes sent.
    Hierarchical: the ranks of a node hold the same replica (as after exact intra-node steps)."""
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    stats = CommStats(LOCAL)
    outer = OuterSync(FakeOptimizer([p]), 2, 0.7, 0.9, process_groups=pg, hierarchical=hierarchical, comm_stats=stats)
    replica = dist.get_rank() // LOCAL if hierarchical else dist.get_rank()
    out = []
    for rnd in range(2):
        with torch.no_grad():
            p -= outer_values(replica, rnd)
        assert not outer.step(2 * rnd + 1)
        assert outer.step(2 * rnd + 2)
        out.append(p.detach().clone())
    return out, {k: v["wire_bytes"] for k, v in stats.get().items()}


OVERLAP_CASES = {"plain_d2": (1.0, 0.0, 2), "diloco_d1": (0.7, 0.9, 1)}  # (eta, mu, D), H = 2
OVERLAP_ITERS = 8  # syncs start at 2, 4, 6; 8, the last iteration, applies the pending one and syncs blocking


def local_step(replica, iteration):
    """Rank-independent within a replica: what one local optimizer step subtracts."""
    g = torch.Generator().manual_seed(90 + iteration)
    return torch.randn(6, generator=g, dtype=torch.float64).float() * (replica + 1)


def overlap_run(pg, hierarchical, eta, mu, overlap):
    """--local-sgd-overlap-steps: the parameter after each iteration of local steps and syncs (H = 2),
    and, from the first iteration >= 3 that ends with a correction pending, the values of a copy
    restarted from ``state_dict`` taken then and run to the end: ``(value, restarted value)``."""
    replica = dist.get_rank() // LOCAL if hierarchical else dist.get_rank()

    def make(stats=None):
        p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
        return p, OuterSync(
            FakeOptimizer([p]),
            2,
            eta,
            mu,
            process_groups=pg,
            hierarchical=hierarchical,
            overlap_steps=overlap,
            last_iteration=OVERLAP_ITERS,
            comm_stats=stats,
        )

    stats = CommStats(LOCAL)  # the first run's collectives
    p, outer = make(stats)
    values, restarted = [], None
    for it in range(1, OVERLAP_ITERS + 1):
        with torch.no_grad():
            p -= local_step(replica, it)
        outer.step(it)
        values.append(p.detach().clone())
        if restarted is not None:
            with torch.no_grad():
                restarted[0].sub_(local_step(replica, it))
            restarted[1].step(it)
            values[-1] = (values[-1], restarted[0].detach().clone())
        if restarted is None and it >= 3 and outer.pending is not None:  # 3 (D = 2) or 4 (D = 1)
            state = outer.state_dict()  # waits for the pending reduction
            sent = {k: v["wire_bytes"] for k, v in stats.get().items()}
            restarted = make()
            with torch.no_grad():
                restarted[0].copy_(p)
            restarted[1].load_state_dict(state)
    assert outer.pending is None
    return values, sent


def local_grads(pg, hierarchical):
    """DDP under --local-sgd-interval: the gradient each rank holds after one accumulated step."""
    cfg = ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=BUCKET, hierarchical_grad_reduce=hierarchical,
                         local_sgd_interval=2)  # fmt: skip
    stats = CommStats(LOCAL)
    ddp = DistributedDataParallel(make_model(), cfg, process_groups=pg, comm_stats=stats)
    ddp.zero_grad_buffer()
    accumulate(ddp, 0, parallel_state.group_rank(pg.dp_cp), ddp.no_sync)
    ddp.finish_grad_sync()
    return torch.cat([p.main_grad.reshape(-1) for p in ddp.module.parameters()]), sorted(stats.get())


STREAM_ITERS, STREAM_RESTART = 8, 3  # H = 2, F = 2, D = 1: a fragment starts at every iteration; 8 syncs both


def stream_step(replica, iteration):
    """What one local optimizer step subtracts from the 12 elements of the two parameters."""
    return torch.cat([local_step(replica, iteration), local_step(replica + 10, iteration)])


def streaming_run(pg, hierarchical):
    """Streaming DiLoCo (--local-sgd-fragments 2, H = 2, overlap 1, eta 0.7, mu 0.9) of two parameters
    (one per fragment): the values after each iteration, those of a copy restarted from the state
    taken after iteration STREAM_RESTART (a correction pending), and the bytes of the first run."""
    replica = dist.get_rank() // LOCAL if hierarchical else dist.get_rank()

    def make(stats=None):
        p, q = (torch.nn.Parameter(torch.arange(6, dtype=torch.float32) + 6 * i) for i in range(2))
        sync = OuterSync(FakeOptimizer([p, q]), 2, 0.7, 0.9, process_groups=pg, hierarchical=hierarchical,
                         overlap_steps=1, last_iteration=STREAM_ITERS, fragments=2, comm_stats=stats)  # fmt: skip
        return (p, q), sync

    def train(params, sync, it):
        with torch.no_grad():
            step = stream_step(replica, it)
            params[0].sub_(step[:6])
            params[1].sub_(step[6:])
        sync.step(it)
        return torch.cat([x.detach().reshape(-1) for x in params])

    stats = CommStats(LOCAL)  # the first run's collectives
    params, sync = make(stats)
    values, restarted = [], None
    for it in range(1, STREAM_ITERS + 1):
        values.append(train(params, sync, it))
        if restarted is not None:
            values[-1] = (values[-1], train(*restarted, it))
        if it == STREAM_RESTART:
            state = sync.state_dict()
            restarted = make()
            with torch.no_grad():
                for mine, theirs in zip(restarted[0], params):
                    mine.copy_(theirs)
            restarted[1].load_state_dict(state)
    sent = {k: v["wire_bytes"] for k, v in stats.get().items()}
    return values, sent


def quantized_outer_run(pg, hierarchical):
    """One sync (H = 1) of a 12-element parameter from 0 after a local step of integers with a 127 in every
    chunk of 6 (exactly representable pseudo-gradients), with --outer-grad-int8-chunk 6 and without, plain
    averaging and DiLoCo: ``{(case, quantized): (value, {kind: wire bytes})}``."""
    replica = dist.get_rank() // LOCAL if hierarchical else dist.get_rank()
    g = torch.Generator().manual_seed(7 + replica)
    step = torch.randint(-126, 127, (12,), generator=g).float()
    step[[replica, 6 + replica]] = 127.0 * (-1) ** replica
    out = {}
    for case, (eta, mu) in {"plain": (1.0, 0.0), "diloco": (0.7, 0.9)}.items():
        for chunk in (0, 6):
            p, stats = torch.nn.Parameter(torch.zeros(12)), CommStats()
            sync = OuterSync(FakeOptimizer([p]), 1, eta, mu, process_groups=pg, hierarchical=hierarchical,
                             comm_stats=stats, outer_grad_int8_chunk=chunk)  # fmt: skip
            with torch.no_grad():
                p -= step
            sync.step(1)
            out[case, chunk > 0] = (p.detach().clone(), {k: v["wire_bytes"] for k, v in stats.get().items()})
    return out


WARMUPS = {"local": {"local_sgd_interval": 2, "local_sgd_warmup_iters": 1},
           "int8": {"grad_compression": "int8", "grad_compression_warmup_iters": 1}}  # fmt: skip


def warmup_grads(pg, hierarchical):
    """DDP under a warm-up of one iteration (``WARMUPS``): each iteration's reduced gradient (the same
    microbatches both times) and its collectives ``{kind: (calls, wire bytes)}``."""
    out, me = {}, parallel_state.group_rank(pg.dp_cp)
    for name, extra in WARMUPS.items():
        cfg = ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=BUCKET, hierarchical_grad_reduce=hierarchical,
                             **{**SETTINGS, **extra})  # fmt: skip
        stats = CommStats(LOCAL)
        ddp = DistributedDataParallel(make_model(), cfg, process_groups=pg, comm_stats=stats)
        out[name] = []
        for iteration in (1, 2):
            ddp.begin_step(iteration)
            stats.reset()
            ddp.zero_grad_buffer()
            accumulate(ddp, 0, me, ddp.no_sync)
            ddp.finish_grad_sync()
            counted = {k: (v["calls"], v["wire_bytes"]) for k, v in stats.get().items()}
            out[name].append((torch.cat([p.main_grad.reshape(-1) for p in ddp.module.parameters()]), counted))
    return out


def by_name(tensors, src, dst):
    """``{parameter of src: x}`` -> ``{parameter of dst with the same name: x}`` (what a checkpoint does by names)."""
    names, params = {p: n for n, p in src.module.named_parameters()}, dict(dst.module.named_parameters())
    return {(params[names[k[0]]], *k[1:]) if isinstance(k, tuple) else params[names[k]]: v for k, v in tensors.items()}


def reshard_checks(pg, trained):
    """The pending update ``P`` of the int8 runs (flat and hierarchical), loaded into fresh lossless
    runs (top-k ratio 1, flat / hierarchical): their first step's result is the exact mean gradient
    plus ``P``.  PowerSGD's ``Q``s copied into a run with one bucket (other keys and matrix indices)."""
    out = {}
    me = parallel_state.group_rank(pg.dp_cp)
    for h in (False, True):
        ddp = trained[("int8", h)]
        pending = reshard.pending_updates([ddp])
        lossless = DistributedDataParallel(
            make_model(),
            parallel_config(COMPRESSED, grad_compression="topk", hierarchical_grad_reduce=h, topk_ratio=1.0),
            process_groups=pg,
        )
        reshard.load_pending([lossless], by_name(pending, ddp, lossless))
        lossless.zero_grad_buffer()
        accumulate(lossless, 0, me, lossless.no_sync)
        lossless.finish_grad_sync()
        out[h] = {
            "residuals": {k: v.clone() for k, v in ddp.compressor.residuals.items()},
            "pending": torch.cat([pending[p].reshape(-1) for p in ddp.module.parameters()]),
            "next": torch.cat([p.main_grad.reshape(-1) for p in lossless.module.parameters()]),
        }
    src = trained[("powersgd", False)]
    one = DistributedDataParallel(
        make_model(), parallel_config(COMPRESSED, grad_compression="powersgd", ddp_bucket_size=None), process_groups=pg
    )
    copied = reshard.load_powersgd_qs([one], by_name(reshard.powersgd_qs([src]), src, one))
    before, after = reshard.powersgd_qs([src]), by_name(reshard.powersgd_qs([one]), one, src)
    same = set(after) == set(before) and all(torch.equal(q, after[k]) for k, q in before.items())
    out["q"] = (copied, len(reshard.powersgd_q_shapes([one])), len(one.compressor.method.qs), same)
    return out


def worker():
    parallel_state.initialize_model_parallel(ranks_per_node=LOCAL)
    pg = parallel_state.get_process_groups()
    me = dist.get_rank()
    out = {"exact": exact_checks(pg.dp_cp, me)}
    out["conserve"] = {n: conservation(pg.dp_cp, me, n, 0.25) for n in METHODS}
    out["nonfinite"] = {n: non_finite(pg.dp_cp, me, n) for n in METHODS}
    out["diloco"] = {h: diloco_run(pg, h) for h in (False, True)}
    out["overlap"] = {(c, h): overlap_run(pg, h, *OVERLAP_CASES[c]) for c in OVERLAP_CASES for h in (False, True)}
    out["local"] = {h: local_grads(pg, h) for h in (False, True)}
    out["warmup"] = {h: warmup_grads(pg, h) for h in (False, True)}
    out["streaming"] = {h: streaming_run(pg, h) for h in (False, True)}
    out["quantized_outer"] = {h: quantized_outer_run(pg, h) for h in (False, True)}
    trained = {}
    out["ddp"] = {(n, h): ddp_run(n, h, pg, keep=trained) for n in METHODS for h in (False, True)}
    out["distopt"] = {(n, h): ddp_run(n, h, pg, distopt=True) for n, h in DISTOPT_CASES}
    out["zero2"] = {n: ddp_run(n, False, pg, distopt=True, strategy="optim_grads") for n in ZERO2_CASES}
    out["reshard"] = reshard_checks(pg, trained)
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The single-process simulations are tiny: one thread (two threads on a busy 2-core host are 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(worker, K, timeout=300)


# --- checks ---------------------------------------------------------------------------------------


def test_lossless_cases_equal_the_exact_all_reduce_and_bytes_are_the_ring_count(ranks):
    for r in ranks:
        e = r["exact"]
        assert torch.equal(e["topk"]["got"], e["topk"]["exact"])  # ratio 1: every entry sent
        assert torch.equal(e["int8"]["got"], e["int8"]["exact"])  # k 2^-3, |k| <= 127: exact in int8
        assert torch.equal(e["fp8"]["got"], e["fp8"]["exact"])  # e4m3 values x 2^-3, one 448 per chunk
        assert torch.equal(e["int4"]["got"], e["int4"]["exact"])  # k 2^-3, |k| <= 7, one |k| = 7 per chunk
        for name in ("powersgd2", "powersgd3"):  # rank-2 sum, rank >= 2: the exact sum up to rounding
            torch.testing.assert_close(e[name]["got"], e[name]["exact"], rtol=1e-5, atol=1e-5)
        # ring all-gather of a P-byte payload over K ranks: (K-1) P sent; all-reduce of B: 2 (K-1)/K B
        assert e["topk"]["bytes"] == {"grad_topk_all_gather": (K - 1) * 37 * 8}
        assert e["int8"]["bytes"] == {"grad_int8_all_gather": (K - 1) * (40 + 4 * 3)}
        assert e["fp8"]["bytes"] == {"grad_fp8_all_gather": (K - 1) * (40 + 4 * 3)}  # 1 byte per value + scales
        assert e["int4"]["bytes"] == {"grad_int4_all_gather": (K - 1) * (20 + 4 * 3)}  # 2 values per byte
        # reduce-scatter: the same sum on the shard; all-to-all of blocks of S = 10 values + M = 2 scales
        # (shards [10, 20) and [30, 40) overlap two chunks of 16): (K-1) (S + 4 M) sent, half to the other node
        for name in ("int8_rs", "fp8_rs"):
            assert torch.equal(e[name]["got"], e[name]["exact"])
            assert e[name]["bytes"] == ((K - 1) * (10 + 4 * 2), 2 * (10 + 4 * 2))
        for rank in (2, 3):
            assert e[f"powersgd{rank}"]["bytes"] == {
                "grad_powersgd_p_all_reduce": 2 * (K - 1) / K * 4 * (5 + 12 * rank),
                "grad_powersgd_q_all_reduce": 2 * (K - 1) / K * 4 * (10 * rank),
            }


def test_error_feedback_conserves_the_gradient(ranks):
    for name in METHODS:
        sum_out = ranks[0]["conserve"][name][0]
        for r in ranks[1:]:
            assert torch.equal(r["conserve"][name][0], sum_out)  # every rank holds the same result
        total_g = sum(r["conserve"][name][1] for r in ranks)
        total = sum_out + sum(r["conserve"][name][2] for r in ranks)
        if name == "topk":  # integers: every sum is exact, and so is the residual (a, sent entries zeroed)
            assert torch.equal(total, total_g)
            assert sum(r["conserve"][name][2].abs().sum() for r in ranks) > 0  # something was held back
        else:
            torch.testing.assert_close(total, total_g, rtol=0, atol=1e-4)


def test_non_finite_gradients_reach_every_rank_and_leave_the_residual(ranks):
    for r in ranks:
        for name, v in r["nonfinite"].items():
            assert v == {"finite": False, "kept": True}, name


# --- single-process simulation of the DDP runs ------------------------------------------------


def simulate_method(name, a_list, matrices, key, qs):
    """(sum over ranks, what each rank sent) for the compensated gradients ``a_list`` of one group;
    ``qs``: that group's PowerSGD warm starts (seeded by ``key`` as on the ranks)."""
    if name == "none":
        return sum(a_list), a_list
    if name == "topk":
        enc = [topk.encode(a, SETTINGS["topk_ratio"], ZERO) for a in a_list]
        return topk.decode(torch.stack([p for p, _ in enc]), a_list[0].numel()), [s for _, s in enc]
    if name in ("int8", "fp8"):
        codec = int8.INT8 if name == "int8" else E4M3
        enc = [int8.encode(a, 16, ZERO, None, codec) for a in a_list]
        return int8.decode(torch.stack([p for p, _ in enc]), a_list[0].numel(), 16, codec), [s for _, s in enc]
    if name == "int4":
        enc = [int4.encode(a, 16, ZERO) for a in a_list]
        return int4.decode(torch.stack([p for p, _ in enc]), a_list[0].numel(), 16), [s for _, s in enc]
    out, sents = sum(a_list), [a.clone() for a in a_list]
    for i, s in enumerate(matrices):
        r = powersgd.compressed_rank(s, SETTINGS["powersgd_rank"])
        if r == 0:
            continue
        q = qs.setdefault(i, powersgd.initial_q(key, i, s.shape[1], r, "cpu"))
        mats = [a[s.start : s.end].view(s.shape) for a in a_list]
        p_hat = powersgd.orthogonalize(sum(m @ q for m in mats))
        q_each = [m.t() @ p_hat for m in mats]
        q_sum = sum(q_each)
        out[s.start : s.end] = (p_hat @ q_sum.t()).view(-1)
        for sent, qk in zip(sents, q_each):
            sent[s.start : s.end] = (p_hat @ qk.t()).view(-1)
        qs[i] = q_sum
    return out, sents


def reducing_groups(bucket, hierarchical):
    """``[(lo, hi, [[global ranks whose sum one member contributes], ...]), ...]`` in bucket
    coordinates: flat, the whole bucket over the 4 ranks; hierarchical, chunk ``i`` of the bucket
    over the ranks with local index ``i``, each contributing its node's sum."""
    if not hierarchical:
        return [(0, bucket.numel, [[r] for r in range(K)])]
    c, nodes = bucket.numel // LOCAL, K // LOCAL
    return [(i * c, (i + 1) * c, [list(range(j * LOCAL, (j + 1) * LOCAL)) for j in range(nodes)]) for i in range(LOCAL)]


@functools.lru_cache(maxsize=None)
def simulate(name, hierarchical):
    """The gradients every rank holds after each step, computed in one process: each rank's scaled
    gradient, then the compression with error feedback (of the node sums when hierarchical)."""
    model = make_model()
    buf = ParamAndGradBuffer(list(model.parameters()), torch.float32, BUCKET, None, K, 1.0 / K)
    residual, qs, out = {}, {}, []
    for step in range(STEPS):
        flats = []
        for me in range(K):
            model.zero_grad()
            accumulate(model, step, me, contextlib.nullcontext)
            for p in model.parameters():
                p.main_grad.copy_(p.grad)
            flats.append(buf.grad_data * (1.0 / K))
        result = torch.empty_like(flats[0])
        for b in buf.buckets:
            key = f"dense0.{b.index}"
            for lo, hi, members in reducing_groups(b, hierarchical):
                owners = [(rs[0], lo) for rs in members]  # one residual per member and chunk
                a_list = [
                    sum(flats[r][b.offset + lo : b.offset + hi] for r in rs) + residual.get(o, {}).get(key, 0)
                    for rs, o in zip(members, owners)
                ]
                total, sents = simulate_method(name, a_list, b.matrices(lo, hi), key, qs.setdefault((key, lo), {}))
                for o, a, sent in zip(owners, a_list, sents):
                    residual.setdefault(o, {})[key] = a - sent
                result[b.offset + lo : b.offset + hi] = total
        out.append(result)
        with torch.no_grad():
            for p in model.parameters():
                s, e, _ = buf.param_index_map[p]
                p -= LR * result[s:e].view(p.shape)
    return out


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("name", METHODS)
def test_ddp_run_equals_single_process_simulation(ranks, name, hierarchical):
    expected = simulate(name, hierarchical)
    exact = simulate("none", False)
    for r in ranks:
        run = r["ddp"][(name, hierarchical)]
        for step, (got, want) in enumerate(zip(run["grads"], expected)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{name} step {step}")
        assert not torch.allclose(run["grads"][-1], exact[-1], atol=1e-4)  # it did compress
    first = ranks[0]["ddp"][(name, hierarchical)]["grads"]
    for r in ranks[1:]:  # every replica holds the same bits, so the replicas stay equal
        assert all(torch.equal(a, b) for a, b in zip(r["ddp"][(name, hierarchical)]["grads"], first))


@pytest.mark.parametrize("name,hierarchical", DISTOPT_CASES)
def test_distributed_optimizer_shards_equal_the_compressed_all_reduce(ranks, name, hierarchical):
    """With the distributed optimizer's buffers each rank's shard holds what the compressed
    all-reduce gives there (flat int8: the all-to-all reduce-scatter; hierarchical int8 and
    PowerSGD: the all-reduce, then the shard), bit for bit against the DDP run."""
    for r in ranks:
        got, want = r["distopt"][(name, hierarchical)]["grads"], r["ddp"][(name, hierarchical)]["grads"]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    if not hierarchical and name in ZERO2_CASES:  # ZeRO-2: the same sums land in the sharded gradient
        for r in ranks:
            got, want = r["zero2"][name]["grads"], r["ddp"][(name, False)]["grads"]
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name
            assert r["zero2"][name]["stats"] == r["distopt"][(name, False)]["stats"]
    if (name, hierarchical) in (("int8", False), ("fp8", False)):
        buf = ParamAndGradBuffer(list(make_model().parameters()), torch.float32, BUCKET, None, K, 1.0 / K)
        per_step = 0
        for b in buf.buckets:  # (K-1) (S + 4 M) per bucket, M from where each shard cuts the chunks
            shard = b.numel // K
            per_step += (K - 1) * (shard + 4 * int8.shard_chunks(shard, SETTINGS["int8_chunk_size"], K)[1])
        for r in ranks:
            stats = r["distopt"][(name, hierarchical)]["stats"]
            assert stats == {f"grad_{name}_all_to_all": (STEPS * len(buf.buckets), STEPS * per_step)}


def test_ddp_bytes_are_the_analytic_count(ranks):
    """Per step and bucket of N elements: flat top-k all-gathers 2k int32 (k = round(0.3 N)) over 4
    ranks; hierarchical, only the inter-node leg is compressed (2 ranks, chunks of N/2) while the
    intra-node reduce-scatter and all-gather stay exact fp32."""
    buf = ParamAndGradBuffer(list(make_model().parameters()), torch.float32, BUCKET, None, K, 1.0 / K)
    sizes = [b.numel for b in buf.buckets]
    for r in ranks:
        flat = r["ddp"][("topk", False)]["stats"]
        k = [topk.topk_count(n, SETTINGS["topk_ratio"]) for n in sizes]
        assert flat == {"grad_topk_all_gather": (STEPS * len(sizes), STEPS * sum((K - 1) * 8 * x for x in k))}
        hier = r["ddp"][("int8", True)]["stats"]
        per_step = sum(int8.payload_bytes(n // LOCAL, SETTINGS["int8_chunk_size"]) for n in sizes)
        assert hier["grad_inter_int8_all_gather"] == (STEPS * len(sizes), STEPS * per_step)
        exact_leg = STEPS * sum((LOCAL - 1) / LOCAL * 4 * n for n in sizes)
        assert hier["grad_reduce_scatter_intra"][1] == exact_leg
        assert hier["grad_all_gather_intra"][1] == exact_leg
        assert set(hier) == {"grad_inter_int8_all_gather", "grad_reduce_scatter_intra", "grad_all_gather_intra"}
        # int4 on the inter-node leg: ceil(c/2) bytes of nibbles + 4 per chunk of 16 (c = N/2), fewer than int8's
        hier4 = r["ddp"][("int4", True)]["stats"]
        per_step4 = sum(int4.payload_bytes(n // LOCAL, SETTINGS["int8_chunk_size"]) for n in sizes)
        assert per_step4 == sum((n // LOCAL + 1) // 2 + 4 * -(-(n // LOCAL) // 16) for n in sizes) < per_step
        assert hier4["grad_inter_int4_all_gather"] == (STEPS * len(sizes), STEPS * per_step4)
        assert hier4["grad_reduce_scatter_intra"][1] == hier4["grad_all_gather_intra"][1] == exact_leg


def module_order(buf, flat):
    """A buffer-laid-out tensor in module parameter order (how the ranks return theirs)."""
    return torch.cat([flat[s:e] for s, e, _ in (buf.param_index_map[p] for p in reversed(buf.params))])


def test_pending_update_is_the_sum_of_residuals_and_loads_into_the_next_step(ranks):
    """``P`` = sum over the ranks of their residuals, placed where each covers the bucket (flat: the
    whole bucket; hierarchical: chunk i of the node-local index); loaded into DP 4 (each rank P/4;
    hierarchical: each node's chunk P/2), the next lossless step sends exactly mean g + P."""
    buf = ParamAndGradBuffer(list(make_model().parameters()), torch.float32, BUCKET, None, K, 1.0 / K)
    mean_g = module_order(buf, simulate("none", False)[0])  # step 0 from the initial weights
    for h in (False, True):
        placed = torch.zeros(buf.numel)
        for rank, r in enumerate(ranks):
            for b in buf.buckets:
                c = b.numel // LOCAL if h else b.numel
                lo = b.offset + (rank % LOCAL) * c if h else b.offset
                placed[lo : lo + c] += r["reshard"][h]["residuals"][f"dense0.{b.index}"]
        pending = module_order(buf, placed)
        assert pending.abs().sum() > 0
        for r in ranks:
            torch.testing.assert_close(r["reshard"][h]["pending"], pending, rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(r["reshard"][h]["next"], mean_g + pending, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(ranks[0]["reshard"][h]["next"], mean_g, rtol=1e-3, atol=1e-5)


def test_powersgd_q_is_copied_by_parameter_and_rows(ranks):
    """Three matrices (fc1, fc2, out) in three buckets, loaded into one bucket: all three copied."""
    for r in ranks:
        assert r["reshard"]["q"] == (3, 3, 3, True)


# --- single process -------------------------------------------------------------------------------


def test_residuals_resharded_to_one_rank_are_added_to_its_next_gradient():
    """DP 1 compresses nothing: the pending update loaded (the sum of a DP K run's residuals) is added
    to the first gradient, bit for bit, and none is kept for the second."""
    pg = ProcessGroups.single()
    ddp = DistributedDataParallel(make_model(), parallel_config(COMPRESSED, grad_compression="int8"), process_groups=pg)
    plain = DistributedDataParallel(
        make_model(), parallel_config(COMPRESSED, grad_compression="none"), process_groups=pg
    )
    gen = torch.Generator().manual_seed(3)
    pending = {p: torch.randn(p.shape, generator=gen) for p in ddp.module.parameters()}
    reshard.load_pending([ddp], pending)
    for step in range(2):
        for model in (ddp, plain):
            model.zero_grad_buffer()
            accumulate(model, step, 0, model.no_sync)
            model.finish_grad_sync()
        for p, q in zip(ddp.module.parameters(), plain.module.parameters()):
            assert torch.equal(p.main_grad, q.main_grad + pending[p] if step == 0 else q.main_grad)
    assert ddp.compressor.residuals == {}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_checkpoint_reshards_into_other_buckets_and_resets_without_pending(tmp_path, capsys, method):
    """Through save_checkpoint / load_checkpoint in one process: residuals saved with buckets of 700
    elements load into one bucket (another signature: resharded, one INFO line) with the same values
    per parameter; a checkpoint saved without compression leaves them at zero, with the warning."""
    from megalm.checkpoint.common_json import layout
    from megalm.checkpoint.load import load_checkpoint
    from megalm.checkpoint.save import save_checkpoint
    from megalm.checkpoint.stateful import CheckpointStates
    from megalm.distributed.compression.checkpoint_state import CompressionCheckpointState
    from tests.logs import megalm_logs

    def registered(model):  # as the trainer registers --grad-compression's state
        states = CheckpointStates()
        states.register("grad_compression", CompressionCheckpointState([model], pg, layout(pg)))
        return states

    pg = ProcessGroups.single()
    src = DistributedDataParallel(make_model(), parallel_config(COMPRESSED, grad_compression=method), process_groups=pg)
    gen = torch.Generator().manual_seed(4)
    for b in src.buffers[0].buckets:  # as if resharded from a larger DP size
        src.compressor.residuals[f"dense0.{b.index}"] = torch.randn(b.numel, generator=gen)
    want = reshard.pending_updates([src])
    save_checkpoint(str(tmp_path / "int8"), 1, [src], states=registered(src))
    plain = DistributedDataParallel(
        make_model(), parallel_config(COMPRESSED, grad_compression="none"), process_groups=pg
    )
    save_checkpoint(str(tmp_path / "plain"), 1, [plain])
    for name in ("int8", "plain"):
        dst = DistributedDataParallel(
            make_model(), parallel_config(COMPRESSED, grad_compression=method, ddp_bucket_size=None), process_groups=pg
        )
        with megalm_logs("stderr"):
            load_checkpoint(str(tmp_path / name), [dst], states=registered(dst))
        err = capsys.readouterr().err
        if name == "int8":
            got = reshard.pending_updates([dst])
            assert all(torch.equal(got[q], want[p]) for p, q in zip(src.module.parameters(), dst.module.parameters()))
            assert "gradient-compression state resharded" in err and "pending update of 8 parameters" in err
        else:
            assert dst.compressor.residuals == {} and "restarts from zero" in err


def test_fp8_rounding_nearest_is_the_cast_and_stochastic_is_unbiased():
    a = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for fmt, top in (("e4m3", 448.0), ("e5m2", 57344.0)):
        codec = fp8.FP8Codec(fmt)
        scale = a.view(4, 16).abs().amax(dim=1).repeat_interleave(16) / top
        nearest = int8.encode(a, 16, ZERO, None, codec)[1]
        assert torch.equal(nearest, (a / scale).to(codec.dtype).float() * scale)
        mean = torch.zeros(64)
        gen = torch.Generator().manual_seed(1)
        for _ in range(500):
            mean += int8.encode(a, 16, ZERO, gen, codec)[1] / 500
        # the mean of 500 roundings is far closer than the nearest value (error ~ 1/45 of a step, not 1/4)
        assert (mean - a).abs().mean() < 0.3 * (nearest - a).abs().mean(), fmt


def test_matrix_segments_keep_whole_rows():
    params = [(0, 30, (3, 10)), (30, 35, (5,)), (35, 59, (4, 6))]
    assert matrix_segments(params, 0, 59) == [Segment(0, 30, (3, 10)), Segment(35, 59, (4, 6))]
    # [5, 47): row 0 of the first matrix is cut (rows 1-2 kept); the second keeps rows 0-1 ([35, 47))
    assert matrix_segments(params, 5, 47) == [Segment(5, 25, (2, 10)), Segment(30, 42, (2, 6))]
    assert matrix_segments(params, 12, 19) == []  # less than a row


def test_int4_packs_two_values_per_byte_and_rounds_within_half_a_step():
    codes = torch.randint(1, 16, (37,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = int4.pack(codes)
    assert packed.numel() == 19 and torch.equal(int4.unpack(packed, 37), codes)
    assert int(packed[0]) == int(codes[0]) + 16 * int(codes[1])  # element 2i low nibble, 2i + 1 high
    a = torch.randn(70, generator=torch.Generator().manual_seed(1))
    payload, sent = int4.encode(a, 16, ZERO)
    assert payload.numel() == int4.payload_bytes(70, 16) == 35 + 4 * 5
    scale = torch.cat([a, a.new_zeros(10)]).view(5, 16).abs().amax(dim=1).repeat_interleave(16)[:70] / 7
    assert ((sent - a).abs() <= scale / 2 + 1e-7).all() and not torch.equal(sent, a)
    torch.testing.assert_close(int4.decode(torch.stack([payload, payload]), 70, 16), 2 * sent)
    mean, gen = torch.zeros(70), torch.Generator().manual_seed(2)
    for _ in range(2000):
        mean += int4.encode(a, 16, ZERO, gen)[1] / 2000
    assert ((mean - a).abs() <= 0.1 * scale).all()  # stochastic rounding: unbiased, far inside one step
    poisoned = int4.encode(a, 16, torch.tensor(float("nan")))[0]
    assert not torch.isfinite(int4.decode(poisoned[None], 70, 16)).any()  # a non-finite rank poisons the sum


def test_int8_stochastic_rounding_is_unbiased_and_nearest_is_bounded():
    a = torch.randn(64, generator=torch.Generator().manual_seed(0))
    mean = torch.zeros(64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        mean += int8.encode(a, 16, ZERO, gen)[1] / 2000
    scale = a.view(4, 16).abs().amax(dim=1).repeat_interleave(16) / 127
    assert ((mean - a).abs() <= 0.1 * scale).all()  # the mean of 2000 roundings is far inside one step
    nearest = int8.encode(a, 16, ZERO)[1]
    assert ((nearest - a).abs() <= scale / 2 + 1e-7).all()
    assert not torch.equal(nearest, a)


def test_config_accepts_sharded_gradients_and_refuses_bad_settings():
    def check(**parallel):
        make_config(dict(num_layers=2, hidden_size=64, num_attention_heads=4), parallel)

    check(grad_compression="powersgd")
    check(grad_compression="int8", use_distributed_optimizer=True)  # ZeRO-1: built
    check(grad_compression="fp8", grad_fp8_format="e5m2", grad_fp8_rounding="stochastic")
    for strategy in ("optim_grads", "optim_grads_params"):  # ZeRO-2/3: built
        check(grad_compression="topk", data_parallel_sharding_strategy=strategy)
    with pytest.raises(ConfigError, match="--topk-ratio must be in"):
        check(grad_compression="topk", topk_ratio=0.0)
    with pytest.raises(ConfigError, match="--grad-fp8-chunk-size must be >= 1"):
        check(grad_compression="fp8", grad_fp8_chunk_size=0)
    with pytest.raises(ConfigError, match="--powersgd-rank must be >= 1"):
        check(grad_compression="powersgd", powersgd_rank=0)
    # the warm-ups and Streaming DiLoCo's fragments
    check(grad_compression="powersgd", grad_compression_warmup_iters=10)
    check(local_sgd_interval=4, local_sgd_warmup_iters=10, local_sgd_fragments=2, local_sgd_overlap_steps=2)
    with pytest.raises(ConfigError, match="--grad-compression-warmup-iters needs --grad-compression"):
        check(grad_compression_warmup_iters=10)
    with pytest.raises(ConfigError, match="--local-sgd-warmup-iters needs --local-sgd-interval"):
        check(local_sgd_warmup_iters=10)
    with pytest.raises(ConfigError, match="--local-sgd-fragments must divide --local-sgd-interval 4"):
        check(local_sgd_interval=4, local_sgd_fragments=3)
    with pytest.raises(ConfigError, match="got 2 fragments, 3 overlap steps"):
        check(local_sgd_interval=4, local_sgd_fragments=2, local_sgd_overlap_steps=3)


# --- local SGD / DiLoCo ---------------------------------------------------------------------------


def test_diloco_outer_step_equals_the_hand_computed_one(ranks):
    """x1 = x0 - eta (D + mu m) with m = D, D = x0 - mean; then m = mu m + D2 (Nesterov), over the 4
    data-parallel ranks (flat) or the 2 nodes' replicas (hierarchical: each rank averages half of the
    values across nodes, the node all-gathers them)."""
    eta, mu = 0.7, 0.9
    for hierarchical in (False, True):
        replicas = list(range(K // LOCAL)) if hierarchical else list(range(K))
        x = torch.arange(6, dtype=torch.float64)
        m = torch.zeros(6, dtype=torch.float64)
        for rnd in range(2):
            mean = sum(x - outer_values(k, rnd).double() for k in replicas) / len(replicas)
            d = x - mean
            m = mu * m + d
            x = x - eta * (d + mu * m)
            for r in ranks:
                torch.testing.assert_close(r["diloco"][hierarchical][0][rnd].double(), x, rtol=1e-6, atol=1e-6)
    for r in ranks:  # per sync, 6 fp32 values: flat all-reduce over 4; hierarchical 3 of them across 2 nodes
        assert r["diloco"][False][1] == {"local_sgd_param_all_reduce": 2 * 2 * 3 / 4 * 24}
        assert r["diloco"][True][1] == {
            "local_sgd_param_all_reduce_inter": 2 * 2 * 1 / 2 * 12,
            "local_sgd_param_all_gather_intra": 2 * 1 / 2 * 24,
        }


def overlap_reference(replicas, eta, mu, overlap):
    """Hand-computed --local-sgd-overlap-steps (H = 2) in float64: each replica's values per iteration."""
    x = {k: torch.arange(6, dtype=torch.float64) for k in replicas}
    x0, m, pending, out = torch.arange(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64), None, []

    def outer(avg):
        nonlocal m
        d = x0 - avg
        m = mu * m + d
        return x0 - eta * (d + mu * m)

    for it in range(1, OVERLAP_ITERS + 1):
        for k in replicas:
            x[k] = x[k] - local_step(k, it).double()
        last = it == OVERLAP_ITERS
        if pending is not None and (it >= pending[0] or last):
            snap = pending[1]
            x0 = outer(sum(snap.values()) / len(replicas))
            x = {k: x[k] + (x0 - snap[k]) for k in replicas}  # the correction keeps the progress since the snapshot
            pending = None
        if it % 2 == 0:
            if last:
                x0 = outer(sum(x.values()) / len(replicas))
                x = {k: x0.clone() for k in replicas}
            else:
                pending = (it + overlap, {k: v.clone() for k, v in x.items()})
        out.append({k: v.clone() for k, v in x.items()})
    return out


def test_overlapped_local_sgd_applies_the_delayed_average_and_resumes_exactly(ranks):
    """--local-sgd-overlap-steps D: the snapshot's average is applied D iterations later as
    x <- x + (outer(avg(s)) - s) (plain averaging D = 2 = H; DiLoCo D = 1), flat over 4 replicas and
    hierarchical over 2 nodes; the last iteration ends averaged; an OuterSync restarted from the
    state_dict taken with a correction pending continues bit for bit; the bytes are the blocking ones."""
    for case, (eta, mu, overlap) in OVERLAP_CASES.items():
        for hierarchical in (False, True):
            replicas = list(range(K // LOCAL)) if hierarchical else list(range(K))
            want = overlap_reference(replicas, eta, mu, overlap)
            for rank, r in enumerate(ranks):
                replica = rank // LOCAL if hierarchical else rank
                got, sent = r["overlap"][case, hierarchical]
                syncs = 1 if overlap == 2 else 2  # started before the state was taken (at 3 or 4)
                if hierarchical:  # as test_diloco_outer_step_equals_the_hand_computed_one's, per sync
                    assert sent == {"local_sgd_param_all_reduce_inter": syncs * 2 * 1 / 2 * 12,
                                    "local_sgd_param_all_gather_intra": syncs * 1 / 2 * 24}  # fmt: skip
                else:
                    assert sent == {"local_sgd_param_all_reduce": syncs * 2 * 3 / 4 * 24}
                assert sum(isinstance(v, tuple) for v in got) == (5 if overlap == 2 else 4)
                for it, (value, expected) in enumerate(zip(got, want), start=1):
                    if isinstance(value, tuple):
                        value, restarted = value
                        assert torch.equal(restarted, value), (case, hierarchical, it)
                    torch.testing.assert_close(value.double(), expected[replica], rtol=1e-6, atol=1e-6)
            ends = [r["overlap"][case, hierarchical][0][-1][0] for r in ranks]
            assert all(torch.equal(e, ends[0]) for e in ends)  # averaged at the end: one model


def test_local_sgd_reduces_inside_the_node_only(ranks):
    """Flat: each rank keeps its own mean gradient (no collective); hierarchical: the mean over its
    node (the intra-node all-reduce only)."""
    model = make_model()
    own = []
    for me in range(K):
        model.zero_grad()
        accumulate(model, 0, me, contextlib.nullcontext)
        own.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    for me, r in enumerate(ranks):
        grads, kinds = r["local"][False]
        assert kinds == []
        torch.testing.assert_close(grads, own[me], rtol=1e-6, atol=1e-8)
        grads, kinds = r["local"][True]
        assert kinds == ["grad_all_reduce"]  # over the 2 ranks of the node
        node = me // LOCAL * LOCAL
        torch.testing.assert_close(grads, (own[node] + own[node + 1]) / 2, rtol=1e-6, atol=1e-7)


def test_warmup_iterations_reduce_exactly_over_the_whole_group_then_the_method_starts(ranks):
    """--local-sgd-warmup-iters 1 and --grad-compression-warmup-iters 1 (int8): iteration 1 is plain
    data parallelism (the mean over the 4 ranks; exact fp32 bytes: flat ``2 (K-1)/K 4 N``, hierarchical
    ``(L-1)/L 4 N`` per intra-node leg and ``2 (n-1)/n 4 N/L`` across the n = 2 nodes); iteration 2 is the
    method's (local SGD: the replica's own gradient, nothing sent; int8: its compressed all-gather)."""
    model = make_model()
    own = []
    for me in range(K):
        model.zero_grad()
        accumulate(model, 0, me, contextlib.nullcontext)
        own.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    mean = sum(own) / K
    buf = ParamAndGradBuffer(list(make_model().parameters()), torch.float32, BUCKET, None, K, 1.0 / K)
    sizes = [b.numel for b in buf.buckets]
    flat_bytes = {"grad_all_reduce": (len(sizes), sum(2 * (K - 1) / K * 4 * n for n in sizes))}
    leg = (len(sizes), sum((LOCAL - 1) / LOCAL * 4 * n for n in sizes))
    hier_bytes = {"grad_reduce_scatter_intra": leg, "grad_all_gather_intra": leg,
                  "grad_all_reduce_inter": (len(sizes), sum(2 * 1 / 2 * 4 * n // LOCAL for n in sizes))}  # fmt: skip
    for me, r in enumerate(ranks):
        for h, exact_bytes in ((False, flat_bytes), (True, hier_bytes)):
            for name in WARMUPS:
                (warm, warm_stats), (after, after_stats) = r["warmup"][h][name]
                torch.testing.assert_close(warm, mean, rtol=1e-5, atol=1e-7)
                assert warm_stats == exact_bytes, (h, name)
            local, local_stats = r["warmup"][h]["local"][1]
            node = me // LOCAL * LOCAL
            torch.testing.assert_close(local, own[me] if not h else (own[node] + own[node + 1]) / 2, rtol=1e-6,
                                       atol=1e-7)  # fmt: skip
            assert set(local_stats) == (set() if not h else {"grad_all_reduce"})
            after, after_stats = r["warmup"][h]["int8"][1]
            hier_int8 = {"grad_reduce_scatter_intra", "grad_inter_int8_all_gather", "grad_all_gather_intra"}
            assert set(after_stats) == (hier_int8 if h else {"grad_int8_all_gather"})
            assert not torch.equal(after, warm)  # compressed: not the exact mean


def streaming_reference(replicas, eta=0.7, mu=0.9):
    """Hand-computed Streaming DiLoCo (fragments p = [0, 6), q = [6, 12); p starts at odd iterations, q
    at even ones, each applied 1 iteration later; the last iteration syncs both, blocking), float64."""
    frags = (slice(0, 6), slice(6, 12))
    x = {k: torch.arange(12, dtype=torch.float64) for k in replicas}
    x0, m, pending, out = torch.arange(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64), None, []

    def outer(avg, sl):
        d = x0[sl] - avg
        m[sl] = mu * m[sl] + d
        x0[sl] = x0[sl] - eta * (d + mu * m[sl])
        return x0[sl].clone()

    for it in range(1, STREAM_ITERS + 1):
        for k in replicas:
            x[k] = x[k] - stream_step(k, it).double()
        if pending is not None:  # due at every iteration (D = 1)
            sl, snap = pending
            new = outer(sum(snap.values()) / len(replicas), sl)
            for k in replicas:
                x[k][sl] += new - snap[k]
            pending = None
        if it == STREAM_ITERS:
            for sl in frags:
                new = outer(sum(x[k][sl] for k in replicas) / len(replicas), sl)
                for k in replicas:
                    x[k][sl] = new
        else:
            sl = frags[0] if it % 2 == 1 else frags[1]
            pending = (sl, {k: x[k][sl].clone() for k in replicas})
        out.append({k: v.clone() for k, v in x.items()})
    return out


def test_streaming_diloco_syncs_one_fragment_at_a_time_and_resumes_exactly(ranks):
    """--local-sgd-fragments 2 (H = 2, D = 1): each iteration starts the average of one fragment (6 of
    the 12 values), applied the next; the last iteration syncs both; values equal the float64 hand
    computation (flat over 4 replicas, hierarchical over 2 nodes), a copy restarted from the state taken
    with a fragment's correction pending continues bit for bit, and the bytes are 9 syncs of 6 values."""
    syncs = STREAM_ITERS - 1 + 2  # one start per iteration but the last, which syncs both
    for hierarchical in (False, True):
        replicas = list(range(K // LOCAL)) if hierarchical else list(range(K))
        want = streaming_reference(replicas)
        for rank, r in enumerate(ranks):
            got, sent = r["streaming"][hierarchical]
            replica = rank // LOCAL if hierarchical else rank
            if hierarchical:
                assert sent == {"local_sgd_param_all_reduce_inter": syncs * 2 * 1 / 2 * 12,
                                "local_sgd_param_all_gather_intra": syncs * 1 / 2 * 24}  # fmt: skip
            else:
                assert sent == {"local_sgd_param_all_reduce": syncs * 2 * 3 / 4 * 24}
            assert sum(isinstance(v, tuple) for v in got) == STREAM_ITERS - STREAM_RESTART
            for it, (value, expected) in enumerate(zip(got, want), start=1):
                if isinstance(value, tuple):
                    value, restarted = value
                    assert torch.equal(restarted, value), (hierarchical, it)
                torch.testing.assert_close(value.double(), expected[replica], rtol=1e-6, atol=1e-6)
        ends = [r["streaming"][hierarchical][0][-1][0] for r in ranks]
        assert all(torch.equal(e, ends[0]) for e in ends)  # one model at the end


def test_int8_outer_gradients_are_exact_on_representable_values_with_the_all_gather_bytes(ranks):
    """--outer-grad-int8-chunk 6: pseudo-gradients that 8 bits represent exactly (integers, a 127 per chunk)
    give the fp32 average's result bit for bit (plain averaging and DiLoCo, flat over 4 replicas and
    hierarchical over 2 nodes), and each rank sends one all-gather of ``(n-1) (N + 4 N/C)`` bytes
    (N = 12 flat; hierarchical, the node's chunk of 6 across n = 2 nodes, then the exact intra-node all-gather)."""
    for r in ranks:
        for h in (False, True):
            for case in ("plain", "diloco"):
                (exact, _), (quantized, sent) = (
                    r["quantized_outer"][h][case, False],
                    r["quantized_outer"][h][case, True],
                )
                assert torch.equal(quantized, exact) and exact.abs().sum() > 0, (h, case)
                if h:
                    assert sent == {"local_sgd_outer_grad_int8_all_gather_inter": 1 * (6 + 4 * 1),
                                    "local_sgd_param_all_gather_intra": 1 / 2 * 4 * 12}  # fmt: skip
                else:
                    assert sent == {"local_sgd_outer_grad_int8_all_gather": 3 * (12 + 4 * 2)}
