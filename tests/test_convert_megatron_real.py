"""Importing checkpoints written by real megatron-core (0.19.2), checked against megatron-core's logits.

``tests/fixtures/megatron/`` holds tiny models that megatron-core built, ran and saved with Megatron-LM's
own ``save_checkpoint`` (``make_fixtures.py``, run by hand with megatron-core installed; this test
never imports it): each model folder has ``logits.safetensors`` (megatron-core's fp32 logits on fixed
tokens, the true vocabulary's columns) and one Megatron-LM ``--save`` directory per layout.  Each
layout is imported with ``tools/checkpoint/convert.py --from megatron``'s function, the megalm
model is built from the imported checkpoint and must give megatron-core's logits within 1e-5.
"""

import os

import pytest
import torch

from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
from megalm.conversion.megatron import import_from_megatron
from megalm.conversion.verify import megalm_model_from_tensors

safetensors = pytest.importorskip("safetensors.torch")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron")
CASES = [
    ("llama", "torch_dist"),  # RMSNorm, SwiGLU, RoPE (base 500), GQA, qk-layernorm, no biases, untied, eps 1e-6
    ("llama", "legacy"),
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
