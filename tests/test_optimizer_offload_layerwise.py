"""--optimizer-cpu-offload with LAMB, LARS, Lion and Muon: the offloaded host copies get the norms of the
full tensors and Muon's whole matrices, so the update equals the non-offloaded one bit for bit (CPU ->
CPU copies here, the code path of a GPU; the same arithmetic on the same values).

* one process, plain (fp32 and bf16 main weights) and distributed optimizer (optim), fractions 0.5 and
  1, with and without --overlap-cpu-optimizer-d2h-h2d: weights after 3 clipped steps are bit-identical
  to the non-offloaded optimizer's; the overlapped layer-wise step copies every bucket's gradients
  first (one norm / orthogonalization pass), then each bucket's weights back in order;
* a checkpoint round trip (sharded state dict, host state saved and loaded) into a fresh offloaded
  optimizer continues exactly as the uninterrupted one;
* two spawned ranks (one group): TP 2 (split and replicated parameters, both --muon-tp-mode choices)
  and DP 2 with the distributed optimizer (flat shards that cut tensors; small buckets), 3 steps, every
  optimizer at fractions 0.5 / 1 with and without overlap: bit-identical to the same layout without
  offload; TP 2 also equals one process on the full tensors within 1e-5 relative (blockwise Muon
  aside); a distributed-optimizer checkpoint saved with offload resumes exactly.
"""

import pytest
import torch

from megalm.config import ParallelConfig, validate_config
from megalm.distributed import DistributedDataParallel
from megalm.optimizer import build_optimizer
from megalm.parallel_state import ProcessGroups, get_process_groups
from megalm.tensor_parallel.param_info import set_param_info
from tests.configs import optimizer_config
from tests.distributed_harness import run_distributed
from tests.test_distrib_optimizer import _mlp
from tests.test_optimizer_offload import _steps as train_steps

OPTIMIZERS = {
    "lamb": dict(optimizer="lamb", lr=5e-3),
    "lars": dict(optimizer="lars", lr=1.0, lars_trust_coefficient=0.01),
    "lion": dict(optimizer="lion", lr=1e-3),
    "muon": dict(optimizer="muon", lr=2e-3, muon_tp_mode="duplicated", muon_use_nesterov=True),
    "muon_blockwise": dict(optimizer="muon", lr=2e-3, muon_tp_mode="blockwise"),
}
OFFLOADS = ((0.5, False), (1.0, True), (0.5, True))  # (fraction, overlap)


# Every optimizer's other settings; several DDP buckets (100 elements): the two DP shards cut tensors.
SHARED = dict(weight_decay=0.1, clip_grad=0.5, adam_beta1=0.9, adam_beta2=0.95, ddp_bucket_size=100)


def _offload(fraction, overlap) -> dict:
    """The offload flags of ``fraction`` (None: no offload) and overlapped copies or not."""
    cpu = dict(optimizer_cpu_offload=fraction is not None, optimizer_offload_fraction=fraction or 1.0)
    return dict(cpu, overlap_cpu_optimizer_d2h_h2d=overlap)


def build(opt, fraction=None, overlap=False, distributed=False, dtype=torch.float32, groups=None):
    """``groups``: the optimizer's and DDP's process groups (default: parallel_state's, as a tool would)."""
    groups = get_process_groups() if groups is None else groups
    model = _mlp(dtype)
    cfg = optimizer_config(SHARED, OPTIMIZERS[opt], _offload(fraction, overlap), use_distributed_optimizer=distributed)
    chunk = model
    if distributed:
        chunk = DistributedDataParallel(
            model, ParallelConfig(use_distributed_optimizer=True, ddp_bucket_size=100), process_groups=groups
        )
    return model, chunk, build_optimizer(cfg, [chunk], report_memory=False, process_groups=groups)


def blocks(spec):
    return spec if isinstance(spec, list) else [spec]


def round_trip(opt, fraction, overlap, distributed, groups=None, seed=0):
    """Weights after 2 + 1 steps straight, and after 2 steps, a save, a load into a fresh optimizer, 1 step."""
    model, chunk, optimizer = build(opt, fraction, overlap, distributed, groups=groups)
    train_steps(model, chunk, optimizer, 2, seed)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(zip(optimizer.names, optimizer.model_params))
    state = {k: [b.local.clone() for b in blocks(v)] for k, v in optimizer.sharded_state_dict(params).items()}
    straight = train_steps(model, chunk, optimizer, 1, seed + 1)
    model2, chunk2, fresh = build(opt, fraction, overlap, distributed, groups=groups)
    model2.load_state_dict(saved)
    for k, v in fresh.sharded_state_dict(dict(zip(fresh.names, fresh.model_params))).items():
        for block, t in zip(blocks(v), state[k]):
            block.local.copy_(t)
    fresh.load_sharded_state_dict(fresh.common_state_dict(), main_params_loaded=True)
    return straight, train_steps(model2, chunk2, fresh, 1, seed + 1)


# --- one process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["lamb", "lars", "lion", "muon"])
@pytest.mark.parametrize(
    "dtype, distributed, fraction, overlap",
    [(torch.float32, False, 0.5, False), (torch.bfloat16, False, 1.0, True), (torch.bfloat16, True, 0.5, True)],
)
def test_offloaded_update_is_bit_identical(opt, dtype, distributed, fraction, overlap):
    ref = train_steps(*build(opt, distributed=distributed, dtype=dtype), 3)
    model, chunk, optimizer = build(opt, fraction, overlap, distributed, dtype)
    off = optimizer.offload
    off.transfer.trace = []
    got = train_steps(model, chunk, optimizer, 3)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert off.numel == (244 if fraction == 1.0 else 128 if not distributed else 192)
    assert off.transfer.bytes_d2h == off.transfer.bytes_h2d == 3 * 4 * off.numel
    for main, host in off.pairs:
        assert host.data_ptr() != main.data_ptr() and torch.equal(host.data, main.data)
        assert optimizer.optimizer.state[host]  # the state of an offloaded tensor is the host copy's
    if overlap:
        n = len(off.buckets)
        assert n >= 2
        step = [(d, k) for d, k, _ in off.transfer.trace[: len(off.transfer.trace) // 3]]
        step = [e for i, e in enumerate(step) if i == 0 or e != step[i - 1]]
        if opt == "lion":  # element-wise: per-bucket steps, gradient copies pipelined
            expected = [("d2h", 0)]
            for k in range(n):
                expected += [("d2h", k + 1)] * (k + 1 < n) + [("h2d", k)]
        else:  # layer-wise: every gradient first (one norm / orthogonalization pass), weights back per bucket
            expected = [("d2h", k) for k in range(n)] + [("h2d", k) for k in range(n)]
        assert step == expected


@pytest.mark.parametrize("opt", ["lamb", "lars", "lion", "muon"])
def test_checkpoint_saved_with_offload_resumes_exactly(opt):
    straight, resumed = round_trip(opt, 0.5, True, distributed=False)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt", ["lamb", "lars", "lion", "muon"])
def test_offload_is_accepted_with_every_optimizer(opt):
    cfg = optimizer_config(SHARED, OPTIMIZERS[opt], _offload(0.5, True), use_distributed_optimizer=True)
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 64, 4
    validate_config(cfg)  # refused for all but adam and sgd before


# --- two spawned ranks: TP 2 and DP 2 (distributed optimizer) --------------------------------------


class TPToy(torch.nn.Module):
    """A linear layer's split weight and bias (column-parallel: rows split), a row-parallel weight
    (columns split) and replicated bias and norm weight; rank ``r`` holds its slices of the full tensors."""

    SPLIT = {"linear_fc1.weight": 0, "linear_fc1.bias": 0, "linear_fc2.weight": 1}
    SHAPES = {
        "linear_fc1.weight": (16, 6),
        "linear_fc1.bias": (16,),
        "linear_fc2.weight": (3, 16),
        "linear_fc2.bias": (3,),
        "norm.weight": (6,),
    }

    def __init__(self, rank, size):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        for name, shape in self.SHAPES.items():
            owner, leaf = name.split(".")
            if not hasattr(self, owner):
                self.add_module(owner, torch.nn.Module())
            local = torch.nn.Parameter(shard(torch.randn(*shape, generator=g), self.SPLIT.get(name), rank, size))
            if name in self.SPLIT and size > 1:
                set_param_info(local, tensor_parallel=True, partition_dim=self.SPLIT[name])
            getattr(self, owner).register_parameter(leaf, local)


def shard(full, dim, rank, size):
    return full if dim is None or size == 1 else full.chunk(size, dim)[rank].clone()


def toy_steps(opt, fraction, overlap, groups, rank, size):
    """3 steps of the toy with gradients drawn in full (the same on every rank) and sliced."""
    model = TPToy(rank, size)
    optimizer = build_optimizer(
        optimizer_config(SHARED, OPTIMIZERS[opt], _offload(fraction, overlap)),
        [model],
        report_memory=False,
        process_groups=groups,
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for name, p in model.named_parameters():
            p.grad = shard(torch.randn(*TPToy.SHAPES[name], generator=g), TPToy.SPLIT.get(name), rank, size)
        assert optimizer.step()[0]
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def worker():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.group.WORLD
    both = {"ranks": {"tp": (0, 1), "mp": (0, 1), "tp_dp_cp": (0, 1)}}
    tp = ProcessGroups(tp=world, mp=world, tp_dp_cp=world, **both)
    dp = ProcessGroups(
        dp=world,
        dp_cp=world,
        expt_dp=world,
        tp_dp_cp=world,
        ranks={n: (0, 1) for n in ("dp", "dp_cp", "expt_dp", "tp_dp_cp")},
    )
    out = {"tp": {}, "tp_one": {}, "dp": {}, "resume": {}, "offloaded": {}}
    for opt in OPTIMIZERS:
        out["tp"][opt] = [toy_steps(opt, f, o, tp, rank, 2) for f, o in ((None, False),) + OFFLOADS]
        out["tp_one"][opt] = (
            toy_steps(opt, None, False, ProcessGroups.single(), 0, 1) if opt != "muon_blockwise" else None
        )
    for opt in ("lamb", "lars", "lion", "muon"):
        runs = []
        for f, o in ((None, False),) + OFFLOADS:
            model, chunk, optimizer = build(opt, f, o, True, groups=dp)
            runs.append(train_steps(model, chunk, optimizer, 3, seed=rank))
            if f == 0.5:
                out["offloaded"][opt] = optimizer.offload.numel
        out["dp"][opt] = runs
        out["resume"][opt] = round_trip(opt, 0.5, True, True, groups=dp, seed=rank)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(worker, 2, timeout=240)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_tensor_parallel_offload_equals_no_offload(ranks, opt):
    for rank, r in enumerate(ranks):
        plain, *offloaded = r["tp"][opt]
        for run in offloaded:
            assert all(torch.equal(run[n], plain[n]) for n in plain)
        one = r["tp_one"][opt]
        if one is not None:  # the TP layout is right, too: the full tensors' update
            for n, p in plain.items():
                torch.testing.assert_close(p, shard(one[n], TPToy.SPLIT.get(n), rank, 2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opt", ["lamb", "lars", "lion", "muon"])
def test_distributed_optimizer_offload_equals_no_offload(ranks, opt):
    # at fraction 0.5 the two ranks offload different shares of their shards
    assert ranks[0]["offloaded"][opt] != ranks[1]["offloaded"][opt]
    for r in ranks:
        plain, *offloaded = r["dp"][opt]
        for run in offloaded:
            assert all(torch.equal(a, b) for a, b in zip(run, plain))
        straight, resumed = r["resume"][opt]
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["dp"][opt][0], ranks[1]["dp"][opt][0]))  # one model
