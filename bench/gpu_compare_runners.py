"""Worker side of bench/gpu_compare.py: one implementation per process, on the GPU when there is one.

Each runner builds one model + optimizer from the shared shape and exposes ``step()`` (one full
training step: forward, backward, global-norm clipping at 1.0, AdamW; returns the loss as a tensor,
so timing decides where to synchronize).  Runners:

* ``megalm``: through its real trainer (``parse_config`` -> ``Trainer.setup()`` -> ``train_step``),
  ``--transformer-impl local`` or ``transformer_engine``, fusions on (its defaults, torch.compile'd
  fused kernels) or off (every ``--no-*-fusion``); ``--bf16`` keeps fp32 main weights and gradients.
* ``plain``: a nanoGPT-style model written here (Llama or GPT-3 architecture, fused QKV, causal
  SDPA), bf16 autocast over fp32 weights (PyTorch AMP), torch fused AdamW; ``compile``:
  ``torch.compile(model)``.
* ``mcore``: megatron-core's ``GPTModel`` with its local or Transformer Engine layer spec, wrapped
  as Megatron-LM trains it (``Float16Module``, ``DistributedDataParallel``, ``get_megatron_optimizer``
  with fp32 main weights); if building that path raises, the model is trained like ``plain``
  (autocast + torch AdamW) and the row says so (``path``).
* ``titan``: torchtitan's ``Llama3Model`` built from its config classes (untied, FlexAttention with
  the causal block mask its trainer builds from the positions every step; 0.3 refuses SDPA for
  language models), trained by this loop like ``plain`` (torchtitan's own trainer needs torchrun and
  a TOML job); ``compile``: each transformer block compiled, as torchtitan does.

megatron-core 0.19 and torchtitan 0.3 both import triton at import time, so on a CPU-only torch
they are reported as not importable.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from reference_models import BETAS, CLIP_GRAD, EPS, LR, SEED, WEIGHT_DECAY, param_groups

LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]
LLAMA_FLAGS += ["--untie-embeddings-and-output-weights", "--disable-bias-linear", "--norm-epsilon", "1e-5"]
FUSIONS_OFF = [
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion",
    "--no-norm-fusion",
    "--no-cross-entropy-loss-fusion",
]


def peer_import_error(impl: str, te: bool = False) -> Optional[str]:
    """None when ``impl``'s library (and Transformer Engine if ``te``) imports, else the reason."""
    try:
        if te:
            import transformer_engine.pytorch  # noqa: F401
        if impl == "mcore":
            from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401
        elif impl == "titan":
            from torchtitan.models.llama3 import Llama3Model  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure skips the row
        return f"{type(e).__name__}: {e}"
    return None


def megalm_argv(shape: dict, row: dict, train_iters: int) -> list:
    b = str(shape["micro_batch"])
    argv = [
        *("--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"])),
        *("--num-attention-heads", str(shape["heads"]), "--ffn-hidden-size", str(shape["ffn"])),
        *("--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"])),
        # megalm's NullTokenizer adds an end-of-document id to --vocab-size: V - 1 gives V.
        *("--vocab-size", str(shape["vocab"] - 1), "--micro-batch-size", b, "--global-batch-size", b),
        *("--train-iters", str(train_iters), "--mock-data", "--num-workers", "0", "--eval-iters", "0"),
        *("--log-interval", str(10**9), "--no-log-memory", "--seed", str(SEED), "--lr", str(LR)),
        *("--lr-decay-style", "constant", "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP_GRAD)),
        *("--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS)),
        *("--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", row["te_impl"]),
    ]
    if shape["arch"] == "llama":
        argv += LLAMA_FLAGS
    if shape["groups"] != shape["heads"]:
        argv += ["--group-query-attention", "--num-query-groups", str(shape["groups"])]
    argv += [] if row["compile"] else FUSIONS_OFF
    return argv + (["--bf16"] if row["precision"] == "bf16" else [])


def build_plain_model(shape: dict):
    """nanoGPT-style model: Llama (RMSNorm, RoPE, SwiGLU, GQA, untied, no biases) or GPT-3 (LayerNorm,
    learned positions, GELU, biases, tied embeddings); fused QKV, causal SDPA, fp32 loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, n, g, f, s, v = (shape[k] for k in ("hidden", "heads", "groups", "ffn", "seq", "vocab"))
    d, llama = h // n, shape["arch"] == "llama"
    bias = not llama

    def norm():
        return nn.RMSNorm(h, eps=1e-5) if llama else nn.LayerNorm(h, eps=1e-5)

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = norm(), norm()
            self.qkv = nn.Linear(h, (n + 2 * g) * d, bias=bias)
            self.proj = nn.Linear(n * d, h, bias=bias)
            self.fc1 = nn.Linear(h, 2 * f if llama else f, bias=bias)
            self.fc2 = nn.Linear(f, h, bias=bias)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, val = self.qkv(self.norm1(x)).split([n * d, g * d, g * d], dim=-1)
            q, k, val = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, val))
            if llama:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, val, is_causal=True, enable_gqa=g != n)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, n * d))
            z = self.fc1(self.norm2(x))
            if llama:
                gate, up = z.chunk(2, dim=-1)
                z = F.silu(gate) * up
            else:
                z = F.gelu(z)
            return x + self.fc2(z)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(v, h)
            self.pos = None if llama else nn.Embedding(s, h)
            self.blocks = nn.ModuleList(Block() for _ in range(shape["layers"]))
            self.norm = norm()
            self.head = nn.Linear(h, v, bias=False)
            if not llama:
                self.head.weight = self.embed.weight
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
            if self.pos is not None:
                x = x + self.pos.weight[: idx.shape[1]]
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    torch.manual_seed(SEED)
    return Plain()


def build_titan_model(shape: dict):
    """torchtitan's Llama3Model (its config classes, as its ``_1b`` flavor builds them), untied."""
    import torchtitan.models.llama3 as titan
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    h, n, v = shape["hidden"], shape["heads"], shape["vocab"]
    cfg = titan.Llama3Model.Config(
        dim=h,
        vocab_size=v,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h, param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=h, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=h, out_features=v, param_init=titan._output_linear_init(h)),
        layers=titan._build_llama3_layers(
            n_layers=shape["layers"],
            dim=h,
            n_heads=n,
            n_kv_heads=shape["groups"],
            hidden_dim=shape["ffn"],
            rope=ComplexRoPE.Config(dim=h // n, max_seq_len=shape["seq"], theta=10000, scaling="none"),
            attn_backend="flex",  # torchtitan 0.3 refuses "sdpa" for language models
        ),
    )
    return cfg, cfg.build()


def build_mcore(shape: dict, row: dict, device, bf16: bool):
    """megatron-core GPTModel with the local or TE spec; returns (model to call, megatron optimizer or None)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(SEED)
    llama = shape["arch"] == "llama"
    norm = "RMSNorm" if llama else "LayerNorm"
    cfg = TransformerConfig(
        num_layers=shape["layers"],
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"],
        ffn_hidden_size=shape["ffn"],
        gated_linear_unit=llama,
        activation_func=torch.nn.functional.silu if llama else torch.nn.functional.gelu,
        normalization=norm,
        add_bias_linear=not llama,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        bf16=bf16,
        params_dtype=torch.float32,
        use_cpu_initialization=device.type == "cpu",
    )
    if row["te_impl"] == "transformer_engine":
        spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=norm)
    torch.manual_seed(SEED)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=shape["vocab"],
        max_sequence_length=shape["seq"],
        position_embedding_type="rope" if llama else "learned_absolute",
        share_embeddings_and_output_weights=not llama,
    ).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    try:  # Megatron-LM's own path: bf16 module, contiguous grad buffer, fp32 main weights
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        wrapped = Float16Module(cfg, model) if bf16 else model
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped)
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_eps=EPS,
            clip_grad=CLIP_GRAD,
            bf16=bf16,
            use_distributed_optimizer=False,
        )
        return ddp, get_megatron_optimizer(opt_cfg, [ddp]), n_params, "megatron (Float16Module, DDP, fp32 main)"
    except Exception as e:  # noqa: BLE001 - fall back to the plain loop, and say so
        print(
            f"mcore: Megatron optimizer path failed ({type(e).__name__}: {e}); autocast + torch AdamW", file=sys.stderr
        )
        return model, None, n_params, f"fallback autocast + torch AdamW ({type(e).__name__})"


def torch_adamw(model):
    import torch

    groups = param_groups(list(model.named_parameters()))
    try:
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)


def titan_flops_per_token(cfg, model, seq: int) -> Optional[float]:
    try:
        return float(cfg.get_nparams_and_flops(model, seq)[1])
    except Exception:  # noqa: BLE001 - the peer's formula is optional
        return None


class Runner:
    """One row: built on ``build()``, one training step per ``step()`` (loss tensor, not synchronized)."""

    def __init__(self, row: dict, shape: dict):
        import torch

        self.torch, self.row, self.shape = torch, row, shape
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.bf16 = row["precision"] == "bf16"
        self.own_flops_per_step = None
        self.path = None
        g = torch.Generator().manual_seed(SEED)
        v, b, s = shape["vocab"], shape["micro_batch"], shape["seq"]
        self.batches = [torch.randint(0, v, (b, s + 1), generator=g) for _ in range(4)]
        self.index = 0

    def _next(self):
        x = self.batches[self.index % len(self.batches)]
        self.index += 1
        return x

    def build(self) -> int:
        """Builds the row's model and optimizer; returns its parameter count."""
        impl, torch = self.row["impl"], self.torch
        if impl == "megalm":
            return self._build_megalm()
        if impl == "mcore":
            self.model, self.mopt, n, self.path = build_mcore(self.shape, self.row, self.device, self.bf16)
            self.model.train()
            self.positions = torch.arange(self.shape["seq"], device=self.device).unsqueeze(0)
            self.positions = self.positions.expand(self.shape["micro_batch"], -1)
            if self.mopt is None:
                self.optimizer, self.params = torch_adamw(self.model), list(self.model.parameters())
            return n
        if impl == "titan":
            with torch.device("meta"):  # as torchtitan's trainer: meta, to_empty, init_states
                cfg, model = build_titan_model(self.shape)
            model = model.to_empty(device=self.device)
            with torch.no_grad():
                model.init_states(buffer_device=self.device)
            self.own_flops_per_step = titan_flops_per_token(cfg, model, self.shape["seq"])
            if self.own_flops_per_step is not None:
                self.own_flops_per_step *= self.shape["micro_batch"] * self.shape["seq"]
            self.positions = torch.arange(self.shape["seq"], device=self.device).unsqueeze(0)
            self.positions = self.positions.expand(self.shape["micro_batch"], -1)
            if self.row["compile"]:  # torchtitan compiles each transformer block
                for name, block in list(model.layers.named_children()):
                    model.layers.register_module(name, torch.compile(block))
            self.model = model
        else:
            with self.device:  # parameters created (and initialized) on the device
                self.model = build_plain_model(self.shape)
        self.model.train()
        self.params = list(self.model.parameters())
        self.optimizer = torch_adamw(self.model)
        n = sum(p.numel() for p in self.params)
        if impl == "plain" and self.row["compile"]:
            self.model = torch.compile(self.model)
        return n

    def _build_megalm(self) -> int:
        import pretrain_gpt
        from megalm.config import parse_config
        from megalm.training.initialize import world_size_from_env
        from megalm.training.training import Trainer

        self.argv = megalm_argv(self.shape, self.row, self.row["train_iters"])
        cfg = parse_config(self.argv, world_size=world_size_from_env())
        self.trainer = Trainer(cfg, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
        self.trainer.setup()
        for chunk in self.trainer.model:
            chunk.train()
        self.trainer.train_iter = self._megalm_batches()
        return sum(p.numel() for c in self.trainer.model for p in c.parameters())

    def _megalm_batches(self):
        torch, b, s = self.torch, self.shape["micro_batch"], self.shape["seq"]
        positions = torch.arange(s).unsqueeze(0).expand(b, -1)
        ones = torch.ones(b, s, dtype=torch.float32)
        while True:
            x = self._next()
            yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": ones, "position_ids": positions}

    def step(self):
        torch, impl = self.torch, self.row["impl"]
        if impl == "megalm":
            from megalm.training.step import train_step

            t = self.trainer
            out = train_step(
                t.cfg,
                t.forward_step_func,
                t.train_iter,
                t.model,
                t.optimizer,
                t.scheduler,
                t.state,
                t.microbatches,
                t.groups,
            )
            return out.losses.get("lm loss")
        x = self._next().to(self.device, non_blocking=True)
        tokens, labels = x[:, :-1], x[:, 1:]
        if impl == "mcore" and self.mopt is not None:  # Megatron-LM's step: grad buffer, fp32 main, clip
            self.model.zero_grad_buffer()
            self.mopt.zero_grad()
            loss = self.model(tokens, self.positions, None, labels=labels).float().mean()
            loss.backward()
            self.model.finish_grad_sync()
            self.mopt.step()
            return loss.detach()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if impl == "plain":
                loss = self.model(tokens, labels)
            elif impl == "mcore":
                loss = self.model(tokens, self.positions, None, labels=labels).float().mean()
            else:  # torchtitan: the mask from the positions every step, as its trainer does
                masks = self.model.get_attention_masks(positions=self.positions)
                logits = self.model(tokens, self.positions, masks)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_GRAD, foreach=True)
        self.optimizer.step()
        return loss.detach()
