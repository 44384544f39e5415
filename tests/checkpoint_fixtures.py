"""Small random checkpoints shared by the conversion and generation tests (no transformers import,
so spawned ranks that use them start fast); their model: ``tests.configs.TINY_GPT``."""

import torch

from megalm.checkpoint.save import save_checkpoint
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
