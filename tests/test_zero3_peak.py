"""ZeRO-3's per-rank peak on the CPU allocator's own count (:class:`megalm.training.memory.TrackedAllocations`).

Two gloo ranks, a stack of square fp32 linears, one bucket per layer, one microbatch with
``--overlap-grad-reduce``; ``P`` the padded parameter bytes, ``K = 2``, ``B`` the largest bucket's bytes:

* building the model and DDP's ZeRO-3 buffers (:class:`~megalm.distributed.sharded_param_buffer.ShardedParamBuffer`)
  holds at most the model, the shards and one bucket: peak ``<= P + 2 P / K + B`` (weight and gradient
  shards; before, the flat buffer and every bucket's copy coexisted: ``2 P`` more), and it ends holding
  the shards only, ``2 P / K`` (the model's own storage is gone);
* one training step (forward, backward, AdamW step) peaks at most at the steady state
  (weight, gradient, fp32 Adam shards: ``4 P / K``) plus the gathered working set of two buckets, the
  gradient buckets of the overlapped reduction (three) and the activations, measured on the same step
  without DDP's sharding of the weights (ZeRO-2's peak less its full weights ``P`` less its steady state);
* ZeRO-3's step peak is below ZeRO-2's by at least ``P (1 - 1/K) - 2 B``.
"""

import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import DistributedDataParallel, finalize_model_grads
from megalm.optimizer import build_optimizer
from megalm.parallel_state import get_process_groups
from megalm.training.memory import TrackedAllocations
from tests.distributed_harness import run_distributed
from tests.test_ddp import make_cfg

K, WIDTH, LAYERS, BATCH = 2, 128, 6, 4
LAYER = WIDTH * WIDTH + WIDTH  # elements of one layer (a multiple of K: no padding)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _run(strategy):
    kw = dict(overlap_grad_reduce=True, ddp_bucket_size=LAYER)
    cfg = make_cfg()
    cfg.parallel.data_parallel_sharding_strategy = strategy
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(parallel_state.get_data_parallel_rank()))
    with TrackedAllocations() as tracked:  # blocks allocated before it started are not counted when freed
        with tracked.phase("build"):
            model = _model()
            ddp = DistributedDataParallel(
                model,
                ParallelConfig(data_parallel_sharding_strategy=strategy, **kw),
                process_groups=get_process_groups(),
            )
        optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups())

        def step():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            F.mse_loss(ddp(x), x).backward()
            finalize_model_grads([ddp], process_groups=get_process_groups())
            assert optimizer.step()[0]

        step()  # Adam state exists from here on
        with tracked.phase("step"):
            step()
    ddp.finish_param_sync()
    ddp.gather_params()
    buckets = [b for buf in ddp.all_buffers for b in buf.buckets]
    return {
        "build": tracked.phases["build"],
        "step": tracked.phases["step"],
        "end": tracked.end,
        "buckets": [b.numel * 4 for b in buckets],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def worker():
    parallel_state.initialize_model_parallel(1, 1)
    return {s: _run(s) for s in ("optim_grads", "optim_grads_params")}


def test_zero3_peak_follows_its_formula():
    for out in run_distributed(worker, K, timeout=240):
        z2, z3 = out["optim_grads"], out["optim_grads_params"]
        for a, b in zip(z2["params"], z3["params"]):  # same training, bit for bit
            assert torch.equal(a, b)
        assert z3["buckets"] == [LAYER * 4] * LAYERS
        p, b = LAYERS * LAYER * 4, LAYER * 4
        slack = 4096  # DDP's and the optimizer's small tensors (flags, step counters)
        print({s: {k: v for k, v in r.items() if k in ("build", "step", "end")} for s, r in out.items()}, p, b)
        assert z3["build"] <= p + 2 * p // K + b + slack, (z3["build"], p, b)
        steady3, steady2 = 4 * p // K, p + 3 * p // K  # (weights,) gradient, exp_avg, exp_avg_sq shards
        for steady, run in ((steady2, z2), (steady3, z3)):
            assert abs(run["end"] - steady) <= slack, (run["end"], steady)
        transient = z2["step"] - steady2  # activations, gradient buckets in flight, optimizer temporaries
        assert transient > 0
        assert z3["step"] <= steady3 + 2 * b + transient + slack, (z3["step"], steady3, b, transient)
        assert z3["step"] <= z2["step"] - (p - p // K) + 2 * b + slack
