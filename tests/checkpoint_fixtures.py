"""Small random checkpoints shared by the conversion and generation tests (no transformers import,
so spawned ranks that use them start fast)."""

from typing import Optional

import torch

from megalm.checkpoint.save import save_checkpoint
from megalm.config import MegalmConfig, set_vocab_size, validate_config
from megalm.parallel_state import get_process_groups

# A Llama-style variant (RoPE, RMSNorm, SwiGLU, GQA, untied) with biases, so bias mappings are exercised too.
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    num_attention_heads=4,
    rotary_base=500.0,
    norm_epsilon=1e-6,
)


def tiny_cfg(
    vocab: int, tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None, **model
) -> MegalmConfig:
    """A validated 2-layer, hidden-32 config (init std 0.3) with vocabulary ``vocab``; ``model``
    overrides model fields."""
    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 32, 4, 48
    m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by, m.init_method_std = 16, vocab, 64, 0.3
    for k, v in model.items():
        setattr(m, k, v)
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = tokenizer_type, tokenizer_model
    validate_config(cfg)
    set_vocab_size(cfg, vocab)
    return cfg


def save_random_model(cfg, root, iteration=7):
    """A random model (init std from ``cfg``, random norms and biases) saved as a TP 1 / PP 1
    checkpoint under ``root``; returns it in eval mode."""
    from megalm.models import GPTModel

    model = GPTModel(cfg, process_groups=get_process_groups())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name and "weight" in name else 0.0))
    save_checkpoint(str(root), iteration, [model], config=cfg.to_dict())
    return model.eval()
