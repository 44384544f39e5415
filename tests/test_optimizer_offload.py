"""--optimizer-cpu-offload / --optimizer-offload-fraction: the update of a fraction of the main
parameters runs on host copies (CPU -> CPU copies here, the code path of a GPU).

* fp32 and bf16, plain and distributed optimizer (optim, optim_grads, optim_grads_params, one rank),
  fractions 0.5 and 1 (six combinations): weights after 3 clipped AdamW steps are bit-identical to
  the non-offloaded optimizer's;
* which tensors go to the host (whole tensors while fewer than fraction x total elements went) and
  the measured bytes: device optimizer state 8 B per element kept, host 16 B per element offloaded
  (copy, gradient buffer, two moments); the host copies are separate storage;
* --overlap-cpu-optimizer-d2h-h2d (several buckets, pipelined): bit-identical to the same; its copies
  are issued in pipeline order (bucket k+1's gradients before bucket k's weights) and both paths move
  4 B per offloaded element each way per step (counted on the copies);
* a checkpoint round trip (sharded state dict) into a fresh offloaded optimizer refreshes its host
  copies, so the next step equals the uninterrupted one.
Training runs with offload (DP 2, ZeRO-2: parity and resume) are in tests/test_sharding_strategy_training.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megalm.distributed import finalize_model_grads
from megalm.optimizer.memory_accounting import optimizer_memory
from megalm.parallel_state import get_process_groups
from tests.test_distrib_optimizer import _mlp
from tests.training_runs import offload_optimizer


def _build(dtype, strategy, fraction, overlap=False):
    """The 244-element MLP with ``fraction`` of its update offloaded to the host (None: no offload)."""
    offload = None if fraction is None else "cpu"
    return offload_optimizer(_mlp(dtype), strategy, offload=offload, fraction=fraction or 1.0, overlap=overlap)


def _steps(model, chunk, optimizer, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        if chunk is not model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        F.mse_loss(chunk(x.to(model[0].weight.dtype)).float(), y).backward()
        if chunk is not model:
            finalize_model_grads([chunk], process_groups=get_process_groups())
        ok, _, _ = optimizer.step()
        assert ok
    if chunk is not model:
        chunk.gather_params()  # ZeRO-3: whole weights to read
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "dtype, strategy, fraction, overlap",
    [
        (torch.float32, None, 1.0, False),
        (torch.bfloat16, None, 0.5, False),
        (torch.float32, "optim", 0.5, False),
        (torch.bfloat16, "optim_grads", 0.5, False),
        (torch.float32, "optim_grads_params", 1.0, False),
        (torch.bfloat16, "optim_grads_params", 0.5, False),
        (torch.float32, None, 1.0, True),
        (torch.bfloat16, "optim_grads", 0.5, True),
        (torch.bfloat16, "optim_grads_params", 1.0, True),
    ],
)
def test_offloaded_update_is_bit_identical(dtype, strategy, fraction, overlap):
    ref = _steps(*_build(dtype, strategy, None), 3)
    model, chunk, optimizer = _build(dtype, strategy, fraction, overlap)
    optimizer.offload.transfer.trace = []
    got = _steps(model, chunk, optimizer, 3)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    off = optimizer.offload
    assert off.transfer.bytes_d2h == off.transfer.bytes_h2d == 3 * 4 * off.numel
    if overlap:
        assert len(off.buckets) >= 2
        step = [(d, k) for d, k, _ in off.transfer.trace[: len(off.transfer.trace) // 3]]
        expected = [("d2h", 0)]
        for k in range(len(off.buckets)):
            expected += [("d2h", k + 1)] * (k + 1 < len(off.buckets)) + [("h2d", k)]
        assert [e for i, e in enumerate(step) if i == 0 or e != step[i - 1]] == expected
    for main, host in off.pairs:
        assert host.data_ptr() != main.data_ptr() and torch.equal(host.data, main.data)
        assert optimizer.optimizer.state[host]["exp_avg"].data_ptr() != 0
    # 244 elements; at 0.5 (122): plain: the 8x16 weight (128) alone; distributed: its ranges follow
    # the buffer (reverse) order, so the 16x4 weight (64) then the 8x16 one (128)
    half = 128 if strategy is None else 64 + 128
    assert off.numel == (half if fraction == 0.5 else 244)
    mem = optimizer_memory(optimizer, [chunk])
    assert mem["optimizer_state"] == 8 * (244 - off.numel)
    assert mem["host"] == 16 * off.numel


def _blocks(spec):
    return spec if isinstance(spec, list) else [spec]


def test_checkpoint_round_trip_refreshes_host_copies():
    model, chunk, optimizer = _build(torch.bfloat16, "optim_grads", 1.0)
    _steps(model, chunk, optimizer, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(zip(optimizer.names, optimizer.model_params))
    state = {k: [b.local.clone() for b in _blocks(v)] for k, v in optimizer.sharded_state_dict(params).items()}
    ref = _steps(model, chunk, optimizer, 1, seed=1)

    model2, chunk2, fresh = _build(torch.bfloat16, "optim_grads", 1.0)
    model2.load_state_dict(saved)
    for k, v in fresh.sharded_state_dict(dict(zip(fresh.names, fresh.model_params))).items():
        for block, t in zip(_blocks(v), state[k]):
            block.local.copy_(t)
    fresh.load_sharded_state_dict(fresh.common_state_dict(), main_params_loaded=True)
    got = _steps(model2, chunk2, fresh, 1, seed=1)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_overlapped_offload_of_nothing_is_a_plain_step():
    """A rank that offloads no tensor (fraction 0 here; a distributed-optimizer rank with an empty shard)
    takes one plain step with --overlap-cpu-optimizer-d2h-h2d (it indexed an empty bucket list before)."""
    from megalm.optimizer.cpu_offload import CpuOffload

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    ref = torch.nn.Parameter(w.detach().clone())
    w.grad, ref.grad = torch.ones(4, 3), torch.ones(4, 3)
    offload = CpuOffload([w], 0.0, overlap=True)
    assert offload.pairs == [] and offload.buckets == []
    offload.step(torch.optim.Adam([w], lr=0.1))
    torch.optim.Adam([ref], lr=0.1).step()
    assert torch.equal(w.detach(), ref.detach())
