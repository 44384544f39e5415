#!/usr/bin/env bash
# Tiny GPT that trains on a CPU-only machine: 4 processes on one node, TP 2 x DP 2, gloo.
# Shape: 4 layers, hidden 256, 4 heads, seq 256, learned positions, LayerNorm, GELU, tied
#   embeddings; vocabulary 8192 (NullTokenizer over --mock-data unless DATA_PATH and
#   TOKENIZER_MODEL are given) -> ~5.3M parameters (the shared/README reference shape).
# Layout: TP 2 (+ sequence parallel), PP 1, DP 2, micro batch 4, global batch 16
#   -> 2 microbatches per DP rank per step (exercises gradient accumulation); PRECISION=auto:
#   bf16 (fp32 main weights) where the CPU has native bf16 instructions, else fp32.
# Memory: ~5.3M x 18 B (bf16 weights, fp32 grads, main weights, Adam moments) / TP = ~50 MB per
#   rank plus activations and torch itself: ~1-2 GB for all four processes.
# Time (2 cores, 4 ranks oversubscribing them): ~1.4 s per iteration in fp32 (AVX2 CPU), ~1.5 s in
#   bf16 on a CPU with native bf16;
#   20 iterations by default, about a minute with start-up.
# Needs: tensor + sequence parallelism and data parallelism (all in megalm today).
# Environment: the same as the GPU scripts (scripts/common.sh); GPUS_PER_NODE is the number
#   of processes (default 4).  Checkpoints go to runs/gpt_tiny_cpu/checkpoints and a rerun
#   resumes from there (rm -rf runs/gpt_tiny_cpu to start over).
#
# Usage:  scripts/pretrain_gpt_tiny_cpu.sh
#         TRAIN_ITERS=100 scripts/pretrain_gpt_tiny_cpu.sh --log-interval 1
#         DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=data/tok.model \
#             TOKENIZER_TYPE=SentencePieceTokenizer scripts/pretrain_gpt_tiny_cpu.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=gpt_tiny_cpu
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
NNODES=${NNODES:-1}
TP=${TP:-2}
PP=${PP:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-16}
SEQ_LENGTH=256
TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
PRECISION=${PRECISION:-auto}
NUM_WORKERS=${NUM_WORKERS:-0}

TRAIN_ITERS=${TRAIN_ITERS:-20}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-2}
megalm_fix_schedule
LR=${LR:-1.0e-3}
MIN_LR=${MIN_LR:-1.0e-4}
SAVE_INTERVAL=${SAVE_INTERVAL:-$TRAIN_ITERS}
LOG_INTERVAL=${LOG_INTERVAL:-5}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
EVAL_ITERS=${EVAL_ITERS:-2}

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 256
    --num-attention-heads 4
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.02
)

OPTIMIZER_ARGS=(
    --optimizer adam
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --lr-decay-iters "$LR_DECAY_ITERS"
    --adam-beta1 0.9
    --adam-beta2 0.95
    --weight-decay 0.1
    --clip-grad 1.0
    --distributed-timeout-minutes 5
)

megalm_launch "$@"
