"""The fused output layer + cross entropy (one process) against ``F.linear`` + ``F.cross_entropy``,
and the GPT model with the fusion on against the model with it off.  Tensor-parallel and
sequence-parallel shards are checked in tests/test_tensor_parallel.py."""

import pytest
import torch
import torch.nn.functional as F

from megalm import parallel_state
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel import linear_cross_entropy as lce
from megalm.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from tests.configs import make_config
from tests.numerics import relative_error
from tests.test_gpt_model import CONFIGS, MODEL, make_batch

S, B, H, V_PAD, VOCAB = 7, 3, 16, 48, 45  # 21 tokens; columns 45..47 are padding
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def one_process():
    parallel_state.destroy_model_parallel()  # tensor-parallel size one, no process group


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V_PAD, H, generator=g) * 0.5).to(dtype)
    w[VOCAB:] = 0.0  # padded rows stay zero, as in the model
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    mask = (torch.rand(S, B, generator=g) > 0.3).float()
    return x, w.requires_grad_(), target, mask


def _reference(x, w, target, upstream):
    x, w = (t.detach().float().requires_grad_() for t in (x, w))
    logits = x @ w.t()
    logits = torch.cat([logits[..., :VOCAB], torch.full_like(logits[..., VOCAB:], float("-inf"))], -1)
    loss = F.cross_entropy(logits.view(-1, V_PAD), target.view(-1), reduction="none").view(S, B)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 21])  # one token per chunk, a ragged last chunk, one chunk
def test_matches_linear_then_cross_entropy(dtype, rows, monkeypatch):
    monkeypatch.setitem(lce.CHUNK_BYTES, "cpu", 4 * V_PAD * rows)
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    x, w, target, mask = _inputs(dtype)
    g = torch.Generator().manual_seed(1)
    # The loss's usual gradient (scale x mask: saved gradients scaled) and any other one (recomputed).
    for upstream in (0.37 * mask, torch.rand(S, B, generator=g), torch.zeros(S, B)):
        x.grad = w.grad = None
        loss = linear_cross_entropy(x, w, target, VOCAB, token_weight=mask, tp_group=get_process_groups().tp)
        (loss * upstream).sum().backward()
        ref_loss, ref_dx, ref_dw = _reference(x, w, target, upstream)
        assert loss.dtype == torch.float32 and loss.shape == (S, B)
        assert relative_error(loss, ref_loss) < TOL[dtype] / 10
        assert x.grad.dtype == dtype and w.grad.dtype == dtype
        if upstream.any():
            assert relative_error(x.grad, ref_dx) < TOL[dtype] and relative_error(w.grad, ref_dw) < TOL[dtype]
        else:
            assert not x.grad.any() and not w.grad.any()
        assert not w.grad[VOCAB:].any()  # padded rows get no gradient
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(x, w, target, VOCAB, tp_group=get_process_groups().tp), loss.detach())


def test_default_weights_and_errors():
    x, w, target, _ = _inputs(torch.float32)
    loss = linear_cross_entropy(x, w, target, VOCAB, tp_group=get_process_groups().tp)  # token weights default to ones
    loss.mean().backward()
    _, ref_dx, ref_dw = _reference(x, w, target, torch.full((S, B), 1.0 / (S * B)))
    assert relative_error(x.grad, ref_dx) < 2e-6 and relative_error(w.grad, ref_dw) < 2e-6
    loss = linear_cross_entropy(x, w, target, VOCAB, tp_group=get_process_groups().tp)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.sum().backward()
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(x, w, target[:-1], VOCAB, tp_group=get_process_groups().tp)
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(x, w[:, :-1], target, VOCAB, tp_group=get_process_groups().tp)
    with pytest.raises(ValueError, match="token_weight"):
        linear_cross_entropy(x, w, target, VOCAB, token_weight=torch.ones(S), tp_group=get_process_groups().tp)


def test_chunk_rows_follow_the_byte_budget():
    assert lce.chunk_rows(10_000, 4096, torch.device("cpu")) == (16 << 20) // (4 * 4096)  # 1024 tokens
    assert lce.chunk_rows(10_000, 128_000, torch.device("cpu")) == lce.MIN_CHUNK_ROWS
    assert lce.chunk_rows(10_000, 128_000, torch.device("cuda")) == (512 << 20) // (4 * 128_000)
    assert lce.chunk_rows(3, 8192, torch.device("cpu")) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", ["learned-LayerNorm-GELU-bias-tied-MHA", "rope-RMSNorm-SwiGLU-nobias-untied-GQA"])
def test_gpt_model_fused_equals_unfused(config, dtype):
    """Loss and every parameter gradient with --cross-entropy-loss-fusion on and off (tied and
    untied output weights), the loss weighted by a 0/1 loss mask passed to the model."""
    import pretrain_gpt
    from megalm.models import GPTModel

    results = []
    for fused in (True, False):
        cfg = make_config(MODEL, CONFIGS[config], cross_entropy_loss_fusion=fused)
        model = GPTModel(cfg, process_groups=get_process_groups()).to(dtype)
        assert model.fusion_plan.cross_entropy == ("fused linear" if fused else "unfused")
        tokens, positions, labels, weights = make_batch(3)
        mask = (weights > 0.25).float()
        loss, _, _ = pretrain_gpt.loss_func(mask, model, model(tokens, positions, labels, loss_mask=mask))  # sum, count
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert relative_error(loss_on, loss_off) < TOL[dtype] / 10
    assert grads_on.keys() == grads_off.keys()
    for name in grads_on:
        assert relative_error(grads_on[name].float(), grads_off[name].float()) < 5 * TOL[dtype], name
