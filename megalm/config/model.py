"""``ModelConfig``: the architecture flags (dense and mixture of experts).  The checks that need
nothing but them: :mod:`megalm.config.model_checks` (MoE's: :mod:`megalm.config.moe`); against the
parallel layout: :mod:`megalm.config.cross`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional, Union

from megalm.config.fields import Section
from megalm.config.fields import flag_field as _f
from megalm.config.model_checks import validate_model


@dataclass
class ModelConfig(Section):
    """Architecture of the GPT transformer, dense or mixture of experts."""

    num_layers: int = _f(2, "Number of transformer layers.")
    hidden_size: int = _f(128, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = _f(
        None, "MLP hidden size; default 4 x hidden (SwiGLU: 8/3 x hidden rounded to 64)."
    )
    num_attention_heads: int = _f(4, "Number of attention heads.")
    kv_channels: Optional[int] = _f(None, "Per-head projection size; default hidden / heads.")
    group_query_attention: bool = _f(False, "Use grouped-query attention (see --num-query-groups).")
    num_query_groups: Optional[int] = _f(None, "Number of key/value head groups with --group-query-attention.")
    seq_length: int = _f(128, "Sequence length of training samples.")
    max_position_embeddings: Optional[int] = _f(None, "Size of the learned position table; default --seq-length.")
    position_embedding_type: str = _f(
        "learned_absolute",
        "Position embedding (yarn: Megatron's spelling of rope with --rope-type yarn).",
        choices=["learned_absolute", "rope", "yarn", "none"],
    )
    add_position_embedding: bool = _f(
        True,
        "Megatron's switch: with learned absolute positions, use none (= --position-embedding-type none); "
        "with rope, no effect.",
        flag="--no-position-embedding",
        action="store_false",
    )
    rotary_base: int = _f(10000, "Base of the rotary embedding frequencies.")
    rotary_percent: float = _f(1.0, "Fraction of each head's dimensions that is rotated.")
    normalization: str = _f("LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = _f(1e-5, "Epsilon of the normalization layers.")
    apply_layernorm_1p: bool = _f(
        False,
        "Zero-centered norm weights (LayerNorm and RMSNorm): initialised to 0 and applied as (1 + weight), "
        "for numerical stability (Megatron's LayerNorm1P / TE's zero_centered_gamma).",
    )
    swiglu: bool = _f(False, "Use SwiGLU in the MLP instead of GELU.")
    openai_gelu: bool = _f(
        False,
        "GELU as its tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) instead of the exact erf "
        "form (Megatron-LM's --openai-gelu; Megatron's default fused bias-GELU computes this form too, so "
        "tools/checkpoint/convert.py --from megatron sets it for such checkpoints).",
    )
    squared_relu: bool = _f(
        False,
        "Use squared ReLU relu(x)^2 in the MLP instead of GELU (Megatron-LM's --squared-relu, Nemotron recipes); "
        "not with --swiglu, --quick-geglu or --openai-gelu.",
    )
    add_bias_linear: bool = _f(
        True, "Disable biases in all linear layers.", flag="--disable-bias-linear", action="store_false"
    )
    untie_embeddings_and_output_weights: bool = _f(False, "Use a separate output layer instead of the word embedding.")
    qk_layernorm: bool = _f(
        False, "Normalize each query and key head (--normalization over the head dimension) before RoPE."
    )
    add_qkv_bias: bool = _f(False, "Give the QKV projection a bias even with --disable-bias-linear (Qwen-style).")
    multi_latent_attention: bool = _f(
        False,
        "Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents "
        "(--q-lora-rank, --kv-lora-rank), per-head dims --qk-head-dim + --qk-pos-emb-head-dim (RoPE part) "
        "and --v-head-dim; --qk-layernorm normalizes the latents.",
    )
    q_lora_rank: Optional[int] = _f(
        None, "MLA: rank of the query latent (unset: queries projected directly from the hidden state)."
    )
    kv_lora_rank: int = _f(32, "MLA: rank of the key/value latent (what the KV cache stores).")
    qk_head_dim: int = _f(128, "MLA: per-head query/key dimension without position embedding.")
    qk_pos_emb_head_dim: int = _f(64, "MLA: per-head query/key dimension carrying RoPE (the key part is shared).")
    v_head_dim: int = _f(128, "MLA: per-head value dimension.")
    mtp_num_layers: Optional[int] = _f(
        None,
        "Multi-token prediction depths (DeepSeek-V3): depth k predicts the token k+1 ahead from the previous "
        "depth's hidden state and the embedding of the token k ahead (shared embedding and output layer).",
    )
    mtp_loss_scaling_factor: float = _f(
        0.1, "Weight of the multi-token prediction losses: factor / --mtp-num-layers times their sum is trained."
    )
    rope_type: Optional[str] = _f(
        None,
        "RoPE variant: rope (plain) or yarn (YaRN frequency scaling, see --rotary-scaling-factor); "
        "default rope, yarn with --multi-latent-attention (Megatron's MLA default).",
        choices=["rope", "yarn"],
    )
    rotary_scaling_factor: float = _f(1.0, "YaRN: context extension factor (1: no scaling).")
    original_max_position_embeddings: Optional[int] = _f(
        None, "YaRN: the context length the model was trained with before extension (default 4096)."
    )
    beta_fast: float = _f(32.0, "YaRN: fast rotation count bounding the extrapolated frequencies.")
    beta_slow: float = _f(1.0, "YaRN: slow rotation count bounding the interpolated frequencies.")
    mscale: float = _f(1.0, "YaRN: attention temperature multiplier of the rotary tables (cos/sin).")
    mscale_all_dim: float = _f(
        0.0, "YaRN: temperature of all dims: divides the tables' mscale and squares into the softmax scale (0: off)."
    )
    hidden_dropout: float = _f(0.1, "Dropout probability after attention and MLP outputs.")
    attention_dropout: float = _f(0.1, "Dropout probability on attention weights.")
    position_keyed_attention_dropout: bool = _f(
        False,
        "Draw the attention-dropout mask as a hash of (a per-call key from the model-parallel RNG stream, layer, "
        "batch, head, global query and key positions), so it does not depend on how the sequence is split. Always "
        "on under --context-parallel-size > 1; without CP it replaces the attention backend's dropout by megalm's "
        "tiled PyTorch core (whose results equal every CP size's).",
    )
    init_method_std: float = _f(0.02, "Standard deviation of the normal weight initialization.")
    use_scaled_init_method: bool = _f(
        True,
        "Disable the std/sqrt(2 x layers) init of output projections.",
        flag="--no-scaled-init-method",
        action="store_false",
    )
    make_vocab_size_divisible_by: int = _f(
        128, "Pad the vocabulary to a multiple of this value x tensor parallel size."
    )
    vocab_size: Optional[int] = _f(
        None, "Vocabulary size (set from the tokenizer; required with --tokenizer-type NullTokenizer)."
    )
    recompute_granularity: Optional[str] = _f(
        None, "Activation recomputation granularity.", choices=["full", "selective"]
    )
    recompute_activations: bool = _f(False, "Megatron's spelling of --recompute-granularity selective.")
    recompute_modules: Optional[List[str]] = _f(
        None,
        "Modules recomputed in backward with --recompute-granularity selective (Megatron's names): core_attn "
        "(default), mlp (dense MLPs), moe (whole MoE blocks), moe_act (the experts' activation), layernorm (the "
        "layers' two norms), shared_experts, mla_up_proj (MLA's up projections and RoPE, keeping only latents).",
        nargs="+",
    )
    recompute_method: Optional[str] = _f(
        None,
        "With full recompute: 'uniform' (chunks of N layers) or 'block' (first N layers of each stage).",
        choices=["uniform", "block"],
    )
    recompute_num_layers: Optional[int] = _f(
        None, "Layers per recompute chunk (uniform) or recomputed layers per stage (block)."
    )
    cpu_offloading: bool = _f(
        False,
        "Offload activations: the tensors the first --cpu-offloading-num-layers transformer layers save for "
        "backward move to host memory after their forward and come back, prefetched one layer ahead, before "
        "their backward (results unchanged).",
    )
    cpu_offloading_num_layers: int = _f(
        0, "With --cpu-offloading: how many transformer layers, from the first, offload their activations."
    )
    cpu_offloading_weights: bool = _f(
        False, "Megatron's weight offloading with --cpu-offloading: not built (refused); activations are offloaded."
    )
    apply_query_key_layer_scaling: bool = _f(
        False, "Megatron-LM's fp16 guard; a no-op here (warns): attention scales by 1/sqrt(head dim)."
    )
    bias_gelu_fusion: bool = _f(
        True,
        "Disable the fused bias + GeLU (bias + squared ReLU with --squared-relu).",
        flag="--no-bias-gelu-fusion",
        action="store_false",
    )
    bias_swiglu_fusion: bool = _f(
        True, "Disable the fused bias + SwiGLU.", flag="--no-bias-swiglu-fusion", action="store_false"
    )
    bias_dropout_fusion: bool = _f(
        True, "Disable the fused bias + dropout + add.", flag="--no-bias-dropout-fusion", action="store_false"
    )
    apply_rope_fusion: bool = _f(
        True, "Disable the fused rotary embedding.", flag="--no-rope-fusion", action="store_false"
    )
    masked_softmax_fusion: bool = _f(
        True, "Disable the fused masked softmax.", flag="--no-masked-softmax-fusion", action="store_false"
    )
    norm_fusion: bool = _f(
        True,
        "Disable the compiled LayerNorm/RMSNorm (megalm; apex's fused norms are used "
        "instead whenever NVIDIA apex is installed on a GPU).",
        flag="--no-norm-fusion",
        action="store_false",
    )
    cross_entropy_loss_fusion: bool = _f(
        True,
        "Output layer and vocab-parallel cross entropy as one chunked function "
        "that never materializes the logits (on by default in megalm; "
        "--no-cross-entropy-loss-fusion: logits, then the loss).",
        action=argparse.BooleanOptionalAction,
    )
    attention_backend: str = _f(
        "auto",
        "Attention core: auto (flash-attn when installed with bf16/fp16 on a GPU; "
        "blocked on a CPU in fp32 without attention dropout for sequences of "
        "128-1024; else PyTorch SDPA), flash (flash-attn), fused (PyTorch SDPA), "
        "blocked (causal attention in query blocks, no dropout), unfused or local "
        "(QK^T, masked softmax, @V).",
        choices=["auto", "flash", "fused", "blocked", "unfused", "local"],
    )
    use_flash_attn: bool = _f(False, "Megatron-LM's spelling of --attention-backend flash.")
    transformer_impl: str = _f(
        "local",
        "Transformer layer implementation: megalm's (local) or NVIDIA Transformer "
        "Engine's fused modules (transformer_engine, GPU).",
        choices=["local", "transformer_engine"],
    )
    fp8_format: Optional[str] = _f(
        None,
        "FP8 training through Transformer Engine (needs --transformer-impl "
        "transformer_engine on a GPU): e4m3 everywhere, or hybrid (e4m3 forward, "
        "e5m2 gradients).",
        choices=["e4m3", "hybrid"],
    )
    fp8_margin: int = _f(0, "FP8 delayed scaling: scale = fp8 max / amax / 2^margin.")
    fp8_amax_history_len: int = _f(1, "FP8 delayed scaling: number of steps of amax history kept per tensor.")
    fp8_amax_compute_algo: str = _f(
        "most_recent", "FP8 delayed scaling: the amax used from the history.", choices=["most_recent", "max"]
    )

    # gpt-oss: sliding-window attention, softmax sinks, clamped GLU, YaRN (megalm/config/gptoss.py checks them).
    window_size: Optional[List[int]] = _f(
        None,
        "Sliding-window attention as Megatron's (left,right) pair, e.g. 127,0: query i sees keys i-left..i "
        "(causal, so right must be 0; -1 as left: unbounded = full attention).",
        type="int_pair",
    )
    window_attn_skip_freq: Optional[Union[int, List[int]]] = _f(
        None,
        "With --window-size: which layers keep full attention. An int N: every N-th layer (1-based layer numbers "
        "divisible by N) is full, the others sliding-window; or a list with one 0/1 entry per layer as a Python "
        'expression, e.g. "[1,1,1,0]*3" (1: sliding window, 0: full). Unset: every layer slides.',
        type="moe_layer_freq",
    )
    softmax_type: str = _f(
        "vanilla",
        "Attention softmax: vanilla; off-by-one (a constant 0 logit in every row's denominator: "
        "exp(s_j) / (1 + sum exp(s)); learnable (a learned per-head sink logit in the denominator, gpt-oss).",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    quick_geglu: bool = _f(
        False, "Gated MLP with quick-GELU: x1 * sigmoid(1.702 x1) * (x2 + --glu-linear-offset) for [x1; x2] = fc1(x)."
    )
    glu_linear_offset: float = _f(0.0, "Offset added to the linear half of a gated MLP (gpt-oss: 1.0).")
    activation_func_clamp_value: Optional[float] = _f(
        None,
        "Clamp of a gated MLP's fc1 output (gpt-oss: 7.0): the gated half to at most c, the linear half to [-c, c].",
    )
    yarn_original_max_position_embeddings: Optional[int] = _f(
        None, "YaRN (Megatron's non-MLA spelling of --original-max-position-embeddings): the pre-extension context."
    )
    yarn_beta_fast: Optional[float] = _f(None, "YaRN: Megatron's non-MLA spelling of --beta-fast.")
    yarn_beta_slow: Optional[float] = _f(None, "YaRN: Megatron's non-MLA spelling of --beta-slow.")
    yarn_correction_range_round_to_int: Optional[bool] = _f(
        None,
        "YaRN: round the correction range to integers (Megatron's default; --no-yarn-correction-range-round-to-int: "
        "do not, as gpt-oss).",
        action=argparse.BooleanOptionalAction,
    )
    enable_gpt_oss: bool = _f(
        False,
        "gpt-oss's YaRN with Megatron's values: --rope-type yarn, factor 32, original context 131072, "
        "beta 32/1, mscale 1/0, no rounding (as Megatron's ModelOpt builder sets them).",
    )
    disable_bf16_reduced_precision_matmul: bool = _f(
        False,
        "On CUDA: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False (bf16 GEMMs accumulate "
        "at full precision). No effect on a CPU.",
    )

    # Mixture of experts (Megatron-LM's --num-experts / --moe-* flags); see megalm/transformer/moe.
    num_experts: Optional[int] = _f(None, "Number of experts in each MoE layer (unset: dense model).")
    moe_ffn_hidden_size: Optional[int] = _f(None, "Hidden size of each expert's MLP; default --ffn-hidden-size.")
    moe_layer_freq: Union[int, List[int]] = _f(
        1,
        "Which layers are MoE layers: every k-th layer (an int k: layers 0, k, 2k, ...), or one 0/1 entry "
        'per layer as a Python list, e.g. "[0,1,1,1]" or "([0]+[1]*3)*2".',
        type="moe_layer_freq",
    )
    moe_router_topk: int = _f(2, "Number of experts each token is routed to.")
    moe_router_score_function: str = _f("softmax", "Router score function.", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool = _f(
        False,
        "Softmax over all experts before the top-k (default: top-k of the logits, then softmax over the k chosen).",
    )
    moe_router_num_groups: Optional[int] = _f(
        None,
        "Group-limited routing (DeepSeek-V3): the experts form this many groups (e.g. one per device) and each "
        "token is routed within its --moe-router-group-topk best groups.",
    )
    moe_router_group_topk: Optional[int] = _f(
        None, "Group-limited routing: groups each token may use, ranked by the sum of their top-k/group-topk scores."
    )
    moe_router_topk_scaling_factor: Optional[float] = _f(
        None, "Multiply the routing weights of the chosen experts by this factor (DeepSeek-V3's 2.5)."
    )
    moe_router_enable_expert_bias: bool = _f(
        False,
        "Aux-loss-free load balancing (sigmoid scores): a per-expert bias added to the scores when choosing the "
        "experts (not to their weights), moved by --moe-router-bias-update-rate after each step towards even load.",
    )
    moe_router_bias_update_rate: float = _f(
        1e-3, "Step of the expert bias: bias += rate * sign(mean tokens per expert - tokens of the expert)."
    )
    moe_router_load_balancing_type: str = _f(
        "aux_loss",
        "Load-balancing loss: per micro-batch (aux_loss), per sequence (seq_aux_loss) or none.",
        choices=["aux_loss", "seq_aux_loss", "none"],
    )
    moe_aux_loss_coeff: float = _f(0.0, "Coefficient of the load-balancing loss (1e-2 is typical).")
    moe_z_loss_coeff: Optional[float] = _f(None, "Coefficient of the router z-loss (1e-3 is typical; unset: off).")
    moe_router_dtype: Optional[str] = _f(
        None,
        "Compute router logits and probabilities in this precision (default: the model's).",
        choices=["fp32", "fp64"],
    )
    moe_shared_expert_intermediate_size: Optional[int] = _f(
        None, "Hidden size of a shared expert every token goes through (unset: none)."
    )
    moe_token_dispatcher_type: str = _f(
        "allgather",
        "How tokens reach the experts over the expert-parallel group. flex (Megatron's DeepEP / HybridEP fused "
        "all-to-all, CUDA only) runs megalm's alltoall dispatcher: the same tokens reach the same experts with the "
        "same weights, moved by two torch.distributed all-to-alls instead of fused kernels.",
        choices=["allgather", "alltoall", "flex"],
    )
    moe_router_force_load_balancing: bool = _f(
        False,
        "Benchmark mode (Megatron's): route by random normal logits instead of the router's (straight-through "
        "gradient), so experts receive balanced loads; the model does not learn to route.",
    )
    moe_shared_expert_gate: bool = _f(
        False, "Scale the shared expert's output by sigmoid(x . g) with a learned gate vector g (Qwen2-MoE style)."
    )
    moe_expert_capacity_factor: Optional[float] = _f(
        None,
        "Expert capacity = ceil(tokens x topk / experts x factor); tokens beyond it are dropped (unset: dropless).",
    )
    moe_token_drop_policy: str = _f(
        "probs",
        "Which tokens an over-full expert keeps: highest probabilities or earliest positions.",
        choices=["probs", "position"],
    )
    moe_pad_expert_input_to_capacity: bool = _f(
        False, "Pad every expert's input to its capacity (needs --moe-expert-capacity-factor)."
    )
    moe_grouped_gemm: bool = _f(False, "Compute the local experts with one batched matmul instead of a loop.")
    moe_per_layer_logging: bool = _f(False, "Also log each MoE layer's losses and tokens per expert.")

    # Derived values (not flags), filled by validate_config.
    padded_vocab_size: Optional[int] = field(default=None, metadata={"derived": True})

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 is a fused ``[gate; up]`` pair (SwiGLU or quick-GEGLU)."""
        return self.swiglu or self.quick_geglu

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    def validate(self) -> None:
        """Sizes, heads, FFN width (derived), positions, dropout, recompute, attention core, activation
        offloading, fp8 settings and the MoE flags, each against this section alone
        (:func:`megalm.config.model_checks.validate_model`)."""
        validate_model(self)
