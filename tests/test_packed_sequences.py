"""--qkv-format thd (packed sequences): the packed parameters from the documents, a packed model's loss and
gradients against each document run alone (padded) and against the dense document mask, no ``s x s``
tensor on the packed path, windows / sinks and multi-latent attention, flash-attn's varlen call layout,
the batch and the refusals.

TP2 (sequence parallel) x DP2 against one process on real ranks: tests/test_training.py
(``docmask_thd_tp2`` against ``docmask_ref``)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalm.config import ConfigError
from megalm.data.gpt_dataset import document_ids, positions_restarting_after
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from megalm.transformer.attention_mask import document_causal_mask
from megalm.transformer.packed_seq import (
    PackedSequenceError,
    packed_seq_params_from_documents,
    positions_in_segments,
)
from megalm.transformer.varlen_attention import varlen_attention
from tests.configs import make_config
from tests.test_reset_attention_mask import EOD, MODEL, VOCAB, docs_tokens

S = 96


def _documents(b: int = 2):
    tokens = docs_tokens(3, b, S, 0.02)
    tokens[0, [30, 63, 64]] = EOD  # documents cut by the blocked core's 64-row blocks, one of length 1
    tokens[1:, [40, 80]] = EOD
    return tokens, torch.stack([document_ids(t, EOD) for t in tokens])


def test_packed_params_from_documents():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    params = packed_seq_params_from_documents(ids)
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 6, 7, 12] and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.qkv_format == "thd" and params.batch_shape == (2, 6)
    assert positions_in_segments(params).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    tokens, ids = _documents(3)
    restarted = torch.stack([positions_restarting_after(t, EOD) for t in tokens])
    assert torch.equal(positions_in_segments(packed_seq_params_from_documents(ids)), restarted)
    q = torch.zeros(S, 2, 1, 4)
    with pytest.raises(PackedSequenceError, match=f"for 3 rows of {S} tokens given a batch of 2 rows of {S}"):
        varlen_attention(q, q, q, packed_seq_params_from_documents(ids), lambda *a: a[0])
    with pytest.raises(PackedSequenceError, match=r"document ids must be \[b, s\]"):
        packed_seq_params_from_documents(ids[0])


class _SequenceSquares(TorchDispatchMode):
    """Counts the tensors ops make (forward and backward) with two dimensions of at least ``s``: a mask or
    scores over the whole sequence."""

    def __init__(self, s: int):
        super().__init__()
        self.s, self.count = s, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and sum(size >= self.s for size in t.shape) >= 2:
                self.count += 1
        return out


def _loss_and_grads(model, tokens, positions, labels, loss_mask, **kw):
    model.zero_grad()
    loss = (model(tokens, positions, labels, **kw) * loss_mask).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_grads_close(a, b, tol, what):
    for name in a:
        scale = max(1.0, a[name].abs().max().item())
        assert (a[name] - b[name]).abs().max().item() <= tol * scale, (what, name)


def test_packed_equals_documents_alone_and_the_dense_mask():
    """Loss and gradients of a packed micro-batch equal those of its documents run each alone in a padded
    batch (positions from 0, the padding out of the loss) and those of the dense document mask (1e-5); the
    packed forward and backward make no tensor of ``s x s``, the dense path does."""
    torch.manual_seed(0)
    model = GPTModel(make_config(MODEL, attention_backend="sdpa"), process_groups=get_process_groups()).train()
    tokens, ids = _documents()
    labels, loss_mask = torch.roll(tokens, -1, 1), torch.ones(tokens.shape)
    params = packed_seq_params_from_documents(ids)
    positions = positions_in_segments(params)
    longest = params.max_seqlen_q
    packed_loss, packed = _loss_and_grads(model, tokens, positions, labels, loss_mask, packed_seq_params=params)
    mask = document_causal_mask(ids)
    dense_loss, dense = _loss_and_grads(model, tokens, positions, labels, loss_mask, attention_mask=mask)
    # One attention block forward and backward: nothing of [.., s, s] on the packed path; the dense one has its mask.
    attention, hidden = model.decoder.layers["0"].self_attention, torch.randn(S, 2, 32, requires_grad=True)
    cos, sin = model.rotary.tables(positions, S, hidden.device)
    for documents, squares in ((params, 0), (None, 1)):
        with _SequenceSquares(S) as seen:
            mask = document_causal_mask(ids) if documents is None else documents
            attention(hidden, cos, sin, attention_mask=mask)[0].sum().backward()
        assert (seen.count == 0) == (squares == 0), (documents is None, seen.count)
    assert longest < S
    assert packed_loss == pytest.approx(dense_loss, rel=1e-6)
    _assert_grads_close(packed, dense, 1e-5, "dense")
    # Each document alone: one row per document, padded to the longest, labels as in the packed batch.
    docs = [(r, a - r * S, e - r * S) for r in range(2) for a, e in params.segments() if a // S == r]
    alone = torch.full((len(docs), longest), EOD)
    alone_labels, alone_mask = torch.zeros_like(alone), torch.zeros(alone.shape)
    for i, (r, a, e) in enumerate(docs):
        alone[i, : e - a], alone_labels[i, : e - a], alone_mask[i, : e - a] = tokens[r, a:e], labels[r, a:e], 1.0
    alone_positions = torch.arange(longest).expand(len(docs), longest)
    alone_loss, separate = _loss_and_grads(model, alone, alone_positions, alone_labels, alone_mask)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-6)
    _assert_grads_close(packed, separate, 1e-5, "alone")
    causal_loss, _ = _loss_and_grads(model, tokens, positions, labels, loss_mask)
    assert causal_loss != pytest.approx(packed_loss, rel=1e-6)  # the documents matter at the tolerance used


def test_packed_cores_gpt_oss_and_mla_equal_the_dense_mask():
    """The blocked and unfused cores, sliding windows (every other layer) with learnable sinks (SDPA and blocked
    cores), and multi-latent attention with YaRN under full recompute: packed equals the dense document mask."""
    tokens, ids = _documents()
    labels, loss_mask = torch.roll(tokens, -1, 1), torch.ones(tokens.shape)
    params = packed_seq_params_from_documents(ids)
    positions = positions_in_segments(params)
    gpt_oss = dict(window_size=(8, 0), window_attn_skip_freq=2, softmax_type="learnable")
    mla = dict(
        multi_latent_attention=True,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        group_query_attention=False,
        num_query_groups=None,
    )
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cases = [("plain", {}, "blocked"), ("plain", {}, "unfused"), ("gpt-oss", gpt_oss, "sdpa")]
    cases += [("gpt-oss", gpt_oss, "blocked"), ("mla", {**mla, **recompute}, "sdpa")]
    for name, extra, backend in cases:
        torch.manual_seed(0)
        model = GPTModel(
            make_config(MODEL, extra, attention_backend=backend), process_groups=get_process_groups()
        ).train()
        mask = document_causal_mask(ids)
        dense_loss, dense = _loss_and_grads(model, tokens, positions, labels, loss_mask, attention_mask=mask)
        loss, packed = _loss_and_grads(model, tokens, positions, labels, loss_mask, packed_seq_params=params)
        assert loss == pytest.approx(dense_loss, rel=1e-6), (name, backend)
        _assert_grads_close(packed, dense, 1e-5, (name, backend))


def test_flash_varlen_call_layout():
    """flash-attn's varlen kernel (faked here by per-segment SDPA on what it is given) receives ``[t, heads, d]``
    tensors in packed order, the cumulative lengths and the window; its output is laid back as ``[s, b, n, d]``."""
    g = torch.Generator().manual_seed(1)
    s, b, n, groups, d = 48, 2, 4, 2, 8
    q = torch.randn(s, b, n, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    tokens = docs_tokens(2, b, s, 0.1)
    params = packed_seq_params_from_documents(torch.stack([document_ids(t, EOD) for t in tokens]))
    calls = []

    def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, window_size):
        calls.append((q.shape, cu_q is params.cu_seqlens_q, max_q, window_size, causal))
        bounds = cu_q.tolist()
        outs = []
        for a, e in zip(bounds[:-1], bounds[1:]):
            outs.append(varlen_window_core(*(t[a:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), window_size))
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    def varlen_window_core(q, k, v, window_size):
        L = q.shape[2]
        i = torch.arange(L)
        allowed = (i[:, None] >= i[None, :]) & ((window_size[0] < 0) | (i[:, None] - i[None, :] <= window_size[0]))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, allowed, enable_gqa=True)

    for window in (None, 5):
        core = lambda q, k, v: varlen_window_core(q, k, v, (-1 if window is None else window, 0))  # noqa: E731
        want = varlen_attention(q, k, v, params, core)
        got = varlen_attention(q, k, v, params, core, flash=fake_flash, window=window)
        assert got.shape == (s, b, n, d) and (got - want).abs().max().item() < 1e-6
    assert calls == [
        (torch.Size([b * s, n, d]), True, params.max_seqlen_q, (-1, -1), True),
        (torch.Size([b * s, n, d]), True, params.max_seqlen_q, (5, 0), True),
    ]


def test_get_batch_packs_the_documents(tmp_path):
    from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megalm.data.mock_dataset import MockIndexedDataset
    from megalm.parallel_state import ProcessGroups
    from megalm.training import get_batch

    low = MockIndexedDataset(VOCAB, EOD, max_length=20, seed=1)
    config = GPTDatasetConfig(seq_length=32, seed=1, eod=EOD, reset_attention_mask=True, cache_dir=str(tmp_path))
    ds = GPTDataset(low, torch.arange(len(low)).numpy(), 4, "train", config)
    items = [ds[i] for i in range(2)]
    cfg = make_config(qkv_format="thd", validate=False)  # get_batch reads this field only
    batch = get_batch(iter([torch.utils.data.default_collate(items)]), cfg, ProcessGroups.single())
    tokens = torch.stack([it["tokens"] for it in items])
    ids = torch.stack([it["document_ids"] for it in items])
    assert batch["attention_mask"] is None
    assert torch.equal(batch["packed_seq_params"].cu_seqlens_q, packed_seq_params_from_documents(ids).cu_seqlens_q)
    assert batch["packed_seq_params"].cu_seqlens_q.numel() > 3  # several documents
    assert torch.equal(batch["position_ids"], torch.stack([positions_restarting_after(t, EOD) for t in tokens]))


# A small model over 32 tokens, its documents packed (--reset-attention-mask --qkv-format thd).
PACKED = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=VOCAB)
PACKED.update(reset_attention_mask=True, qkv_format="thd")


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"reset_attention_mask": False}, "--qkv-format thd packs the documents of --reset-attention-mask"),
        (
            {"context_parallel_size": 2, "qkv_format": "sbhd"},
            r"--reset-attention-mask is not supported with --context-parallel-size > 1 \(the CP cores take the "
            r"documents packed: add --qkv-format thd\)",
        ),
        ({"transformer_impl": "transformer_engine"}, "thd is not supported with --transformer-impl transformer_engine"),
        (
            {"position_keyed_attention_dropout": True, "qkv_format": "sbhd"},
            "--reset-attention-mask is not supported with --position-keyed-attention-dropout",
        ),
    ],
)
def test_refusals(setting, message):
    with pytest.raises(ConfigError, match=message):
        make_config(PACKED, {"attention_dropout": 0.0}, setting)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather"])
def test_context_parallel_and_keyed_dropout_accepted_with_thd(comm):
    """Packed documents run under every --cp-comm-type with attention dropout (position-keyed under CP), and
    without CP with --position-keyed-attention-dropout."""
    for cp, keyed in ((2, False), (1, True)):
        fields = dict(attention_dropout=0.1, position_keyed_attention_dropout=keyed, cp_comm_type=comm)
        cfg = make_config(PACKED, context_parallel_size=cp, world_size=cp, **fields)
        assert cfg.parallel.context_parallel_size == cp


def test_flash_backend_accepted_with_thd():
    """The dense mask refuses --attention-backend flash; packed documents run flash-attn's varlen kernel."""
    assert make_config(PACKED, attention_backend="flash", bf16=True).data.qkv_format == "thd"


def test_allgather_core_masks_other_documents():
    """The allgather CP core's chunks with packed documents (here one rank: its two chunks) equal the dense
    document mask over the whole sequence, plain and with gpt-oss's window and sinks."""
    from megalm.context_parallel.allgather import allgather_attention
    from megalm.fusions.attention_variants import variant_attention
    from megalm.transformer.packed_seq import document_ids

    g = torch.Generator().manual_seed(3)
    s, b, n, kv, d = 16, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=g) for h in (n, kv, kv))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5])
    ids = document_ids(packed_seq_params_from_documents(docs))
    assert torch.equal(ids, torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 11 + [4] * 5]))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    dense = (causal & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)  # [b, 1, s, s]
    heads = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    sinks = torch.randn(n, generator=g)
    refs = {
        None: torch.nn.functional.scaled_dot_product_attention(*heads, attn_mask=dense, enable_gqa=True),
        (3, sinks): variant_attention(*heads, 3, sinks, doc_mask=dense),
    }
    for variant, ref in refs.items():
        got = allgather_attention(q, k, v, None, variant=variant, documents=ids).permute(1, 2, 0, 3)
        assert (got - ref).abs().max() < 1e-6
    causal_only = allgather_attention(q, k, v, None).permute(1, 2, 0, 3)
    assert (causal_only - refs[None]).abs().max() > 1e-3  # the documents matter
