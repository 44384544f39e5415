"""The one checkpoint protocol of both optimizers (single process, no communication).

* ``sharded_state_dict`` of the plain and the distributed optimizer after the same training
  describe the same keys and global shapes, and their blocks assemble to the same full tensors
  (fp32: no ``main_param``; bf16: with it);
* a parameter left out of ``params`` (a tied copy) has no entry;
* ``load_sharded_state_dict(common, main_params_loaded)``: True keeps the loaded fp32 main
  weights, False rebuilds them from the model weights; the loss scaler comes from ``common``;
* optimizer_sharded_state uses only the protocol (no duck typing);
* misuse raises megalm errors (whole-tensor state of the distributed optimizer, chunks without DDP).
"""

import pytest
import torch
import torch.nn.functional as F

from megalm.checkpoint.model_state import model_sharded_state, optimizer_sharded_state
from megalm.config import ParallelConfig
from megalm.distributed import DistributedDataParallel
from megalm.errors import MegalmError
from megalm.optimizer import DistributedOptimizer, MixedPrecisionOptimizer, OptimizerError, build_optimizer
from megalm.optimizer.factory import get_param_groups, make_torch_optimizer
from megalm.optimizer.grad_scaler import ConstantGradScaler
from megalm.parallel_state import get_process_groups
from tests.configs import optimizer_config


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(dtype)


def _build(dtype, distributed, bucket_size=50):
    model = _mlp(dtype)
    ddp = DistributedDataParallel(
        model,
        ParallelConfig(use_distributed_optimizer=distributed, ddp_bucket_size=bucket_size),
        process_groups=get_process_groups(),
    )
    adam = dict(optimizer="adam", lr=1e-2, clip_grad=1.0)
    cfg = optimizer_config(adam, bf16=dtype == torch.bfloat16, use_distributed_optimizer=distributed)
    return model, ddp, build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups())


def _train(model, ddp, opt, steps=2):
    g = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 3, generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        F.mse_loss(ddp(x).float(), y).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
    ddp.finish_param_sync()


def _assemble(specs):
    """Full tensors from blocks (every element covered exactly once, else the test fails)."""
    out = {}
    for key, value in specs.items():
        blocks = value if isinstance(value, list) else [value]
        full = torch.full(tuple(blocks[0].global_shape), float("nan"), dtype=torch.float64)
        for b in blocks:
            assert tuple(b.global_shape) == tuple(full.shape), key
            where = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.local.shape))
            assert torch.isnan(full[where]).all(), f"{key}: overlapping blocks"
            full[where] = b.local.double()
        assert not torch.isnan(full).any(), f"{key}: uncovered elements"
        out[key] = full
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_distributed_describe_the_same_tensors(dtype):
    states = {}
    for distributed in (False, True):
        model, ddp, opt = _build(dtype, distributed)
        assert isinstance(opt, DistributedOptimizer) == distributed
        _train(model, ddp, opt)
        params = dict(model.named_parameters())
        specs = opt.sharded_state_dict(params)
        if distributed:  # a bucket boundary splits parameters into ranges: lists of blocks
            assert any(isinstance(v, list) for v in specs.values())
        states[distributed] = _assemble(specs)
    plain, dist = states[False], states[True]
    keys = {f"optimizer.{n}.{k}" for n, _ in _mlp(dtype).named_parameters() for k in ("exp_avg", "exp_avg_sq", "step")}
    if dtype != torch.float32:
        keys |= {f"optimizer.{n}.main_param" for n, _ in _mlp(dtype).named_parameters()}
    assert set(plain) == set(dist) == keys
    for key in keys:
        assert plain[key].shape == dist[key].shape
        torch.testing.assert_close(dist[key], plain[key], rtol=1e-6, atol=1e-9)
    assert plain["optimizer.0.weight.step"].item() == 2.0


@pytest.mark.parametrize("distributed", [False, True])
def test_params_left_out_have_no_state_entries(distributed):
    model, ddp, opt = _build(torch.float32, distributed)
    params = {n: p for n, p in model.named_parameters() if n != "2.weight"}
    specs = opt.sharded_state_dict(params)
    assert not [k for k in specs if k.startswith("optimizer.2.weight.")]
    assert "optimizer.2.bias.exp_avg" in specs
    assert set(optimizer_sharded_state(opt, [ddp])) == set(opt.sharded_state_dict(dict(model.named_parameters())))


@pytest.mark.parametrize("distributed", [False, True])
def test_load_sharded_state_dict_main_params_loaded_is_explicit(distributed):
    model, ddp, opt = _build(torch.bfloat16, distributed)
    assert isinstance(opt, DistributedOptimizer if distributed else MixedPrecisionOptimizer)
    opt.grad_scaler = ConstantGradScaler(8.0)
    specs = opt.sharded_state_dict(dict(model.named_parameters()))
    mains = [v for k, v in specs.items() if k.endswith(".main_param")]
    blocks = [b for v in mains for b in (v if isinstance(v, list) else [v])]
    for b in blocks:  # what a checkpoint load writes in place: values the bf16 model cannot hold
        b.local.fill_(0.123456789)
    opt.load_sharded_state_dict({"grad_scaler": {"scale": 32.0}}, main_params_loaded=True)
    assert opt.get_loss_scale() == 32.0
    assert all((b.local == 0.123456789).all() for b in blocks)  # kept
    opt.load_sharded_state_dict({}, main_params_loaded=False)
    assert opt.get_loss_scale() == 32.0
    model_values = _assemble(model_sharded_state([ddp]))
    main_values = _assemble({k: v for k, v in specs.items() if k.endswith(".main_param")})
    for key, value in main_values.items():  # rebuilt from the model weights
        name = key[len("optimizer.") : -len(".main_param")]
        assert torch.equal(value, model_values[f"model.{name}"]), key


def test_misuse_raises_megalm_errors():
    model, ddp, opt = _build(torch.float32, True)
    for whole_tensor_call in (opt.state_dict, opt.sharded_param_state, lambda: opt.load_state_dict({})):
        with pytest.raises(MegalmError, match="ranges of parameters"):
            whole_tensor_call()
    groups = get_param_groups(list(model.named_parameters()), 0.0)
    torch_optimizer = make_torch_optimizer(optimizer_config().training)  # the default optimizer
    with pytest.raises(OptimizerError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(groups, torch_optimizer, [model], process_groups=get_process_groups())


def test_checkpoint_of_another_optimizer_is_refused():
    """AdamW's and Lamb's states share names: the optimizer's class is recorded and checked on load."""
    model, ddp, opt = _build(torch.float32, distributed=False)
    common = opt.common_state_dict()
    assert common["optimizer"] == "AdamW"
    opt.load_sharded_state_dict(common, main_params_loaded=True)  # the same optimizer loads
    with pytest.raises(OptimizerError, match="is Lamb.s but this run uses AdamW: load it with --no-load-optim"):
        opt.load_sharded_state_dict(dict(common, optimizer="Lamb"), main_params_loaded=True)
