"""The blocked causal attention (megalm/transformer/blocked_attention.py) against PyTorch SDPA:
outputs and gradients for ragged and exact block counts, in the model's memory layout, whole
GPT models with either core, and when ``--attention-backend auto`` picks it.  Tensor-parallel
parity with it is in tests/test_gpt_model.py, its config error (no attention dropout) in
tests/test_config.py, its saved bytes in tests/test_estimate.py."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megalm.fusions import EAGER, backends, plan_fusions
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from megalm.transformer.attention import SelfAttention
from megalm.transformer.blocked_attention import BLOCK, block_ranges, blocked_causal_attention
from tests.configs import SMALL_GPT, make_config, model_config
from tests.numerics import relative_error


def _qkv_views(s, b, n, d, dtype, seed=0):
    """q, k, v as the model hands them over: ``[b, n, s, d]`` views of one ``[s, b, n, 3d]`` tensor."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(s, b, n, 3 * d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return mixed, [t.permute(1, 2, 0, 3) for t in torch.split(mixed, d, dim=-1)]


def _output_and_grad(core, s, b, n, d, dtype):
    mixed, (q, k, v) = _qkv_views(s, b, n, d, dtype)
    out = core(q, k, v)
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    (grad,) = torch.autograd.grad(out, mixed, grad_out)
    return out, grad


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("s", [1, 37, BLOCK, 2 * BLOCK + 22])
def test_blocked_attention_matches_sdpa(s):
    b, n, d = 2, 3, 16
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        out, grad = _output_and_grad(blocked_causal_attention, s, b, n, d, dtype)
        ref_out, ref_grad = _output_and_grad(_sdpa, s, b, n, d, dtype)
        assert out.dtype == dtype and out.shape == (b, n, s, d)
        assert relative_error(out, ref_out) < tol and relative_error(grad, ref_grad) < tol, (
            dtype,
            relative_error(out, ref_out),
            relative_error(grad, ref_grad),
        )
        # written in [s, b, n, d] memory: the context for linear_proj is a view, no copy
        assert out.permute(2, 0, 1, 3).is_contiguous()
    out, grad = _output_and_grad(blocked_causal_attention, s, b, n, d, torch.bfloat16)
    ref_out, ref_grad = _output_and_grad(_sdpa, s, b, n, d, torch.float64)
    assert out.dtype == torch.bfloat16 and relative_error(out, ref_out) < 2e-2 and relative_error(grad, ref_grad) < 3e-2


def test_block_ranges_cover_the_sequence_once():
    assert list(block_ranges(2 * BLOCK + 5)) == [(0, BLOCK), (BLOCK, 2 * BLOCK), (2 * BLOCK, 2 * BLOCK + 5)]
    assert list(block_ranges(3)) == [(0, 3)]
    with pytest.raises(ValueError, match="one shape"):
        q = torch.zeros(1, 2, 8, 4)
        blocked_causal_attention(q, q[:, :1], q)


# A Llama-style small GPT (RoPE, RMSNorm, SwiGLU, 2 query groups) over 150 tokens.
MODEL = dict(SMALL_GPT, seq_length=150, vocab_size=64, position_embedding_type="rope", normalization="RMSNorm")
MODEL.update(swiglu=True, group_query_attention=True, num_query_groups=2)


def test_gpt_with_blocked_attention_equals_sdpa():
    """A GQA GPT (s = 150: two full blocks and a ragged one) with either core: same loss and grads."""
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 64, (2, 150), generator=g) for _ in range(2))
    results = {}
    for backend in ("blocked", "fused"):
        torch.manual_seed(7)
        model = GPTModel(make_config(MODEL, attention_backend=backend), process_groups=get_process_groups())
        assert model.fusion_plan.attention == {"blocked": "blocked", "fused": "sdpa"}[backend]
        loss = model(tokens, None, labels)
        loss.mean().backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss, grads), (ref_loss, ref_grads) = results["blocked"], results["fused"]
    assert relative_error(loss, ref_loss) < 1e-6
    for name, ref in ref_grads.items():
        assert relative_error(grads[name], ref) < 1e-5, name


def test_auto_picks_blocked_on_cpu_fp32_without_dropout_in_the_measured_range(monkeypatch):
    assert plan_fusions(make_config(MODEL, seq_length=256).model).attention == "blocked"
    assert plan_fusions(make_config(MODEL, seq_length=128).model).attention == "blocked"
    assert plan_fusions(make_config(MODEL, seq_length=1024).model).attention == "blocked"
    assert plan_fusions(make_config(MODEL, seq_length=64).model).attention == "sdpa"
    assert plan_fusions(make_config(MODEL, seq_length=2048).model).attention == "sdpa"
    assert plan_fusions(make_config(MODEL, seq_length=256, attention_dropout=0.1).model).attention == "sdpa"
    assert plan_fusions(make_config(MODEL, seq_length=256).model, half_precision=True).attention == "sdpa"
    assert plan_fusions(make_config(MODEL, seq_length=256, attention_backend="fused").model).attention == "sdpa"
    assert plan_fusions(make_config(MODEL, seq_length=4096, attention_backend="blocked").model).attention == "blocked"
    monkeypatch.setattr(backends, "use_cuda", lambda: True)
    assert plan_fusions(make_config(MODEL, seq_length=256).model).attention == "sdpa"


def test_attention_built_with_blocked_core_and_dropout_fails_at_construction():
    m = model_config(num_layers=1, hidden_size=32, num_attention_heads=4)  # attention dropout 0.1
    with pytest.raises(ValueError, match="no attention dropout.*--attention-dropout 0 \\(got 0.1\\)"):
        SelfAttention(
            m,
            plan=dataclasses.replace(EAGER, attention="blocked"),
            tp_group=get_process_groups().tp,
            cp_group=get_process_groups().cp,
        )
