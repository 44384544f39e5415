"""Checkpoint conversion megalm <-> Hugging Face transformers, checked by logits (fp32, 1e-4).

Models are tiny and random (init std 0.3 and random norms/biases, so that a wrong mapping moves
the logits by far more than the tolerance): megalm models saved with megalm.checkpoint,
transformers models built from a config in this process (no downloads).
"""

import copy
import json
import os
import runpy
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is needed to load the exported models")

from megalm.checkpoint.common_json import read_common  # noqa: E402
from megalm.checkpoint.load import load_checkpoint  # noqa: E402
from megalm.checkpoint.resume import find_checkpoint  # noqa: E402
from megalm.checkpoint.save import save_checkpoint  # noqa: E402
from megalm.config import MegalmConfig  # noqa: E402
from megalm.conversion.errors import ConversionError  # noqa: E402
from megalm.conversion.export_hf import export_to_hf  # noqa: E402
from megalm.conversion.import_hf import import_from_hf  # noqa: E402
from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader  # noqa: E402
from megalm.conversion.verify import megalm_model_from_tensors  # noqa: E402
from megalm.parallel_state import get_process_groups  # noqa: E402
from tests.checkpoint_fixtures import LLAMA, save_random_model  # noqa: E402
from tests.configs import TINY_GPT, make_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 120
GPT2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False)


# The tiny GPT of the conversion tests (the tests add the architecture and a tokenizer).
MODEL = dict(TINY_GPT, vocab_size=VOCAB)


def tokens(n=3, s=16, seed=0):
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    from tests.test_tokenizers import make_sp_model

    return make_sp_model(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)


@pytest.mark.parametrize("arch", ["llama-gqa-bias-untied", "gpt2-tied", "gpt2-squared-relu"])
def test_export_logits_match_transformers(arch, tmp_path, sp_model):
    cfg = make_config(
        MODEL,
        LLAMA if arch.startswith("llama") else GPT2,
        dict(squared_relu=True) if arch.endswith("squared-relu") else {},
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=sp_model,
    )
    model = save_random_model(cfg, tmp_path / "ckpt")
    result = export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_bytes=20_000)
    assert result.iteration == 7 and len(result.files) > 1  # sharded, with an index
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [result.architecture]
    if arch.startswith("gpt2"):  # --squared-relu is transformers' ReLUSquaredActivation
        assert config["activation_function"] == ("relu2" if arch.endswith("squared-relu") else "gelu")
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
    theirs = hf_logits(tmp_path / "hf", ids)
    assert ours.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (ours - theirs).abs().max() < 1e-4

    # The tokenizer loads with transformers and gives the ids megalm trained on.
    import sentencepiece as spm

    from tests.test_tokenizers import sample_texts

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    for text in sample_texts(5, seed=4):
        assert tok(text).input_ids == sp.encode(text)
    assert config["eos_token_id"] == sp.eos_id() and tok.eos_token_id == sp.eos_id()


def _hf_model(kind, tmp_path):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=1000.0,
            initializer_range=0.3,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            activation_function="gelu",
            initializer_range=0.3,
        )
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(tmp_path / "hf"))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_logits_match_transformers_and_round_trip(kind, tmp_path):
    hf_model = _hf_model(kind, tmp_path)
    result = import_from_hf(
        str(tmp_path / "hf"),
        str(tmp_path / "ckpt"),
        extra_args=["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--seq-length", "16"],
    )
    common = json.loads(Path(result.path, "common.json").read_text())
    assert common["layout"]["tensor_model_parallel_size"] == 2 and common["layout"]["pipeline_model_parallel_size"] == 2
    assert common["config"]["model"]["seq_length"] == 16 and common["iteration"] == 0
    reader = MegalmCheckpointReader(str(tmp_path / "ckpt"))
    ours = megalm_model_from_tensors(reader.config, reader.load(reader.model_names))
    ids = tokens()
    with torch.no_grad():
        diff = (ours(ids)[..., :VOCAB] - hf_model(input_ids=ids).logits).abs().max()
    assert diff < 1e-4

    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    from safetensors.torch import load_file

    original, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(back) <= set(original)
    assert all(torch.equal(back[k], original[k]) for k in back)


def test_import_refusals(tmp_path):
    _hf_model("llama", tmp_path)
    hf = tmp_path / "hf"
    config = json.loads((hf / "config.json").read_text())

    def refused(change, match, weights=None):
        d = tmp_path / f"case{len(os.listdir(tmp_path))}"
        shutil.copytree(hf, d)
        cfg = dict(config)
        change(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        if weights:
            weights(d)
        with pytest.raises(ConversionError, match=match):
            import_from_hf(str(d), str(tmp_path / "out"))

    refused(lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling")
    refused(lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type")
    refused(lambda c: c.update(attention_bias=True), "attention_bias")
    refused(lambda c: c.update(hidden_act="gelu"), "hidden_act")
    refused(lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings")
    refused(lambda c: c.update(model_type="mixtral"), "mixture-of-experts")
    refused(lambda c: c.update(model_type="t5"), "model_type")
    refused(
        lambda c: None,
        "pickle",
        weights=lambda d: (os.remove(d / "model.safetensors"), (d / "pytorch_model.bin").write_bytes(b"x")),
    )
    with pytest.raises(ConversionError, match="num-layers"):
        import_from_hf(str(hf), str(tmp_path / "out2"), extra_args=["--num-layers", "5"])


def test_export_refusals(tmp_path):
    for i, (model, match) in enumerate(
        [
            (dict(position_embedding_type="rope"), "no Hugging Face architecture"),
            (dict(LLAMA, rotary_percent=0.5), "rotary-percent"),
            (dict(LLAMA, num_experts=4), "mixture-of-experts"),
            (dict(LLAMA, swiglu=False, squared_relu=True), "--squared-relu MLP \\(needs --swiglu\\)"),
        ]
    ):
        cfg = make_config(MODEL, model)
        root = tmp_path / f"c{i}"
        save_random_model(cfg, root)
        with pytest.raises(ConversionError, match=match):
            export_to_hf(str(root), str(tmp_path / f"hf{i}"))


def test_mixed_precision_export_reads_fp32_main_params(tmp_path):
    from megalm.models import GPTModel
    from megalm.optimizer import build_optimizer

    cfg = copy.deepcopy(make_config(MODEL, LLAMA))  # an editable copy: the validated config is frozen
    cfg.training.bf16 = True
    model = GPTModel(cfg, process_groups=get_process_groups()).to(torch.bfloat16)
    optimizer = build_optimizer(cfg, [model], process_groups=get_process_groups())
    with torch.no_grad():
        for main in optimizer.main_params:
            main.add_(1e-4)  # fp32 values that bf16 cannot hold
    save_checkpoint(str(tmp_path / "ckpt"), 1, [model], optimizer, config=cfg.to_dict())
    reader = MegalmCheckpointReader(str(tmp_path / "ckpt"))
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert reader.dtype(name) == torch.bfloat16
    main = dict(zip(optimizer.names, optimizer.main_params))[name]
    assert torch.equal(reader.load([name])[name], main.detach())
    result = export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result.dtype == "bfloat16"


def _tp2_train_and_logits(argv, ids):
    """On 2 ranks: train TP 2 (+SP) through pretrain(), reload the checkpoint, return the gathered logits."""
    import pretrain_gpt
    from megalm import parallel_state
    from megalm.models import GPTModel
    from megalm.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megalm.training import pretrain

    pretrain(pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
    save = argv[argv.index("--save") + 1]
    cfg = MegalmConfig.from_dict(read_common(find_checkpoint(save))["config"])
    model = GPTModel(cfg, process_groups=get_process_groups())
    load_checkpoint(cfg.checkpoint.save, [model], finetune=True)
    model.eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids), parallel_state.get_process_groups().tp)
    parallel_state.destroy_model_parallel()
    return logits[..., : cfg.model.vocab_size]


def test_export_from_tp2_training_equals_tp1(tmp_path):
    """A checkpoint written by 2 real TP ranks exports to a model with the ranks' logits, and to the
    same tensors as the same weights saved from one process (TP 2 x PP 2 and expert parallelism:
    tests/test_convert_mixtral.py)."""
    from megalm.models import GPTModel
    from tests.distributed_harness import run_distributed
    from tests.test_training import TINY

    argv = TINY + [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--lr-warmup-iters",
        "0",
        "--save",
        str(tmp_path / "tp2"),
        "--save-interval",
        "2",
        "--log-interval",
        "1",
    ]
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = run_distributed(_tp2_train_and_logits, world_size=2, args=(argv, ids), timeout=150)
    assert torch.equal(logits[0], logits[1])
    export_to_hf(str(tmp_path / "tp2"), str(tmp_path / "hf2"))
    assert (hf_logits(tmp_path / "hf2", ids) - logits[0]).abs().max() < 1e-4

    reader = MegalmCheckpointReader(str(tmp_path / "tp2"))
    assert reader.common["layout"]["tensor_model_parallel_size"] == 2
    model = megalm_model_from_tensors(reader.config, reader.load(reader.model_names))
    save_checkpoint(str(tmp_path / "tp1"), 2, [model], config=reader.common["config"])
    export_to_hf(str(tmp_path / "tp1"), str(tmp_path / "hf1"))
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "hf1" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(model, GPTModel)


def test_convert_cli_with_verify(tmp_path, capsys):
    cfg = make_config(MODEL, GPT2)
    save_random_model(cfg, tmp_path / "ckpt")
    convert = runpy.run_path(str(REPO / "tools" / "checkpoint" / "convert.py"))
    assert (
        convert["main"](
            [
                "--to",
                "hf",
                "--load-dir",
                str(tmp_path / "ckpt"),
                "--save-dir",
                str(tmp_path / "hf"),
                "--dtype",
                "bfloat16",
                "--verify",
            ]
        )
        == 0
    )
    assert (
        convert["main"](
            [
                "--to",
                "megalm",
                "--load-dir",
                str(tmp_path / "hf"),
                "--save-dir",
                str(tmp_path / "back"),
                "--tensor-model-parallel-size",
                "2",
                "--verify",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("| OK") == 2 and "GPT2LMHeadModel" in out
    assert (
        convert["main"](["--to", "megalm", "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "x")])
        == 2
    )
    assert "config.json" in capsys.readouterr().err


def test_gpt2_bpe_tokenizer_through_both_conversions(tmp_path):
    """GPT2BPETokenizer (Megatron's --vocab-file/--merge-file) exports as a transformers GPT-2
    tokenizer with the same ids, and an import records the files given on its command line."""
    from megalm.tokenizers import GPT2BPETokenizer
    from tests.test_tokenizers import TRICKY_TEXTS, make_gpt2_files, sample_texts

    vocab_file, merge_file = make_gpt2_files(tmp_path)
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    cfg = copy.deepcopy(
        make_config(TINY_GPT, GPT2, vocab_size=tok.vocab_size)
    )  # an editable copy: the validated config is frozen
    cfg.data.tokenizer_type, cfg.data.vocab_file, cfg.data.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    save_random_model(cfg, tmp_path / "ckpt")
    convert = runpy.run_path(str(REPO / "tools" / "checkpoint" / "convert.py"))
    assert (
        convert["main"](["--to", "hf", "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]) == 0
    )
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).is_file(), name
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in sample_texts(10, seed=6) + TRICKY_TEXTS[:4]:
        assert hf_tok(text).input_ids == tok.tokenize(text), text
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == hf_tok.eos_token_id == tok.eod

    assert (
        convert["main"](
            [
                "--to",
                "megalm",
                "--load-dir",
                str(tmp_path / "hf"),
                "--save-dir",
                str(tmp_path / "back"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab_file,
                "--merge-file",
                merge_file,
            ]
        )
        == 0
    )
    data = MegalmCheckpointReader(str(tmp_path / "back")).config.data
    assert (data.tokenizer_type, data.vocab_file, data.merge_file) == ("GPT2BPETokenizer", vocab_file, merge_file)


def test_llama2_tokenizer_exports_with_bos(tmp_path, sp_model):
    from megalm.conversion.tokenizer_files import export_tokenizer
    from megalm.tokenizers import Llama2Tokenizer
    from tests.test_tokenizers import sample_texts

    special, note = export_tokenizer("Llama2Tokenizer", str(tmp_path), 16, tokenizer_model=sp_model)
    assert "BOS added" in note and special["bos_token_id"] == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Llama2Tokenizer(sp_model)
    for text in sample_texts(5, seed=8):
        assert hf_tok(text).input_ids == ours.tokenize(text)
