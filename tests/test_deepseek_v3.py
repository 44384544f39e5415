"""Multi-latent attention and the DeepSeek-V3 mapping against transformers' ``DeepseekV3ForCausalLM``.

A tiny random HF model (dense first layer, then MoE layers with sigmoid group-limited routing, a
non-zero correction bias, shared experts; MLA with query and key/value latents, YaRN RoPE with
both mscales) is saved, imported into megalm, and must give the same logits (fp32, 1e-5), the same
loss and the same weights after one SGD step; exported back, HF loads every tensor and greedy
tokens (megalm with its compressed KV cache, HF and the re-exported HF) are equal.
"""

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

VOCAB = 96
HF_DSV3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=48,
    moe_intermediate_size=20,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    initializer_range=0.2,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    rms_norm_eps=1e-6,
)


def _hf_model(directory=None, seed=0):
    import transformers

    if directory is not None:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        return model.eval()
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**HF_DSV3)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megalm.conversion.import_hf import import_from_hf

    tmp = tmp_path_factory.mktemp("dsv3")
    hf = _hf_model()
    hf.save_pretrained(tmp / "hf")
    result = import_from_hf(str(tmp / "hf"), str(tmp / "ckpt"), ["--tokenizer-type", "NullTokenizer"])
    return {"tmp": tmp, "hf": hf, "import": result}


def _megalm(converted):
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors

    reader = MegalmCheckpointReader(str(converted["tmp"] / "ckpt"))
    tensors = reader.load(reader.model_names)
    return megalm_model_from_tensors(reader.config, tensors), reader.config


def tokens(n=2, s=12, seed=0):
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


def test_yarn_tables_match_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megalm.transformer.yarn import YarnScaling

    config = transformers.DeepseekV3Config(**HF_DSV3)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    p = HF_DSV3["rope_parameters"]
    yarn = YarnScaling(p["factor"], p["original_max_position_embeddings"], 32.0, 1.0, p["mscale"], p["mscale_all_dim"])
    assert torch.allclose(yarn.inv_freq(8, 1000.0), inv_freq, rtol=0, atol=1e-7)
    assert abs(yarn.table_scale - attention_factor) < 1e-12 and yarn.table_scale != 1.0
    # plain frequencies are somewhere kept, somewhere divided by the factor
    plain = 1.0 / 1000.0 ** (torch.arange(0, 8, 2) / 8)
    assert torch.isclose(inv_freq[0], plain[0]) and torch.isclose(inv_freq[-1], plain[-1] / 4)


def test_import_config(converted):
    m = converted["import"].config.model
    assert m.multi_latent_attention and m.qk_layernorm and m.rope_type == "yarn"
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (24, 16, 16, 8, 12)
    assert m.moe_layer_freq == [0, 1, 1] and m.num_experts == 8 and m.moe_shared_expert_intermediate_size == 40
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (4, 2, 2.5)


def test_logits_and_one_training_step_match_transformers(converted):
    hf = converted["hf"]
    model, cfg = _megalm(converted)
    ids = tokens()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = model(ids)[..., :VOCAB]
    assert (out - ref).abs().max() < 1e-5, (out - ref).abs().max()
    assert ref.std() > 0.5  # not a degenerate model

    # One SGD step on the mean next-token loss, then the logits again.
    labels = tokens(seed=1)
    hf.train(), model.train()
    hf_loss = F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss = model(ids, labels=labels).mean()
    assert abs(loss.item() - hf_loss.item()) < 1e-5
    hf_loss.backward(), loss.backward()
    # Every gradient, HF's mapped to megalm's names by the importer's own mapping (5.x fused experts).
    from megalm.conversion.deepseek_v3 import DeepseekV3

    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    hf_grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers() if n.endswith("correction_bias")})
    mapped = dict(DeepseekV3().to_megalm(cfg.model, hf_grads.__getitem__, list(hf_grads)))
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) <= set(mapped) and len(grads) == len(mapped) - 2  # + the two routers' expert bias
    for name, grad in grads.items():
        g = grad[:VOCAB] if "embedding" in name or "output_layer" in name else grad
        assert (g - mapped[name].reshape(g.shape)).abs().max() < 1e-5, name
    with torch.no_grad():
        for module in (hf, model):
            for p in module.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    hf.eval(), model.eval()
    with torch.no_grad():
        ref, out = hf(input_ids=ids).logits, model(ids)[..., :VOCAB]
    assert (out - ref).abs().max() < 1e-5 * ref.abs().max(), (out - ref).abs().max()  # relative after the step
    moved = model.decoder.layers["1"].self_attention.linear_kv_up_proj.weight.grad.abs().max()
    assert moved > 1e-4  # the step changed the latent projections


def test_export_round_trip_and_cached_greedy_tokens(converted):
    from megalm.conversion.export_hf import export_to_hf
    from megalm.inference.generation import generate

    tmp = converted["tmp"]
    hf = _hf_model()  # the untrained reference (the module fixture's model took a step)
    result = export_to_hf(str(tmp / "ckpt"), str(tmp / "hf_out"))
    assert result.architecture == "DeepseekV3ForCausalLM"
    config = json.loads((tmp / "hf_out" / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 2
    assert config["rope_parameters"]["mscale_all_dim"] == 0.8
    exported = _hf_model(tmp / "hf_out")
    model, _ = _megalm(converted)
    prompt = tokens(1, 5, seed=3)
    hf_tokens = hf.generate(prompt, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    out_tokens = exported.generate(prompt, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    cached = generate(model, prompt[0].tolist(), 10, use_cache=True).generated_ids
    uncached = generate(model, prompt[0].tolist(), 10, use_cache=False).generated_ids
    assert hf_tokens == out_tokens == cached == uncached
    assert len(set(hf_tokens)) > 1
