"""A validated config is frozen: every assignment after validate_config raises; copies are new,
editable configs; facts known only later (the tokenizer's vocabulary) come as a frozen copy."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from megalm.config import MegalmConfig, parse_config, replace_config, validate_config, with_vocab_size
from tests.configs import MODEL_FLAGS

ARGV = list(MODEL_FLAGS)


def test_assigning_after_validation_raises():
    cfg = parse_config(ARGV + ["--vocab-size", "100"], world_size=2)
    for section, field, value in (
        ("model", "hidden_size", 128),
        ("parallel", "tensor_model_parallel_size", 2),
        ("training", "train_iters", 10),
        ("data", "tokenizer_type", "NullTokenizer"),
        ("checkpoint", "save", "/tmp/x"),
        ("logging", "log_interval", 1),
        ("megatron_compat", "manual_gc", True),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"{field}: the configuration is frozen"):
            setattr(getattr(cfg, section), field, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.training.seed
    assert cfg.model.hidden_size == 64 and cfg.parallel.data_parallel_size == 2  # nothing changed


def test_copies_are_new_configs_and_validation_of_a_frozen_config_returns_a_copy():
    cfg = parse_config(ARGV, world_size=2)
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg)), MegalmConfig.from_dict(cfg.to_dict())):
        twin.training.micro_batch_size = 2  # editable
        assert twin == dataclasses.replace(twin) and twin.training.micro_batch_size == 2
    again = validate_config(cfg, world_size=1)
    assert again is not cfg and again.parallel.data_parallel_size == 1 and cfg.parallel.data_parallel_size == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.parallel.world_size = 4


def test_vocabulary_and_later_facts_come_as_frozen_copies():
    cfg = parse_config(ARGV + ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "8"], 2)
    with_vocab = with_vocab_size(cfg, 101, tokenizer_type="NullTokenizer")
    assert (with_vocab.model.vocab_size, with_vocab.model.padded_vocab_size) == (101, 112)  # 8 x TP 2 = 16
    assert with_vocab.data.tokenizer_type == "NullTokenizer" and with_vocab.parallel is cfg.parallel
    assert cfg.model.vocab_size is None and cfg.data.tokenizer_type is None  # the validated one is unchanged
    other = replace_config(with_vocab, checkpoint={"save": "/ckpt"})
    assert other.checkpoint.save == "/ckpt" and with_vocab.checkpoint.save is None
    for frozen in (with_vocab.model, with_vocab.data, other.checkpoint, other):
        assert frozen.frozen
