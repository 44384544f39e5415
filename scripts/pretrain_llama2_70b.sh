#!/usr/bin/env bash
# Llama-2 70B shape (Touvron et al. 2023, Llama 2, Table 1 and section 2.2), Megatron-LM flags.
# Shape: 80 layers, hidden 8192, 64 heads, 8 key/value groups (GQA), head dim 128, SwiGLU FFN 28672,
#   seq 4096, rotary positions (base 10000), RMSNorm (eps 1e-5), no biases, untied output layer,
#   no dropout, init std 0.02.
# Parameters: 68.99B with vocabulary 32000 (padded to 32768 at TP 8);
#   tokenizer: its sentencepiece tokenizer.model (SentencePieceTokenizer).
# Schedule: batch 1024 x 4096 = 4.2M tokens, lr 1.5e-4 -> 1.5e-5 cosine, warm-up 2000 iterations,
#   2T tokens (476837 iterations), AdamW betas (0.9, 0.95), eps 1e-5, weight decay 0.1,
#   clip 1.0 (the Llama 2 recipe).
# Layout: 4 nodes x 8 x 80 GB GPUs = 32; TP 8, PP 4, DP 1, micro batch 1,
#   global batch 1024 -> 1024 microbatches per DP rank per step; --bf16.
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 2.17B parameters on the fullest GPU x 18 B
#     (bf16 weights, fp32 grads, fp32 main weights + moments) = 39 GB;
#     (DP 1: the distributed optimizer's 6 + 12/d B saves nothing until NNODES grows).
#   activations: s*b*(12h + 4*g*d + 6*ffn)/TP bytes per layer and microbatch = 141 MB
#     x 20 layers per stage x 4 microbatches in flight (1F1B, first stage) = 11 GB;
#   logits (s*b*V/TP x ~12 B, last stage) 0.2 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~55 GB of 80 GB.
#   With the distributed optimizer (default) a smaller layout also fits: TP=4 with NNODES=8 (DP 4) with DIST_OPT=1 needs ~66 GB per GPU.
# Needs:
#   tensor parallelism 8 + sequence parallelism 
#   pipeline parallelism 4 (1F1B)
#   4 nodes x 8 GPUs (GPUS_PER_NODE x NNODES = 32); see scripts/slurm/pretrain.sbatch
#   distributed optimizer with overlapped reduce-scatter/all-gather (DIST_OPT=1, the default)
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), TOKENIZER_MODEL (unset: NullTokenizer with VOCAB_SIZE ids),
#   TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR, WANDB_PROJECT, GPUS_PER_NODE, NNODES,
#   NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.  Extra flags are appended.
#
# Usage:  DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama-2/tokenizer.model scripts/pretrain_llama2_70b.sh
#         sbatch --nodes 4 scripts/slurm/pretrain.sbatch scripts/pretrain_llama2_70b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=llama2_70b
NNODES=${NNODES:-4}
TP=${TP:-8}
PP=${PP:-4}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1024}
SEQ_LENGTH=4096
TOKENIZER_TYPE=${TOKENIZER_TYPE:-Llama2Tokenizer}  # sentencepiece, BOS before each document
VOCAB_SIZE=${VOCAB_SIZE:-32000}

# 2T tokens, cosine decay over all of them, 2000 warm-up iterations.
TRAIN_TOKENS=${TRAIN_TOKENS:-2000000000000}
TRAIN_ITERS=${TRAIN_ITERS:-$(( TRAIN_TOKENS / (GLOBAL_BATCH_SIZE * SEQ_LENGTH) ))}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-2000}
megalm_fix_schedule
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}

MODEL_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
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
    --adam-eps 1e-5
    --weight-decay 0.1
    --clip-grad 1.0
    --exit-signal-handler
)

megalm_launch "$@"
