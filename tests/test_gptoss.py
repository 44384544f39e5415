"""gpt-oss in megalm against transformers' ``GptOssForCausalLM`` (tiny, random, fp32, no download):
sliding-window attention on alternate layers, learnable sinks, clamped quick-GEGLU experts with biases,
a biased router and YaRN positions.  Imported with the converter, logits and one SGD step equal HF's
within 1e-5 in each attention core (SDPA, blocked, unfused); export gives back the same tensors and
the same greedy tokens.  The cores' window / sink math is checked against an explicit softmax in fp64.
"""

import dataclasses
import importlib.util

import pytest
import torch

from megalm.config import ConfigError, build_parser, config_from_args, validate_config
from megalm.config.gptoss import layer_window
from megalm.transformer.attention_variants import variant_attention
from megalm.transformer.blocked_attention import blocked_causal_attention

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
VOCAB = 96


def hf_config(**over):
    from transformers import GptOssConfig

    rope = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False)
    rope.update(original_max_position_embeddings=16, rope_theta=1000.0)
    kw = dict(
        num_hidden_layers=3,
        num_local_experts=4,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        rope_parameters=rope,
        swiglu_limit=2.0,
    )
    kw.update(over)
    return GptOssConfig(**kw)


def hf_model(directory):
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(hf_config())
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.3)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.add_(1.0)
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(str(directory))
    return model.eval()


def tokens(n=2, s=24, seed=1):
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


def _loss(logits_fn, ids):
    return torch.nn.functional.cross_entropy(logits_fn(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@needs_hf
def test_import_logits_train_step_and_round_trip_match_transformers(tmp_path):
    from safetensors.torch import load_file

    from megalm.conversion.export_hf import export_to_hf
    from megalm.conversion.import_hf import import_from_hf
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors
    from megalm.fusions import EAGER

    reference = hf_model(tmp_path / "hf")
    extra = ["--tokenizer-type", "NullTokenizer", "--moe-aux-loss-coeff", "0", "--seq-length", "32"]
    result = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), extra_args=extra)
    m = result.config.model
    assert m.window_size == [4, 0] and m.softmax_type == "learnable" and m.rope_type == "yarn"
    assert [layer_window(m, i) for i in range(3)] == [4, None, 4]  # HF layer_types: sliding, full, sliding
    reader = MegalmCheckpointReader(str(tmp_path / "ckpt"))
    tensors = reader.load(reader.model_names)
    ids = tokens()
    hf_logits = lambda model: lambda x: model(input_ids=x).logits  # noqa: E731
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    assert expected.abs().max() > 1.0  # the clamps and sinks matter at this scale
    for backend in ("sdpa", "blocked", "unfused"):
        ours = megalm_model_from_tensors(reader.config, tensors)
        plan = dataclasses.replace(EAGER, attention=backend)
        from megalm.models import GPTModel

        model = GPTModel(reader.config, fusion_plan=plan)
        model.load_state_dict(ours.state_dict())
        model.eval()
        with torch.no_grad():
            assert (model(ids)[..., :VOCAB] - expected).abs().max() < 1e-5, backend
    # One training step: the same loss, and every gradient, mapped to HF's layout by the converter, equal
    # (relative to the tensor's largest gradient); the SGD step then leaves the two models equal.
    from megalm.conversion.gptoss import GptOss

    hf = hf_model(tmp_path / "hf2")
    loss_hf, loss_ours = _loss(hf_logits(hf), ids), _loss(lambda x: model(x)[..., :VOCAB], ids)
    assert abs(loss_hf - loss_ours) < 1e-5
    loss_hf.backward()
    loss_ours.backward()
    ours_grads = {name: p.grad for name, p in model.named_parameters()}
    mapped = dict(GptOss().to_hf(m, lambda names: {n: ours_grads[n] for n in names}))
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert set(mapped) == set(hf_grads)
    for name, grad in hf_grads.items():  # (megalm pads the vocabulary rows to 128)
        assert (mapped[name][: grad.shape[0]] - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max()), name
    with torch.no_grad():
        for module in (hf, model):
            for p in module.parameters():
                p.sub_(0.01 * p.grad)
        after = hf(input_ids=ids).logits
        assert (after - expected).abs().max() > 1e-2  # the step moved the model
        assert (model(ids)[..., :VOCAB] - after).abs().max() < 1e-4
    # Export: the same tensors, the same greedy tokens.
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    original, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in back)
    from transformers import GptOssForCausalLM

    again = GptOssForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    prompt = ids[:1, :6]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    first = reference.generate(prompt, **kw)
    assert torch.equal(again.generate(prompt, **kw), first)
    greedy = prompt
    with torch.no_grad():
        for _ in range(8):
            greedy = torch.cat([greedy, ours(greedy)[:, -1, :VOCAB].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, first)


@pytest.mark.parametrize(
    "window, sinks, doc", [(None, False, False), (5, False, False), (70, True, False), (40, True, True)]
)
def test_blocked_and_sdpa_cores_equal_explicit_softmax(window, sinks, doc):
    torch.manual_seed(0)
    b, n, s, d = 2, 3, 150, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sink = torch.randn(n, dtype=torch.float64, requires_grad=True) if sinks else None
    mask = None
    if doc:
        docs = torch.tensor([0] * 60 + [1] * 50 + [2] * 40)
        mask = ((docs[:, None] == docs[None]) & torch.ones(s, s, dtype=torch.bool).tril()).expand(b, 1, s, s).clone()
    i = torch.arange(s)
    ok = (i[:, None] >= i[None]) & ((i[:, None] - i[None] <= window) if window is not None else True)
    ok = ok & mask if mask is not None else ok
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~ok, float("-inf"))
    if sinks:
        scores = torch.cat([scores, sink.view(1, n, 1, 1).expand(b, n, s, 1)], -1)
    ref = scores.softmax(-1)[..., :s] @ v
    params = [q, k, v] + ([sink] if sinks else [])
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad((ref * grad).sum(), params)
    for core in (variant_attention, blocked_causal_attention):
        out = core(
            q,
            k,
            v,
            window=window,
            sinks=sink,
            **({"doc_mask": mask} if core is variant_attention else {"allowed": mask}),
        )
        assert (out - ref).abs().max() < 1e-12
        for got, want in zip(torch.autograd.grad((out * grad).sum(), params), expected):
            assert (got - want).abs().max() < 1e-12


def _validate(*flags, world_size=1):
    cfg = config_from_args(build_parser().parse_args(list(flags)))
    return validate_config(cfg, world_size=world_size)


def test_gptoss_flags_parse_and_refusals():
    m = _validate("--window-size", "127,0", "--window-attn-skip-freq", "2", "--num-layers", "4").model
    assert m.window_size == [127, 0] and [layer_window(m, i) for i in range(4)] == [127, None, 127, None]
    m = _validate("--window-size", "(3,0)", "--window-attn-skip-freq", "[1,0,0,1]", "--num-layers", "4").model
    assert [layer_window(m, i) for i in range(4)] == [3, None, None, 3]
    m = _validate("--enable-gpt-oss", "--position-embedding-type", "rope").model
    assert m.rope_type == "yarn" and m.rotary_scaling_factor == 32.0
    assert m.original_max_position_embeddings == 131072 and m.yarn_correction_range_round_to_int is False
    assert _validate("--position-embedding-type", "yarn").model.rope_type == "yarn"
    m = _validate("--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0").model
    assert m.gated_linear_unit and m.ffn_hidden_size == 320  # 8/3 h rounded to 64, as SwiGLU
    for flags, words in (
        (("--window-size", "4,2"), "right must be 0"),
        (("--swiglu", "--quick-geglu"), "two gated MLPs"),
        (("--glu-linear-offset", "1.0"), "gated MLP"),
        (("--window-attn-skip-freq", "2"), "needs --window-size"),
        (("--softmax-type", "learnable", "--transformer-impl", "transformer_engine"), "--transformer-impl local"),
    ):
        with pytest.raises(ConfigError, match=words):
            _validate(*flags)
    with pytest.raises(ConfigError, match="a2a or allgather"):
        _validate(
            "--softmax-type", "learnable", "--context-parallel-size", "2", "--attention-dropout", "0", world_size=2
        )


def test_flops_count_window_layers_keys_and_sink_parameters():
    """Sliding-window layers count min(s, w + 1) keys per query in QK^T and AV (Megatron's full-square
    convention otherwise); the sinks are n parameters per layer in the estimate, as in the built model."""
    from megalm.config import set_vocab_size
    from megalm.estimate.parameters import total_parameters
    from megalm.flops import num_floating_point_operations
    from megalm.models import GPTModel

    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    plain = _validate(*base, "--vocab-size", "128")
    windowed = _validate(*base, "--vocab-size", "128", "--window-size", "7,0", "--window-attn-skip-freq", "2")
    for cfg in (plain, windowed):
        set_vocab_size(cfg, 128)
    b, s, nd = 3, 32, 64
    diff = num_floating_point_operations(windowed, b) - num_floating_point_operations(plain, b)
    assert diff == pytest.approx(12 * b * s * nd * 2 * (8 - 32))  # layers 1 and 3 slide: 8 keys instead of 32
    sinks = _validate(*base, "--vocab-size", "128", "--softmax-type", "learnable")
    set_vocab_size(sinks, 128)
    assert total_parameters(sinks) - total_parameters(plain) == 4 * 4
    assert total_parameters(sinks) == sum(p.numel() for p in GPTModel(sinks).parameters())
