"""Importing Megatron-LM checkpoints (tools/checkpoint/convert.py --from megatron), checked by logits.

The Megatron-LM layouts are built here with plain torch from a random megalm model: ``torch_dist``
(stacked ``decoder.layers.*`` keys, Transformer Engine's fused norm names, ``_extra_state`` and RNG
byte entries, a padded vocabulary, an optimizer tensor, ``metadata.json``, ``common.pt`` with an
``argparse.Namespace`` holding a Megatron enum) and legacy ``mp_rank_XX_YYY/model_optim_rng.pt``
files (TP 2 x PP 2 shards with stage-local layer numbers, a tied output-layer copy on the last
stage, numpy RNG state).  The imported checkpoint's model must give the original logits.
"""

import argparse
import copy
import enum
import io
import json
import os
import random
import shutil
import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir
from megalm.conversion.errors import ConversionError
from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
from megalm.conversion.megatron import import_from_megatron
from megalm.conversion.megatron_args import GPTOSS_FIELDS
from megalm.conversion.megatron_pickles import MegatronPickleError
from megalm.conversion.verify import megalm_model_from_tensors
from megalm.fusions import EAGER
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from tests.configs import TINY_GPT, make_config

VOCAB, PADDED = 100, 128
GPT = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False, openai_gelu=True)
SQRELU = dict(GPT, openai_gelu=False, squared_relu=True)  # Megatron's --squared-relu (--no-bias-gelu-fusion)
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    rotary_base=500,
    norm_epsilon=1e-6,
    qk_layernorm=True,
)
# gpt-oss's layers (dense here): learnable sinks, sliding windows on every other layer, the clamped quick-GEGLU with
# biases, YaRN positions.  The clamp is small so that the random weights' fc1 outputs reach it.
GPTOSS = dict(
    position_embedding_type="rope",
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=8,
    yarn_correction_range_round_to_int=False,
    normalization="RMSNorm",
    quick_geglu=True,
    glu_linear_offset=1.0,
    activation_func_clamp_value=0.5,
    softmax_type="learnable",
    window_size=[3, 0],
    window_attn_skip_freq=2,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
)
TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


class AttnBackend(enum.Enum):  # pickled under Megatron-core's module name, as Megatron's args hold it
    auto = 5


@pytest.fixture(autouse=True)
def megatron_enum_module(monkeypatch):
    """A stand-in ``megatron.core.transformer.enums`` so that torch.save can pickle the enum by that name."""
    module = types.ModuleType("megatron.core.transformer.enums")
    AttnBackend.__module__ = module.__name__
    module.AttnBackend = AttnBackend
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)


def random_model(arch: str):
    fields = {"gpt": GPT, "llama": LLAMA, "gptoss": GPTOSS, "sqrelu": SQRELU}[arch]
    cfg = copy.deepcopy(make_config(TINY_GPT, fields, vocab_size=VOCAB))  # editable copy (frozen once validated)
    cfg.model.num_layers = 4
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    torch.manual_seed(0)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups())  # plain PyTorch: no compile time
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "softmax_offset")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name and "weight" in name else 0.0))
    return cfg, model.eval()


def megatron_args(cfg, tp=1, pp=1) -> argparse.Namespace:
    m = cfg.model
    return argparse.Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.head_dim,
        group_query_attention=m.group_query_attention,
        num_query_groups=m.num_query_groups,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        normalization=m.normalization,
        norm_epsilon=m.norm_epsilon,
        apply_layernorm_1p=False,
        qk_layernorm=m.qk_layernorm,
        swiglu=m.swiglu,
        squared_relu=m.squared_relu,
        # Megatron turns the fusion off without biases; it refuses it with --squared-relu
        bias_gelu_fusion=m.add_bias_linear and not m.squared_relu,
        openai_gelu=False,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        make_vocab_size_divisible_by=PADDED // tp,
        padded_vocab_size=PADDED,
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,  # Megatron's NullTokenizer adds the end-of-document id
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        data_path=["/data/x_text_document"],
        # gpt-oss's args, under the names Megatron-LM's parser gives them (defaults when not gpt-oss)
        window_size=None if m.window_size is None else tuple(m.window_size),
        **{name: getattr(m, name) for name in GPTOSS_FIELDS if name != "window_size"},
    )


def padded_params(model):
    """``{megalm name: full tensor}`` with the vocabulary rows padded to ``PADDED`` (random rows)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t[:VOCAB], torch.randn(PADDED - VOCAB, t.shape[1])])
        out[name] = t
    return out


def adam_state(name, weight):
    """The test's stand-in Adam state of a weight: ``exp_avg = w / 2``, ``exp_avg_sq = w^2``, ``fp32_param = w``."""
    return {"exp_avg": weight / 2, "exp_avg_sq": weight**2, "fp32_param": weight}[name]


def save_torch_dist(cfg, model, root, iteration=20, dtype=torch.float32, adam_step=None):
    """``adam_step``: also save Adam's state in model space (:func:`adam_state` of every weight) and the
    step in common.pt's optimizer param_groups; else one stray optimizer tensor."""
    path = checkpoint_dir(str(root), iteration)
    state, layers = {}, {}
    for name, t in padded_params(model).items():
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers.") :].split(".", 1)
            layers.setdefault(TE_NORMS.get(rest, rest), {})[int(i)] = t
        else:
            state[name] = t
    for rest, per_layer in layers.items():
        state["decoder.layers." + rest] = torch.stack([per_layer[i] for i in range(cfg.model.num_layers)])
    state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1"] = io.BytesIO(b"te fp8 state")
    state["rng_state/shard_0.0_1.1"] = io.BytesIO(b"rng")
    if adam_step is None:
        state["optimizer.state.exp_avg.output_layer.weight"] = torch.zeros(3)
    else:
        weights = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
        for s_name in ("exp_avg", "exp_avg_sq", "fp32_param"):
            state.update({f"optimizer.state.{s_name}.{k}": adam_state(s_name, v) for k, v in weights})
    model_keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")]
    state.update({k: state[k].to(dtype) for k in model_keys})
    dcp.save(state, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}, f)
    common = {"args": megatron_args(cfg), "checkpoint_version": 3.0, "iteration": iteration}
    if adam_step is not None:  # the distributed optimizer's common part: param_groups without params
        common["optimizer"] = {"optimizer": {"param_groups": [{"lr": 1e-4, "step": adam_step}]}}
    torch.save(common, f"{path}/common.pt")
    (root / TRACKER_FILENAME).write_text(str(iteration))


def tp_shard(name: str, t: torch.Tensor, r: int, tp: int, swiglu: bool) -> torch.Tensor:
    """TP rank ``r``'s shard of a full tensor, as Megatron-LM's layers hold it."""
    if swiglu and ".linear_fc1." in name:
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
    if name.endswith(("word_embeddings.weight", "output_layer.weight")) or ".linear_qkv." in name:
        return t.chunk(tp)[r]
    if ".linear_fc1." in name:
        return t.chunk(tp)[r]
    if name.endswith((".linear_proj.weight", ".linear_fc2.weight")):
        return t.chunk(tp, dim=1)[r]
    return t


def save_legacy(cfg, model, root, tp=2, pp=2, iteration=30):
    path = checkpoint_dir(str(root), iteration)
    full = padded_params(model)
    per_stage = cfg.model.num_layers // pp
    for stage in range(pp):
        first, last = stage * per_stage, (stage + 1) * per_stage
        sd = {}
        for name, t in full.items():
            if name.startswith("decoder.layers."):
                i, rest = name[len("decoder.layers.") :].split(".", 1)
                if first <= int(i) < last:
                    sd[f"decoder.layers.{int(i) - first}.{rest}"] = t
            elif name.startswith("embedding.") and stage == 0:
                sd[name] = t
            elif name.startswith(("decoder.final_layernorm", "output_layer")) and stage == pp - 1:
                sd[name] = t
        if stage == pp - 1 and not cfg.model.untie_embeddings_and_output_weights:
            sd["output_layer.weight"] = full["embedding.word_embeddings.weight"]  # the tied copy
        sd["decoder.layers.0.self_attention.core_attention._extra_state"] = io.BytesIO(b"te")
        for r in range(tp):
            swiglu = cfg.model.swiglu
            shard = {k: v if k.endswith("_extra_state") else tp_shard(k, v, r, tp, swiglu) for k, v in sd.items()}
            os.makedirs(f"{path}/mp_rank_{r:02d}_{stage:03d}")
            state = {
                "args": megatron_args(cfg, tp, pp),
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": shard,
                "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]}},
                "rng_state": [
                    {
                        "random_rng_state": random.getstate(),
                        "np_rng_state": np.random.get_state(),
                        "torch_rng_state": torch.get_rng_state(),
                        "rng_tracker_states": {},
                    }
                ],
            }
            torch.save(state, f"{path}/mp_rank_{r:02d}_{stage:03d}/model_optim_rng.pt")
    (root / TRACKER_FILENAME).write_text(str(iteration))


def imported_logits(save_dir, ids):
    reader = MegalmCheckpointReader(str(save_dir))
    model = megalm_model_from_tensors(reader.config, reader.load(reader.model_names))
    with torch.no_grad():
        return model(ids)[..., :VOCAB], reader


@pytest.mark.parametrize("arch", ["gpt", "llama", "gptoss", "sqrelu"])
def test_import_torch_dist_and_legacy_give_the_same_logits(arch, tmp_path):
    cfg, model = random_model(arch)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids)[..., :VOCAB]
    assert reference.abs().max() > 1.0
    for layout, save in (("torch_dist", save_torch_dist), ("legacy", save_legacy)):
        src, dst = tmp_path / f"megatron_{layout}", tmp_path / f"megalm_{layout}"
        src.mkdir()
        save(cfg, model, src)
        r = import_from_megatron(str(src), str(dst), extra_args=["--tensor-model-parallel-size", "2"])
        logits, reader = imported_logits(dst, ids)
        assert (logits - reference).abs().max() <= 1e-6, (arch, layout)
        m = reader.config.model
        assert m.vocab_size == VOCAB and m.openai_gelu == (arch == "gpt") and m.num_layers == 4
        assert m.squared_relu == (arch == "sqrelu")
        assert reader.config.parallel.tensor_model_parallel_size == 2  # the recorded target layout
        assert reader.shape("embedding.word_embeddings.weight") == (VOCAB, 32)
        assert any("optimizer state" in n and "not imported" in n for n in r.notes)
        if arch == "gpt":
            assert any("tanh approximation" in n for n in r.notes)
        if arch == "gptoss":  # each gpt-oss part recorded (and so in the logits above)
            assert {k: getattr(m, k) for k in GPTOSS} == {k: getattr(cfg.model, k) for k in GPTOSS}
            assert (m.window_size, m.softmax_type, m.quick_geglu, m.rope_type) == ([3, 0], "learnable", True, "yarn")

    # Megatron's GELU with the fusion off is the exact one: a tanh model's logits then differ.
    args_exact = megatron_args(cfg)
    args_exact.bias_gelu_fusion = False
    if arch == "gpt":
        from megalm.conversion.megatron_args import megalm_fields

        fields, _ = megalm_fields(vars(args_exact), "x", VOCAB)
        assert fields["openai_gelu"] is False
    if arch == "sqrelu":  # squared ReLU is never a GELU, whatever the saved fusion flag says
        from megalm.conversion.megatron_args import megalm_fields

        args_fused = megatron_args(cfg)
        args_fused.bias_gelu_fusion = True
        fields, notes = megalm_fields(vars(args_fused), "x", VOCAB)
        assert fields["squared_relu"] is True and fields["openai_gelu"] is False and not notes


def test_refusals_name_the_file_and_run_nothing(tmp_path):
    cfg, model = random_model("llama")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    src = tmp_path / "dist"
    src.mkdir()
    save_torch_dist(cfg, model, src)
    common = checkpoint_dir(str(src), 20) + "/common.pt"
    torch.save({"args": Evil(), "iteration": 20}, common)
    with pytest.raises(MegatronPickleError, match=f"{common}: refusing to unpickle the global .*system"):
        import_from_megatron(str(src), str(tmp_path / "out1"))

    # --ignore-saved-args: common.pt is never opened; the architecture is the flags, checked by shapes.
    flags = (
        "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 48 --group-query-attention "
        "--num-query-groups 2 --position-embedding-type rope --rotary-base 500 --normalization RMSNorm "
        "--norm-epsilon 1e-6 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --qk-layernorm "
        "--seq-length 16 --vocab-size 100"
    ).split()
    r = import_from_megatron(str(src), str(tmp_path / "flags"), extra_args=flags, use_saved_args=False)
    assert any("common.pt not read" in n for n in r.notes)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (imported_logits(tmp_path / "flags", ids)[0] - model(ids)[..., :VOCAB]).abs().max() <= 1e-6
    wrong = [f if f != "48" else "40" for f in flags]
    with pytest.raises(ConversionError, match="linear_fc1.weight has shape .*the megalm flags imply"):
        import_from_megatron(str(src), str(tmp_path / "flags2"), extra_args=wrong, use_saved_args=False)

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_legacy(cfg, model, legacy)
    file = checkpoint_dir(str(legacy), 30) + "/mp_rank_01_001/model_optim_rng.pt"
    torch.save({"args": megatron_args(cfg, 2, 2), "model": {"x": Evil()}}, file)
    with pytest.raises(MegatronPickleError, match=f"{file}: refusing to unpickle"):
        import_from_megatron(str(legacy), str(tmp_path / "out2"))
    assert not marker.exists()

    # What megalm cannot represent is refused by flag; architecture flags must agree with the saved args.
    torch.save({"args": megatron_args(cfg), "iteration": 20}, common)  # a clean common.pt again
    args = megatron_args(cfg)
    args.multi_latent_attention, args.rotary_interleaved = True, True
    torch.save({"args": args, "iteration": 20}, common)
    with pytest.raises(ConversionError, match="--multi-latent-attention True .*--rotary-interleaved True"):
        import_from_megatron(str(src), str(tmp_path / "out3"))
    torch.save({"args": megatron_args(cfg), "iteration": 20}, common)
    with pytest.raises(ConversionError, match="--hidden-size 64 disagrees"):
        import_from_megatron(str(src), str(tmp_path / "out4"), extra_args=["--hidden-size", "64"])
    args = megatron_args(cfg)
    args.ffn_hidden_size = 40  # the saved tensors are 48 wide
    torch.save({"args": args, "iteration": 20}, common)
    with pytest.raises(ConversionError, match="linear_fc1.weight has shape .*the saved args imply"):
        import_from_megatron(str(src), str(tmp_path / "out5"))
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists() and not marker.exists()

    # Mixed directory forms, a missing stage and pre-mcore model names are refused by name.
    iter_dir = checkpoint_dir(str(legacy), 30)
    os.rename(f"{iter_dir}/mp_rank_01_001", f"{iter_dir}/mp_rank_01_001_001")
    with pytest.raises(ConversionError, match="mp_rank_ directories of mixed forms"):
        import_from_megatron(str(legacy), str(tmp_path / "out6"))
    for name in ("mp_rank_00_001", "mp_rank_01_001_001"):  # a stage missing: the files do not match the args
        shutil.rmtree(f"{iter_dir}/{name}")
    with pytest.raises(ConversionError, match="the saved args give PP 2 x EP 1, the directory holds TP 2 x PP 1"):
        import_from_megatron(str(legacy), str(tmp_path / "out7"))
    from megalm.conversion.megatron import to_megalm_names

    with pytest.raises(ConversionError, match="language_model.embedding.* legacy \\(pre-mcore\\) model"):
        to_megalm_names({"language_model.embedding.word_embeddings.weight": torch.zeros(1)}, cfg.model, "f")


def test_convert_cli_from_megatron(tmp_path, capsys):
    import runpy

    cfg, model = random_model("gpt")
    src = tmp_path / "megatron"
    src.mkdir()
    save_torch_dist(cfg, model, src, dtype=torch.bfloat16)  # a --bf16 run's model weights
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools/checkpoint/convert.py")
    main = runpy.run_path(script)["main"]
    assert main(["--from", "megatron", "--load-dir", str(src), "--save-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM torch_dist iter_0000020 ->" in out and "--openai-gelu" in out
    assert "vocabulary 100 from the tokenizer named in the saved args (the saved padded size was 128)" in out
    assert "weights imported in bfloat16; the fp32 main copies in Megatron's optimizer state are not read" in out
    assert MegalmCheckpointReader(str(tmp_path / "out")).dtype("decoder.final_layernorm.weight") == torch.bfloat16


def test_openai_gelu_is_megatrons_fused_bias_gelu():
    """``--openai-gelu`` computes Megatron's ``bias_gelu_impl`` formula (tanh), not the erf GELU;
    the GPT-2 mapping writes and reads it as Hugging Face's ``gelu_new``."""
    from megalm.conversion.gpt2 import GPT2
    from megalm.fusions.activations import bias_gelu, bias_gelu_tanh

    x, b = torch.randn(64, 8, dtype=torch.float64) * 3, torch.randn(8, dtype=torch.float64)
    y = x + b
    megatron = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
    assert (bias_gelu_tanh.eager(x, b) - megatron).abs().max() < 1e-7
    assert (bias_gelu.eager(x, b) - megatron).abs().max() > 1e-4
    cfg = make_config(TINY_GPT, GPT, vocab_size=VOCAB)
    hf = GPT2().hf_config(cfg.model, "float32", {})
    assert hf["activation_function"] == "gelu_new" and GPT2().megalm_fields(hf)["openai_gelu"] is True
    hf = GPT2().hf_config(make_config(TINY_GPT, SQRELU, vocab_size=VOCAB).model, "float32", {})
    fields = GPT2().megalm_fields(hf)  # transformers' "relu2" reads back as --squared-relu
    assert hf["activation_function"] == "relu2" and fields["squared_relu"] and not fields["openai_gelu"]
    hf["activation_function"] = "relu"
    with pytest.raises(ConversionError, match="activation_function = 'relu'.*'relu2', --squared-relu"):
        GPT2().megalm_fields(hf)


def test_true_vocabulary_size():
    from megalm.conversion.megatron_args import true_vocab_size

    null = {"tokenizer_type": "NullTokenizer", "vocab_size": 99, "padded_vocab_size": 128}
    assert true_vocab_size(null, None, None)[0] == 100  # + the end-of-document id
    assert true_vocab_size(null, 120, 100) == (120, "--vocab-size")
    hf = {"tokenizer_type": "HuggingFaceTokenizer", "vocab_size": None, "padded_vocab_size": 128}
    assert true_vocab_size(hf, None, 110) == (110, "the tokenizer named in the saved args")
    with pytest.raises(ConversionError, match="give --vocab-size N"):
        true_vocab_size(hf, None, None)
    with pytest.raises(ConversionError, match="--vocab-size 200 is larger than the saved padded vocabulary 128"):
        true_vocab_size(hf, 200, None)


def test_vocabulary_from_the_saved_tokenizer(tmp_path):
    """The tokenizer the saved args name gives the vocabulary and is recorded; a moved file is named in
    a note and ``--tokenizer-model`` points to its new place."""
    pytest.importorskip("sentencepiece")
    from tests.test_tokenizers import make_sp_model

    sp = make_sp_model(tmp_path, vocab_size=VOCAB)
    cfg, model = random_model("llama")
    src = tmp_path / "megatron"
    src.mkdir()
    save_torch_dist(cfg, model, src)
    common = checkpoint_dir(str(src), 20) + "/common.pt"
    args = megatron_args(cfg)
    args.tokenizer_type, args.tokenizer_model, args.vocab_size = "SentencePieceTokenizer", "/moved/tok.model", None
    torch.save({"args": args, "iteration": 20}, common)
    with pytest.raises(ConversionError, match="give --vocab-size N.*saved tokenizer could not be opened.*moved/tok"):
        import_from_megatron(str(src), str(tmp_path / "out1"))
    r = import_from_megatron(str(src), str(tmp_path / "out2"), extra_args=["--tokenizer-model", sp])
    assert r.config.data.tokenizer_type == "SentencePieceTokenizer" and r.config.data.tokenizer_model == sp
    assert r.config.model.vocab_size == VOCAB and "from the tokenizer named in the saved args" in r.notes[0]


def test_adam_state_imports_and_loads_into_megalms_optimizer(tmp_path):
    """Model-space Adam state (moments, fp32 main weights) maps like the weights and loads with --load."""

    cfg, model = random_model("llama")
    src, dst = tmp_path / "megatron", tmp_path / "megalm"
    src.mkdir()
    save_torch_dist(cfg, model, src, dtype=torch.bfloat16, adam_step=7)
    r = import_from_megatron(str(src), str(dst))
    assert any("Adam's optimizer state imported (moments and fp32 main weights, step 7)" in n for n in r.notes)
    assert any("fp32 main copies in Megatron's optimizer state are imported" in n for n in r.notes)

    assert_imported_adam_state(dst, MegalmCheckpointReader(str(dst)).config, model, step=7)


def assert_imported_adam_state(dst, loaded_cfg, model, step):
    """The megalm checkpoint at ``dst`` (config ``loaded_cfg``, edited) loads with --load into a bf16 model with
    megalm's Adam: its fp32 main weights and moments equal :func:`adam_state` of ``model``'s weights exactly (not
    rounded to bf16), its step is ``step``, and the bf16 weights are ``model``'s rounded."""
    from megalm.checkpoint.load import load_checkpoint
    from megalm.config import set_vocab_size
    from megalm.distributed import DistributedDataParallel
    from megalm.optimizer import build_optimizer

    loaded_cfg.training.bf16, loaded_cfg.training.optimizer = True, "adam"  # a --bf16 run: fp32 main weights
    loaded_cfg.parallel.tensor_model_parallel_size = 1
    set_vocab_size(loaded_cfg, VOCAB)
    target = GPTModel(loaded_cfg, fusion_plan=EAGER, process_groups=get_process_groups()).to(torch.bfloat16)
    ddp = DistributedDataParallel(target, loaded_cfg.parallel, process_groups=get_process_groups())
    optimizer = build_optimizer(loaded_cfg, [ddp], report_memory=False, process_groups=get_process_groups())
    load_checkpoint(str(dst), [ddp], optimizer)
    state = optimizer.sharded_param_state()
    originals = dict(model.named_parameters())
    for name, p in target.named_parameters():
        full = originals[name].detach()
        assert torch.equal(p.detach(), full.to(torch.bfloat16)), name
        for key in ("exp_avg", "exp_avg_sq", "main_param"):
            expected = adam_state({"main_param": "fp32_param"}.get(key, key), full).reshape(state[name][key].shape)
            assert torch.equal(state[name][key], expected), (name, key)  # fp32 masters: exact, not bf16
        assert int(state[name]["step"]) == step
