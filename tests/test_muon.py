"""Muon on one process: the Newton-Schulz iteration and the step against references written here
(Jordan et al.'s quintic iteration, Megatron's scale modes), its parameter split (linear layers'
matrices vs embeddings, output layer, biases and norms on AdamW) and its flags' checks."""

import math
import re

import pytest
import torch

from megalm.config import ConfigError, MegalmConfig, validate_config
from megalm.optimizer import build_optimizer
from megalm.optimizer.factory import get_param_groups, muon_param_groups
from megalm.optimizer.muon import newton_schulz

B1, B2, EPS, WD, LR, MU = 0.9, 0.999, 1e-8, 0.1, 1e-2, 0.9


def ns_reference(g, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        xxt = x @ x.T
        x = a * x + b * (xxt @ x) + c * (xxt @ xxt @ x)
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 6), (6, 16), (12, 12)])
def test_newton_schulz_equals_the_reference_and_orthogonalizes(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape, dtype=torch.float64)
    got = newton_schulz(g, 5)
    torch.testing.assert_close(got.double(), ns_reference(g, 5), rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(got.double())
    assert len(s) == min(shape) and s.min() > 0.6 and s.max() < 1.25  # U V^T up to the quintic's band
    # An odd matrix polynomial of g: g's singular vectors, so U^T NS(g) V is diagonal.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ got.double() @ vh.T
    assert (d - torch.diag(torch.diagonal(d))).abs().max() < 1e-5


def make_cfg(**training):
    cfg = MegalmConfig()
    t = cfg.training
    t.optimizer, t.lr, t.clip_grad, t.weight_decay = "muon", LR, 0.0, WD
    t.adam_beta1, t.adam_beta2, t.adam_eps, t.muon_momentum = B1, B2, EPS, MU
    for k, v in training.items():
        setattr(t, k, v)
    return cfg


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).double()


SCALES = {
    "spectral": lambda o, i: math.sqrt(max(o, i)),
    "unit_rms_norm": lambda o, i: math.sqrt(o / i),
    "shape_scaling": lambda o, i: math.sqrt(max(1.0, o / i)),
}


def muon_reference(params, grads, state, t, nesterov, mode, extra):
    for i, (w, g) in enumerate(zip(params, grads)):
        if w.ndim == 2:  # Muon
            m = MU * state.get(i, torch.zeros_like(w)) + (1 - MU) * g
            state[i] = m
            d = (1 - MU) * g + MU * m if nesterov else m
            u = ns_reference(d, 5) * SCALES[mode](*w.shape) * extra
            w.mul_(1 - LR * WD)
        else:  # AdamW, no decay on biases and norms
            m, v = state.get(i, (torch.zeros_like(w), torch.zeros_like(w)))
            m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
            state[i] = (m, v)
            u = (m / (1 - B1**t)) / ((v / (1 - B2**t)).sqrt() + EPS)
        w.sub_(LR * u)


@pytest.mark.parametrize("nesterov, mode, extra", [(False, "spectral", 1.0), (True, "unit_rms_norm", 0.2)])
def test_one_process_step_equals_the_reference(nesterov, mode, extra):
    model = mlp()
    ref = [p.detach().clone() for p in model.parameters()]
    cfg = make_cfg(muon_use_nesterov=nesterov, muon_scale_mode=mode, muon_extra_scale_factor=extra)
    opt = build_optimizer(cfg, [model], report_memory=False)
    state = {}
    torch.manual_seed(1)
    for t in range(1, 4):
        model.zero_grad()
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        assert opt.step()[0]
        muon_reference(ref, grads, state, t, nesterov, mode, extra)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


def test_embeddings_output_layer_biases_and_norms_go_to_adam():
    shapes = {
        "embedding.word_embeddings.weight": (10, 4),
        "embedding.position_embeddings.weight": (8, 4),
        "decoder.layers.0.mlp.linear_fc1.weight": (8, 4),
        "decoder.layers.0.mlp.linear_fc1.bias": (8,),
        "decoder.final_layernorm.weight": (4,),
        "output_layer.weight": (10, 4),
    }
    named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]
    groups = muon_param_groups(get_param_groups(named, 0.1))
    assert [(g["name"], g["muon"], g["weight_decay"], g["names"]) for g in groups] == [
        ("muon", True, 0.1, ["decoder.layers.0.mlp.linear_fc1.weight"]),
        (
            "decay",
            False,
            0.1,
            ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight"],
        ),
        ("no_decay", False, 0.0, ["decoder.layers.0.mlp.linear_fc1.bias", "decoder.final_layernorm.weight"]),
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"muon_tp_mode": "distributed"}, "--muon-tp-mode distributed is not built"),
        ({"muon_num_ns_steps": 0}, "--muon-num-ns-steps must be >= 1"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    cfg = MegalmConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2, 64, 4
    cfg.training.optimizer = "muon"
    for k, v in flags.items():
        setattr(cfg.training, k, v)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg)
