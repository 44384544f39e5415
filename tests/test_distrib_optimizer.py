"""The distributed optimizer (ZeRO-1) on a tiny MLP: real gloo ranks against single-process AdamW.

* DP 2 and 4, one or several buckets (padding), with and without overlapped grad reduction and
  parameter gather, expert (``allreduce=False``) parameters: parameters after 3 clipped AdamW
  steps equal single-process AdamW within 1e-6, identical on every rank;
* communication: one reduce-scatter and one all-gather per bucket per step, no all-reduce of
  gradients, ring bytes (K-1)/K of the padded buffer each;
* overlapped all-gathers are still pending after the step and are waited for by the forward;
* measured bytes per parameter equal the formula for d in {1, 2, 4} (fp32, bf16, fp16 with
  fp32 or fp16 gradients);
* an inf in one rank's gradient shard skips the step on every rank and backs the scale off;
* flat ranges cut into rectangular checkpoint blocks exactly.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import CommStats, DistributedDataParallel, finalize_model_grads
from megalm.optimizer import DistributedOptimizer, build_optimizer
from megalm.optimizer.grad_scaler import DynamicGradScaler
from megalm.optimizer.memory_accounting import formula_bytes_per_param, optimizer_memory
from megalm.parallel_state import get_process_groups
from megalm.param_layout import flat_range_blocks
from tests.configs import optimizer_config
from tests.distributed_harness import run_distributed
from tests.test_ddp import GLOBAL_BATCH, NUM_MICRO, OPTIMIZER, STEPS, batch, make_model, reference_run

PRECISIONS = {  # name: (param dtype, accumulate_allreduce_grads_in_fp32)
    "fp32": (torch.float32, True),
    "bf16": (torch.bfloat16, True),
    "fp16": (torch.float16, True),
    "fp16_fp16_grads": (torch.float16, False),
}


# --- pure functions ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)])
def test_flat_range_blocks_cover_each_range_exactly(shape):
    numel = math.prod(shape)
    ref = torch.arange(numel).view(shape)
    for start in range(numel):
        for end in range(start + 1, numel + 1):
            blocks = flat_range_blocks(shape, start, end)
            assert len(blocks) <= 2 * (len(shape) - 1) + 1
            cursor = start
            for flat, offsets, sizes in blocks:
                assert flat == cursor
                block = ref[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert torch.equal(block.flatten(), torch.arange(flat, flat + math.prod(sizes)))
                cursor += math.prod(sizes)
            assert cursor == end


def _mlp(dtype):
    torch.manual_seed(0)  # 8*16+16 + 2*16 + 16*4+4 = 244 elements: no padding for d in {1, 2, 4}
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(dtype)


def _memory(precision, distributed):
    dtype, fp32_grads = PRECISIONS[precision]
    model = _mlp(dtype)
    ddp = DistributedDataParallel(
        model,
        ParallelConfig(use_distributed_optimizer=distributed, accumulate_allreduce_grads_in_fp32=fp32_grads),
        process_groups=get_process_groups(),
    )
    cfg = optimizer_config(OPTIMIZER)
    cfg.parallel.use_distributed_optimizer = distributed
    mem = optimizer_memory(build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups()), [ddp])
    mem.pop("per_param")
    return mem


def test_memory_formula_single_rank_and_plain_optimizer():
    plain = {"fp32": 16, "bf16": 18, "fp16": 18, "fp16_fp16_grads": 20}
    for precision in PRECISIONS:
        for distributed in (True, False):
            mem = _memory(precision, distributed)
            assert mem["params"] == 244 and mem["d"] == 1
            assert mem["total"] == mem["formula"] * 244 == plain[precision] * 244, (precision, distributed, mem)
            assert mem["optimizer_state"] == 8 * 244


# --- distributed runs ------------------------------------------------------------------------------


def _train(dp, overlap, bucket_size, expert_last_layer):
    model = make_model()
    if expert_last_layer:
        for p in model.out.parameters():
            p.allreduce = False
    cfg = optimizer_config(OPTIMIZER)
    cfg.parallel = ParallelConfig(
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        ddp_bucket_size=bucket_size,
        use_distributed_optimizer=True,
    )
    stats = CommStats()
    ddp = DistributedDataParallel(model, cfg.parallel, process_groups=get_process_groups(), comm_stats=stats)
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups(), comm_stats=stats)
    assert isinstance(optimizer, DistributedOptimizer)
    buckets = [b for buf in ddp.all_buffers for b in buf.buckets]
    rank, mb = parallel_state.get_data_parallel_rank(), GLOBAL_BATCH // dp // NUM_MICRO
    out = {
        "n_buckets": len(buckets),
        "norms": [],
        "pending_after_step": [],
        "pending_after_forward": [],
        "padded_numel": sum(b.numel for b in buckets),
        "owned": sum(r.numel for r in optimizer.ranges),
    }
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.view(dp, NUM_MICRO, mb, 8)[rank], y.view(dp, NUM_MICRO, mb, 3)[rank]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for k in range(NUM_MICRO):
            if k < NUM_MICRO - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x[k]), y[k]) / NUM_MICRO).backward()
            else:
                loss = F.mse_loss(ddp(x[k]), y[k]) / NUM_MICRO
                if step > 0:
                    out["pending_after_forward"].append(sum(b.param_handle is not None for b in buckets))
                loss.backward()
        finalize_model_grads([ddp], process_groups=get_process_groups(), comm_stats=stats)
        ok, norm, _ = optimizer.step()
        assert ok
        out["pending_after_step"].append(sum(b.param_handle is not None for b in buckets))
        out["norms"].append(norm)
    ddp.finish_param_sync()
    out["stats"] = stats.get()
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]
    return out


def _memory_distributed(dp):
    out = {}
    for precision in PRECISIONS:
        mem = _memory(precision, True)
        out[precision] = (mem["total"], mem["formula"] * mem["params"], mem["optimizer_state"], mem["d"])
    return out


def _found_inf_on_one_rank():
    """fp16: an inf in rank 0's gradient shard only must skip the step on every rank."""
    model = _mlp(torch.float16)
    ddp = DistributedDataParallel(
        model, ParallelConfig(use_distributed_optimizer=True), process_groups=get_process_groups()
    )
    cfg = optimizer_config(OPTIMIZER)
    cfg.parallel.use_distributed_optimizer = True
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups())
    optimizer.grad_scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=1000, hysteresis=1)
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for inject in (True, False):
        ddp.zero_grad_buffer()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).half()
        optimizer.scale_loss(ddp(x).float().pow(2).mean()).backward()
        finalize_model_grads([ddp], process_groups=get_process_groups())
        if inject and parallel_state.get_data_parallel_rank() == 0:
            optimizer.ranges[0].grad[0] = float("inf")
        ok, norm, _ = optimizer.step()
        changed = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        results.append((ok, norm is None, optimizer.get_loss_scale(), changed))
    return results


def worker(dp):
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for overlap, bucket, expert in ((False, None, False), (False, 100, False), (True, 100, False), (True, 100, True)):
        results[(overlap, bucket, expert)] = _train(dp, overlap, bucket, expert)
    results["memory"] = _memory_distributed(dp)
    results["found_inf"] = _found_inf_on_one_rank()
    return results


@pytest.mark.parametrize("dp", [2, 4])
def test_distributed_optimizer_matches_single_process(dp):
    _, ref_params, ref_norms = reference_run()
    ranks = run_distributed(worker, dp, args=(dp,), timeout=150)
    for key, res in ranks[0].items():
        if not isinstance(key, tuple):
            continue
        overlap, bucket, expert = key
        for r in ranks:  # every rank holds the same (all-gathered) parameters
            for a, b in zip(r[key]["params"], res["params"]):
                assert (a == b).all(), key
        for a, e in zip(res["params"], ref_params):
            torch.testing.assert_close(torch.from_numpy(a), e, rtol=1e-6, atol=1e-6 * e.abs().max().item())
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-6)
        # each rank owns 1/dp of every bucket; together exactly the 1507 parameter elements
        assert sum(r[key]["owned"] for r in ranks) == 1507
        n = res["n_buckets"]
        assert n == (1 if bucket is None else 3)
        stats = res["stats"]
        assert "grad_all_reduce" not in stats
        for kind in ("grad_reduce_scatter", "param_all_gather"):
            assert stats[kind]["calls"] == n * STEPS
            assert stats[kind]["tensor_bytes"] == 4 * res["padded_numel"] * STEPS
            assert stats[kind]["wire_bytes"] == pytest.approx((dp - 1) / dp * stats[kind]["tensor_bytes"])
        # what gloo sends: its reduce-scatter is an all-reduce of the bucket (bench/collective_wire_bytes.py)
        rs, ag = stats["grad_reduce_scatter"], stats["param_all_gather"]
        assert rs["sent_bytes"] == pytest.approx(2 * rs["wire_bytes"]) and ag["sent_bytes"] == ag["wire_bytes"]
        # overlapped gathers are left running by the step and waited for by the forward
        assert res["pending_after_step"] == [n if overlap else 0] * STEPS
        assert res["pending_after_forward"] == [0] * (STEPS - 1)
    for precision, (total, formula_total, state, d) in ranks[0]["memory"].items():
        assert d == dp
        assert total == formula_total, precision  # e.g. bf16: (6 + 12/d) x 244 bytes exactly
        assert state == 8 * 244 // dp
        dtype, fp32_grads = PRECISIONS[precision]
        assert formula_total / 244 == formula_bytes_per_param(dtype, torch.float32 if fp32_grads else dtype, dp)[0]
    for r in ranks:
        (ok0, none0, scale0, changed0), (ok1, _, scale1, changed1) = r["found_inf"]
        assert (ok0, none0, scale0, changed0) == (False, True, 512.0, False)  # skipped everywhere, scale halved
        assert ok1 and scale1 == 512.0 and changed1
