"""Sharded gradients (ZeRO-2, ``--data-parallel-sharding-strategy optim_grads``) on a tiny MLP, real gloo ranks.

* DP 4 (DP 2, TP 2 and the non-overlapped reduction run end to end in
  tests/test_sharding_strategy_training.py), three buckets (padding) reduced during the backward
  (--overlap-grad-reduce), expert (``allreduce=False``) parameters, 3 microbatches:
  parameters after 3 clipped AdamW steps are bit-identical to the distributed optimizer's (ZeRO-1)
  and equal single-process AdamW within 1e-6;
* communication: one reduce-scatter per bucket per step (ZeRO-1's bytes), no gradient all-reduce;
* memory: after the reduction no bucket's full storage is alive and the gradient bytes on a rank
  are ``grad size x padded numel / d``; bytes per parameter equal the formula (``4 + 12/d`` fp32,
  ``2 + 16/d`` bf16/fp16 with fp32 grads, ``2 + 18/d`` fp16 grads) for d in {1, 4}, and so do
  the planner's (tools/estimate.py) per strategy, optim and optim_grads;
* ZeRO-3 (``optim_grads_params``) on the same MLP: bit-identical to ZeRO-1; ``2n - 1`` all-gathers per
  microbatch for ``n`` buckets; with prefetch (``--overlap-param-gather``) bit-identical again, the same
  all-gathers (none wasted), the counted prefetches, and on the live tensors at every module forward and
  gradient accumulation at most one bucket more gathered than without (forward: 1 bucket without, 2 with);
* a gradient arriving after its bucket was reduce-scattered is refused;
* the flag: ``optim`` / ``optim_grads`` turn the distributed optimizer on, the distributed optimizer
  alone means ``optim``; what is not built is a ConfigError naming the flags.
"""

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.config.sections import ConfigError
from megalm.distributed import CommStats, DistributedDataParallel, finalize_model_grads
from megalm.distributed.param_and_grad_buffer import DataParallelError
from megalm.estimate.planner import state_bytes_per_param, strategy_bytes_per_param
from megalm.optimizer import build_optimizer
from megalm.optimizer.memory_accounting import formula_bytes_per_param, optimizer_memory
from megalm.parallel_state import get_process_groups
from tests.configs import make_config, optimizer_config
from tests.distributed_harness import run_distributed
from tests.test_data_parallel_config import MODEL as DP_MODEL
from tests.test_ddp import GLOBAL_BATCH, NUM_MICRO, OPTIMIZER, STEPS, batch, make_model, reference_run
from tests.test_distrib_optimizer import PRECISIONS, _mlp

ZERO2, ZERO3 = "optim_grads", "optim_grads_params"


def _ddp(model, strategy, comm_stats=None, **kw):
    return DistributedDataParallel(
        model,
        ParallelConfig(data_parallel_sharding_strategy=strategy, **kw),
        process_groups=get_process_groups(),
        comm_stats=comm_stats,
    )


def _memory(precision, strategy=ZERO2):
    dtype, fp32_grads = PRECISIONS[precision]
    ddp = _ddp(_mlp(dtype), strategy, accumulate_allreduce_grads_in_fp32=fp32_grads)
    cfg = optimizer_config(OPTIMIZER, data_parallel_sharding_strategy=strategy)
    mem = optimizer_memory(build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups()), [ddp])
    return mem["total"], mem["formula"] * mem["params"], mem["grads"], mem["d"], mem["grads_sharded"]


@pytest.mark.parametrize(
    "parallel,strategy",
    [
        ({}, "no_shard"),
        ({"use_distributed_optimizer": True}, "optim"),
        ({"data_parallel_sharding_strategy": "optim"}, "optim"),
        ({"data_parallel_sharding_strategy": "optim_grads", "overlap_param_gather": True}, "optim_grads"),
        # ZeRO-3 prefetch and recompute (tests/test_sharding_strategy_training.py trains them)
        ({"data_parallel_sharding_strategy": ZERO3, "overlap_param_gather": True}, ZERO3),
        ({"data_parallel_sharding_strategy": ZERO3, "recompute_granularity": "selective"}, ZERO3),
    ],
)
def test_strategy_flag(parallel, strategy):
    p = make_config(DP_MODEL, parallel).parallel
    assert p.data_parallel_sharding_strategy == strategy
    assert p.use_distributed_optimizer == (strategy != "no_shard")


@pytest.mark.parametrize(
    "parallel,message",
    [
        (
            {"data_parallel_sharding_strategy": "optim_grads_params", "expert_tensor_parallel_size": 2},
            "optim_grads_params with --expert-tensor-parallel-size 2 is not built yet",
        ),
        (
            {"data_parallel_sharding_strategy": "optim_grads", "pipeline_model_parallel_size": 2},
            "optim_grads with --pipeline-model-parallel-size 2 is not built yet",
        ),
        (
            {"data_parallel_sharding_strategy": "optim_grads", "hierarchical_grad_reduce": True},
            "optim_grads with --hierarchical-grad-reduce is not built yet",
        ),
    ],
)
def test_strategy_refusals(parallel, message):
    with pytest.raises(ConfigError, match=message):
        make_config(DP_MODEL, parallel)


def test_formula_bytes_per_param():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert formula_bytes_per_param(f32, f32, 4, grads_sharded=True) == (
        4 + 12 / 4,
        "4 + 12/d (fp32 params and grads, grads sharded)",
    )
    assert formula_bytes_per_param(bf16, f32, 4, grads_sharded=True)[0] == 2 + 16 / 4
    assert formula_bytes_per_param(f16, f16, 4, grads_sharded=True)[0] == 2 + 18 / 4
    assert formula_bytes_per_param(bf16, f32, 4) == (6 + 12 / 4, "6 + 12/d (bf16 params, fp32 grads)")


def test_memory_single_rank():
    for precision in PRECISIONS:
        total, formula_total, _, d, sharded = _memory(precision)
        assert (d, sharded) == (1, True)
        assert total == formula_total, precision


def _gathered_sampler(ddp, buckets):
    """Hooks (run after DDP's) recording, at every module forward and gradient accumulation, the
    bytes of gathered parameters and how many unpinned buckets are gathered (a prefetch counts)."""
    samples = {"forward": [], "backward": []}

    def sample(phase):
        samples[phase].append(
            (sum(buf.param_bytes() for buf in ddp.all_buffers), sum(b.gathered and not b.pinned for b in buckets))
        )

    for m in ddp.module.modules():
        m.register_forward_pre_hook(lambda *_: sample("forward"))
    for p in ddp.module.parameters():
        p.register_post_accumulate_grad_hook(lambda *_: sample("backward"))
    return samples


def _train(dp, strategy, overlap, bucket_size, expert_last_layer, prefetch=False):
    model = make_model()
    if expert_last_layer:
        for p in model.out.parameters():
            p.allreduce = False
    gather = overlap and (strategy != ZERO3 or prefetch)  # ZeRO-3: --overlap-param-gather = prefetch
    kw = dict(overlap_grad_reduce=overlap, overlap_param_gather=gather, ddp_bucket_size=bucket_size)
    stats = CommStats()
    ddp = _ddp(model, strategy, stats, **kw)
    cfg = optimizer_config(OPTIMIZER, data_parallel_sharding_strategy=strategy)
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups(), comm_stats=stats)
    buckets = [b for buf in ddp.all_buffers for b in buf.buckets]
    rank, mb = parallel_state.get_data_parallel_rank(), GLOBAL_BATCH // dp // NUM_MICRO
    out = {"n_buckets": len(buckets), "padded_numel": sum(b.numel for b in buckets), "live": [], "grad_bytes": []}
    out["gathered_after_step"], out["param_bytes_after_step"] = [], []
    out["bucket_bytes"] = sorted(b.numel * b.param_data.element_size() for b in buckets)
    samples = _gathered_sampler(ddp, buckets) if strategy == ZERO3 else None
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.view(dp, NUM_MICRO, mb, 8)[rank], y.view(dp, NUM_MICRO, mb, 3)[rank]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for k in range(NUM_MICRO):
            loss = F.mse_loss(ddp(x[k]), y[k]) / NUM_MICRO
            if k < NUM_MICRO - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        finalize_model_grads([ddp], process_groups=get_process_groups(), comm_stats=stats)
        out["live"].append(sum(b.grad_data is not None for b in buckets))
        out["grad_bytes"].append(sum(buf.grad_bytes() for buf in ddp.all_buffers))
        ok, norm, _ = optimizer.step()
        assert ok
        if strategy == ZERO3:  # between iterations only the shards of the weights are left
            out["gathered_after_step"].append(sum(b.gathered for b in buckets))
            out["param_bytes_after_step"].append(sum(buf.param_bytes() for buf in ddp.all_buffers))
    ddp.finish_param_sync()
    ddp.gather_params()
    out["stats"] = stats.get()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    if samples is not None:
        out["samples"], out["prefetches"] = samples, ddp._unsharder.prefetches
    if strategy == ZERO2:  # a late gradient (a backward outside no_sync after the reduction) is refused
        ddp.start_grad_sync()
        try:
            F.mse_loss(ddp(x[0]), y[0]).backward()
            out["late"] = None
        except DataParallelError as e:
            out["late"] = str(e)
    return out


def worker(dp):
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for key in ((True, 100, True),):
        results[key] = {s: _train(dp, s, *key) for s in ("optim", ZERO2, ZERO3)}
        results[key]["prefetch"] = _train(dp, ZERO3, *key, prefetch=True)
    results["memory"] = {p: _memory(p) for p in PRECISIONS}
    results["memory3"] = {p: _memory(p, ZERO3) for p in PRECISIONS}
    results["memory_optim"] = {p: _memory(p, "optim") for p in PRECISIONS}
    return results


def _check_prefetch(plain, prefetch, zero1, n):
    """ZeRO-3 with --overlap-param-gather: bit-identical, the same all-gathers, one bucket more at most."""
    for a, b in zip(prefetch["params"], zero1["params"]):
        assert torch.equal(a, b)
    assert prefetch["stats"]["param_all_gather"] == plain["stats"]["param_all_gather"]  # none wasted
    # per microbatch (buckets fc1+norm, fc2, out): forward fc1's pre-hook launches fc2's bucket, fc2's out's;
    # backward out's unpack launches fc2's, fc2's fc1's; the very first forward has no order yet
    assert n == 3 and prefetch["prefetches"] == 4 * NUM_MICRO * STEPS - 2
    largest = prefetch["bucket_bytes"][-1]
    for phase in ("forward", "backward"):
        without = max(c for _, c in plain["samples"][phase])
        assert max(c for _, c in prefetch["samples"][phase]) <= without + 1, phase
        assert max(b for b, _ in prefetch["samples"][phase]) <= max(b for b, _ in plain["samples"][phase]) + largest
    assert max(c for _, c in plain["samples"]["forward"]) == 1  # one module's bucket at a time
    assert max(c for _, c in prefetch["samples"]["forward"]) == 2  # ... and the next one in flight


def test_sharded_strategies_match_zero1_and_single_process():
    dp = 4
    _, ref_params, _ = reference_run()
    ranks = run_distributed(worker, dp, args=(dp,), timeout=150)
    for r in ranks:
        for key, res in r.items():
            if not isinstance(key, tuple):
                continue
            zero1, zero2 = res["optim"], res[ZERO2]
            for a, b in zip(zero2["params"], zero1["params"]):
                assert torch.equal(a, b), key  # same reduction, same shards: bit-identical
            for a, e in zip(zero2["params"], ref_params):
                torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6 * e.abs().max().item())
            n, padded = zero2["n_buckets"], zero2["padded_numel"]
            assert n == 3
            stats = zero2["stats"]
            assert "grad_all_reduce" not in stats
            assert stats["grad_reduce_scatter"] == zero1["stats"]["grad_reduce_scatter"]
            assert stats["grad_reduce_scatter"]["calls"] == n * STEPS
            # after the reduction only the shard is left: 4 bytes x padded numel / d (ZeRO-1: all of it)
            assert zero2["live"] == [0] * STEPS
            assert zero2["grad_bytes"] == [4 * padded // dp] * STEPS
            assert zero1["grad_bytes"] == [4 * padded] * STEPS
            assert "arrived after its bucket" in zero2["late"]
            zero3 = res[ZERO3]
            for a, b in zip(zero3["params"], zero1["params"]):
                assert torch.equal(a, b), key  # ZeRO-3: the same values, gathered before use
            assert zero3["stats"]["grad_reduce_scatter"] == zero1["stats"]["grad_reduce_scatter"]
            assert zero3["live"] == [0] * STEPS and zero3["grad_bytes"] == zero2["grad_bytes"]
            assert zero3["gathered_after_step"] == [0] * STEPS
            assert zero3["param_bytes_after_step"] == [4 * padded // dp] * STEPS
            # per microbatch each bucket is gathered for the forward and again for the backward, but the
            # last one of the forward (still gathered when backward starts); + n for the final gather_params
            assert zero3["stats"]["param_all_gather"]["calls"] == (2 * n - 1) * NUM_MICRO * STEPS + n
            _check_prefetch(zero3, res["prefetch"], zero1, n)
        for precision, (total, formula_total, grads, d, sharded) in r["memory"].items():
            assert (d, sharded) == (dp, True)
            assert total == formula_total, precision  # e.g. bf16: (2 + 16/d) x 244 bytes exactly
            assert grads == (4 if PRECISIONS[precision][1] else 2) * 244 // dp
        # tools/estimate.py's bytes per parameter per strategy equal the measured ones
        for precision, (total, formula_total, _, d, _) in r["memory3"].items():
            assert total == formula_total and d == dp, precision  # e.g. bf16: 18/d x 244 bytes exactly
        for strategy, memory in (("optim_grads", r["memory"]), ("optim", r["memory_optim"]), (ZERO3, r["memory3"])):
            for precision, (total, *_) in memory.items():
                dtype, fp32_grads = PRECISIONS[precision]
                name = "fp32" if dtype == torch.float32 else "bf16"
                per_param = state_bytes_per_param(name, "adam", 0.0, fp32_grads)
                assert total == 244 * sum(strategy_bytes_per_param(per_param, dp, strategy).values()), precision
