"""LAMB, LARS and Lion on one process against references written here from the papers' formulas,
through megalm's optimizer wrapper (parameter groups: biases and norm weights left out of the trust
ratio), and their flags' checks."""

import math
import re

import pytest
import torch

from megalm.config import ConfigError
from megalm.optimizer import build_optimizer
from megalm.optimizer.lamb import Lamb
from megalm.parallel_state import get_process_groups
from tests.configs import make_config, optimizer_config

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.1, 1e-2


# The settings every optimizer here runs with (the tests add the optimizer and its own flags).
BASE = dict(lr=LR, clip_grad=0.0, weight_decay=WD, adam_beta1=B1, adam_beta2=B2, adam_eps=EPS)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).double()


def excluded(p):  # the papers' exclusion list: biases and norm weights (1-D here)
    return p.ndim < 2


def norm(t):
    return math.sqrt(float((t.detach() * t.detach()).sum()))


def lamb_reference(params, grads, state, t):
    for i, (w, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(w), torch.zeros_like(w)))
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        state[i] = (m, v)
        wd = 0.0 if excluded(w) else WD
        u = (m / (1 - B1**t)) / ((v / (1 - B2**t)).sqrt() + EPS) + wd * w
        wn, un = norm(w), norm(u)
        r = 1.0 if excluded(w) or wn == 0 or un == 0 else min(wn / un, 10.0)
        w -= LR * r * u


def lars_reference(params, grads, state, t, eta=0.02, mu=0.9):
    for i, (w, g) in enumerate(zip(params, grads)):
        wd = 0.0 if excluded(w) else WD
        wn, gn = norm(w), norm(g)
        local = 1.0 if excluded(w) or wn == 0 or gn == 0 else eta * wn / (gn + wd * wn)
        buf = mu * state.get(i, torch.zeros_like(w)) + local * (g + wd * w)
        state[i] = buf
        w -= LR * buf


def lion_reference(params, grads, state, t, b1=0.8, b2=0.95):
    for i, (w, g) in enumerate(zip(params, grads)):
        m = state.get(i, torch.zeros_like(w))
        c = b1 * m + (1 - b1) * g
        wd = 0.0 if excluded(w) else WD
        w -= LR * (torch.sign(c) + wd * w)
        state[i] = b2 * m + (1 - b2) * g


CASES = {
    "lamb": (lamb_reference, {}),
    "lars": (lars_reference, {"lars_trust_coefficient": 0.02, "sgd_momentum": 0.9}),
    "lion": (lion_reference, {"lion_beta1": 0.8, "lion_beta2": 0.95}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_process_step_equals_the_papers_formula(name):
    reference, flags = CASES[name]
    model = mlp()
    ref = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(
        optimizer_config(BASE, flags, optimizer=name), [model], report_memory=False, process_groups=get_process_groups()
    )
    state = {}
    torch.manual_seed(1)
    for t in range(1, 5):
        x = torch.randn(8, 6, dtype=torch.float64)
        model.zero_grad()
        model(x).pow(2).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        ok, _, _ = opt.step()
        assert ok
        reference(ref, grads, state, t)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-9)
    moved = [norm(p.detach() - q) for p, q in zip(mlp().parameters(), model.parameters())]
    assert min(moved) > 1e-4  # every tensor moved


def test_lamb_trust_ratio_is_clamped_and_one_for_zero_weights():
    w = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    big = torch.nn.Parameter(torch.full((4, 4), 1e3, dtype=torch.float64))
    opt = Lamb([w, big], lr=0.1, betas=(B1, B2), eps=EPS)
    w.grad = torch.ones_like(w)
    big.grad = torch.ones_like(big)
    opt.step()
    # Adam's first direction is g / (|g| + eps) ~ 1: the zero weight moves by lr (ratio 1), the big one
    # by lr x 10 (||w|| / ||u|| = 1000, clamped at 10).
    torch.testing.assert_close(w.detach(), torch.full_like(w, -0.1), rtol=1e-6, atol=0)
    torch.testing.assert_close(big.detach(), torch.full_like(big, 1e3 - 1.0), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"optimizer": "lars", "lars_trust_coefficient": 0.0}, "--lars-trust-coefficient must be > 0"),
        ({"optimizer": "lion", "lion_beta2": 1.0}, "--lion-beta2 must be in [0, 1)"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(flags, num_layers=2, hidden_size=64, num_attention_heads=4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_keeps_fp32_main_weights_and_fp16_overflow_skips(name):
    _, flags = CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).bfloat16()
    opt = build_optimizer(
        optimizer_config(BASE, flags, optimizer=name, bf16=True),
        [model],
        report_memory=False,
        process_groups=get_process_groups(),
    )
    model(torch.randn(8, 6, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    assert opt.step()[0]
    for p, main in zip(opt.model_params, opt.main_params):
        assert main.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(p.detach(), main.detach().bfloat16(), rtol=0, atol=0)
    # fp16 with a constant loss scale: an inf gradient skips the step and leaves weights and state alone.
    model = mlp().half()
    opt = build_optimizer(
        optimizer_config(BASE, flags, optimizer=name, fp16=True, loss_scale=8.0),
        [model],
        report_memory=False,
        process_groups=get_process_groups(),
    )
    opt.init_state()
    before = [t.clone() for m in opt.main_params for t in opt.optimizer.state[m].values()]
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    assert opt.step() == (False, None, None)
    after = [t for m in opt.main_params for t in opt.optimizer.state[m].values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before)) and len(after) > 0
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))


def test_a_sharding_wrapper_must_describe_its_shards():
    from megalm.optimizer import FP32Optimizer, OptimizerError
    from megalm.optimizer.factory import get_param_groups, make_torch_optimizer

    class Sharded(FP32Optimizer):  # a future wrapper (e.g. FSDP) that forgot the layout hooks
        grads_sharded = True

    model = mlp()
    groups = get_param_groups(list(model.named_parameters()), WD)
    with pytest.raises(OptimizerError, match="does not say how"):
        Sharded(
            groups,
            make_torch_optimizer(optimizer_config(BASE, optimizer="lamb").training),
            process_groups=get_process_groups(),
        )
    # AdamW needs no layout
    Sharded(
        groups,
        make_torch_optimizer(optimizer_config(BASE, optimizer="adam").training),
        process_groups=get_process_groups(),
    )
