"""Typed configuration, the command line built from it, and validation in one place.

Each dataclass field is one Megatron-LM flag: its name is the flag with ``--`` dropped and
dashes turned into underscores, unless ``metadata["flag"]`` says otherwise (used for
negated flags such as ``--disable-bias-linear`` -> ``add_bias_linear``).  ``help`` in the
metadata is the field's documentation and the flag's ``--help`` text.

:func:`validate_config` is the only place where combinations are checked; it runs before
any process group or model exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import List, Optional, Union


def _f(default, help: str, **meta):
    """A dataclass field carrying its flag documentation."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending flags and values."""


# ---------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """Architecture of the GPT transformer, dense or mixture of experts."""

    num_layers: int = _f(2, "Number of transformer layers.")
    hidden_size: int = _f(128, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = _f(None, "MLP hidden size; default 4 x hidden (SwiGLU: 8/3 x hidden rounded to 64).")
    num_attention_heads: int = _f(4, "Number of attention heads.")
    kv_channels: Optional[int] = _f(None, "Per-head projection size; default hidden / heads.")
    group_query_attention: bool = _f(False, "Use grouped-query attention (see --num-query-groups).")
    num_query_groups: Optional[int] = _f(None, "Number of key/value head groups with --group-query-attention.")
    seq_length: int = _f(128, "Sequence length of training samples.")
    max_position_embeddings: Optional[int] = _f(None, "Size of the learned position table; default --seq-length.")
    position_embedding_type: str = _f("learned_absolute", "Position embedding.", choices=["learned_absolute", "rope", "none"])
    rotary_base: int = _f(10000, "Base of the rotary embedding frequencies.")
    rotary_percent: float = _f(1.0, "Fraction of each head's dimensions that is rotated.")
    normalization: str = _f("LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the normalization layers.")
    swiglu: bool = _f(False, "Use SwiGLU in the MLP instead of GELU.")
    add_bias_linear: bool = _f(True, "Disable biases in all linear layers.", flag="--disable-bias-linear", action="store_false")
    untie_embeddings_and_output_weights: bool = _f(False, "Use a separate output layer instead of the word embedding.")
    hidden_dropout: float = _f(0.1, "Dropout probability after attention and MLP outputs.")
    attention_dropout: float = _f(0.1, "Dropout probability on attention weights.")
    init_method_std: float = _f(0.02, "Standard deviation of the normal weight initialization.")
    use_scaled_init_method: bool = _f(True, "Disable the std/sqrt(2 x layers) init of output projections.",
                                      flag="--no-scaled-init-method", action="store_false")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this value x tensor parallel size.")
    vocab_size: Optional[int] = _f(None, "Vocabulary size (set from the tokenizer; required with --tokenizer-type NullTokenizer).")
    recompute_granularity: Optional[str] = _f(None, "Activation recomputation granularity.", choices=["full", "selective"])
    recompute_method: Optional[str] = _f(None, "With full recompute: 'uniform' (chunks of N layers) or 'block' (first N layers of each stage).",
                                         choices=["uniform", "block"])
    recompute_num_layers: Optional[int] = _f(None, "Layers per recompute chunk (uniform) or recomputed layers per stage (block).")
    apply_query_key_layer_scaling: bool = _f(False, "Accepted for compatibility; attention uses 1/sqrt(head dim).")
    bias_gelu_fusion: bool = _f(True, "Disable the fused bias + GeLU.", flag="--no-bias-gelu-fusion", action="store_false")
    bias_swiglu_fusion: bool = _f(True, "Disable the fused bias + SwiGLU.", flag="--no-bias-swiglu-fusion", action="store_false")
    bias_dropout_fusion: bool = _f(True, "Disable the fused bias + dropout + add.", flag="--no-bias-dropout-fusion", action="store_false")
    apply_rope_fusion: bool = _f(True, "Disable the fused rotary embedding.", flag="--no-rope-fusion", action="store_false")
    masked_softmax_fusion: bool = _f(True, "Disable the fused masked softmax.", flag="--no-masked-softmax-fusion", action="store_false")
    norm_fusion: bool = _f(True, "Disable the compiled LayerNorm/RMSNorm (megalm; apex's fused norms are used "
                                 "instead whenever NVIDIA apex is installed on a GPU).",
                           flag="--no-norm-fusion", action="store_false")
    cross_entropy_loss_fusion: bool = _f(True, "Output layer and vocab-parallel cross entropy as one chunked function "
                                               "that never materializes the logits (on by default in megalm; "
                                               "--no-cross-entropy-loss-fusion: logits, then the loss).",
                                         action=argparse.BooleanOptionalAction)
    attention_backend: str = _f("auto", "Attention core: auto (flash-attn when installed with bf16/fp16 on a GPU, "
                                        "else PyTorch SDPA), flash (flash-attn), fused (PyTorch SDPA), unfused or "
                                        "local (QK^T, masked softmax, @V).",
                                choices=["auto", "flash", "fused", "unfused", "local"])
    transformer_impl: str = _f("local", "Transformer layer implementation: megalm's (local) or NVIDIA Transformer "
                                        "Engine's fused modules (transformer_engine, GPU).",
                               choices=["local", "transformer_engine"])
    fp8_format: Optional[str] = _f(None, "FP8 training through Transformer Engine (needs --transformer-impl "
                                         "transformer_engine on a GPU): e4m3 everywhere, or hybrid (e4m3 forward, "
                                         "e5m2 gradients).", choices=["e4m3", "hybrid"])
    fp8_margin: int = _f(0, "FP8 delayed scaling: scale = fp8 max / amax / 2^margin.")
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling: number of steps of amax history kept per tensor.")
    fp8_amax_compute_algo: str = _f("most_recent", "FP8 delayed scaling: the amax used from the history.",
                                    choices=["most_recent", "max"])

    # Mixture of experts (Megatron-LM's --num-experts / --moe-* flags); see megalm/transformer/moe.
    num_experts: Optional[int] = _f(None, "Number of experts in each MoE layer (unset: dense model).")
    moe_ffn_hidden_size: Optional[int] = _f(None, "Hidden size of each expert's MLP; default --ffn-hidden-size.")
    moe_layer_freq: Union[int, List[int]] = _f(
        1, "Which layers are MoE layers: every k-th layer (an int k: layers 0, k, 2k, ...), or one 0/1 entry "
           "per layer as a Python list, e.g. \"[0,1,1,1]\" or \"([0]+[1]*3)*2\".", type="moe_layer_freq")
    moe_router_topk: int = _f(2, "Number of experts each token is routed to.")
    moe_router_score_function: str = _f("softmax", "Router score function.", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = _f(False, "Softmax over all experts before the top-k (default: top-k of the "
                                             "logits, then softmax over the k chosen).")
    moe_router_load_balancing_type: str = _f("aux_loss", "Load-balancing loss: per micro-batch (aux_loss), per "
                                                         "sequence (seq_aux_loss) or none.",
                                             choices=["aux_loss", "seq_aux_loss", "none"])
    moe_aux_loss_coeff: float = _f(0.0, "Coefficient of the load-balancing loss (1e-2 is typical).")
    moe_z_loss_coeff: Optional[float] = _f(None, "Coefficient of the router z-loss (1e-3 is typical; unset: off).")
    moe_router_dtype: Optional[str] = _f(None, "Compute router logits and probabilities in this precision "
                                               "(default: the model's).", choices=["fp32", "fp64"])
    moe_shared_expert_intermediate_size: Optional[int] = _f(None, "Hidden size of a shared expert every token "
                                                                  "goes through (unset: none).")
    moe_token_dispatcher_type: str = _f("allgather", "How tokens reach the experts over the expert-parallel group.",
                                        choices=["allgather", "alltoall"])
    moe_expert_capacity_factor: Optional[float] = _f(None, "Expert capacity = ceil(tokens x topk / experts x "
                                                           "factor); tokens beyond it are dropped (unset: dropless).")
    moe_token_drop_policy: str = _f("probs", "Which tokens an over-full expert keeps: highest probabilities or "
                                             "earliest positions.", choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = _f(False, "Pad every expert's input to its capacity (needs "
                                                       "--moe-expert-capacity-factor).")
    moe_grouped_gemm: bool = _f(False, "Compute the local experts with one batched matmul instead of a loop.")
    moe_per_layer_logging: bool = _f(False, "Also log each MoE layer's losses and tokens per expert.")

    # Derived values (not flags), filled by validate_config.
    padded_vocab_size: Optional[int] = field(default=None, metadata={"derived": True})

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads


@dataclass
class ParallelConfig:
    """How the model and data are split across processes."""

    tensor_model_parallel_size: int = _f(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = _f(1, "Pipeline model parallel size.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(None, "Layers per virtual pipeline stage (interleaved 1F1B).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = _f(None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B).")
    decoder_first_pipeline_num_layers: Optional[int] = _f(None, "Layers on the first pipeline stage (uneven split).")
    decoder_last_pipeline_num_layers: Optional[int] = _f(None, "Layers on the last pipeline stage (uneven split).")
    context_parallel_size: int = _f(1, "Context parallel size.")
    expert_model_parallel_size: int = _f(1, "Expert model parallel size.")
    sequence_parallel: bool = _f(False, "Shard norms and dropout along the sequence over tensor-parallel ranks.")
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state and main weights over data-parallel ranks (ZeRO-1).")
    overlap_grad_reduce: bool = _f(False, "Reduce gradient buckets during the last microbatch's backward.")
    overlap_param_gather: bool = _f(False, "All-gather updated parameters during the next forward (distributed optimizer).")
    ddp_bucket_size: Optional[int] = _f(None, "Gradient bucket size in elements; default max(40M, 1M x DP).")
    accumulate_allreduce_grads_in_fp32: bool = _f(True, "Accumulate and reduce gradients in fp32 (always on with --bf16/--fp16).")
    variable_seq_lengths: bool = _f(False, "Exchange tensor shapes between pipeline stages each microbatch.")
    distributed_timeout_minutes: int = _f(10, "Timeout of every collective, in minutes.")

    # Derived.
    world_size: Optional[int] = field(default=None, metadata={"derived": True})
    data_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})
    virtual_pipeline_model_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})


@dataclass
class TrainingConfig:
    """Batches, schedule, optimizer, precision and stopping."""

    micro_batch_size: int = _f(1, "Samples per microbatch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Samples per iteration over all ranks; default micro x DP.")
    rampup_batch_size: Optional[List[int]] = _f(None, "Batch size ramp-up: <start> <increment> <ramp-up samples>.", nargs=3)
    train_iters: Optional[int] = _f(None, "Iterations to train (or --train-samples).")
    train_samples: Optional[int] = _f(None, "Samples to train (or --train-iters).")
    seed: int = _f(1234, "Random seed (weights, dropout, data order).")
    optimizer: str = _f("adam", "Optimizer (adam is AdamW: decoupled weight decay).", choices=["adam", "sgd"])
    lr: float = _f(1e-4, "Peak learning rate.")
    min_lr: float = _f(0.0, "Minimum learning rate after decay.")
    lr_decay_style: str = _f("linear", "Learning-rate decay.", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_warmup_iters: int = _f(0, "Linear warm-up iterations.")
    lr_warmup_fraction: Optional[float] = _f(None, "Warm-up as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = _f(0.0, "Learning rate at the start of warm-up.")
    lr_decay_iters: Optional[int] = _f(None, "Iterations to decay over; default --train-iters.")
    lr_decay_samples: Optional[int] = _f(None, "Samples to decay over (with --train-samples).")
    lr_warmup_samples: Optional[int] = _f(None, "Warm-up samples (with --train-samples).")
    lr_wsd_decay_samples: Optional[int] = _f(None, "Samples of WSD's final decay phase (with --train-samples).")
    override_opt_param_scheduler: bool = _f(False, "On load, use the learning-rate schedule of the command line.")
    use_checkpoint_opt_param_scheduler: bool = _f(False, "On load, use the learning-rate schedule saved in the checkpoint.")
    lr_wsd_decay_style: str = _f("exponential", "Annealing shape of WSD's decay phase.", choices=["exponential", "linear", "cosine"])
    lr_wsd_decay_iters: Optional[int] = _f(None, "Length of WSD's final decay phase.")
    weight_decay: float = _f(0.01, "Decoupled weight decay (not applied to biases and norms).")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    sgd_momentum: float = _f(0.9, "SGD momentum.")
    clip_grad: float = _f(1.0, "Clip gradients to this global L2 norm (0 disables).")
    log_num_zeros_in_grad: bool = _f(False, "Count zero gradient entries and log them.")
    bf16: bool = _f(False, "bf16 weights and compute, fp32 main weights and gradients.")
    fp16: bool = _f(False, "fp16 weights and compute, fp32 main weights, dynamic loss scaling.")
    loss_scale: Optional[float] = _f(None, "Static loss scale (fp16); dynamic when unset.")
    initial_loss_scale: float = _f(2.0 ** 32, "Initial dynamic loss scale.")
    min_loss_scale: float = _f(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = _f(1000, "Iterations without overflow before the scale doubles.")
    hysteresis: int = _f(2, "Overflows tolerated before the scale halves.")
    eval_interval: int = _f(1000, "Evaluate on the validation split every this many iterations.")
    eval_iters: int = _f(100, "Validation iterations per evaluation (0 disables).")
    exit_interval: Optional[int] = _f(None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = _f(None, "Save and exit after this many minutes.")
    exit_signal_handler: bool = _f(False, "On SIGTERM finish the step, save and exit 0.")
    skip_train: bool = _f(False, "Only evaluate.")


@dataclass
class DataConfig:
    """Where samples come from and how they are split and tokenized."""

    data_path: Optional[List[str]] = _f(None, "Blend: 'w1 prefix1 w2 prefix2 ...' or a single prefix.", nargs="*")
    split: str = _f("969,30,1", "Train,valid,test proportions of --data-path.")
    train_data_path: Optional[List[str]] = _f(None, "Separate training blend.", nargs="*")
    valid_data_path: Optional[List[str]] = _f(None, "Separate validation blend.", nargs="*")
    test_data_path: Optional[List[str]] = _f(None, "Separate test blend.", nargs="*")
    data_cache_path: Optional[str] = _f(None, "Where built sample indices are cached (default: beside the data).")
    mock_data: bool = _f(False, "Use deterministic synthetic data.")
    tokenizer_type: Optional[str] = _f(None, "Tokenizer.", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    tokenizer_model: Optional[str] = _f(None, "Sentencepiece model file or Hugging Face tokenizer.json / directory.")
    num_workers: int = _f(2, "DataLoader worker processes.")
    eod_mask_loss: bool = _f(False, "Mask the loss on end-of-document tokens.")


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints (torch.distributed.checkpoint)."""

    save: Optional[str] = _f(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = _f(None, "Save every this many iterations.")
    load: Optional[str] = _f(None, "Directory to load the latest checkpoint from.")
    no_load_optim: bool = _f(False, "Do not load optimizer and scheduler state.")
    no_load_rng: bool = _f(False, "Do not load random number generator states.")
    finetune: bool = _f(False, "Load weights only and start from iteration 0.")
    ckpt_step: Optional[int] = _f(None, "Load this iteration instead of the latest.")
    async_save: bool = _f(False, "Write checkpoints in the background.")


@dataclass
class LoggingConfig:
    """Console, metrics file, TensorBoard and Weights & Biases."""

    log_interval: int = _f(100, "Print a log line every this many iterations.")
    metrics_file: Optional[str] = _f(None, "Append JSON Lines metrics here (one record per logged iteration and evaluation).")
    tensorboard_dir: Optional[str] = _f(None, "Write TensorBoard scalars here.")
    wandb_project: Optional[str] = _f(None, "Weights & Biases project (enables W&B logging).")
    wandb_exp_name: Optional[str] = _f(None, "Weights & Biases run name.")
    wandb_save_dir: Optional[str] = _f(None, "Weights & Biases local directory.")
    device_peak_flops: Optional[float] = _f(None, "Peak FLOP/s per device for MFU (default: table, or measured on CPU).")
    log_memory: bool = _f(True, "Disable the peak-memory report.", flag="--no-log-memory", action="store_false")


@dataclass
class MegalmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MegalmConfig":
        kwargs = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory
            known = {g.name for g in dataclasses.fields(sub)}
            kwargs[f.name] = sub(**{k: v for k, v in d.get(f.name, {}).items() if k in known})
        return cls(**kwargs)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(MegalmConfig)}


# --- command line ----------------------------------------------------------------------

def parse_moe_layer_freq(text) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an int, or a list written as a Python literal built from int lists with
    ``+`` and ``*`` (Megatron's form, e.g. ``"([0]+[1]*3)*2"``).  Evaluated without ``eval``."""
    import ast

    if isinstance(text, (int, list)):
        return text
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)
    try:
        out = value(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} is neither an int nor a list such as "
                                         f"\"[0,1,1,1]\" or \"([0]+[1]*3)*2\"") from None
    if isinstance(out, list) and not all(isinstance(v, int) for v in out):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} must be a flat list of 0/1 entries")
    return out


# Flag parsers for fields whose type is not a plain int/float/str (metadata["type"]).
_FLAG_TYPES = {"moe_layer_freq": parse_moe_layer_freq}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, List):
        return _base_type(typing.get_args(tp)[0])
    return tp


def add_config_arguments(parser: argparse.ArgumentParser, extra_sections: Optional[dict] = None) -> argparse.ArgumentParser:
    """Add one flag per config field, grouped by section."""
    sections = dict(SECTIONS, **(extra_sections or {}))
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("derived"):
                continue
            kw = {"dest": f"{section}.{f.name}", "help": f.metadata.get("help")}
            action = f.metadata.get("action")
            tp = hints[f.name]
            if action or _base_type(tp) is bool:
                kw["action"] = action or "store_true"
                kw["default"] = f.default
            else:
                kw["type"] = _FLAG_TYPES.get(f.metadata.get("type"), _base_type(tp))
                kw["default"] = f.default if f.default is not dataclasses.MISSING else None
                for key in ("choices", "nargs"):
                    if key in f.metadata:
                        kw[key] = f.metadata[key]
                if "choices" not in f.metadata:
                    kw["metavar"] = f.name.upper()
            group.add_argument(_flag(f), **kw)
    return parser


def build_parser(description: str = "megalm", extra_sections: Optional[dict] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    return add_config_arguments(parser, extra_sections)


def config_from_args(args: argparse.Namespace) -> MegalmConfig:
    values = vars(args)
    kwargs = {}
    for section, cls in SECTIONS.items():
        kwargs[section] = cls(**{f.name: values[f"{section}.{f.name}"] for f in dataclasses.fields(cls)
                                 if f"{section}.{f.name}" in values})
    return MegalmConfig(**kwargs)


def parse_config(argv: Optional[List[str]] = None, world_size: Optional[int] = None) -> MegalmConfig:
    """Parse Megatron-style flags and validate them (before any process group exists)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        return validate_config(cfg, world_size=world_size)
    except ConfigError as e:
        parser.error(str(e))


# --- validation ------------------------------------------------------------------------

def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _validate_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """Mixture-of-experts flags (needs ``ffn_hidden_size`` and ``sequence_parallel`` settled)."""
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if m.num_experts is None:
        _check(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    e = m.num_experts
    _check(e >= 1, f"--num-experts must be >= 1, got {e}")
    _check(1 <= m.moe_router_topk <= e, f"--moe-router-topk {m.moe_router_topk} must be in [1, --num-experts {e}]")
    _check(ep >= 1 and e % ep == 0, f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
    _check(tp == 1 or p.sequence_parallel,
           f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (each tensor-parallel rank "
           f"routes its own slice of the sequence)")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    _check(m.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be positive, got {m.moe_ffn_hidden_size}")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        _check(freq >= 1, f"--moe-layer-freq {freq} must be >= 1")
    else:
        _check(isinstance(freq, list) and len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
               f"--moe-layer-freq {freq} must have one 0/1 entry per layer (--num-layers {m.num_layers})")
    _check(m.moe_router_score_function == "softmax" or not m.moe_router_pre_softmax,
           "--moe-router-pre-softmax needs --moe-router-score-function softmax")
    _check(m.moe_aux_loss_coeff >= 0.0, f"--moe-aux-loss-coeff must be >= 0, got {m.moe_aux_loss_coeff}")
    _check(m.moe_z_loss_coeff is None or m.moe_z_loss_coeff >= 0.0,
           f"--moe-z-loss-coeff must be >= 0, got {m.moe_z_loss_coeff}")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None:
        _check(shared > 0 and shared % tp == 0,
               f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
               f"--tensor-model-parallel-size {tp}")
    cf = m.moe_expert_capacity_factor
    _check(cf is None or cf > 0.0, f"--moe-expert-capacity-factor must be positive, got {cf}")
    _check(cf is not None or not m.moe_pad_expert_input_to_capacity,
           "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


def _validate_fp8(m: ModelConfig, p: ParallelConfig, t) -> None:
    """``--fp8-*``: Transformer Engine layers, delayed-scaling settings, and the shapes TE's fp8 GEMMs take."""
    if m.fp8_format is None:
        return
    _check(m.transformer_impl == "transformer_engine", f"--fp8-format {m.fp8_format} needs --transformer-impl "
                                                       f"transformer_engine (fp8 runs inside Transformer Engine's layers)")
    _check(m.fp8_margin >= 0 and m.fp8_amax_history_len >= 1,
           f"--fp8-margin must be >= 0 and --fp8-amax-history-len >= 1, got {m.fp8_margin} and {m.fp8_amax_history_len}")
    _check(m.recompute_granularity != "full", "--fp8-format with --recompute-granularity full is not supported "
                                              "(megalm's recompute does not replay TE's fp8 scaling state); use "
                                              "--recompute-granularity selective or no recompute")
    tp, heads, d = p.tensor_model_parallel_size, m.num_attention_heads, m.head_dim
    widths = {"hidden": m.hidden_size, "qkv/tp": (heads + 2 * m.num_kv_heads) * d // tp, "heads*d/tp": heads * d // tp,
              "ffn/tp": m.ffn_hidden_size // tp}  # fc1's [gate; up] width is twice ffn/tp
    bad = {name: width for name, width in widths.items() if width % 16}
    _check(not bad, f"--fp8-format: Transformer Engine's fp8 GEMMs need widths divisible by 16, got {bad}")
    tokens = m.seq_length * t.micro_batch_size // (tp if p.sequence_parallel else 1)
    _check(tokens % 8 == 0, f"--fp8-format: Transformer Engine's fp8 GEMMs need the tokens per rank and micro-batch "
                            f"(--seq-length x --micro-batch-size, / TP under sequence parallelism) divisible by 8, "
                            f"got {tokens}")


def validate_config(cfg: MegalmConfig, world_size: Optional[int] = None) -> MegalmConfig:
    """Check every combination and fill derived values.  Raises :class:`ConfigError`."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _check(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    _check(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")

    # Heads and hidden sizes.
    if m.kv_channels is None:
        _check(m.hidden_size % m.num_attention_heads == 0,
               f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}")
    _check(m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if m.group_query_attention:
        _check(m.num_query_groups is not None and m.num_query_groups > 0,
               "--group-query-attention needs --num-query-groups")
        _check(m.num_attention_heads % m.num_query_groups == 0,
               f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}")
        _check(m.num_query_groups % tp == 0,
               f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    else:
        m.num_query_groups = None
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if m.swiglu else 4 * m.hidden_size
        m.ffn_hidden_size = max(m.ffn_hidden_size, 64 if m.swiglu else m.ffn_hidden_size)
    _check(m.ffn_hidden_size % tp == 0,
           f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if m.position_embedding_type == "rope":
        rot = int(m.head_dim * m.rotary_percent)
        _check(rot % 2 == 0 and rot > 0, f"rotary dimension {rot} (head dim {m.head_dim} x --rotary-percent "
                                         f"{m.rotary_percent}) must be a positive even number")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute":
        _check(m.seq_length <= m.max_position_embeddings,
               f"--seq-length {m.seq_length} is longer than --max-position-embeddings {m.max_position_embeddings} "
               f"with learned absolute positions")
    for name in ("hidden_dropout", "attention_dropout"):
        _check(0.0 <= getattr(m, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")

    # Recompute.
    if m.recompute_granularity == "full":
        _check(m.recompute_method is not None, "--recompute-granularity full needs --recompute-method {uniform,block}")
        _check(m.recompute_num_layers is not None and m.recompute_num_layers >= 1,
               "--recompute-granularity full needs --recompute-num-layers >= 1")
    elif m.recompute_method is not None:
        _check(False, f"--recompute-method {m.recompute_method} needs --recompute-granularity full")

    # Pipeline split.
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _check(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        _check(middle_layers >= 0 and (middle_stages == 0 and middle_layers == 0 or
                                       middle_stages > 0 and middle_layers % middle_stages == 0),
               f"--num-layers {m.num_layers} minus first ({first}) and last ({last}) stage layers "
               f"cannot be split evenly over the other {middle_stages} pipeline stages")
    else:
        _check(m.num_layers % pp == 0,
               f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    vpp = None
    if p.num_layers_per_virtual_pipeline_stage is not None or p.num_virtual_stages_per_pipeline_rank is not None:
        _check(p.num_layers_per_virtual_pipeline_stage is None or p.num_virtual_stages_per_pipeline_rank is None,
               "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank")
        _check(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        _check(first is None and last is None, "uneven first/last stages are not supported with virtual stages")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_rank = m.num_layers // pp
            _check(per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
                   f"layers per pipeline rank ({per_rank}) is not divisible by "
                   f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage}")
            vpp = per_rank // p.num_layers_per_virtual_pipeline_stage
        else:
            vpp = p.num_virtual_stages_per_pipeline_rank
            _check((m.num_layers // pp) % vpp == 0,
                   f"layers per pipeline rank ({m.num_layers // pp}) is not divisible by "
                   f"--num-virtual-stages-per-pipeline-rank {vpp}")
    p.virtual_pipeline_model_parallel_size = vpp
    _check(p.context_parallel_size == 1, "--context-parallel-size > 1 is not supported yet")
    _check(not p.overlap_param_gather or p.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the optimizer's parameter all-gather)")
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False  # as Megatron: a no-op without tensor parallelism
    if p.sequence_parallel:
        _check(m.seq_length % tp == 0,
               f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} (sequence parallel)")
    _validate_moe(m, p)

    # Precision.
    _check(not (t.bf16 and t.fp16), "--bf16 and --fp16 are mutually exclusive")
    _validate_fp8(m, p, t)
    _check(m.attention_backend != "flash" or t.bf16 or t.fp16,
           "--attention-backend flash needs --bf16 or --fp16 (flash-attn has no fp32 kernels)")
    _check(t.loss_scale is None or t.fp16, "--loss-scale needs --fp16")

    # World size dependent checks.
    if world_size is not None:
        from megalm.parallel_state import validate_layout

        try:
            p.data_parallel_size = validate_layout(world_size, tp, pp, p.context_parallel_size,
                                                   p.expert_model_parallel_size, vpp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        p.world_size = world_size
        dp = p.data_parallel_size
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _check(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
        _check(t.global_batch_size % (t.micro_batch_size * dp) == 0,
               f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
               f"{t.micro_batch_size} x data-parallel size {dp}")
        if vpp is not None and vpp > 1:
            n_micro = t.global_batch_size // (t.micro_batch_size * dp)
            _check(n_micro % pp == 0,
                   f"interleaved pipeline schedule needs the number of microbatches ({n_micro}) "
                   f"to be divisible by --pipeline-model-parallel-size {pp}")
        if t.rampup_batch_size is not None:
            start, incr, _ = t.rampup_batch_size
            _check(start % (t.micro_batch_size * dp) == 0 and incr % (t.micro_batch_size * dp) == 0,
                   f"--rampup-batch-size start {start} and increment {incr} must be multiples of "
                   f"micro batch x DP = {t.micro_batch_size * dp}")

    # Training length.
    _check(not (t.train_iters is not None and t.train_samples is not None),
           "give only one of --train-iters and --train-samples")
    _check(t.rampup_batch_size is None or t.train_samples is not None,
           "--rampup-batch-size needs --train-samples")
    _check(t.lr_warmup_fraction is None or (t.lr_warmup_iters == 0 and t.lr_warmup_samples is None),
           "give only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction")
    if t.train_iters is not None and t.lr_decay_style != "constant" and t.lr_warmup_fraction is None:
        decay = t.lr_decay_iters or t.train_iters
        _check(t.lr_warmup_iters < decay, f"--lr-warmup-iters {t.lr_warmup_iters} must be shorter than the decay "
                                          f"({decay} iterations: --lr-decay-iters or --train-iters)")
    _check(not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
           "give only one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler")
    for name in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"):
        _check(getattr(t, name) is None or t.train_samples is not None,
               f"--{name.replace('_', '-')} needs --train-samples (with --train-iters use the *-iters flags)")
    _check(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is larger than --lr {t.lr}")
    _check(t.loss_scale_window >= 1 and t.hysteresis >= 1, "--loss-scale-window and --hysteresis must be >= 1")

    # Data.
    sources = [d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path]
    _check(not (d.mock_data and any(sources)), "--mock-data cannot be combined with data paths")
    _check(not (d.data_path and any(sources[1:])),
           "give either --data-path or --train/valid/test-data-path, not both")
    if d.split:
        parts = [s for s in d.split.replace("/", ",").split(",") if s.strip()]
        try:
            vals = [float(s) for s in parts]
        except ValueError:
            raise ConfigError(f"--split {d.split!r} must be comma-separated numbers, e.g. 969,30,1") from None
        _check(len(vals) <= 3 and all(v >= 0 for v in vals) and sum(vals) > 0,
               f"--split {d.split!r} needs up to three non-negative proportions with a positive sum")
    if d.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        _check(d.tokenizer_model is not None, f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model")
    if d.tokenizer_type == "NullTokenizer":
        _check(m.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    if m.vocab_size is not None:
        m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)

    # Checkpoints and logging.
    _check(cfg.checkpoint.save_interval is None or cfg.checkpoint.save_interval > 0, "--save-interval must be positive")
    _check(cfg.logging.log_interval > 0, "--log-interval must be positive")
    return cfg


def set_vocab_size(cfg: MegalmConfig, vocab_size: int) -> None:
    """Record the tokenizer's vocabulary size and the padded size used by the embedding."""
    cfg.model.vocab_size = vocab_size
    cfg.model.padded_vocab_size = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by,
                                                 cfg.parallel.tensor_model_parallel_size)
