"""ZeRO-3's per-rank peak on the CPU allocator's own count (:class:`megalm.training.memory.TrackedAllocations`).

Two gloo ranks, a stack of square fp32 linears, one bucket per layer, one microbatch with
``--overlap-grad-reduce``; ``P`` the padded parameter bytes, ``K = 2``, ``B`` the largest bucket's bytes:

* building the model and DDP's ZeRO-3 buffers (:class:`~megalm.distributed.sharded_param_buffer.ShardedParamBuffer`)
  holds at most the model, the shards and one bucket: peak ``<= P + 2 P / K + B`` (weight and gradient
  shards; before, the flat buffer and every bucket's copy coexisted: ``2 P`` more), and it ends holding
  the shards only, ``2 P / K`` (the model's own storage is gone);
* the step's peak (steady state ``4 P / K`` plus two gathered buckets, the gradient buckets in flight
  and the activations) is measured by ``bench/zero3_peak.py`` and not asserted here: it moved by whole
  buckets between runs on a loaded host; both strategies must train to the same weights, bit for bit.
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
        # The steady state after the step and the step's peak are reported (bench/zero3_peak.py), not asserted:
        # on a loaded 2-core host they moved by whole buckets from run to run (a bucket-sized block freed by a
        # gloo thread before or after the window closes), so only the build peak is a stable number here.
        assert z3["build"] < z2["build"], (z3["build"], z2["build"])
