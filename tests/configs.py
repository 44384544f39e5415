"""The tests' configs: :func:`make_config` is the one place a test file builds a ``MegalmConfig``
(tests/test_test_fixtures.py keeps it so), and the shapes the tests share.

A test names the fields it changes, by their config field names (the flag with ``--`` dropped and ``-``
turned into ``_``, e.g. ``tensor_model_parallel_size=2``, ``lr=1e-3``); each goes to the section that owns
it (field names are unique across sections).  A file whose tests share a special shape keeps it as a
dict constant and passes it first: ``make_config(MODEL, num_layers=3)`` (later values win).  From flags,
as the entry points parse them: :func:`megalm.config.parse_config`; flags of the tiny GPT:
:func:`tests.training_runs.tiny_flags`.
"""

import dataclasses

from megalm.config import SECTIONS, MegalmConfig, ModelConfig, ParallelConfig, validate_config

# Field name -> the section that owns it ("lr" -> "training").
FIELD_SECTION = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}

# No dropout: forward passes repeat exactly (parity tests compare outputs of two runs).
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)

# The smallest model flags of the tests that parse flags without training (config, estimate, refusals): the
# other flags at their defaults.
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]

# The 2-layer, hidden-32 GPT without dropout of the model and layer parity tests; they add the sequence
# length, the vocabulary and their variant (position embedding, normalization, MLP...).
SMALL_GPT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    make_vocab_size_divisible_by=16,
    **NO_DROPOUT,
)

# The 2-layer, hidden-32 GPT of the conversion, generation and checkpoint tests (init std 0.3, so that a
# random model's outputs differ visibly between positions); the tests add the vocabulary.
TINY_GPT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    seq_length=16,
    make_vocab_size_divisible_by=64,
    init_method_std=0.3,
)

# A tiny DeepSeek-style model (MLA, RMSNorm, SwiGLU without biases, 4 routed experts, top-2) for
# :func:`tiny_config`; the tests add the layer count, sequence length and MoE layer pattern.
MLA_MOE = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    make_vocab_size_divisible_by=16,
    init_method_std=0.2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    multi_latent_attention=True,
    qk_layernorm=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
)


def make_config(*shapes: dict, validate: bool = True, world_size=None, **fields) -> MegalmConfig:
    """A ``MegalmConfig`` with the defaults but the fields of ``shapes`` (dicts, in order) and ``fields``
    (last wins), each set in the section that owns it.

    ``validate``: run :func:`megalm.config.validate_config` (with ``world_size``), which also pads the
    vocabulary and freezes the config; ``False`` returns it editable and unchecked (for code that reads a
    config as it is: optimizers, data builders, tests of validation itself).  An unknown field name is a
    ``TypeError`` (a typo would otherwise build the default silently)."""
    cfg = MegalmConfig()
    for name, value in {k: v for shape in (*shapes, fields) for k, v in shape.items()}.items():
        if name not in FIELD_SECTION:
            raise TypeError(f"make_config: no config section has a field {name!r}")
        setattr(getattr(cfg, FIELD_SECTION[name]), name, value)
    return validate_config(cfg, world_size=world_size) if validate else cfg


def tiny_config(vocab_size: int, **model) -> MegalmConfig:
    """A validated (frozen) config with the default model but ``model`` and a ``vocab_size``-token
    vocabulary (padded as the tokenizer's would be)."""
    return make_config(model, vocab_size=vocab_size)


def optimizer_config(*shapes: dict, **training) -> MegalmConfig:
    """An unvalidated config (optimizers read it as it is) with ``shapes`` and ``training`` (optimizer,
    learning rate, betas...) set as :func:`make_config` sets them, for tests that build an optimizer by hand."""
    return make_config(*shapes, validate=False, **training)


def tiny_flags_config(*shapes: dict, tokenizer_vocab=None, world_size=None, **flags) -> MegalmConfig:
    """The config ``pretrain_gpt`` parses from :func:`tests.training_runs.tiny_flags` of ``shapes`` and
    ``flags`` (flag names with ``_``; values as tiny_flags takes them), validated for ``world_size`` ranks;
    ``tokenizer_vocab``: with the vocabulary the tokenizer reports, as the trainer records it."""
    from megalm.config import parse_config, with_vocab_size
    from tests.training_runs import tiny_flags

    cfg = parse_config(tiny_flags(**{k: v for shape in (*shapes, flags) for k, v in shape.items()}), world_size)
    return cfg if tokenizer_vocab is None else with_vocab_size(cfg, tokenizer_vocab)


def model_config(*shapes: dict, **fields) -> ModelConfig:
    """The model section of an unvalidated config with ``shapes`` and ``fields`` set as :func:`make_config`
    sets them, for tests that build a layer or plan fusions from the section as it is."""
    return make_config(*shapes, validate=False, **fields).model


def parallel_config(*shapes: dict, **fields) -> ParallelConfig:
    """The parallel section of an unvalidated config with ``shapes`` and ``fields`` set as :func:`make_config`
    sets them, for tests that wrap a model in ``DistributedDataParallel`` by hand."""
    return make_config(*shapes, validate=False, **fields).parallel
