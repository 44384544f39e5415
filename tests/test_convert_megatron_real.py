"""Importing checkpoints written by real megatron-core (0.19.2), checked against megatron-core's logits.

``tests/fixtures/megatron/`` holds tiny models that megatron-core built, ran and saved with Megatron-LM's
own ``save_checkpoint`` (``make_fixtures.py``, run by hand with megatron-core installed; this test
never imports it): each model folder has ``logits.safetensors`` (megatron-core's fp32 logits on fixed
tokens, the true vocabulary's columns) and one Megatron-LM ``--save`` directory per layout.  Each
layout is imported with ``tools/checkpoint/convert.py --from megatron``'s function, the megalm
model is built from the imported checkpoint and must give megatron-core's logits within 1e-5.
``adam`` holds the distributed optimizer's state after one step (both of its checkpoint formats) and
the state megatron-core's optimizer held: the import must resume exactly that.
"""

import os

import pytest
import torch

from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.resume import find_checkpoint
from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
from megalm.conversion.megatron import import_from_megatron
from megalm.conversion.verify import megalm_model_from_tensors
from megalm.parallel_state import get_process_groups

safetensors = pytest.importorskip("safetensors.torch")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron")
CASES = [
    ("llama", "torch_dist"),  # RMSNorm, SwiGLU, RoPE (base 500), GQA, qk-layernorm, no biases, untied, eps 1e-6
    ("gpt", "torch_dist"),  # LayerNorm, GELU (Megatron's fused bias-GELU: tanh), learned positions, biases, tied
    ("gpt", "legacy"),
    ("llama_tp2", "torch_dist"),  # saved by 2 tensor-parallel ranks (DCP chunks)
    ("llama_tp2", "legacy"),  # mp_rank_00 / mp_rank_01 merged
    ("moe", "torch_dist"),  # layer 0 dense, layer 1 4 SwiGLU experts top-2: numbered layers, [experts, ...] keys
    ("moe", "legacy"),
    ("singleton", "torch_dist"),  # the same MoE saved with singleton_local_shards: a key per expert, fc1 _w / _v
]


def megatron_logits(model: str):
    saved = safetensors.load_file(os.path.join(FIXTURES, model, "logits.safetensors"))
    return saved["tokens"], saved["logits"]


def imported_logits(save_dir: str, tokens: torch.Tensor):
    reader = MegalmCheckpointReader(save_dir)
    model = megalm_model_from_tensors(reader.config, reader.load(reader.model_names))
    with torch.no_grad():
        return model(tokens)[..., : reader.config.model.vocab_size], reader


@pytest.mark.parametrize("model,layout", CASES)
def test_megatron_core_checkpoint_gives_megatron_cores_logits(model, layout, tmp_path):
    tokens, reference = megatron_logits(model)
    assert reference.abs().max() > 1.0  # a model whose logits tell a wrong mapping
    result = import_from_megatron(os.path.join(FIXTURES, model, layout), str(tmp_path / "megalm"))
    logits, reader = imported_logits(str(tmp_path / "megalm"), tokens)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max() <= 1e-5, (model, layout)
    assert reader.config.model.vocab_size == 100 and any("vocabulary 100" in n for n in result.notes)
    with pytest.raises(CheckpointError, match="is a Megatron-LM checkpoint .*convert.py --from megatron"):
        find_checkpoint(os.path.join(FIXTURES, model, layout))  # --load on it names the converter


@pytest.mark.parametrize("layout", ["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_state_resumes_as_megatron_core_held_it(layout, tmp_path):
    """``adam``: one Adam step in megatron-core's distributed optimizer, saved in its default flat-buffer
    format (``dp_reshardable``) and in ``fully_reshardable`` (model space, ``optimizer.state.param.*``).
    The imported moments, fp32 main weights and step load into megalm's optimizer with ``--load``'s
    ``load_checkpoint`` equal to the values megatron-core's optimizer held (``adam_state.safetensors``)."""
    from megalm.checkpoint.load import load_checkpoint
    from megalm.config import set_vocab_size
    from megalm.distributed import DistributedDataParallel
    from megalm.fusions import EAGER
    from megalm.models import GPTModel
    from megalm.optimizer import build_optimizer

    dst = str(tmp_path / "megalm")
    result = import_from_megatron(os.path.join(FIXTURES, "adam", layout), dst)
    assert any("Adam's optimizer state imported (moments and fp32 main weights, step 1)" in n for n in result.notes)
    tokens, reference = megatron_logits("adam")
    assert (imported_logits(dst, tokens)[0] - reference).abs().max() <= 1e-5

    cfg = MegalmCheckpointReader(dst).config
    cfg.training.optimizer = "adam"
    set_vocab_size(cfg, cfg.model.vocab_size)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups())
    ddp = DistributedDataParallel(model, cfg.parallel, process_groups=get_process_groups())
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=get_process_groups())
    load_checkpoint(dst, [ddp], optimizer)
    state = optimizer.sharded_param_state()
    held = safetensors.load_file(os.path.join(FIXTURES, "adam", "adam_state.safetensors"))
    vocab = cfg.model.vocab_size
    for name, p in model.named_parameters():
        for key, live in (
            ("exp_avg", state[name]["exp_avg"]),
            ("exp_avg_sq", state[name]["exp_avg_sq"]),
            ("fp32_param", p),
        ):
            megatron, live = held[f"{name}.{key}"], live.detach()
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):  # both padded, differently
                megatron, live = megatron[:vocab], live[:vocab]
            assert torch.equal(live, megatron.reshape(live.shape)), (name, key)
        assert int(state[name]["step"]) == 1  # the saved param groups' step, not the iteration (10)
    assert held["decoder.layers.0.mlp.linear_fc2.weight.exp_avg"].abs().max() > 0


def test_flat_buffers_that_do_not_hold_the_saved_weights_are_refused():
    """The ``dp_reshardable`` layout is found from the fp32 main weights: a bucket whose values match no
    saved weight (here one weight changed) refuses the optimizer state instead of misplacing it."""
    from megalm.conversion.errors import ConversionError
    from megalm.conversion.megatron_flat_optimizer import expected_order, place_parameters
    from megalm.conversion.megatron_layouts import TorchDistCheckpoint

    ckpt = TorchDistCheckpoint(os.path.join(FIXTURES, "adam", "dp_reshardable", "iter_0000010"))
    weights, buckets = ckpt.layer_tensors(1), ckpt.flat_optimizer_buckets()
    states = place_parameters(buckets, weights, "x")
    assert sorted(states["exp_avg"]) == sorted(weights)
    first = expected_order(list(weights))[0]
    assert first == "output_layer.weight"  # megatron-core's buffer holds the parameters in reverse order
    assert torch.equal(buckets[0]["exp_avg"][: weights[first].numel()], states["exp_avg"][first].reshape(-1))
    changed = dict(weights)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    changed[name] = weights[name] + 1e-3
    with pytest.raises(ConversionError, match="no saved weight matches the fp32 main weights at element"):
        place_parameters(buckets, changed, "x")

    # Another model-parallel rank's buffers (a TP 2 run): the weights import, the optimizer state does not.
    from megalm.conversion import megatron

    ckpt.optimizer_keys = ckpt.optimizer_keys + [
        k.replace("dp_group_idx_0", "dp_group_idx_1") for k in ckpt.optimizer_keys
    ]
    cfg = megatron.config_from_saved_args(ckpt.args, "x", [])[0]
    optimizer, note = megatron._optimizer_state(ckpt, cfg.model, "x", "iter_0000010", weights)
    assert optimizer is None and "not imported (weights only)" in note and "dp_group_idx [0, 1]" in note
