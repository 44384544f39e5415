"""The model presets: one table, read by ``scripts/pretrain_<name>.sh`` (through
``python3 tools/presets.py NAME --shell``) and by ``tools/estimate.py --preset NAME``.

GPT-3: Brown et al. 2020, Table 2.1 (shapes, batch in tokens, learning rates; 300B tokens,
cosine to 10% over 260B, 375M warm-up tokens, Adam betas 0.9/0.95, weight decay 0.1, clip 1.0;
the paper's batch ramp-up is left out: megalm's --rampup-batch-size needs sample-based schedule
flags it lacks).  Init std ~sqrt(2/(5h)).  Llama: Touvron et al. 2023 (Llama 2, Table 1 and
section 2.2: lr 3e-4, 1.5e-4 for 70B, 2000 warm-up iterations, cosine to 10%, 4M-token batches,
2T tokens); Llama-3 8B: 8192 context, rotary base 500000, 15T tokens, the Llama 2 schedule.
Mixtral 8x7B: Jiang et al. 2024 and its config.json for the shape, Megatron-LM's examples/mixtral
recipe for the schedule and MoE settings.  Default layouts are for 80 GB GPUs (H100 / A100-80GB);
``python3 tools/estimate.py --preset NAME`` prints the memory per GPU of each.
"""

from __future__ import annotations

from megalm.presets.spec import Layout, MoE, Preset, RunDefaults, Schedule, Shape

GPT3_SOURCE = "Brown et al. 2020 (GPT-3), Table 2.1"
LLAMA2_SOURCE = "Touvron et al. 2023 (Llama 2), Table 1 and section 2.2"


def _gpt3(name, title, layers, hidden, heads, std, lr, min_lr, micro, global_batch, tp=1, pp=1, nnodes=1, note=""):
    """GPT-3 family: GPT-2 BPE vocabulary, 2048 context, 300B tokens (decay over 260B, 375M warm-up)."""
    return Preset(
        name=name,
        title=title,
        source=GPT3_SOURCE + note,
        shape=Shape(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=2048, init_method_std=std
        ),
        layout=Layout(micro_batch_size=micro, global_batch_size=global_batch, nnodes=nnodes, tp=tp, pp=pp),
        schedule=Schedule(
            lr=lr,
            min_lr=min_lr,
            train_tokens=300_000_000_000,
            decay_fraction=(260, 300),
            warmup_tokens=375_000_000,
            adam_eps=1e-8,
        ),
        vocab_size=50257,
        tokenizer_type="HuggingFaceTokenizer",
    )


LLAMA = {
    "position_embedding_type": "rope",
    "rotary_base": 10000,
    "normalization": "RMSNorm",
    "norm_epsilon": 1e-5,
    "swiglu": True,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "dropout": 0.0,
}


def _llama2(name, title, layers, hidden, ffn, heads, lr, min_lr, tp, groups=None, pp=1, nnodes=1):
    """Llama 2 family: 32000-token sentencepiece vocabulary, 4096 context, 2T tokens, 4M-token batches."""
    return Preset(
        name=name,
        title=title,
        source=LLAMA2_SOURCE,
        shape=Shape(
            num_layers=layers,
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            num_query_groups=groups,
            seq_length=4096,
            **LLAMA,
        ),
        layout=Layout(micro_batch_size=1, global_batch_size=1024, nnodes=nnodes, tp=tp, pp=pp),
        schedule=Schedule(lr=lr, min_lr=min_lr, train_tokens=2_000_000_000_000, warmup_iters=2000, adam_eps=1e-5),
        vocab_size=32000,
        tokenizer_type="Llama2Tokenizer",
    )


TINY_CPU_SCHEDULE = Schedule(
    lr=1.0e-3, min_lr=1.0e-4, train_iters=20, warmup_iters=2, exit_signal_handler=False, distributed_timeout_minutes=5
)
TINY_CPU_RUN = RunDefaults(
    num_workers=0, save_interval_is_train_iters=True, log_interval=5, eval_interval=10, eval_iters=2
)

_ALL = (
    _gpt3("gpt3_125m", "GPT-3 Small", 12, 768, 12, 0.02, 6.0e-4, 6.0e-5, micro=8, global_batch=256),
    _gpt3("gpt3_350m", "GPT-3 Medium", 24, 1024, 16, 0.02, 3.0e-4, 3.0e-5, micro=8, global_batch=256),
    _gpt3("gpt3_1.3b", "GPT-3 XL", 24, 2048, 16, 0.014, 2.0e-4, 2.0e-5, micro=4, global_batch=512),
    _gpt3("gpt3_2.7b", "GPT-3 2.7B", 32, 2560, 32, 0.0125, 1.6e-4, 1.6e-5, micro=4, global_batch=512, tp=2),
    _gpt3("gpt3_6.7b", "GPT-3 6.7B", 32, 4096, 32, 0.01, 1.2e-4, 1.2e-5, micro=2, global_batch=1024, tp=4),
    _gpt3(
        "gpt3_13b",
        "GPT-3 13B",
        40,
        5120,
        40,
        0.009,
        1.0e-4,
        1.0e-5,
        micro=2,
        global_batch=1024,
        tp=8,
        note="; hidden 5120 as in Megatron/NeMo (the paper's 5140 is not divisible by 40 heads)",
    ),
    _gpt3(
        "gpt3_175b",
        "GPT-3 175B",
        96,
        12288,
        96,
        0.006,
        0.6e-4,
        0.6e-5,
        micro=1,
        global_batch=1536,
        tp=8,
        pp=16,
        nnodes=16,
    ),
    _llama2("llama2_7b", "Llama-2 7B", 32, 4096, 11008, 32, 3.0e-4, 3.0e-5, tp=4),
    _llama2("llama2_13b", "Llama-2 13B", 40, 5120, 13824, 40, 3.0e-4, 3.0e-5, tp=8),
    _llama2("llama2_70b", "Llama-2 70B (GQA 8)", 80, 8192, 28672, 64, 1.5e-4, 1.5e-5, tp=8, groups=8, pp=4, nnodes=4),
    Preset(
        name="llama3_8b",
        title="Llama-3 8B (GQA 8)",
        source="Llama 3 model card (shape); the Llama 2 recipe (Llama 3 published no 8B schedule)",
        shape=Shape(
            num_layers=32,
            hidden_size=4096,
            ffn_hidden_size=14336,
            num_attention_heads=32,
            num_query_groups=8,
            seq_length=8192,
            **{**LLAMA, "rotary_base": 500000},
        ),
        layout=Layout(micro_batch_size=1, global_batch_size=512, tp=4),
        schedule=Schedule(lr=3.0e-4, min_lr=3.0e-5, train_tokens=15_000_000_000_000, warmup_iters=2000, adam_eps=1e-5),
        vocab_size=128256,
        tokenizer_type="HuggingFaceTokenizer",
    ),
    Preset(
        name="mixtral_8x7b",
        title="Mixtral 8x7B (8 experts, top-2)",
        source="Jiang et al. 2024 and its config.json (shape); Megatron-LM's examples/mixtral (schedule, MoE)",
        shape=Shape(
            num_layers=32,
            hidden_size=4096,
            ffn_hidden_size=14336,
            num_attention_heads=32,
            num_query_groups=8,
            seq_length=4096,
            max_position_embeddings=32768,
            **{**LLAMA, "rotary_base": 1000000},
            init_method_std=0.01,
        ),
        moe=MoE(num_experts=8, moe_ffn_hidden_size=14336, moe_router_load_balancing_type="aux_loss"),
        layout=Layout(micro_batch_size=1, global_batch_size=256, nnodes=4, tp=1, pp=4, ep=8, recompute="full"),
        schedule=Schedule(lr=1.0e-4, min_lr=1.0e-5, train_iters=500_000, decay_fraction=(320, 500), warmup_iters=500),
        vocab_size=32000,
        tokenizer_type="Llama2Tokenizer",
    ),
    Preset(
        name="gpt_tiny_cpu",
        title="tiny GPT, CPU",
        source="megalm: trains on a CPU-only machine in about a minute",
        shape=Shape(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, dropout=0.0),
        layout=Layout(micro_batch_size=4, global_batch_size=16, gpus_per_node=4, tp=2, precision="auto"),
        schedule=TINY_CPU_SCHEDULE,
        run=TINY_CPU_RUN,
        vocab_size=8192,
        tokenizer_type="SentencePieceTokenizer",
    ),
    Preset(
        name="moe_tiny_cpu",
        title="tiny MoE GPT (8 experts, top-2), CPU",
        source="megalm: mixture of experts with expert parallelism on a CPU-only machine",
        shape=Shape(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=256, dropout=0.0),
        moe=MoE(num_experts=8, moe_ffn_hidden_size=256, moe_z_loss_coeff=1e-3),
        layout=Layout(micro_batch_size=4, global_batch_size=16, gpus_per_node=4, tp=2, ep=2, precision="auto"),
        schedule=TINY_CPU_SCHEDULE,
        run=TINY_CPU_RUN,
        vocab_size=8192,
        tokenizer_type="SentencePieceTokenizer",
    ),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
