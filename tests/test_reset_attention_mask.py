"""--reset-attention-mask: the document mask against Megatron's loop, a masked model against running
each document on its own, the blocked core's backward, the data path and the refusals.

TP2 against TP1 on real ranks: tests/test_training.py (``docmask_*`` runs); every pipeline stage
receiving the documents: tests/test_data_loader.py (layout ``pp4docs``)."""

import copy

import pytest
import torch

from megalm.config import ConfigError
from megalm.data.gpt_dataset import document_ids, positions_restarting_after
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from megalm.transformer.attention_mask import document_causal_mask
from megalm.transformer.blocked_attention import blocked_causal_attention
from tests.configs import SMALL_GPT, make_config

EOD, VOCAB = 0, 50


def megatron_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Megatron's get_ltor_masks_and_position_ids with reset_attention_mask, as True = may attend."""
    b, s = tokens.shape
    mask = torch.tril(torch.ones(b, 1, s, s))
    for i in range(b):
        for j in (tokens[i] == eod).nonzero().flatten().tolist():
            mask[i, 0, j + 1 :, : j + 1] = 0
    return mask > 0.5


def docs_tokens(seed: int, b: int, s: int, eod_rate: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (b, s), generator=g)
    tokens[torch.rand(b, s, generator=g) < eod_rate] = EOD
    return tokens


def test_document_mask_equals_megatrons_loop():
    for seed, rate in ((0, 0.0), (1, 0.1), (2, 0.4)):
        tokens = docs_tokens(seed, 3, 40, rate)
        tokens[0, 0] = tokens[1, -1] = EOD  # an eod first and one last
        ids = torch.stack([document_ids(t, EOD) for t in tokens])
        assert torch.equal(document_causal_mask(ids), megatron_mask(tokens, EOD))
    assert document_ids(torch.tensor([5, 0, 7, 8, 0, 0, 9]), 0).tolist() == [0, 0, 1, 1, 1, 2, 3]


# A Llama-style small GPT (8 heads in 4 query groups) over 160 tokens, with --reset-attention-mask and
# --reset-position-ids.
MODEL = dict(SMALL_GPT, num_attention_heads=8, seq_length=160, vocab_size=VOCAB, position_embedding_type="rope")
MODEL.update(normalization="RMSNorm", swiglu=True, group_query_attention=True, num_query_groups=4, seed=11)
MODEL.update(reset_attention_mask=True, reset_position_ids=True)


@pytest.mark.parametrize("backend", ["sdpa", "blocked", "unfused"])
def test_masked_model_equals_each_document_run_alone(backend):
    """Logits of a packed sequence under the document mask (and restarted positions) equal those of
    each document run through the same model on its own with plain causal attention (<= 1e-6)."""
    torch.manual_seed(0)
    cfg = make_config(MODEL, attention_backend=backend)
    model = GPTModel(cfg, process_groups=get_process_groups()).eval()
    tokens = docs_tokens(3, 2, 160, 0.02)  # 160 positions: the blocked core's 64-row blocks cut documents
    tokens[0, [30, 63, 64, 100]] = EOD
    ids = torch.stack([document_ids(t, EOD) for t in tokens])
    positions = torch.stack([positions_restarting_after(t, EOD) for t in tokens])
    with torch.no_grad():
        packed = model(tokens, positions, attention_mask=document_causal_mask(ids))[..., :VOCAB]
        causal = model(tokens, positions)[..., :VOCAB]  # the padded vocabulary's logits are -inf
        for row in range(tokens.shape[0]):
            for doc in ids[row].unique().tolist():
                where = (ids[row] == doc).nonzero().flatten()
                alone = model(tokens[row : row + 1, where], positions[row : row + 1, where])[..., :VOCAB]
                assert (packed[row, where] - alone[0]).abs().max().item() <= 1e-6, (backend, row, doc)
    assert (packed - causal).abs().max().item() > 1e-2  # the mask changes the result


def test_blocked_core_backward_with_mask_equals_plain_pytorch():
    g = torch.Generator().manual_seed(5)
    b, n, s, d = 2, 2, 130, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    tokens = docs_tokens(6, b, s, 0.03)
    mask = document_causal_mask(torch.stack([document_ids(t, EOD) for t in tokens]))
    grad = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    out = blocked_causal_attention(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v), grad)
    scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~mask, float("-inf"))
    ref_out = torch.softmax(scores, -1) @ v
    ref = torch.autograd.grad(ref_out, (q, k, v), grad)
    assert (out - ref_out).abs().max().item() < 1e-12
    assert all((a - r).abs().max().item() < 1e-12 for a, r in zip(got, ref))
    with pytest.raises(ValueError, match=r"the attention mask must have shape \(2, 1, 130, 130\)"):
        blocked_causal_attention(q, k, v, mask[:1])


def test_recompute_keeps_the_mask():
    """Selective, full-uniform and full-block recompute give the same loss and gradients under the mask."""
    tokens = docs_tokens(4, 2, 96, 0.05)
    ids = torch.stack([document_ids(t, EOD) for t in tokens])
    labels, mask = torch.roll(tokens, -1, 1), document_causal_mask(ids)

    def loss_and_grads(**recompute):
        model = GPTModel(make_config(MODEL, recompute), process_groups=get_process_groups()).train()
        loss = model(tokens, None, labels, attention_mask=mask).sum()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = loss_and_grads()
    for granularity, method in (("selective", None), ("full", "uniform"), ("full", "block")):
        extra = {"recompute_num_layers": 1, "recompute_method": method} if method else {}
        loss, grads = loss_and_grads(recompute_granularity=granularity, **extra)
        assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), (granularity, method)


def test_gpt_dataset_items_carry_documents_and_get_batch_builds_the_mask(tmp_path):
    from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megalm.data.mock_dataset import MockIndexedDataset
    from megalm.parallel_state import ProcessGroups
    from megalm.training import get_batch

    low = MockIndexedDataset(VOCAB, EOD, max_length=20, seed=1)
    config = GPTDatasetConfig(seq_length=32, seed=1, eod=EOD, reset_attention_mask=True, cache_dir=str(tmp_path))
    ds = GPTDataset(low, torch.arange(len(low)).numpy(), 4, "train", config)
    items = [ds[i] for i in range(2)]
    assert all(torch.equal(it["document_ids"], document_ids(it["tokens"], EOD)) for it in items)
    assert int(items[0]["document_ids"][-1]) > 0  # documents of <= 20 tokens: a sample spans several
    batch = get_batch(iter([torch.utils.data.default_collate(items)]), None, ProcessGroups.single())
    tokens = torch.stack([it["tokens"] for it in items])
    assert torch.equal(batch["attention_mask"], megatron_mask(tokens, EOD))
    plain = GPTDataset(low, torch.arange(len(low)).numpy(), 4, "train", GPTDatasetConfig(32, 1, EOD))
    assert (
        get_batch(iter([torch.utils.data.default_collate([plain[0]])]), None, ProcessGroups.single())["attention_mask"]
        is None
    )


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"context_parallel_size": 2}, "--reset-attention-mask is not supported with --context-parallel-size > 1"),
        ({"transformer_impl": "transformer_engine"}, "not supported with --transformer-impl transformer_engine"),
        ({"attention_backend": "flash"}, "--reset-attention-mask is not supported with --attention-backend flash"),
        ({"position_keyed_attention_dropout": True}, "not supported with --position-keyed-attention-dropout"),
    ],
)
def test_refused_with_context_parallelism_te_and_flash_attn(setting, message):
    model = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=VOCAB)
    base = dict(model, attention_dropout=0.0, reset_attention_mask=True, bf16=True)  # bf16: flash-attn's kernels
    with pytest.raises(ConfigError, match=message):
        make_config(base, setting)


def test_keyed_dropout_core_refuses_a_mask_it_cannot_apply():
    """A model built without validation (keyed dropout and a dense document mask) raises rather than running
    the keyed core without the mask (it takes packed documents only)."""
    from megalm.tensor_parallel import model_parallel_manual_seed

    cfg = copy.deepcopy(make_config(MODEL))  # an unvalidated copy (the validated config is frozen)
    cfg.model.position_keyed_attention_dropout, cfg.model.attention_dropout = True, 0.1
    tracker = model_parallel_manual_seed(11, get_process_groups())
    model = GPTModel(cfg, process_groups=get_process_groups(), rng_tracker=tracker).train()
    tokens = docs_tokens(7, 2, 32, 0.1)
    mask = document_causal_mask(torch.stack([document_ids(t, EOD) for t in tokens]))
    with pytest.raises(ConfigError, match="without --qkv-format thd is not supported with position-keyed"):
        model(tokens, None, torch.roll(tokens, -1, 1), attention_mask=mask)
