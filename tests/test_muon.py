"""Muon on one process: the Newton-Schulz iteration and the step against references written here
(Jordan et al.'s quintic iteration, Megatron's scale modes), the fused QKV weight split into its
query, key and value parts as Megatron-LM's default (MHA and GQA, a real megalm attention layer),
``--muon-no-split-qkv`` (the fused matrix whole, as before the split), Megatron's coefficient sets
(``--muon-coefficient-type``) and matmul precision (``--muon-fp32-matmul-prec``: bf16 iterations under
``medium``), its parameter split (linear layers' matrices vs embeddings, output layer, biases and norms
on AdamW) and its flags' checks."""

import math
import re

import pytest
import torch

from megalm.config import ConfigError, parse_config
from megalm.optimizer import build_optimizer, muon
from megalm.optimizer.factory import get_param_groups, muon_param_groups
from megalm.optimizer.muon import MuonError, newton_schulz, split_qkv_rows
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel.param_info import param_info
from megalm.transformer.attention import SelfAttention
from tests.configs import make_config, model_config, optimizer_config

B1, B2, EPS, WD, LR, MU = 0.9, 0.999, 1e-8, 0.1, 1e-2, 0.9


# Megatron-LM's --muon-coefficient-type sets (emerging_optimizers' muon_utils), one per iteration.
COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)] * 5,
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
}


def ns_reference(g, steps, kind="simple"):
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for a, b, c in COEFFICIENTS[kind][:steps]:
        xxt = x @ x.T
        x = a * x + b * (xxt @ x) + c * (xxt @ xxt @ x)
    return x.T if tall else x


@pytest.mark.parametrize("shape, kind", [((16, 6), "simple"), ((6, 16), "quintic"), ((12, 12), "simple")])
def test_newton_schulz_equals_the_reference_and_orthogonalizes(shape, kind):
    torch.manual_seed(0)
    g = torch.randn(*shape, dtype=torch.float64)
    got = newton_schulz(g, 5, coefficient_type=kind)
    torch.testing.assert_close(got.double(), ns_reference(g, 5, kind), rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(got.double())
    assert len(s) == min(shape) and s.min() > 0.6 and s.max() < 1.25  # U V^T up to the quintic's band
    # An odd matrix polynomial of g: g's singular vectors, so U^T NS(g) V is diagonal.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ got.double() @ vh.T
    assert (d - torch.diag(torch.diagonal(d))).abs().max() < 1e-5


# The optimizer of these tests; fp32 Newton-Schulz iterations ("highest"), for the fp64 references.
MUON = dict(optimizer="muon", lr=LR, clip_grad=0.0, weight_decay=WD, adam_beta1=B1, adam_beta2=B2, adam_eps=EPS)
MUON.update(muon_momentum=MU, muon_fp32_matmul_prec="highest")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).double()


SCALES = {
    "spectral": lambda o, i: math.sqrt(max(o, i)),
    "unit_rms_norm": lambda o, i: math.sqrt(o / i),
    "shape_scaling": lambda o, i: math.sqrt(max(1.0, o / i)),
}


def muon_reference(params, grads, state, t, nesterov, mode, extra, kind):
    for i, (w, g) in enumerate(zip(params, grads)):
        if w.ndim == 2:  # Muon
            m = MU * state.get(i, torch.zeros_like(w)) + (1 - MU) * g
            state[i] = m
            d = (1 - MU) * g + MU * m if nesterov else m
            u = ns_reference(d, 5, kind) * SCALES[mode](*w.shape) * extra
            w.mul_(1 - LR * WD)
        else:  # AdamW, no decay on biases and norms
            m, v = state.get(i, (torch.zeros_like(w), torch.zeros_like(w)))
            m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
            state[i] = (m, v)
            u = (m / (1 - B1**t)) / ((v / (1 - B2**t)).sqrt() + EPS)
        w.sub_(LR * u)


@pytest.mark.parametrize(
    "nesterov, mode, extra, kind", [(False, "spectral", 1.0, "quintic"), (True, "unit_rms_norm", 0.2, "simple")]
)
def test_one_process_step_equals_the_reference(nesterov, mode, extra, kind):
    model = mlp()
    ref = [p.detach().clone() for p in model.parameters()]
    cfg = optimizer_config(
        MUON,
        muon_use_nesterov=nesterov,
        muon_scale_mode=mode,
        muon_extra_scale_factor=extra,
        muon_coefficient_type=kind,
    )
    opt = build_optimizer(cfg, [model], report_memory=False, process_groups=get_process_groups())
    state = {}
    torch.manual_seed(1)
    for t in range(1, 4):
        model.zero_grad()
        model(torch.randn(8, 6, dtype=torch.float64)).pow(2).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        assert opt.step()[0]
        muon_reference(ref, grads, state, t, nesterov, mode, extra, kind)
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
        ({"muon_fp32_matmul_prec": "low"}, "--muon-fp32-matmul-prec low is not supported: torch has no 'low'"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(flags, num_layers=2, hidden_size=64, num_attention_heads=4, optimizer="muon")


HEADS, HIDDEN, HEAD_DIM = 4, 16, 4


def attention(groups):
    """One megalm attention layer (4 heads of 4, ``groups`` query groups) in fp64: its fused QKV weight
    has the grouped row layout and the record the split reads."""
    shape = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_dropout=0.0)
    m = model_config(shape, group_query_attention=groups < HEADS, num_query_groups=groups)
    layer = SelfAttention(m, tp_group=get_process_groups().tp, cp_group=get_process_groups().cp).double()
    torch.manual_seed(0)
    with torch.no_grad():  # the layers leave their values to the model's initialization
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return layer


def split_qkv_reference(d, groups, mode):
    """Megatron's split written out: per query group ``g`` the rows ``[q heads of g; k_g; v_g]``; Q, K
    and V each stack their rows of every group in group order, take Newton-Schulz and their own scale,
    and go back to their rows."""
    q_rows, rows = HEADS // groups * HEAD_DIM, (HEADS // groups + 2) * HEAD_DIM
    spans = [(0, q_rows), (q_rows, q_rows + HEAD_DIM), (q_rows + HEAD_DIM, rows)]
    out = torch.empty_like(d)
    for lo, hi in spans:
        part = torch.cat([d[g * rows + lo : g * rows + hi] for g in range(groups)])
        o = ns_reference(part, 5, "quintic") * SCALES[mode](*part.shape)
        for g in range(groups):
            out[g * rows + lo : g * rows + hi] = o[g * (hi - lo) : (g + 1) * (hi - lo)]
    return out


def attention_steps(layer, cfg, steps=3):
    """``steps`` Muon steps on ``layer`` from fixed inputs: ``[(grads, params after)]``."""
    opt = build_optimizer(cfg, [layer], report_memory=False, process_groups=get_process_groups())
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        layer.zero_grad()
        layer(torch.randn(6, 2, HIDDEN, dtype=torch.float64)).pow(2).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
        assert opt.step()[0]
        out.append((grads, {n: p.detach().clone() for n, p in layer.named_parameters()}))
    return out


@pytest.mark.parametrize("groups, mode", [(4, "spectral"), (2, "unit_rms_norm"), (1, "shape_scaling")])
def test_split_qkv_step_equals_the_reference(groups, mode):
    """Multi-head (4 groups) and grouped-query attention (2 and 1 groups): 3 steps of Muon with the QKV
    split (the default) equal the reference within 1e-6, and differ from orthogonalizing QKV whole."""
    layer = attention(groups)
    qkv = layer.linear_qkv.weight
    assert param_info(qkv).qkv_split_shapes == (HEADS // groups * HEAD_DIM, HEAD_DIM, HEAD_DIM)
    w = qkv.detach().clone()
    m = torch.zeros_like(w)
    cfg = optimizer_config(MUON, muon_scale_mode=mode)
    for grads, after in attention_steps(layer, cfg):
        m = MU * m + (1 - MU) * grads["linear_qkv.weight"]
        whole = w * (1 - LR * WD) - LR * ns_reference(m, 5, "quintic") * SCALES[mode](*m.shape)
        w = w * (1 - LR * WD) - LR * split_qkv_reference(m, groups, mode)
        torch.testing.assert_close(after["linear_qkv.weight"], w, rtol=1e-6, atol=1e-7)
        assert (after["linear_qkv.weight"] - whole).abs().max() > 1e-4  # the split changes the update


def test_no_split_flag_orthogonalizes_the_fused_matrix_whole_as_before():
    """``--muon-no-split-qkv``: the fused QKV weight's update is bit for bit the whole-matrix one (the
    code before the split: ``NS(D).to(dtype) * scale``), and equals the reference within 1e-6."""
    layer = attention(2)
    w = layer.linear_qkv.weight.detach().clone()
    cfg = optimizer_config(
        MUON, muon_split_qkv=False, muon_coefficient_type="simple"
    )  # megalm's settings before the flags
    [(grads, after)] = attention_steps(layer, cfg, steps=1)
    d = torch.zeros_like(w).lerp_(grads["linear_qkv.weight"], 1 - MU)
    old = w.clone().mul_(1 - LR * WD).add_(newton_schulz(d, 5).to(d.dtype) * math.sqrt(max(d.shape)), alpha=-LR)
    assert torch.equal(after["linear_qkv.weight"], old)
    ref = w * (1 - LR * WD) - LR * ns_reference(d, 5) * math.sqrt(max(d.shape))
    torch.testing.assert_close(after["linear_qkv.weight"], ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_newton_schulz_runs_at_the_flag_precision_and_restores_it(precision, monkeypatch):
    """Megatron's semantics: torch's float32 matmul precision set for the pass (restored after it), and
    under medium the iterations in bf16."""
    seen = []

    def recording(d, steps, **kw):
        seen.append((torch.get_float32_matmul_precision(), kw["dtype"], kw["coefficient_type"]))
        return newton_schulz(d, steps, **kw)

    monkeypatch.setattr(muon, "newton_schulz", recording)
    before = torch.get_float32_matmul_precision()
    attention_steps(attention(2), optimizer_config(MUON, muon_fp32_matmul_prec=precision), steps=1)
    dtype = torch.bfloat16 if precision == "medium" else torch.float32
    assert seen == [(precision, dtype, "quintic")] * 4  # Q, K, V of linear_qkv, then linear_proj
    assert torch.get_float32_matmul_precision() == before


def test_bf16_iterations_stay_within_bf16_of_the_reference():
    torch.manual_seed(0)
    g = torch.randn(24, 40)
    fp32 = newton_schulz(g, 5, coefficient_type="quintic")
    bf16 = newton_schulz(g, 5, coefficient_type="quintic", dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32
    ref = ns_reference(g, 5, "quintic")
    assert (fp32.double() - ref).abs().max() < 1e-5
    assert 1e-4 < (bf16.double() - ref).abs().max() < 0.05  # bf16's rounding (8 bits), and no more


def test_megatron_spellings_of_the_muon_flags():
    def training(*argv):
        base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--optimizer", "muon"]
        return parse_config(base + list(argv)).training

    t = training()
    # Megatron-LM's defaults, except the precision: megalm's fp32 keeps every layout at one process's numbers
    assert (t.muon_split_qkv, t.muon_fp32_matmul_prec, t.muon_coefficient_type) == (True, "highest", "quintic")
    assert t.muon_use_nesterov is False
    assert training("--muon-no-split-qkv").muon_split_qkv is False
    assert training("--muon-nesterov").muon_use_nesterov is True  # Megatron-LM 0.19's spelling
    assert training("--muon-use-nesterov").muon_use_nesterov is True  # the older one
    assert training("--muon-fp32-matmul-prec", "high").muon_fp32_matmul_prec == "high"
    assert training("--muon-fp32-matmul-prec", "medium").muon_fp32_matmul_prec == "medium"
    assert training("--muon-coefficient-type", "simple", "--muon-num-ns-steps", "3").muon_num_ns_steps == 3
    with pytest.raises(ConfigError, match="--muon-coefficient-type quintic needs --muon-num-ns-steps a multiple of 5"):
        training("--muon-num-ns-steps", "3")
    with pytest.raises(ConfigError, match="--muon-coefficient-type polar_express needs --muon-num-ns-steps >= 8"):
        training("--muon-coefficient-type", "polar_express")


def test_split_rows_refuses_a_matrix_of_partial_groups():
    with pytest.raises(MuonError, match=r"a fused QKV matrix of 10 rows is not whole groups of 4 rows"):
        split_qkv_rows(torch.zeros(10, 3), (2, 1, 1))
