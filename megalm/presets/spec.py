"""The shape of a model preset: frozen dataclasses, one field per Megatron-LM setting.

A :class:`Preset` is pure data (no process groups, no torch): the model's shape, its default
parallel layout, its learning-rate schedule and the launcher defaults of its script.
:mod:`megalm.presets.table` holds the presets; :mod:`megalm.presets.flags` turns one, with the
launcher's overrides, into ``pretrain_gpt.py`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalm.errors import MegalmError


class PresetError(MegalmError):
    """An unknown preset name, or an override (``TP``, ``LR``, ``PRECISION``...) that cannot apply."""


@dataclass(frozen=True)
class Shape:
    """Transformer shape (``--num-layers`` ... ``--init-method-std``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    ffn_hidden_size: int | None = None  # None: Megatron's 4h
    num_query_groups: int | None = None  # set: --group-query-attention
    max_position_embeddings: int | None = None  # None: seq_length
    position_embedding_type: str = "learned_absolute"
    rotary_base: int | None = None
    normalization: str = "LayerNorm"
    norm_epsilon: float | None = None  # None: Megatron's 1e-5 default, flag not passed
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    dropout: float = 0.1  # --hidden-dropout and --attention-dropout
    init_method_std: float = 0.02


@dataclass(frozen=True)
class MoE:
    """Mixture of experts in every layer (``--num-experts`` ... ``--moe-grouped-gemm``)."""

    num_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int = 2
    moe_router_load_balancing_type: str | None = None  # None: Megatron's default, flag not passed
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float | None = None
    moe_router_dtype: str = "fp32"
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = True


@dataclass(frozen=True)
class Layout:
    """Default parallel layout and batch; the launcher's TP, PP, EP, ... override each field."""

    micro_batch_size: int
    global_batch_size: int
    gpus_per_node: int = 8
    nnodes: int = 1
    tp: int = 1
    pp: int = 1
    ep: int | None = None  # MoE presets only: --expert-model-parallel-size
    recompute: str = "none"  # none | selective | full (uniform, RECOMPUTE_NUM_LAYERS per chunk)
    precision: str = "bf16"  # bf16 | fp16 | fp32 | auto (bf16 where the machine runs it natively)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nnodes


@dataclass(frozen=True)
class Schedule:
    """Adam and a cosine learning-rate schedule, given in tokens (``train_tokens``,
    ``warmup_tokens``: iterations follow the global batch) or in iterations."""

    lr: float
    min_lr: float
    train_tokens: int | None = None
    train_iters: int | None = None  # used when train_tokens is None
    decay_fraction: tuple[int, int] = (1, 1)  # decay over train_iters * num // den
    warmup_tokens: int | None = None
    warmup_iters: int | None = None  # used when warmup_tokens is None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float | None = None  # None: Megatron's 1e-8 default, flag not passed
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    exit_signal_handler: bool = True  # save and exit on SIGTERM (Slurm's pre-emption signal)
    distributed_timeout_minutes: int | None = None


@dataclass(frozen=True)
class RunDefaults:
    """Launcher defaults a preset changes (None: the launcher's own, scripts/common.sh)."""

    num_workers: int | None = None
    save_interval_is_train_iters: bool = False  # save once, at the end
    log_interval: int | None = None
    eval_interval: int | None = None
    eval_iters: int | None = None


@dataclass(frozen=True)
class Preset:
    """One model recipe: ``name`` is also its script (``scripts/pretrain_<name>.sh``) and run directory."""

    name: str
    title: str
    source: str  # where the shape and the hyperparameters come from
    shape: Shape
    layout: Layout
    schedule: Schedule
    vocab_size: int  # NullTokenizer's vocabulary when no tokenizer file is given
    tokenizer_type: str  # the --tokenizer-type used with TOKENIZER_MODEL
    moe: MoE | None = None
    run: RunDefaults = RunDefaults()
