"""Reference implementations for bench/train_throughput.py, and the setup every row shares.

The thread count, seed, optimizer settings and shapes all implementations are measured with; the
random token batches; torch AdamW grouped as megalm groups it; the plain nanoGPT-style Llama
(:func:`build_plain_model`), Hugging Face ``LlamaForCausalLM`` (:func:`build_hf_model`) and the
training step both run (:func:`reference_step`).  megalm itself is built by the workers in
train_throughput.py through its real trainer.  torch and transformers are imported inside the
functions, so importing this module is cheap.
"""

from __future__ import annotations

import math

THREADS = 2  # torch threads of every worker (and of the matmul-peak measurement)

# The optimizer every implementation uses (megalm through its flags, the others through torch).
LR, BETAS, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-5, (0.9, 0.95), 1e-8, 0.1, 1.0
SEED = 1234


def llama_ffn(hidden: int) -> int:
    """SwiGLU width: 8h/3 rounded up to a multiple of 16 (688 for 256, 1376 for 512)."""
    return int(math.ceil(8 * hidden / 3 / 16) * 16)


SHAPES = {
    "tiny": dict(hidden=256, layers=4, heads=4, seq=256, vocab=8192, micro_batch=8, ffn=llama_ffn(256)),
    "medium": dict(hidden=512, layers=8, heads=8, seq=512, vocab=32000, micro_batch=4, ffn=llama_ffn(512)),
    "toy": dict(hidden=64, layers=2, heads=2, seq=32, vocab=256, micro_batch=2, ffn=llama_ffn(64)),
}

# The implementations (table names, in table order) and precisions compared.
IMPL_NAMES = {"megalm": "megalm", "hf": "HF LlamaForCausalLM (sdpa)", "plain": "plain PyTorch (nanoGPT-style)"}
PRECISIONS = ("fp32", "bf16")


def random_batches(shape: dict, count: int = 4):
    """``count`` batches of random tokens ``[micro_batch, seq + 1]`` (inputs = [:, :-1], targets = [:, 1:])."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return [
        torch.randint(0, shape["vocab"], (shape["micro_batch"], shape["seq"] + 1), generator=g) for _ in range(count)
    ]


def param_groups(named_params):
    """megalm's grouping: weight decay on ndim >= 2, none on norms (and biases)."""
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def torch_adamw(model):
    """AdamW exactly as megalm builds it (fused kernels when available)."""
    import torch

    groups = param_groups(list(model.named_parameters()))
    try:
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)


def build_plain_model(shape: dict):
    """A nanoGPT-style Llama: fused QKV and gate/up projections, RoPE (rotate half), causal SDPA."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, n, f, s = shape["hidden"], shape["heads"], shape["ffn"], shape["seq"]
    d = h // n

    def rope(x, cos, sin):  # x [b, n, s, d]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.RMSNorm(h, eps=1e-5)
            self.qkv = nn.Linear(h, 3 * h, bias=False)
            self.proj = nn.Linear(h, h, bias=False)
            self.mlp_norm = nn.RMSNorm(h, eps=1e-5)
            self.gate_up = nn.Linear(h, 2 * f, bias=False)
            self.down = nn.Linear(f, h, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, n, d).permute(2, 0, 3, 1, 4)  # [b, n, t, d]
            y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
            gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class PlainLlama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(shape["vocab"], h)
            self.blocks = nn.ModuleList(Block() for _ in range(shape["layers"]))
            self.norm = nn.RMSNorm(h, eps=1e-5)
            self.head = nn.Linear(h, shape["vocab"], bias=False)
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, idx, targets):
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    torch.manual_seed(SEED)
    return PlainLlama()


def build_hf_model(shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=shape["seq"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.float32)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"HF model uses attention implementation {impl!r}, expected 'sdpa'")
    return model


def reference_step(impl: str, model, optimizer, params, batch, autocast: bool) -> float:
    """One full training step of the ``"plain"`` or ``"hf"`` model on ``batch`` ``[micro_batch, seq + 1]``
    (bf16 autocast when ``autocast``; global-norm clipping at CLIP_GRAD); returns the loss."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if impl == "hf":
            inputs = batch[:, :-1]
            loss = model(input_ids=inputs, labels=inputs, use_cache=False).loss
        else:
            loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD, foreach=True)
    optimizer.step()
    return float(loss.detach())
