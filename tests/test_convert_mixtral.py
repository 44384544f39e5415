"""Mixtral conversion megalm (mixture of experts) <-> transformers' MixtralForCausalLM, checked by logits
(fp32, 1e-4), and exports from checkpoints saved by real pipeline / tensor / expert-parallel ranks.

Models are tiny and random (init std 0.3, random norms) so that a wrong mapping, a swapped gate/up
projection or a different routing rule moves the logits far beyond the tolerance.  The spawned
ranks (one group of 4) build the models with megalm's layout-independent initialization and save
them; the reference is the same model saved from one process, and the exports must be
byte-identical.  This module imports transformers lazily: the spawned ranks import it too.
"""

import copy
import importlib.util
import json
import os
import re
import runpy
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.save import save_checkpoint
from megalm.config import MegalmConfig, set_vocab_size, validate_config
from megalm.conversion.errors import ConversionError
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel.random import RNGStatesTracker
from tests.configs import make_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is needed to load the exported models"
)

REPO = Path(__file__).resolve().parents[1]
# Llama-style attention (GQA 4 heads / 2 groups, RoPE, RMSNorm) with 4 SwiGLU experts, top-2, no biases.
MIXTRAL = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    num_attention_heads=4,
    rotary_base=500.0,
    norm_epsilon=1e-6,
    hidden_size=64,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=40,
    moe_aux_loss_coeff=0.01,
)
HF_MIXTRAL = dict(
    hidden_size=64,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rope_theta=1000.0,
    initializer_range=0.3,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.02,
)


def _tc():
    """Helpers of tests/test_convert.py (imported here, not at module level: it imports transformers)."""
    from tests import test_convert

    return test_convert


def _transformers():
    import transformers

    return transformers


def _safetensors(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _hf_model(directory):
    model, info = _transformers().AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # every weight came from the files
    return model.eval()


def _perturb_norms(chunks):
    """Norm weights from a generator seeded by the global parameter name: equal on every layout."""
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if "norm" in name:
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


# --- single process ------------------------------------------------------------------------------


def test_export_logits_match_transformers(tmp_path):
    from megalm.conversion.export_hf import export_to_hf
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors

    tc = _tc()
    cfg = make_config(tc.MODEL, MIXTRAL)
    model = tc.save_random_model(cfg, tmp_path / "ckpt")
    result = export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert result.architecture == "MixtralForCausalLM" and len(result.files) > 1  # sharded, with an index
    assert any("top-2" in note for note in result.notes)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 40)
    assert config["router_aux_loss_coef"] == 0.01 and config["sliding_window"] is None
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    assert "attention_bias" not in config and "mlp_bias" not in config

    # The original Mixtral file layout: per-expert w1 (gate) / w3 (up) / w2 (down) under block_sparse_moe.
    tensors = _safetensors(tmp_path / "hf")
    prefix = "model.layers.1.block_sparse_moe."
    assert tensors[prefix + "gate.weight"].shape == (4, 64)
    assert tensors[prefix + "experts.3.w1.weight"].shape == (40, 64) == tensors[prefix + "experts.3.w3.weight"].shape
    assert tensors[prefix + "experts.3.w2.weight"].shape == (64, 40)
    fc1 = model.state_dict()["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(tensors[prefix + "experts.3.w1.weight"], fc1[:40])
    assert torch.equal(tensors[prefix + "experts.3.w3.weight"], fc1[40:])
    assert len(tensors) == 1 + 2 * (6 + 1 + 4 * 3) + 2

    ids = tc.tokens()
    with torch.no_grad():
        ours = model(ids)[..., : tc.VOCAB]
        theirs = _hf_model(tmp_path / "hf")(input_ids=ids).logits
    assert ours.abs().max() > 1.0  # logits large enough for the tolerance to mean something
    assert (ours - theirs).abs().max() < 1e-4

    # The routing rule matters at this tolerance: megalm's --moe-router-pre-softmax (top-k weights not
    # renormalized) gives other logits, which is why the mapping refuses it.
    reader = MegalmCheckpointReader(str(tmp_path / "ckpt"))
    pre = copy.deepcopy(reader.config)
    pre.model.moe_router_pre_softmax = True
    with torch.no_grad():
        pre_logits = megalm_model_from_tensors(pre, reader.load(reader.model_names))(ids)[..., : tc.VOCAB]
    assert (pre_logits - theirs).abs().max() > 1e-2


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A random transformers MixtralForCausalLM (norms perturbed) saved with save_pretrained."""
    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(vocab_size=_tc().VOCAB, **HF_MIXTRAL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    directory = tmp_path_factory.mktemp("hf_mixtral") / "hf"
    model.save_pretrained(str(directory))
    return directory, model.eval()


def test_import_logits_match_transformers_and_round_trip(hf_mixtral, tmp_path):
    from megalm.conversion.export_hf import export_to_hf
    from megalm.conversion.import_hf import import_from_hf
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors

    hf_dir, hf_model = hf_mixtral
    assert any("block_sparse_moe.experts.0.w1" in k for k in _safetensors(hf_dir))  # the format save_pretrained writes
    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
        "--seq-length",
        "16",
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    result = import_from_hf(str(hf_dir), str(tmp_path / "ckpt"), extra_args=layout)
    assert result.architecture == "MixtralForCausalLM"
    common = json.loads(Path(result.path, "common.json").read_text())
    assert common["layout"]["expert_model_parallel_size"] == 2 and common["layout"]["tensor_model_parallel_size"] == 2
    m = common["config"]["model"]
    assert (m["num_experts"], m["moe_router_topk"], m["moe_ffn_hidden_size"]) == (4, 2, 40)
    assert m["moe_aux_loss_coeff"] == 0.02 and m["moe_router_pre_softmax"] is False
    assert m["moe_token_dispatcher_type"] == "alltoall" and m["add_bias_linear"] is False
    reader = MegalmCheckpointReader(str(tmp_path / "ckpt"))
    tensors = reader.load(reader.model_names)
    assert tensors["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (80, 64)
    ours = megalm_model_from_tensors(reader.config, tensors)
    ids = _tc().tokens()
    with torch.no_grad():
        theirs = hf_model(input_ids=ids).logits
        diff = (ours(ids)[..., : _tc().VOCAB] - theirs).abs().max()
    assert theirs.abs().max() > 1.0 and diff < 1e-4

    # Back to transformers: the very tensors we started from.
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    original, back = _safetensors(hf_dir), _safetensors(tmp_path / "back")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in back)

    # transformers 5.x in-memory names (fused experts: mlp.experts.gate_up_proj [E, 2F, h]) import the same.
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(hf_dir / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 80, 64)
    save_file(state, str(fused / "model.safetensors"))
    import_from_hf(str(fused), str(tmp_path / "ckpt_fused"))
    again = MegalmCheckpointReader(str(tmp_path / "ckpt_fused"))
    assert all(torch.equal(v, tensors[k]) for k, v in again.load(again.model_names).items())


def test_refusals_name_the_field(hf_mixtral, tmp_path):
    from megalm.conversion.architectures import for_megalm
    from megalm.conversion.export_hf import export_to_hf
    from megalm.conversion.import_hf import import_from_hf

    tc = _tc()
    # Export: what Mixtral cannot express.
    for change, match in [
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(moe_layer_freq=[1, 0]), r"--moe-layer-freq \[1, 0\] leaves layers \[1\] dense"),
        (dict(moe_layer_freq=2), "--moe-layer-freq 2"),
        (dict(moe_shared_expert_intermediate_size=32), "--moe-shared-expert-intermediate-size"),
        (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (dict(add_bias_linear=True), "--disable-bias-linear"),
        (dict(swiglu=False), "needs --swiglu"),
        (dict(normalization="LayerNorm"), "--normalization LayerNorm"),
    ]:
        with pytest.raises(ConversionError, match="MixtralForCausalLM: .*" + match):
            for_megalm(make_config(tc.MODEL, MIXTRAL, change).model)
    # With pre-softmax and k = E the k weights are the whole softmax and sum to 1: same as Mixtral.
    assert for_megalm(make_config(tc.MODEL, MIXTRAL, moe_router_pre_softmax=True, moe_router_topk=4).model).moe
    cfg = make_config(tc.MODEL, MIXTRAL, moe_router_score_function="sigmoid")
    tc.save_random_model(cfg, tmp_path / "sigmoid")
    with pytest.raises(ConversionError, match="mixture-of-experts model .4 experts.*score-function sigmoid"):
        export_to_hf(str(tmp_path / "sigmoid"), str(tmp_path / "out_sigmoid"))
    assert not (tmp_path / "out_sigmoid").exists()

    # Import: what megalm cannot express, other MoE families, and flags that disagree with config.json.
    hf_dir, _ = hf_mixtral
    config = json.loads((hf_dir / "config.json").read_text())

    def refused(change, match, extra_args=()):
        d = tmp_path / f"case{len(os.listdir(tmp_path))}"
        shutil.copytree(hf_dir, d)
        cfg = dict(config)
        change(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConversionError, match=match):
            import_from_hf(str(d), str(tmp_path / "out"), extra_args=list(extra_args))

    refused(lambda c: c.update(sliding_window=4096), "sliding_window = 4096")
    refused(lambda c: c.update(router_jitter_noise=0.1), "router_jitter_noise = 0.1")
    refused(lambda c: c.pop("num_local_experts"), "no num_local_experts")
    refused(lambda c: c.update(num_experts_per_tok=5), "num_experts_per_tok = 5")
    refused(lambda c: c.update(hidden_act="gelu"), "hidden_act")
    refused(lambda c: c.update(model_type="qwen2_moe"), "'qwen2_moe' is a mixture-of-experts model .*mixtral")
    refused(lambda c: c.update(model_type="deepseek_v2"), "'deepseek_v2' is a mixture-of-experts model")
    refused(lambda c: None, "--num-experts 8 disagrees with config.json", ["--num-experts", "8"])
    refused(lambda c: None, "--expert-model-parallel-size 3", ["--expert-model-parallel-size", "3"])
    # A dense model cannot become a mixture of experts on import.
    tc._hf_model("llama", tmp_path / "llama")
    with pytest.raises(ConversionError, match="--num-experts 4 disagrees with config.json"):
        import_from_hf(str(tmp_path / "llama" / "hf"), str(tmp_path / "out"), extra_args=["--num-experts", "4"])
    # A training-only setting may be overridden on import.
    result = import_from_hf(str(hf_dir), str(tmp_path / "override"), extra_args=["--moe-aux-loss-coeff", "0.05"])
    assert result.config.model.moe_aux_loss_coeff == 0.05


def test_convert_cli_with_verify(tmp_path, capsys):
    tc = _tc()
    tc.save_random_model(make_config(tc.MODEL, MIXTRAL), tmp_path / "ckpt")
    convert = runpy.run_path(str(REPO / "tools" / "checkpoint" / "convert.py"))
    assert (
        convert["main"](
            ["--to", "hf", "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"), "--verify"]
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
                "--expert-model-parallel-size",
                "2",
                "--verify",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MixtralForCausalLM" in out and "EP 2 recorded" in out
    found = re.findall(r"max \|logit diff\| (\S+) \| KL mean (\S+) max (\S+) \| OK", out)
    assert len(found) == 2, out
    for diff, kl_mean, kl_max in found:
        assert float(diff) < 1e-4 and 0 <= float(kl_mean) <= float(kl_max) < 1e-8


# --- checkpoints saved by 4 spawned ranks -------------------------------------------------------


def _save_and_load_on_ranks(jobs, ids):
    """Each job ``(name, config dict, root, action)`` on this rank: build the model chunks of the
    config's layout (megalm's layout-independent init) and ``save`` them with perturbed norms, or
    ``load`` the checkpoint in ``root`` (PP 1) and return the TP-gathered logits of ``ids``."""
    import torch.distributed as dist

    import pretrain_gpt
    from megalm import parallel_state
    from megalm.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megalm.training.build import build_model_chunks

    out = {}
    for name, cfg_dict, root, action in jobs:
        cfg = MegalmConfig.from_dict(cfg_dict)
        validate_config(cfg, world_size=dist.get_world_size())
        set_vocab_size(cfg, cfg.model.vocab_size)
        p = cfg.parallel
        parallel_state.initialize_model_parallel(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
        )
        groups = parallel_state.get_process_groups()
        chunks = build_model_chunks(cfg, pretrain_gpt.model_provider, groups, RNGStatesTracker())
        if action == "save":
            _perturb_norms(chunks)
            save_checkpoint(root, 5, chunks, config=cfg.to_dict())
        else:
            load_checkpoint(root, chunks, finetune=True)
            with torch.no_grad():
                logits = chunks[0].eval()(ids)
                out[name] = gather_from_tensor_model_parallel_region(logits, parallel_state.get_process_groups().tp)[
                    ..., : cfg.model.vocab_size
                ]
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks(hf_mixtral, tmp_path_factory):
    """One group of 4 gloo ranks: saves a dense Llama model under TP 2 x PP 2 (tied embeddings: the last
    stage's copy is not saved), the Mixtral model under PP 2 x EP 2 (alltoall, grouped GEMM) and
    under TP 2 (SP) x EP 2, and loads a transformers Mixtral imported for TP 2 x EP 2."""
    from megalm.conversion.import_hf import import_from_hf
    from tests.distributed_harness import run_distributed

    tmp = tmp_path_factory.mktemp("ranks")
    hf_dir, hf_model = hf_mixtral
    imported = import_from_hf(
        str(hf_dir),
        str(tmp / "imported"),
        extra_args=[
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
            "--seq-length",
            "16",
        ],
    )
    dense = dict(_tc().LLAMA, untie_embeddings_and_output_weights=False)
    jobs = [
        (
            "dense_tp2pp2",
            make_config(
                _tc().MODEL, dense, tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2
            ).to_dict(),
            str(tmp / "dense_tp2pp2"),
            "save",
        ),
        (
            "moe_pp2ep2",
            make_config(
                _tc().MODEL,
                MIXTRAL,
                moe_grouped_gemm=True,
                moe_token_dispatcher_type="alltoall",
                pipeline_model_parallel_size=2,
                expert_model_parallel_size=2,
            ).to_dict(),
            str(tmp / "moe_pp2ep2"),
            "save",
        ),
        (
            "moe_tp2ep2",
            make_config(
                _tc().MODEL, MIXTRAL, tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2
            ).to_dict(),
            str(tmp / "moe_tp2ep2"),
            "save",
        ),
        ("imported", imported.config.to_dict(), str(tmp / "imported"), "load"),
    ]  # layout recorded on import
    ids = _tc().tokens(n=2, s=16)
    results = run_distributed(_save_and_load_on_ranks, world_size=4, args=(jobs, ids), timeout=300)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=ids).logits
    return {"tmp": tmp, "results": results, "hf_logits": hf_logits, "dense": dense}


def _export_equals_one_rank(tmp, saved: str, model: dict):
    """Export ``tmp/saved`` and the same model saved from one process (TP 1, PP 1, EP 1); both must be equal."""
    from megalm.conversion.export_hf import export_to_hf
    from megalm.models import GPTModel

    common = json.loads(next((tmp / saved).glob("iter_*/common.json")).read_text())
    cfg = make_config(_tc().MODEL, model)
    one = GPTModel(cfg, process_groups=get_process_groups())
    _perturb_norms([one])
    save_checkpoint(str(tmp / f"{saved}_1rank"), 5, [one], config=cfg.to_dict())
    export_to_hf(str(tmp / saved), str(tmp / f"hf_{saved}"))
    export_to_hf(str(tmp / f"{saved}_1rank"), str(tmp / f"hf_{saved}_1rank"))
    a, b = _safetensors(tmp / f"hf_{saved}"), _safetensors(tmp / f"hf_{saved}_1rank")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    config_a, config_b = ((tmp / d / "config.json").read_text() for d in (f"hf_{saved}", f"hf_{saved}_1rank"))
    assert config_a == config_b
    return common["layout"], a


def test_export_from_pipeline_parallel_llama_equals_one_rank(ranks):
    layout, tensors = _export_equals_one_rank(ranks["tmp"], "dense_tp2pp2", ranks["dense"])
    assert (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]) == (2, 2)
    assert "lm_head.weight" not in tensors and "model.layers.1.mlp.gate_proj.weight" in tensors


@pytest.mark.parametrize("saved", ["moe_pp2ep2", "moe_tp2ep2"])
def test_export_from_expert_parallel_mixtral_equals_one_rank(ranks, saved):
    layout, tensors = _export_equals_one_rank(ranks["tmp"], saved, MIXTRAL)
    assert layout["expert_model_parallel_size"] == 2 and layout["data_parallel_size"] == 2
    # EP rank 1 saved experts 2 and 3 of both layers (PP: layer 1 on the second stage).
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in tensors


def test_imported_mixtral_runs_on_tensor_and_expert_parallel_ranks(ranks):
    results, expected = ranks["results"], ranks["hf_logits"]
    assert expected.abs().max() > 1.0
    for rank in range(4):
        assert (results[rank]["imported"] - expected).abs().max() < 1e-4
