"""Multi-token prediction (--mtp-num-layers) against a hand-written reference of Megatron's formula.

A tiny MLA + MoE model with 2 MTP depths: its training forward returns the main per-token losses
unchanged, records ``mtp_<k> loss`` equal to the reference's, and its backward gives every parameter
the gradient of ``main + factor / D * sum_k loss_k`` computed by hand (embedding first in the
concatenation, the decoder's normalized output as depth 1's hidden state, tokens / labels / mask
rolled one place left per depth, the model's embedding and output layer shared).
"""

import copy

import torch
import torch.nn.functional as F

from megalm.fusions import EAGER
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from tests.configs import MLA_MOE, make_config

VOCAB = 80


# A dense then an MoE layer, untied, with two MTP depths.
MODEL = dict(MLA_MOE, num_layers=2, seq_length=12, moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.0)
MODEL.update(untie_embeddings_and_output_weights=True, mtp_num_layers=2, mtp_loss_scaling_factor=0.3, vocab_size=VOCAB)


def _roll(x):
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def _reference_loss(model, tokens, labels, mask):
    """main mean loss + factor / D * sum_k (masked mean loss of depth k), written out by hand."""
    cos, sin = model.rotary.tables(None, tokens.shape[1], tokens.device)
    h = model.decoder(model.embedding(tokens), cos, sin)  # normalized decoder output [s, b, h]
    w_out = model.output_layer.weight[:VOCAB]

    def ce(hidden, target):  # [b, s]
        logits = hidden.transpose(0, 1) @ w_out.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(target.shape)

    main = (ce(h, labels) * mask).sum() / mask.sum()
    depth_losses = []
    for layer in model.mtp.layers:
        tokens, labels, mask = _roll(tokens), _roll(labels), _roll(mask)
        e = model.embedding(tokens)
        x = torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1) @ layer.eh_proj.weight.t()
        h = layer.final_layernorm(layer.transformer_layer(x, cos, sin))
        depth_losses.append((ce(h, labels) * mask).sum() / mask.sum())
    factor = model.cfg.model.mtp_loss_scaling_factor / len(depth_losses)
    return main, depth_losses, main + factor * sum(depth_losses)


def test_mtp_matches_hand_reference():
    torch.manual_seed(0)
    cfg = make_config(MODEL)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups()).train()
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12)
    mask[1, 3] = 0.0

    losses = model(tokens, labels=labels, loss_mask=mask)
    main = (losses * mask).sum() / mask.sum()
    metrics = model.mtp_metrics()
    main.backward()
    ref_main, ref_depths, ref_total = _reference_loss(ref_model, tokens, labels, mask)
    ref_total.backward()

    assert abs(main.item() - ref_main.item()) < 1e-6  # the main loss is unchanged
    assert sorted(metrics) == ["mtp_1 loss", "mtp_2 loss"]
    for k, ref in enumerate(ref_depths):
        assert abs(metrics[f"mtp_{k + 1} loss"].item() - ref.item()) < 1e-5
    ref_grads = dict(ref_model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("mtp.layers.1.transformer_layer.mlp.experts") for n in names)  # MoE like the last layer
    for name, p in model.named_parameters():
        ref = ref_grads[name].grad
        if ref is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert (p.grad - ref).abs().max() < 1e-5, name
    # MTP moved the shared embedding beyond the main loss alone
    emb = model.embedding.word_embeddings.weight.grad
    model.zero_grad()
    model.mtp = None
    ((model(tokens, labels=labels, loss_mask=mask) * mask).sum() / mask.sum()).backward()
    assert (emb - model.embedding.word_embeddings.weight.grad).abs().max() > 1e-4


def test_mtp_is_skipped_in_evaluation():
    cfg = make_config(MODEL)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups()).eval()
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        model(tokens, labels=tokens)
    assert model.mtp_metrics() == {}
