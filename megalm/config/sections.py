"""The configuration sections: one typed dataclass per flag group, one field per Megatron-LM flag.

Each field's name is the flag with ``--`` dropped and dashes turned into underscores, unless
``metadata["flag"]`` says otherwise (used for negated flags such as ``--disable-bias-linear``
-> ``add_bias_linear``).  ``help`` in the metadata is the field's documentation and the
flag's ``--help`` text.  Combinations are checked in :mod:`megalm.config.validation`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Union

from megalm.config.fields import flag_field
from megalm.config.megatron_compat import MegatronCompatConfig
from megalm.errors import MegalmError
from megalm.tokenizers.build import TOKENIZER_TYPES

_f = flag_field


class ConfigError(MegalmError, ValueError):
    """An invalid configuration; the message names the offending flags and values."""


# ---------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
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
        True, "Disable the fused bias + GeLU.", flag="--no-bias-gelu-fusion", action="store_false"
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
        return self.swiglu or getattr(self, "quick_geglu", False)

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads


@dataclass
class ParallelConfig:
    """How the model and data are split across processes."""

    tensor_model_parallel_size: int = _f(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = _f(1, "Pipeline model parallel size.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(
        None, "Layers per virtual pipeline stage (interleaved 1F1B)."
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = _f(
        None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B)."
    )
    decoder_first_pipeline_num_layers: Optional[int] = _f(None, "Layers on the first pipeline stage (uneven split).")
    decoder_last_pipeline_num_layers: Optional[int] = _f(None, "Layers on the last pipeline stage (uneven split).")
    context_parallel_size: int = _f(
        1,
        "Context parallel size: each sequence is cut into 2 x CP chunks and CP rank i "
        "holds chunks i and 2CP-1-i (equal causal work); gradients are reduced over "
        "data x context parallel ranks.",
    )
    cp_comm_type: str = _f(
        "p2p",
        "Communication of the attention core under context parallelism: p2p (ring "
        "attention, K/V sent around the ring overlapped with compute), a2a (Ulysses "
        "all-to-all, heads and KV groups per TP rank divisible by CP) or allgather "
        "(K/V all-gathered over CP).",
        choices=["p2p", "a2a", "allgather"],
    )
    expert_model_parallel_size: int = _f(1, "Expert model parallel size.")
    expert_tensor_parallel_size: Optional[int] = _f(
        None,
        "Tensor-parallel size of the experts (ETP), independent of --tensor-model-parallel-size: > 1 splits every "
        "expert over ETP adjacent ranks (fc1 column-, fc2 row-parallel; expert layout etp-ep-edp, expert DP = "
        "world / (PP x ETP x EP); the ETP group's tokens are all-gathered). Absent or "
        "1: experts whole on every rank, each TP rank running them on its own sequence slice (Megatron's default "
        "when absent is ETP = TP: same model, other memory and communication).",
    )
    sequence_parallel: bool = _f(False, "Shard norms and dropout along the sequence over tensor-parallel ranks.")
    use_distributed_optimizer: bool = _f(
        False, "Shard optimizer state and main weights over data-parallel ranks (ZeRO-1)."
    )
    data_parallel_sharding_strategy: str = _f(
        "no_shard",
        "What data-parallel ranks shard (megalm's implementation of Megatron's names; "
        "--use-megatron-fsdp is not needed and changes nothing): no_shard (plain DP), "
        "optim (= --use-distributed-optimizer, ZeRO-1), optim_grads (ZeRO-2: also the reduced gradients; "
        "each bucket's full gradient "
        "storage is freed once reduce-scattered), optim_grads_params (ZeRO-3: also the parameters, "
        "all-gathered per bucket before each module's forward and again for backward; "
        "--overlap-param-gather prefetches the next bucket).",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    overlap_grad_reduce: bool = _f(False, "Reduce gradient buckets during the last microbatch's backward.")
    overlap_param_gather: bool = _f(
        False,
        "All-gather updated parameters during the next forward (distributed optimizer); with "
        "--data-parallel-sharding-strategy optim_grads_params (as Megatron-FSDP): prefetch, the next "
        "bucket's all-gather in flight while the current one is used, in forward and in backward.",
    )
    ddp_bucket_size: Optional[int] = _f(None, "Gradient bucket size in elements; default max(40M, 1M x DP).")
    hierarchical_grad_reduce: bool = _f(
        False,
        "Topology-aware data-parallel reduction (megalm): each gradient bucket "
        "is reduce-scattered inside the node, all-reduced across nodes among "
        "the ranks with the same local index (1/L of it per rank), and "
        "all-gathered inside the node; with --use-distributed-optimizer "
        "reduce-scattered inside then across nodes and the parameters "
        "gathered back the same way.  Same results as the flat collectives "
        "up to summation order; nodes are consecutive blocks of "
        "LOCAL_WORLD_SIZE ranks, and the data-parallel group must have the "
        "same number of ranks on every node.",
    )
    grad_compression: str = _f(
        "none",
        "Compress the data-parallel gradient reduction (megalm), with error feedback (what a rank did "
        "not send is added to its next step's gradient): powersgd (rank --powersgd-rank approximation "
        "of every matrix, two all-reduces; vectors and small matrices exact), topk (all-gather of the "
        "--topk-ratio largest-magnitude entries and their indices), int8 (all-gather of 8-bit values "
        "with one fp32 scale per --int8-chunk-size elements), fp8 (the same with fp8 values, "
        "--grad-fp8-format).  Once per step (after gradient accumulation); with --hierarchical-grad-reduce "
        "only the inter-node leg.  With --use-distributed-optimizer each rank keeps its shard of the same "
        "result (int8/fp8: an all-to-all instead of the all-gather); not with the optim_grads / "
        "optim_grads_params strategies.  Checkpoints keep the state; loaded under another layout the "
        "residuals are resharded (each rank gets its share of the pending update).",
        choices=["none", "powersgd", "topk", "int8", "fp8"],
    )
    powersgd_rank: int = _f(4, "Rank of PowerSGD's low-rank gradient approximation (--grad-compression powersgd).")
    topk_ratio: float = _f(0.01, "Fraction of each bucket's entries sent by --grad-compression topk, in (0, 1].")
    int8_chunk_size: int = _f(1024, "Elements sharing one fp32 scale under --grad-compression int8.")
    int8_rounding: str = _f(
        "nearest",
        "Rounding of --grad-compression int8: nearest, or stochastic (unbiased; a different random "
        "stream per rank, saved in checkpoints).",
        choices=["nearest", "stochastic"],
    )
    grad_fp8_format: str = _f(
        "e4m3",
        "fp8 format of --grad-compression fp8: e4m3 (3 mantissa bits, largest 448) or e5m2 (2 mantissa "
        "bits, largest 57344); each chunk is scaled so that its largest magnitude is the format's largest.",
        choices=["e4m3", "e5m2"],
    )
    grad_fp8_chunk_size: int = _f(1024, "Elements sharing one fp32 scale under --grad-compression fp8.")
    grad_fp8_rounding: str = _f(
        "nearest",
        "Rounding of --grad-compression fp8: nearest (ties to even), or stochastic (to one of the two "
        "neighbouring fp8 values, unbiased; a different random stream per rank, saved in checkpoints).",
        choices=["nearest", "stochastic"],
    )
    local_sgd_interval: int = _f(
        0,
        "Local SGD / DiLoCo (megalm): data-parallel replicas step independently with their own "
        "optimizer (gradients reduced over no rank, or with --hierarchical-grad-reduce inside the "
        "node only) and their parameters are averaged every this many iterations over the "
        "data-parallel group (hierarchical: across nodes); 0 = synchronous data parallelism.  "
        "Checkpoints keep every replica's weights and optimizer state per rank.",
    )
    local_sgd_overlap_steps: int = _f(
        0,
        "Local SGD / DiLoCo (megalm): overlap the parameter average with this many following training "
        "iterations (0 = blocking, the default).  The average of the parameters snapshotted at a sync "
        "is all-reduced in the background and applied this many iterations later as a correction that "
        "keeps each replica's progress since the snapshot: x <- x + (outer(average) - snapshot).  At most "
        "--local-sgd-interval; a sync due at the run's last iteration (--train-iters) is blocking.",
    )
    outer_lr: float = _f(
        1.0,
        "DiLoCo outer learning rate: every --local-sgd-interval steps x <- x0 - outer_lr (D + "
        "outer_momentum m) with D = x0 - average (x0: the parameters at the last sync); 1 with "
        "--outer-momentum 0 is plain parameter averaging.",
    )
    outer_momentum: float = _f(
        0.0, "DiLoCo outer Nesterov momentum: m <- outer_momentum m + D (see --outer-lr); DiLoCo uses 0.9."
    )
    accumulate_allreduce_grads_in_fp32: bool = _f(
        True, "Accumulate and reduce gradients in fp32 (on unless --grad-reduce-in-bf16)."
    )
    megatron_fsdp_main_grads_dtype: str = _f(
        "auto",
        "Dtype of the gradient buffers (accumulation and the optimizer's main gradients): fp32 = "
        "--accumulate-allreduce-grads-in-fp32; bf16 / fp16 = the parameters' dtype (needs --bf16 / --fp16); auto: "
        "as the other flags say.",
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    megatron_fsdp_grad_comm_dtype: str = _f(
        "auto",
        "Dtype the gradients are reduced in over data-parallel ranks. megalm reduces in its gradient buffers, so "
        "this sets their dtype as --megatron-fsdp-main-grads-dtype does (auto: the main-gradient dtype); the two "
        "must agree when both are given.",
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    grad_reduce_in_bf16: bool = _f(
        False,
        "With --bf16: accumulate and reduce gradients in bf16 (half the data-parallel bytes; the optimizer "
        "still steps fp32 main weights on an fp32 copy of the gradients).",
    )
    variable_seq_lengths: bool = _f(False, "Exchange tensor shapes between pipeline stages each microbatch.")
    distributed_timeout_minutes: float = _f(
        10, "Timeout of every collective, in minutes (fractions allowed); a timeout names its group."
    )

    # Derived.
    world_size: Optional[int] = field(default=None, metadata={"derived": True})
    data_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})
    virtual_pipeline_model_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})


@dataclass
class TrainingConfig:
    """Batches, schedule, optimizer, precision and stopping."""

    micro_batch_size: int = _f(1, "Samples per microbatch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Samples per iteration over all ranks; default micro x DP.")
    rampup_batch_size: Optional[List[int]] = _f(
        None,
        "Batch size ramp-up: <start> <increment> <ramp-up samples>; with --train-samples or --train-iters (then "
        "that many iterations, each batch by the samples consumed so far, as Megatron-LM).",
        nargs=3,
    )
    step_batch_size_schedule: Optional[str] = _f(
        None,
        "Global batch size by consumed tokens: '<tokens>:<batch> ...', e.g. '0:16 2.4B:320' (suffixes K M B T; "
        "the first threshold 0; tokens become samples by floor division by --seq-length). Sets the global "
        "batch size itself (not with --global-batch-size or --rampup-batch-size); with --train-samples or "
        "--train-iters. The learning rate follows the batch only with --lr-batch-scaling.",
    )
    lr_batch_scaling: str = _f(
        "none",
        "megalm's (Megatron has none): scale the learning rate with the batch of each iteration under "
        "--rampup-batch-size or --step-batch-size-schedule. --lr (and --min-lr, the whole schedule) is the value at "
        "the global batch size (the largest batch); an iteration of batch b uses it x b / global batch (linear) "
        "or x sqrt(b / global batch) (sqrt); none: unscaled (--step-batch-size-schedule then warns with both rules).",
        choices=["none", "linear", "sqrt"],
    )
    train_iters: Optional[int] = _f(None, "Iterations to train (or --train-samples).")
    train_samples: Optional[int] = _f(None, "Samples to train (or --train-iters).")
    seed: int = _f(1234, "Random seed (weights, dropout, data order).")
    deterministic_mode: bool = _f(
        False,
        "torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG on CUDA): an op without a "
        "deterministic kernel raises instead of running.",
    )
    optimizer: str = _f(
        "adam",
        "Optimizer: adam is AdamW (decoupled weight decay); sgd (momentum, L2 decay); lamb (Adam direction "
        "times a per-tensor trust ratio ||w||/||update||, clamped at 10); lars (SGD momentum with the "
        "per-tensor local learning rate of --lars-trust-coefficient); lion (sign of interpolated momentum); muon "
        "(Newton-Schulz-orthogonalized momentum for the linear layers' weights, --muon-scalar-optimizer for the rest). "
        "LAMB and LARS leave biases and norm weights out of the trust ratio; their norms are of the full "
        "tensor under every parallel layout.",
        choices=["adam", "sgd", "lamb", "lars", "lion", "muon"],
    )
    lr: float = _f(1e-4, "Peak learning rate.")
    min_lr: float = _f(0.0, "Minimum learning rate after decay.")
    lr_decay_style: str = _f(
        "linear", "Learning-rate decay.", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    )
    lr_warmup_iters: int = _f(0, "Linear warm-up iterations.")
    lr_warmup_fraction: Optional[float] = _f(None, "Warm-up as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = _f(0.0, "Learning rate at the start of warm-up.")
    lr_decay_iters: Optional[int] = _f(None, "Iterations to decay over; default --train-iters.")
    lr_decay_samples: Optional[int] = _f(None, "Samples to decay over (with --train-samples).")
    lr_warmup_samples: Optional[int] = _f(None, "Warm-up samples (with --train-samples).")
    lr_wsd_decay_samples: Optional[int] = _f(None, "Samples of WSD's final decay phase (with --train-samples).")
    override_opt_param_scheduler: bool = _f(False, "On load, use the learning-rate schedule of the command line.")
    use_checkpoint_opt_param_scheduler: bool = _f(
        False, "On load, use the learning-rate schedule saved in the checkpoint."
    )
    lr_wsd_decay_style: str = _f(
        "exponential", "Annealing shape of WSD's decay phase.", choices=["exponential", "linear", "cosine"]
    )
    lr_wsd_decay_iters: Optional[int] = _f(None, "Length of WSD's final decay phase.")
    weight_decay: float = _f(0.01, "Decoupled weight decay (not applied to biases and norms).")
    decoupled_lr: Optional[float] = _f(
        None, "Peak learning rate of the word embedding and output layer (their own schedule; default --lr)."
    )
    decoupled_min_lr: Optional[float] = _f(
        None, "Final learning rate of the word embedding and output layer with --decoupled-lr (default --min-lr)."
    )
    start_weight_decay: Optional[float] = _f(
        None, "Weight decay at the start of training with --weight-decay-incr-style linear or cosine."
    )
    end_weight_decay: Optional[float] = _f(
        None, "Weight decay at the end of training with --weight-decay-incr-style linear or cosine."
    )
    weight_decay_incr_style: str = _f(
        "constant",
        "How weight decay goes from --start-weight-decay to --end-weight-decay over training "
        "(constant: --weight-decay throughout).",
        choices=["constant", "linear", "cosine"],
    )
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    sgd_momentum: float = _f(0.9, "SGD momentum (also LARS').")
    lars_trust_coefficient: float = _f(
        0.001, "LARS trust coefficient eta: local lr = eta ||w|| / (||g|| + weight decay ||w||)."
    )
    lion_beta1: float = _f(0.9, "Lion beta1: interpolation of momentum and gradient for the sign (megalm's flag).")
    lion_beta2: float = _f(0.99, "Lion beta2: momentum decay (megalm's flag).")
    muon_momentum: float = _f(0.95, "Muon momentum (the matrices' momentum buffer decay).")
    muon_split_qkv: bool = _f(
        True,
        "Muon: orthogonalize the fused QKV weight as a whole matrix (Megatron-LM's --muon-no-split-qkv). "
        "Default (as Megatron-LM): split it into its query, key and value parts (every query group's rows of "
        "each, in group order), each orthogonalized and scaled by its own shape.",
        flag="--muon-no-split-qkv",
        action="store_false",
    )
    muon_use_nesterov: bool = _f(
        False,
        "Muon: orthogonalize the Nesterov direction (1 - mu) g + mu m (--muon-nesterov: Megatron-LM's newer spelling).",
        aliases=["--muon-nesterov"],
    )
    muon_num_ns_steps: int = _f(5, "Muon: quintic Newton-Schulz iterations per step.")
    muon_scale_mode: str = _f(
        "spectral",
        "Muon update scale for an out x in matrix: spectral sqrt(max(out, in)), unit_rms_norm sqrt(out/in), "
        "shape_scaling sqrt(max(1, out/in)).",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
    )
    muon_extra_scale_factor: float = _f(1.0, "Muon: extra factor on the update (e.g. 0.2 to match AdamW's RMS).")
    muon_scalar_optimizer: str = _f(
        "adam", "Muon: optimizer of the non-matrix parameters, embeddings and output layer.", choices=["adam"]
    )
    muon_fp32_matmul_prec: str = _f(
        "highest",
        "Muon: precision of the Newton-Schulz iterations (Megatron-LM's flag): medium iterates in bf16 "
        "(Megatron-LM's default; parallel layouts then agree only to bf16 rounding); high in fp32 with "
        "torch.set_float32_matmul_precision('high') (TF32 where the device has it); highest (megalm's "
        "addition and default) in IEEE fp32, so every layout trains to one process's numbers. low is "
        "refused: torch has no such precision (Megatron-LM passes it on and torch ignores it).",
        choices=["low", "medium", "high", "highest"],
    )
    muon_coefficient_type: str = _f(
        "quintic",
        "Muon: Newton-Schulz (a, b, c) sets (Megatron-LM's flag, default and values): quintic, five sets in "
        "turn (--muon-num-ns-steps a multiple of 5); simple, (3.4445, -4.7750, 2.0315) every step (megalm's "
        "before this flag); polar_express, eight sets (8 steps or more); aol, four sets (a multiple of 4).",
        choices=["simple", "quintic", "polar_express", "aol"],
    )
    muon_tp_mode: str = _f(
        "blockwise",
        "Muon under tensor parallelism: duplicated all-gathers each split matrix and orthogonalizes it whole "
        "(equals one process); blockwise orthogonalizes each rank's shard (no communication, a different "
        "update); distributed is not built (refused).",
        choices=["blockwise", "duplicated", "distributed"],
    )
    optimizer_cpu_offload: bool = _f(
        False,
        "Run the optimizer update of --optimizer-offload-fraction of the main parameters on the CPU: "
        "their optimizer state (any --optimizer) lives in host memory, gradients are copied to the host and "
        "updated weights back; LAMB/LARS norms and Muon's matrices still cover the full tensors.",
    )
    optimizer_offload_fraction: float = _f(
        1.0,
        "Fraction of the main parameters (by elements, whole tensors) updated on the CPU with --optimizer-cpu-offload.",
    )
    overlap_cpu_optimizer_d2h_h2d: bool = _f(
        False,
        "With --optimizer-cpu-offload: copy gradients to the host bucket by bucket, each bucket's copy overlapping "
        "the CPU update of the previous one, and updated weights back as each bucket's update ends (LAMB, LARS, "
        "Muon: every bucket's gradients first, for their full-tensor norms and matrices; then bucket by bucket).",
    )
    clip_grad: float = _f(1.0, "Clip gradients to this global L2 norm (0 disables).")
    log_num_zeros_in_grad: bool = _f(False, "Count zero gradient entries and log them.")
    calculate_per_token_loss: bool = _f(
        False,
        "Loss = sum over all tokens / number of loss-mask tokens across "
        "microbatches and data-parallel ranks (instead of the mean of "
        "per-microbatch means).",
    )
    bf16: bool = _f(False, "bf16 weights and compute, fp32 main weights and gradients.")
    fp16: bool = _f(False, "fp16 weights and compute, fp32 main weights, dynamic loss scaling.")
    loss_scale: Optional[float] = _f(None, "Static loss scale (fp16); dynamic when unset.")
    initial_loss_scale: float = _f(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = _f(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = _f(1000, "Iterations without overflow before the scale doubles.")
    hysteresis: int = _f(2, "Overflows tolerated before the scale halves.")
    check_for_nan_in_loss_and_grad: bool = _f(
        True,
        "Stop every rank, without saving, at the first non-finite loss (any rank) or gradient norm "
        "(bf16/fp32; fp16 skips overflows instead, see --max-overflows-at-min-loss-scale); "
        "--no-check-for-nan-in-loss-and-grad skips such iterations and goes on.",
        action=argparse.BooleanOptionalAction,
    )
    max_overflows_at_min_loss_scale: int = _f(
        10,
        "fp16: stop after this many consecutive overflow-skipped iterations at the minimum loss scale "
        "(--min-loss-scale, or the constant --loss-scale); 0 never stops (megalm's flag: Megatron-LM has none).",
    )
    check_for_spiky_loss: bool = _f(
        False,
        "Check each iteration's lm loss against --spiky-loss-factor x the mean of "
        "the previous --spiky-loss-window iterations (one host copy per step).",
    )
    spiky_loss_factor: float = _f(
        10.0, "A loss above this many times the running mean is spiky (Megatron's SPIKY_LOSS_FACTOR)."
    )
    spiky_loss_window: int = _f(100, "Iterations in the running mean of --check-for-spiky-loss.")
    spiky_loss_action: str = _f(
        "warn",
        "On a spiky loss: log a warning and go on, or stop every rank without "
        "saving (rollback to the last checkpoint is not built: refused).",
        choices=["warn", "stop", "rollback"],
    )
    eval_interval: int = _f(1000, "Evaluate on the validation split every this many iterations.")
    eval_iters: int = _f(100, "Validation iterations per evaluation (0 disables).")
    exit_interval: Optional[int] = _f(None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = _f(None, "Save and exit after this many minutes.")
    exit_signal_handler: bool = _f(False, "On SIGTERM finish the step, save and exit 0.")
    skip_train: bool = _f(False, "Only evaluate.")
    hang_watchdog_seconds: float = _f(
        0.0,
        "Dump every rank's Python stacks (stderr and --hang-watchdog-dir) when training makes no progress "
        "for this many seconds; must be below --distributed-timeout-minutes (0: off).",
    )
    hang_watchdog_dir: Optional[str] = _f(
        None, "Where the hang watchdog appends rank_<rank>.txt (default: <--save>/hang_stacks; none: stderr only)."
    )


@dataclass
class DataConfig:
    """Where samples come from and how they are split and tokenized."""

    data_path: Optional[List[str]] = _f(None, "Blend: 'w1 prefix1 w2 prefix2 ...' or a single prefix.", nargs="*")
    split: str = _f("969,30,1", "Train,valid,test proportions of --data-path.")
    train_data_path: Optional[List[str]] = _f(None, "Separate training blend.", nargs="*")
    valid_data_path: Optional[List[str]] = _f(None, "Separate validation blend.", nargs="*")
    test_data_path: Optional[List[str]] = _f(None, "Separate test blend.", nargs="*")
    data_cache_path: Optional[str] = _f(None, "Where built sample indices are cached (default: beside the data).")
    mid_level_dataset_surplus: float = _f(
        0.005, "Extra fraction of samples each blended dataset builds beyond its share, as in Megatron."
    )
    mock_data: bool = _f(False, "Use deterministic synthetic data.")
    tokenizer_type: Optional[str] = _f(None, "Tokenizer.", choices=list(TOKENIZER_TYPES))
    tokenizer_model: Optional[str] = _f(None, "Sentencepiece model file or Hugging Face tokenizer.json / directory.")
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: the vocab.json (e.g. gpt2-vocab.json).")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: the BPE merges (e.g. gpt2-merges.txt).")
    num_workers: int = _f(2, "DataLoader worker processes.")
    dataloader_type: str = _f(
        "single",
        "Sample order: single (in order, from the consumed samples on) or cyclic "
        "(epochs of shuffled samples seeded by --seed and the epoch, re-iterated "
        "endlessly; for train, valid and test as in Megatron).",
        choices=["single", "cyclic"],
    )
    data_sharding: bool = _f(
        True,
        "With --dataloader-type cyclic: shuffle over all samples instead of each "
        "data-parallel rank within its own contiguous bucket.",
        flag="--no-data-sharding",
        action="store_false",
    )
    eod_mask_loss: bool = _f(False, "Mask the loss on end-of-document tokens.")
    reset_position_ids: bool = _f(False, "Restart the position ids at 0 after each end-of-document token.")
    reset_attention_mask: bool = _f(
        False,
        "Document-masked causal attention: a token attends only to earlier tokens of its own document "
        "(documents end at the tokenizer's end-of-document token), as Megatron's get_ltor_masks_and_position_ids.",
    )


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints (torch.distributed.checkpoint)."""

    save: Optional[str] = _f(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = _f(None, "Save every this many iterations.")
    non_persistent_save_interval: Optional[int] = _f(
        None,
        "Also save every this many iterations to --non-persistent-global-ckpt-dir, keeping only the newest "
        "(cheap frequent restart points); a resume loads it when it is newer than the newest --load checkpoint.",
    )
    non_persistent_ckpt_type: Optional[str] = _f(
        None, "Where non-persistent checkpoints go: global (a directory on shared storage).", choices=["global"]
    )
    non_persistent_global_ckpt_dir: Optional[str] = _f(
        None, "Directory of the non-persistent checkpoints (default <save>/non_persistent; read as <load>/...)."
    )
    load: Optional[str] = _f(
        None,
        "Directory to load the latest checkpoint from.  With the same directory as "
        "--save and no checkpoint in it yet, training starts from scratch (Megatron's "
        "auto-resume); otherwise a missing checkpoint is an error.",
    )
    exit_on_missing_checkpoint: bool = _f(False, "Fail when --load holds no checkpoint, also when it is --save.")
    use_checkpoint_args: bool = _f(
        False, "Take the architecture and tokenizer flags not given on the command line from the checkpoint in --load."
    )
    no_load_optim: bool = _f(False, "Do not load optimizer and scheduler state.")
    no_save_optim: bool = _f(
        False, "Do not save optimizer and scheduler state (weights only: resuming needs --no-load-optim)."
    )
    no_save_rng: bool = _f(False, "Do not save random number generator states (resuming needs --no-load-rng).")
    no_load_rng: bool = _f(False, "Do not load random number generator states.")
    finetune: bool = _f(False, "Load weights only and start from iteration 0.")
    ckpt_step: Optional[int] = _f(None, "Load this iteration instead of the latest.")
    ckpt_fallback_to_verified: bool = _f(
        False,
        "When the latest checkpoint in --load fails verification (its "
        "manifest's sizes and sha256 checksums), load the newest older one "
        "that verifies instead of stopping (warning naming each one skipped).",
    )
    async_save: bool = _f(
        False,
        "Write checkpoint tensors in a background thread after copying them to CPU memory; "
        "the tracker file follows when every rank's write is complete.",
    )


@dataclass
class LoggingConfig:
    """Console, metrics file, TensorBoard and Weights & Biases."""

    log_interval: int = _f(100, "Print a log line every this many iterations.")
    logging_level: Optional[int] = _f(
        None, "Level of megalm's log (Python logging: 10 debug, 20 info, 30 warning); default info."
    )
    log_params_norm: bool = _f(False, "Log the L2 norm of the parameters (each distinct parameter counted once).")
    metrics_file: Optional[str] = _f(
        None, "Append JSON Lines metrics here (one record per logged iteration and evaluation)."
    )
    tensorboard_dir: Optional[str] = _f(None, "Write TensorBoard scalars here.")
    tensorboard_log_interval: Optional[int] = _f(
        None,
        "Also write this iteration's loss, learning rate, loss scale, grad norm and batch size to TensorBoard "
        "and W&B every this many iterations (as Megatron; default: with each log line only).",
    )
    wandb_project: Optional[str] = _f(None, "Weights & Biases project (enables W&B logging).")
    wandb_exp_name: Optional[str] = _f(None, "Weights & Biases run name.")
    wandb_save_dir: Optional[str] = _f(None, "Weights & Biases local directory.")
    device_peak_flops: Optional[float] = _f(
        None, "Peak FLOP/s per device for MFU (default: table, or measured on CPU)."
    )
    log_memory: bool = _f(True, "Disable the peak-memory report.", flag="--no-log-memory", action="store_false")
    log_throughput: bool = _f(
        False,
        "Accepted for Megatron-LM scripts (warns): megalm always logs tokens per second, TFLOP/s per rank and MFU.",
    )
    timing_log_level: int = _f(
        0,
        "Per-phase timers in the log: 0 set-up and checkpoint saving, 1 adds forward-backward, "
        "gradient sync and optimizer steps, 2 adds compute, data and pipeline exchanges "
        "(see megalm/timers.py).",
        choices=[0, 1, 2],
    )
    timing_log_option: str = _f(
        "minmax", "Timer values shown across ranks: max, minmax or all.", choices=["max", "minmax", "all"]
    )
    log_memory_to_tensorboard: bool = _f(
        False,
        "Also write this rank's memory (CUDA: mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count; "
        "CPU: mem-max-rss-bytes) to TensorBoard, W&B and the metrics file.",
    )
    log_world_size_to_tensorboard: bool = _f(False, "Also write world-size to TensorBoard, W&B and the metrics file.")
    log_validation_ppl_to_tensorboard: bool = _f(
        False, "Accepted for Megatron-LM scripts (warns): validation perplexity is always logged (lm loss <split> ppl)."
    )
    log_timers_to_tensorboard: bool = _f(
        False,
        "Also write the timers (slowest rank, seconds per iteration) to "
        "TensorBoard, W&B and the metrics file as <name>-time.",
    )
    barrier_with_level_1_timing: bool = _f(
        True,
        "Do not start level-1 timers with a barrier over all ranks.",
        flag="--no-barrier-with-level-1-timing",
        action="store_false",
    )
    log_straggler: bool = _f(
        False,
        "Each log interval, name the slowest and fastest ranks by step time and by compute time "
        "(forward and backward steps), with host and node, on the log line and in the metrics file "
        "(megalm/training/stragglers.py).",
    )
    straggler_minmax_count: int = _f(1, "With --log-straggler: how many slowest and fastest ranks to name.")
    disable_straggler_on_startup: bool = _f(
        False,
        "With --log-straggler: start with the report off; each connection to --straggler-ctrlr-port "
        "on rank 0 toggles it.",
    )
    straggler_ctrlr_port: int = _f(
        65535, "With --log-straggler: rank 0's TCP port whose connections toggle the report (0: any free port)."
    )
    profile: bool = _f(
        False,
        "Profile iterations --profile-step-start to --profile-step-end on --profile-ranks: "
        "with --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, else "
        "cudaProfilerStart/Stop and NVTX ranges for nsys (CUDA).",
    )
    use_pytorch_profiler: bool = _f(False, "With --profile: use torch.profiler (CPU and CUDA activities).")
    profile_step_start: int = _f(10, "First profiled iteration (the step that starts after this many iterations).")
    profile_step_end: int = _f(12, "Profiling stops after this many iterations.")
    profile_ranks: List[int] = _f([0], "Global ranks to profile.", nargs="+")


@dataclass
class MegalmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    megatron_compat: MegatronCompatConfig = field(default_factory=MegatronCompatConfig)

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
