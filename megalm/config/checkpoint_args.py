"""``--use-checkpoint-args``: the architecture and tokenizer flags of the checkpoint in ``--load``.

As in Megatron-LM, a flag given on the command line wins over the checkpoint's value; every
other architecture field (the ones that decide parameter shapes and what the model computes)
and the tokenizer are taken from the saved config, so an evaluation (``--skip-train``) or a
fine-tuning run needs only ``--load`` and the run's own flags.  The parallel layout is not
taken: megalm loads a checkpoint under any layout.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, List

from megalm.config.sections import ConfigError, MegalmConfig

MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "group_query_attention",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "squared_relu",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
)
DATA_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def apply_checkpoint_args(cfg: MegalmConfig, given: Collection[str]) -> List[str]:
    """Copy the saved fields into ``cfg`` unless their ``section.field`` is in ``given`` (flags on
    the command line); returns the ``section.field`` names copied."""
    from megalm.checkpoint.common_json import read_common
    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.resume import find_checkpoint
    from megalm.tokenizers.null_tokenizer import NullTokenizer

    c = cfg.checkpoint
    if not c.load:
        raise ConfigError("--use-checkpoint-args needs --load")
    try:
        path = find_checkpoint(c.load, c.ckpt_step)
        if path is None:
            raise CheckpointError(f"no checkpoint in {c.load}")
        saved = MegalmConfig.from_dict(read_common(path).get("config") or {})
    except CheckpointError as e:
        raise ConfigError(f"--use-checkpoint-args: {e}") from None
    copied = []
    for section, target, source, names in (
        ("model", cfg.model, saved.model, MODEL_FIELDS),
        ("data", cfg.data, saved.data, DATA_FIELDS),
    ):
        values = dataclasses.asdict(source)  # a name missing here is a typo in MODEL_FIELDS / DATA_FIELDS
        for name in names:
            if f"{section}.{name}" not in given:
                setattr(target, name, values[name])
                copied.append(f"{section}.{name}")
    # The saved vocab_size is the tokenizer's; only NullTokenizer is built from --vocab-size
    # (its ids, to which it adds the end-of-document id).
    if (
        "model.vocab_size" not in given
        and saved.data.tokenizer_type == "NullTokenizer"
        and saved.model.vocab_size is not None
        and cfg.data.tokenizer_type == "NullTokenizer"
    ):
        cfg.model.vocab_size = NullTokenizer.ids_for(saved.model.vocab_size)
        copied.append("model.vocab_size")
    return copied
