"""DDP, the optimizers and the gradient norm communicate over the groups passed to them
(:class:`megalm.parallel_state.ProcessGroups`), not over parallel_state's globals.

Two gloo ranks with parallel_state NOT initialized (so every getter, and
``get_process_groups()``, says "this rank alone"); the groups are handed in explicitly:

* DDP over ``dp_cp`` = world: ``main_grad`` is the mean of both ranks' gradients; the same DDP
  built with ``ProcessGroups.single()`` (this rank alone) does not communicate and keeps the local gradient;
* the distributed optimizer (shards over DDP's ``dp_cp``, norm over the world of the groups):
  after one clipped SGD step the parameters equal the single-process update on the mean gradient;
* the plain optimizer with ``tp`` = ``mp`` = world: a TP-sharded gradient counts on both ranks,
  a replicated one once, so the norm equals the norm of the full gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import CommStats, DistributedDataParallel
from megalm.optimizer import FP32Optimizer, build_optimizer
from megalm.parallel_state import ProcessGroups
from tests.configs import optimizer_config
from tests.distributed_harness import run_distributed

LR, CLIP = 1.0, 0.05


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


# Plain SGD; several DDP buckets (bucket size 100), parameters split between the two shards.
SGD = dict(optimizer="sgd", lr=LR, clip_grad=CLIP, weight_decay=0.0, sgd_momentum=0.0, ddp_bucket_size=100)


def worker():
    import torch.distributed as dist

    assert not parallel_state.model_parallel_is_initialized()
    rank, world = dist.get_rank(), dist.group.WORLD
    dp_groups = ProcessGroups(
        dp=world, dp_cp=world, expt_dp=world, ranks={"dp": (0, 1), "dp_cp": (0, 1), "expt_dp": (0, 1)}
    )
    x, y = _batch(rank)
    out = {}
    for name, groups in (("explicit", dp_groups), ("default", ProcessGroups.single())):
        model = _mlp()
        stats = CommStats()
        ddp = DistributedDataParallel(model, ParallelConfig(), process_groups=groups, comm_stats=stats)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        out[name] = (
            [p.main_grad.numpy().copy() for p in model.parameters()],
            stats.get().get("grad_all_reduce", {}).get("calls", 0),
        )

    model = _mlp()
    cfg = optimizer_config(SGD, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(model, cfg.parallel, process_groups=dp_groups)
    opt = build_optimizer(cfg, [ddp], report_memory=False, process_groups=dp_groups)
    F.mse_loss(ddp(x), y).backward()
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    out["distributed"] = (ok, norm, [p.detach().numpy().copy() for p in model.parameters()])

    # TP 2 in all but name: W's rows are split over the ranks, n is replicated.
    tp_groups = ProcessGroups(tp=world, mp=world, ranks={"tp": (0, 1), "mp": (0, 1)})
    W = torch.nn.Parameter(torch.zeros(2, 3))
    W.tensor_model_parallel, W.partition_dim, W.partition_stride = True, 0, 1
    n = torch.nn.Parameter(torch.zeros(3))
    full_W = torch.arange(12.0).view(4, 3)
    W.grad, n.grad = full_W[2 * rank : 2 * rank + 2].clone(), torch.tensor([1.0, 2.0, 3.0])
    groups = [{"name": "all", "params": [W, n], "names": ["W", "n"], "weight_decay": 0.0}]
    norms = []
    for g in (tp_groups, ProcessGroups.single()):
        opt = FP32Optimizer(groups, lambda gs: torch.optim.SGD(gs, lr=1.0), clip_grad=0.0, process_groups=g)
        W.grad, n.grad = full_W[2 * rank : 2 * rank + 2].clone(), torch.tensor([1.0, 2.0, 3.0])
        norms.append(opt.step()[1])
    out["tp_norms"] = norms
    return out


def test_components_use_the_groups_they_are_given():
    ranks = run_distributed(worker, 2, timeout=120)
    # single-process reference on the mean gradient
    model = _mlp()
    losses = [F.mse_loss(model(x), y) for x, y in (_batch(0), _batch(1))]
    (sum(losses) / 2).backward()
    mean_grads = [p.grad.clone() for p in model.parameters()]
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
    assert ref_norm > CLIP  # clipping is active, so a wrong (local) norm changes the update
    with torch.no_grad():
        expected = [p - LR * p.grad for p in model.parameters()]
    for rank, r in enumerate(ranks):
        grads, calls = r["explicit"]
        assert calls >= 1
        for g, m in zip(grads, mean_grads):
            torch.testing.assert_close(torch.from_numpy(g), m, rtol=1e-6, atol=1e-7)
        local_grads, local_calls = r["default"]
        assert local_calls == 0
        assert not all(torch.allclose(torch.from_numpy(g), m) for g, m in zip(local_grads, mean_grads))
        ok, norm, params = r["distributed"]
        assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
        for p, e in zip(params, expected):
            torch.testing.assert_close(torch.from_numpy(p), e, rtol=1e-5, atol=1e-6)
        full = torch.cat([torch.arange(12.0), torch.tensor([1.0, 2.0, 3.0])]).norm().item()
        local = (
            torch.cat([torch.arange(12.0).view(4, 3)[2 * rank : 2 * rank + 2].flatten(), torch.tensor([1.0, 2.0, 3.0])])
            .norm()
            .item()
        )
        assert r["tp_norms"][0] == pytest.approx(full, rel=1e-6)
        assert r["tp_norms"][1] == pytest.approx(local, rel=1e-6)  # default: this rank alone
