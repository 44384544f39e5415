"""Loss scalers, mixed-precision optimizer step, model-parallel gradient clipping, state dicts."""

import copy

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import DistributedDataParallel
from megalm.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    FP32Optimizer,
    MixedPrecisionOptimizer,
    build_optimizer,
    get_param_groups,
)
from megalm.parallel_state import get_process_groups
from tests.configs import make_config, optimizer_config
from tests.distributed_harness import run_distributed

# The optimizer settings of these tests (the callers change some).
ADAM = dict(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.1, sgd_momentum=0.0)


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(dtype)


# --- loss scalers ---------------------------------------------------------------------------------


def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    s = DynamicGradScaler(initial_scale=1024.0, min_scale=64.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # first overflow only uses up hysteresis
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0  # hysteresis exhausted: every further overflow halves
    s.update(False), s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 512.0  # grows after 3 clean steps in a row, hysteresis restored
    s.update(False), s.update(True), s.update(False), s.update(False)
    assert s.scale == 512.0  # the overflow reset the growth tracker
    s.update(True)
    assert s.scale == 256.0  # second overflow since the growth
    restored = DynamicGradScaler(initial_scale=64.0, min_scale=64.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(copy.deepcopy(s.state_dict()))
    for _ in range(5):
        s.update(True), restored.update(True)
        assert s.scale == restored.scale
    assert s.scale == 64.0  # floored at min_scale
    c = ConstantGradScaler(8.0)
    c.update(True)
    assert c.scale == 8.0


def test_fp16_injected_inf_skips_step_and_updates_scale():
    model = mlp(torch.float16)
    ddp = DistributedDataParallel(model, ParallelConfig(), process_groups=get_process_groups())
    opt = build_optimizer(
        optimizer_config(
            ADAM,
            optimizer="sgd",
            lr=0.1,
            clip_grad=0.0,
            weight_decay=0.0,
            fp16=True,
            initial_loss_scale=256.0,
            loss_scale_window=2,
            hysteresis=2,
        ),
        [ddp],
        process_groups=get_process_groups(),
    )
    assert isinstance(opt, MixedPrecisionOptimizer) and opt.get_loss_scale() == 256.0
    x, y = torch.randn(4, 6).half(), torch.randn(4, 3).half()

    def step(inject_inf):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = F.mse_loss(ddp(x).float(), y.float())
        opt.scale_loss(loss * (float("inf") if inject_inf else 1.0)).backward()
        return opt.step()

    before = [p.detach().clone() for p in model.parameters()]
    assert step(True) == (False, None, None) and opt.get_loss_scale() == 256.0
    assert step(True) == (False, None, None) and opt.get_loss_scale() == 128.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # skipped: untouched
    main_of = dict(zip(opt.names, opt.main_params))  # optimizer order is by param group
    mains = [main_of[n] for n, _ in model.named_parameters()]
    main_before = [m.detach().clone() for m in mains]
    ok, norm, _ = step(False)
    assert ok and norm > 0 and opt.get_loss_scale() == 128.0
    # the update used the unscaled gradient: main -= lr * grad, model = fp16(main)
    ref = mlp(torch.float32)
    for p, q in zip(ref.parameters(), before):
        p.data.copy_(q.float())
    F.mse_loss(ref(x.float()), y.float()).backward()
    for m, m0, p in zip(mains, main_before, ref.parameters()):
        torch.testing.assert_close(m0 - m, 0.1 * p.grad, rtol=2e-2, atol=1e-4)  # fp16 forward/backward
    for m, p in zip(mains, model.parameters()):
        assert torch.equal(p, m.half())
    assert step(False)[0] and opt.get_loss_scale() == 256.0  # two clean steps: grows


def test_clipping_matches_torch_and_weight_decay_groups():
    model, ref = mlp(), mlp()
    opt = build_optimizer(
        optimizer_config(ADAM, optimizer="sgd", lr=1.0, clip_grad=0.05, weight_decay=0.0),
        [model],
        process_groups=get_process_groups(),
    )
    assert isinstance(opt, FP32Optimizer)
    opt.log_num_zeros_in_grad = True
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for m in (model, ref):
        F.mse_loss(m(x), y).backward()
    model[0].weight.grad[0, :3] = 0.0
    ref[0].weight.grad[0, :3] = 0.0
    ok, norm, zeros = opt.step()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    assert ok and norm == pytest.approx(ref_norm, rel=1e-6) and ref_norm > 0.05 and zeros == 3
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    groups = get_param_groups(list(model.named_parameters()), 0.1)
    assert [(g["name"], g["weight_decay"], g["names"]) for g in groups] == [
        ("decay", 0.1, ["0.weight", "2.weight"]),
        ("no_decay", 0.0, ["0.bias", "1.weight", "1.bias", "2.bias"]),
    ]


# --- state dict ----------------------------------------------------------------------------------


def _train(model, ddp, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 3, generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(ddp(x).float(), y)).backward()
        assert opt.step()[0]
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype,fp16", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])
def test_state_dict_round_trip_continues_identically(dtype, fp16):
    def build(state=None):
        model = mlp(dtype)
        if state is not None:
            model.load_state_dict(state)
        ddp = DistributedDataParallel(model, ParallelConfig(), process_groups=get_process_groups())
        return (
            model,
            ddp,
            build_optimizer(
                optimizer_config(
                    ADAM, bf16=dtype == torch.bfloat16, fp16=fp16, initial_loss_scale=2.0**12, loss_scale_window=2
                ),
                [ddp],
                process_groups=get_process_groups(),
            ),
        )

    model, ddp, opt = build()
    _train(model, ddp, opt, 3, seed=1)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_sharded = copy.deepcopy(opt.sharded_param_state())
    saved_common = copy.deepcopy(opt.common_state_dict())
    assert set(saved_opt["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    assert set(saved_opt["optimizer"]["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert bool(saved_opt["main_params"]) == (dtype != torch.float32)
    expected = _train(model, ddp, opt, 3, seed=2)

    model2, ddp2, opt2 = build(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.get_loss_scale() == (saved_opt["grad_scaler"] or {"scale": 1.0})["scale"]
    for a, b in zip(_train(model2, ddp2, opt2, 3, seed=2), expected):
        assert torch.equal(a, b)

    # the in-place protocol used by megalm.checkpoint (DCP loads into sharded_param_state()'s tensors)
    model3, ddp3, opt3 = build(saved_model)
    live = opt3.sharded_param_state()
    for name, tensors in saved_sharded.items():
        for key, tensor in tensors.items():
            live[name][key].copy_(tensor)
    opt3.load_sharded_state_dict(saved_common, main_params_loaded=True)  # keeps the restored fp32 main params
    for a, b in zip(_train(model3, ddp3, opt3, 3, seed=2), expected):
        assert torch.equal(a, b)


# --- model-parallel clipping (real ranks) ------------------------------------------------------------


def reference_grads():
    g = torch.Generator().manual_seed(7)
    return {
        k: torch.randn(*shape, generator=g)
        for k, shape in {"W": (8, 4), "n": (4,), "E": (10, 4), "A": (4, 4), "B": (4, 4)}.items()
    }


def _sgd_opt(params_by_name, scaler=None, clip=0.5):
    groups = [
        {"name": "all", "params": list(params_by_name.values()), "names": list(params_by_name), "weight_decay": 0.0}
    ]
    return FP32Optimizer(
        groups,
        lambda gs: torch.optim.SGD(gs, lr=1.0),
        clip_grad=clip,
        grad_scaler=scaler,
        process_groups=get_process_groups(),
    )


def clip_worker():
    import torch.distributed as dist

    rank, G, out = dist.get_rank(), reference_grads(), {}
    # TP 2: W is column-parallel (rows split), n is replicated (e.g. a norm weight).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    W = torch.nn.Parameter(torch.zeros(4, 4))
    W.tensor_model_parallel, W.partition_dim, W.partition_stride = True, 0, 1
    n = torch.nn.Parameter(torch.zeros(4))
    n.tensor_model_parallel = False
    opt = _sgd_opt({"W": W, "n": n})
    W.grad, n.grad = G["W"][4 * rank : 4 * rank + 4].clone(), G["n"].clone()
    ok, norm, _ = opt.step()
    out["tp"] = (ok, norm, (-W.detach()).numpy().copy(), (-n.detach()).numpy().copy())
    # an overflow on one TP rank makes both skip (MAX over the model-parallel group)
    opt = _sgd_opt({"W": W, "n": n}, scaler=DynamicGradScaler(4.0, 1.0, hysteresis=1))
    W.grad, n.grad = torch.ones(4, 4), torch.ones(4)
    if rank == 1:
        W.grad[0, 0] = float("inf")
    out["tp_inf"] = (opt.step(), opt.get_loss_scale())
    opt = _sgd_opt({"W": W, "n": n})
    W.grad, n.grad = torch.ones(4, 4), torch.ones(4)
    if rank == 1:
        W.grad[0, 0] = float("nan")
    out["tp_nan"] = opt.step()[0]

    # PP 2 with a tied embedding: the last stage's copy is not counted again.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    E = torch.nn.Parameter(torch.zeros(10, 4))
    E.shared_embedding = True  # Megatron marks both copies; only the first stage's counts
    L = torch.nn.Parameter(torch.zeros(4, 4))
    opt = _sgd_opt({"E": E, "L": L})
    E.grad, L.grad = G["E"].clone(), G["A" if rank == 0 else "B"].clone()
    out["pp"] = opt.step()[:2]
    return out


def test_clipping_counts_tp_replicas_and_tied_embedding_once():
    G = reference_grads()
    ranks = run_distributed(clip_worker, 2, timeout=90)
    W, n = G["W"].clone().requires_grad_(), G["n"].clone().requires_grad_()
    W.grad, n.grad = G["W"].clone(), G["n"].clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([W, n], 0.5).item()
    assert ref_norm > 0.5
    for rank, r in enumerate(ranks):
        ok, norm, w_update, n_update = r["tp"]
        assert ok and norm == pytest.approx(ref_norm, rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(w_update), W.grad[4 * rank : 4 * rank + 4], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.from_numpy(n_update), n.grad, rtol=1e-6, atol=1e-7)
        assert r["tp_inf"] == ((False, None, None), 2.0) and r["tp_nan"] is False
        pp_ref = torch.cat([G["E"].flatten(), G["A"].flatten(), G["B"].flatten()]).norm().item()
        assert r["pp"][0] and r["pp"][1] == pytest.approx(pp_ref, rel=1e-6)


def test_decoupled_lr_moves_embedding_and_output_layer_by_their_own_schedule():
    """--decoupled-lr: the word embedding and the (untied) output layer step with the decoupled
    schedule (peak --decoupled-lr, end --decoupled-min-lr), everything else with --lr."""
    from megalm.models import GPTModel
    from megalm.training.lr_scheduler import OptimizerParamScheduler
    from tests.test_gpt_model import MODEL, make_batch

    cfg = copy.deepcopy(make_config(MODEL, position_embedding_type="rope", untie_embeddings_and_output_weights=True))
    t = cfg.training  # an editable copy of the validated config
    t.optimizer, t.lr, t.min_lr, t.weight_decay, t.clip_grad, t.sgd_momentum = "sgd", 0.1, 0.01, 0.0, 0.0, 0.0
    t.decoupled_lr, t.decoupled_min_lr = 0.5, 0.05
    t.train_iters, t.global_batch_size, t.lr_decay_style = 10, 1, "linear"
    model = GPTModel(cfg, process_groups=get_process_groups())
    opt = build_optimizer(cfg, [model], report_memory=False, process_groups=get_process_groups())
    sched = OptimizerParamScheduler.from_config(cfg, opt)
    decoupled = {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert [(g["name"], g["max_lr"], g["min_lr"]) for g in opt.param_groups if "max_lr" in g] == [
        ("decoupled_lr", 0.5, 0.05)
    ]
    tokens, positions, labels, _ = make_batch(0)
    for step in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model(tokens, positions, labels=labels).float().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        lrs = (0.5 - (0.5 - 0.05) * step / 10, 0.1 - (0.1 - 0.01) * step / 10)  # linear decay, no warm-up
        assert opt.step()[0]
        for n, p in model.named_parameters():
            lr = lrs[0] if n in decoupled else lrs[1]
            torch.testing.assert_close(p.detach(), before[n] - lr * grads[n], rtol=1e-6, atol=1e-7)
        sched.step(1)
