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

``--init-model-with-meta-device`` (a Llama-style GPT, 2 layers, hidden 64, untied, one bucket per layer):
built on the meta device, ZeRO-3's build never holds the model: peak ``<= 2 P / K + B + M`` (the shards,
one bucket, one parameter's fp32 initial value ``M`` while it is copied in) against the normal build's
``P`` more; the gathered weights equal the normal build's bit for bit and so do two training steps' losses
and weights.
"""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import DistributedDataParallel, finalize_model_grads
from megalm.models import GPTModel
from megalm.optimizer import build_optimizer
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel.random import RNGStatesTracker
from megalm.training.build import build_model_chunks, wrap_data_parallel
from megalm.training.memory import TrackedAllocations
from tests.checkpoint_fixtures import LLAMA
from tests.configs import TINY_GPT, make_config, optimizer_config
from tests.distributed_harness import run_distributed
from tests.test_ddp import OPTIMIZER

K, WIDTH, LAYERS, BATCH = 2, 128, 6, 4
LAYER = WIDTH * WIDTH + WIDTH  # elements of one layer (a multiple of K: no padding)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _run(strategy):
    kw = dict(overlap_grad_reduce=True, ddp_bucket_size=LAYER)
    cfg = optimizer_config(OPTIMIZER)
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


def _gpt(cfg, pre_process=True, post_process=True, layer_numbers=None, *, process_groups, rng_tracker):
    return GPTModel(
        cfg, pre_process, post_process, layer_numbers, process_groups=process_groups, rng_tracker=rng_tracker
    )


def _run_meta(meta):
    """ZeRO-3 GPT built with or without --init-model-with-meta-device; build peak, weights, two steps."""
    cfg = copy.deepcopy(
        make_config(
            TINY_GPT,
            LLAMA,
            vocab_size=256,
            hidden_size=64,
            ffn_hidden_size=128,
            seq_length=32,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    )
    p = cfg.parallel
    p.data_parallel_sharding_strategy, p.overlap_grad_reduce, p.ddp_bucket_size = "optim_grads_params", True, 20000
    p.init_model_with_meta_device = meta
    groups = get_process_groups()
    g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, 256, (2, 33), generator=g)
    gc.collect()  # an earlier run's cycles (DDP's hooks) freed inside the window would lower the count
    with TrackedAllocations() as tracked:
        with tracked.phase("build"):
            (ddp,) = wrap_data_parallel(cfg, build_model_chunks(cfg, _gpt, groups, RNGStatesTracker()), groups)
    sizes = [p.numel() * 4 for p in ddp.parameters()]
    buckets = [b.numel * 4 for buf in ddp.all_buffers for b in buf.buckets]
    ddp.gather_params()
    built = [p.detach().clone() for p in ddp.parameters()]
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=groups)
    losses = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        finalize_model_grads([ddp], process_groups=groups)
        assert optimizer.step()[0]
        losses.append(loss.item())
    ddp.finish_param_sync()
    ddp.gather_params()
    return {
        "build": tracked.phases["build"],
        "sizes": sizes,
        "buckets": buckets,
        "built": built,
        "losses": losses,
        "trained": [p.detach().clone() for p in ddp.parameters()],
    }


def worker():
    parallel_state.initialize_model_parallel(1, 1)
    out = {s: _run(s) for s in ("optim_grads", "optim_grads_params")}
    out["meta"] = {m: _run_meta(m) for m in (False, True)}
    return out


@pytest.fixture(scope="module")
def outs():
    return run_distributed(worker, K, timeout=240)


def test_zero3_peak_follows_its_formula(outs):
    for out in outs:
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


def test_meta_device_build_holds_shards_and_one_bucket(outs):
    for out in outs:
        plain, meta = out["meta"][False], out["meta"][True]
        for key in ("built", "trained"):  # bit for bit: the same initial values, so the same training
            assert all(torch.equal(a, b) for a, b in zip(plain[key], meta[key])), key
        assert plain["losses"] == meta["losses"]
        p, m, b = sum(meta["buckets"]), max(meta["sizes"]), max(meta["buckets"])
        assert len(meta["buckets"]) >= 4 and b < p / 2  # several buckets: "one bucket" is a real bound
        print({"plain": plain["build"], "meta": meta["build"]}, "P", p, "B", b, "M", m)
        slack = 4096  # DDP's small tensors (flags)
        assert meta["build"] <= 2 * p // K + b + m + slack, (meta["build"], p, b, m)
        assert plain["build"] >= meta["build"] + p // 2, (plain["build"], meta["build"], p)  # the model was held
