"""Every fusion against its eager reference (forward and backward) and the backend plan (which
pieces compile, optional packages, clear errors).  The fused output layer + cross entropy is
tested in tests/test_linear_cross_entropy.py and tests/test_tensor_parallel.py."""

import os

import pytest
import torch

from megalm.fusions import EAGER, BackendUnavailable, backends, compile_stats, plan_fusions
from megalm.fusions.activations import bias_gelu, bias_squared_relu, bias_swiglu
from megalm.fusions.dropout_add import bias_dropout_add
from megalm.fusions.norms import layer_norm, rms_norm
from megalm.fusions.rope import rotary_qk
from megalm.fusions.softmax import scaled_causal_softmax
from megalm.parallel_state import get_process_groups
from megalm.transformer.rope import RotaryEmbedding
from tests.configs import model_config
from tests.logs import megalm_logs
from tests.numerics import relative_error

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def compile_on():
    """The suite runs with TORCHDYNAMO_DISABLE=1 (tests/conftest.py); these tests compile."""
    import torch._dynamo

    saved_env, saved_flag = os.environ.get("TORCHDYNAMO_DISABLE"), torch._dynamo.config.disable
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    torch._dynamo.config.disable = False
    yield
    torch._dynamo.config.disable = saved_flag
    if saved_env is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = saved_env


def _leaves(*tensors, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        if isinstance(t, tuple):  # a shape: a random leaf
            out.append((torch.randn(t, generator=g)).to(dtype).requires_grad_())
        else:
            out.append(t)
    return out


def _check(fusion, args, dtype, tol=None, float_args=None):
    """Compiled ``fusion(*args)`` equals ``fusion.eager(*args)`` in outputs and input gradients."""
    tol = tol or TOL[dtype]
    results = []
    for fn in (fusion, fusion.eager):
        inputs = [
            a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args
        ]
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(7)
        sum(o.float().mul(torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
        grads = [a.grad for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        results.append((outs, grads))
    (fused_out, fused_grads), (ref_out, ref_grads) = results
    for a, b in zip(fused_out, ref_out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert relative_error(a, b) < tol, (fusion.name, "forward", relative_error(a, b))
    assert len(fused_grads) == len(ref_grads) > 0
    for a, b in zip(fused_grads, ref_grads):
        assert relative_error(a, b) < tol, (fusion.name, "backward", relative_error(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_fusions_match_eager(dtype):
    s, b, h, ffn = 16, 2, 32, 48
    x, bias = _leaves((s, b, 2 * ffn), (2 * ffn,), dtype=dtype)
    _check(bias_swiglu, (x, bias), dtype)
    _check(bias_swiglu, (x, None), dtype)
    _check(bias_gelu, (x, bias), dtype)
    _check(bias_gelu, (x, None), dtype)
    _check(bias_squared_relu, (x, bias), dtype)
    _check(bias_squared_relu, (x, None), dtype)

    out, bias_h, residual = _leaves((s, b, h), (h,), (s, b, h), dtype=dtype, seed=1)
    _check(bias_dropout_add, (out, bias_h, residual, 0.0, True), dtype)
    _check(bias_dropout_add, (out, None, residual, 0.1, False), dtype)

    weight, norm_bias = _leaves((h,), (h,), dtype=torch.float32, seed=2)
    _check(rms_norm, (residual, weight, 1e-5), dtype)
    _check(layer_norm, (residual, weight, norm_bias, 1e-5), dtype)

    q, k = _leaves((s, b, 4, 8), (s, b, 2, 8), dtype=dtype, seed=3)
    for percent in (1.0, 0.5):
        cos, sin = RotaryEmbedding(8, rotary_percent=percent).tables(None, s, "cpu")
        _check(rotary_qk, (q, k, cos, sin), dtype)

    (scores,) = _leaves((b, 4, s, s), dtype=dtype, seed=4)
    _check(scaled_causal_softmax, (scores, 0.125), dtype)
    (tail,) = _leaves((b, 4, 3, s), dtype=dtype, seed=5)  # 3 queries at the last positions
    _check(scaled_causal_softmax, (tail, 0.125), dtype)
    assert compile_stats().graphs > 0


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_expert_activations_compile_once_for_changing_token_counts(grouped):
    """Experts with the compiled bias + activation equal the eager experts, for token counts that
    change every call (0, 1 and many tokens per expert); only dynamo's 0/1 specializations add graphs."""
    from megalm.config import build_parser, config_from_args, validate_config
    from megalm.tensor_parallel.initialization import initialize_weights
    from megalm.transformer.moe.experts import LocalExperts

    m = validate_config(
        config_from_args(
            build_parser().parse_args(
                [
                    "--hidden-size",
                    "16",
                    "--num-attention-heads",
                    "4",
                    "--vocab-size",
                    "64",
                    "--num-experts",
                    "3",
                    "--moe-ffn-hidden-size",
                    "24",
                    "--swiglu",
                ]
            )
        )
    ).model
    experts = {}
    for name, plan in (("compiled", plan_fusions(m)), ("eager", EAGER)):
        experts[name] = LocalExperts(m, first=0, count=3, grouped=grouped, plan=plan)
        initialize_weights(experts[name], seed=5, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    assert experts["compiled"].bias_activation.dynamic
    graphs = []
    for step, counts in enumerate([[5, 0, 9], [7, 1, 4], [3, 6, 8], [9, 2, 12], [4, 10, 5]]):
        x = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(step))
        results = []
        for name in ("compiled", "eager"):
            xi = x.clone().requires_grad_()
            out = experts[name](xi, counts)
            out.pow(2).sum().backward()
            results.append((out, xi.grad))
        assert (
            relative_error(results[0][0], results[1][0]) < 1e-5 and relative_error(results[0][1], results[1][1]) < 1e-5
        )
        graphs.append(compile_stats().graphs)
    assert graphs[-1] == graphs[2], graphs  # steps 3 and 4 bring no new (0/1/many) pattern: no recompile


def test_fusion_references_are_the_textbook_formulas():
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(5, 12, generator=g), torch.randn(12, generator=g)
    gate, up = (x + bias).chunk(2, -1)
    assert torch.allclose(bias_swiglu.eager(x, bias), gate * torch.sigmoid(gate) * up, atol=1e-6)
    assert torch.allclose(bias_gelu.eager(x, bias), 0.5 * (x + bias) * (1 + torch.erf((x + bias) / 2**0.5)), atol=1e-6)
    assert torch.equal(bias_squared_relu.eager(x, bias), torch.where(x + bias > 0, (x + bias) ** 2, 0.0))
    w = torch.randn(12, generator=g)
    assert torch.allclose(
        rms_norm.eager(x, w, 1e-5), x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w, atol=1e-5
    )
    scores = torch.randn(1, 1, 4, 4, generator=g)
    probs = scaled_causal_softmax.eager(scores, 0.5)
    expected = (scores * 0.5).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.equal(probs.triu(1), torch.zeros_like(probs))


def test_dropout_fusion_masks_like_dropout():
    """The compiled mask is not F.dropout's, but it is a dropout: kept values scaled by 1/(1-p),
    the rest zero, about p of them dropped, the same mask for the same seed."""
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(3)) + 3.0
    residual, p = torch.zeros_like(x), 0.25
    torch.manual_seed(11)
    first = bias_dropout_add(x, None, residual, p, True)
    torch.manual_seed(11)
    again = bias_dropout_add(x, None, residual, p, True)
    assert torch.equal(first, again)
    assert not torch.equal(first, bias_dropout_add(x, None, residual, p, True))  # the generator moved on
    kept = first != 0
    assert torch.allclose(first[kept], x[kept] / (1 - p), rtol=1e-5)
    assert abs((~kept).float().mean().item() - p) < 0.02


# The model section the fusion plans are made for (not validated: plan_fusions reads it as it is).
ROPE_SWIGLU = dict(position_embedding_type="rope", swiglu=True)


def test_plan_follows_flags_and_environment(monkeypatch):
    plan = plan_fusions(model_config(ROPE_SWIGLU))
    assert (plan.attention, plan.norm, plan.bias_activation, plan.rope, plan.bias_dropout_add, plan.cross_entropy) == (
        "sdpa",
        "compiled",
        "compiled",
        "compiled",
        "compiled",
        "fused linear",
    )
    off = plan_fusions(
        model_config(
            ROPE_SWIGLU,
            bias_swiglu_fusion=False,
            apply_rope_fusion=False,
            bias_dropout_fusion=False,
            norm_fusion=False,
            masked_softmax_fusion=False,
            cross_entropy_loss_fusion=False,
            attention_backend="unfused",
        )
    )
    assert (
        off.attention,
        off.masked_softmax,
        off.norm,
        off.bias_activation,
        off.rope,
        off.bias_dropout_add,
        off.cross_entropy,
    ) == ("unfused", "eager", "eager", "eager", "eager", "eager", "unfused")
    assert plan_fusions(model_config(ROPE_SWIGLU, swiglu=False, bias_gelu_fusion=False)).bias_activation == "eager"
    assert plan_fusions(model_config(ROPE_SWIGLU, position_embedding_type="learned_absolute")).rope == "none"
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    eager = plan_fusions(model_config(ROPE_SWIGLU))
    assert eager.norm == eager.rope == eager.bias_activation == "eager" and eager.cross_entropy == "fused linear"
    assert "norm: eager" in eager.describe()
    assert EAGER.attention == "sdpa" and not any(EAGER.compiled(f) for f in vars(EAGER))


def test_missing_accelerator_packages_fail_with_install_hints():
    """No GPU here: TE, apex and flash-attn are never selected; asking for them explains how to get them."""
    assert backends.transformer_engine_module() is None
    assert backends.apex_norm_functions() is None
    assert backends.flash_attn_function() is None
    with pytest.raises(BackendUnavailable, match="Transformer Engine.*pip install --no-build-isolation"):
        plan_fusions(model_config(ROPE_SWIGLU, transformer_impl="transformer_engine"))
    with pytest.raises(BackendUnavailable, match="flash-attn.*pip install flash-attn"):
        plan_fusions(model_config(ROPE_SWIGLU, attention_backend="flash"), half_precision=True)
    assert plan_fusions(model_config(ROPE_SWIGLU, attention_backend="auto"), half_precision=True).attention == "sdpa"
    assert "unrelated" in backends.APEX_INSTALL and "github.com/NVIDIA/apex" in backends.APEX_INSTALL


def test_optional_packages_are_used_when_importable(monkeypatch):
    """With CUDA and the packages importable (stand-ins here), the plan picks them; the unrelated
    PyPI 'apex' (no apex.normalization) does not count."""
    import sys
    import types

    calls = []
    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func = lambda q, k, v, dropout_p=0.0, causal=False: calls.append("flash") or q
    apex_pkg, normalization = types.ModuleType("apex"), types.ModuleType("apex.normalization")
    fused = types.ModuleType("apex.normalization.fused_layer_norm")
    fused.fused_layer_norm_affine = lambda x, w, b, shape, eps: calls.append("apex-ln") or x
    fused.fused_rms_norm_affine = lambda x, w, shape, eps: calls.append("apex-rms") or x
    monkeypatch.setattr(backends, "use_cuda", lambda: True)
    for fn in (backends.apex_norm_functions, backends.flash_attn_function, backends.transformer_engine_module):
        fn.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))  # the unrelated PyPI package
        assert backends.apex_norm_functions() is None
        backends.apex_norm_functions.cache_clear()
        monkeypatch.setitem(sys.modules, "apex", apex_pkg)
        monkeypatch.setitem(sys.modules, "apex.normalization", normalization)
        monkeypatch.setitem(sys.modules, "apex.normalization.fused_layer_norm", fused)
        monkeypatch.setitem(sys.modules, "flash_attn", flash)
        plan = plan_fusions(model_config(ROPE_SWIGLU), half_precision=True)
        assert plan.norm == "apex" and plan.attention == "flash-attn"
        assert (
            plan_fusions(model_config(ROPE_SWIGLU, attention_backend="fused"), half_precision=True).attention == "sdpa"
        )
        assert plan_fusions(model_config(ROPE_SWIGLU), half_precision=False).attention == "sdpa"
        monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
        te_plan = plan_fusions(
            model_config(ROPE_SWIGLU, transformer_impl="transformer_engine")
        )  # TE layers: test_transformer_engine.py
        assert te_plan.uses_te() and te_plan.attention == "te" and "transformer: te" in te_plan.describe()
        from megalm.transformer.norm import RMSNorm

        norm = RMSNorm(8, impl=plan.norm)
        norm(torch.randn(2, 8))
        assert calls == ["apex-rms"]
    finally:
        for fn in (backends.apex_norm_functions, backends.flash_attn_function, backends.transformer_engine_module):
            fn.cache_clear()


def test_fusion_falls_back_to_eager_when_a_seen_signature_hits_the_recompile_limit(capsys):
    """A process that runs many models (reused test ranks, several trainings) can exhaust dynamo's
    recompile limit on a signature the fusion has already seen (a guard outside its key, here the
    strides): the fusion logs a WARNING and runs eagerly instead of raising dynamo's hard failure."""
    import torch._dynamo

    from megalm.fusions.compile import Fusion

    f = Fusion(lambda x, w: x * torch.sigmoid(w), "test_recompile_limit")
    f._compiled = torch.compile(f.eager, backend="eager", fullgraph=True)  # dynamo's guards without inductor's cost
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(f(x, w), f.eager(x, w))  # compiled: one graph
        transposed = torch.randn(4, 4).t()  # same key (shape, dtype), other strides: a recompile
        with megalm_logs("stderr"):  # megalm's own handler, as in a run
            assert torch.equal(f(transposed, w), transposed * torch.sigmoid(w))
    logged = [line for line in capsys.readouterr().err.splitlines() if "torch.compile failed" in line]
    assert len(logged) == 1 and "WARNING" in logged[0] and "'test_recompile_limit'" in logged[0], logged
    assert f._failed and torch.equal(f(x, w), f.eager(x, w))
    from megalm.fusions.compile import _signature

    with torch.no_grad():  # the grad mode is in the key: evaluation is a new signature, not a seen one
        evaluation = _signature((x, w), False)
    assert evaluation != _signature((x, w), False)
