#!/usr/bin/env bash
# Llama-2 7B shape (Touvron et al. 2023, Llama 2, Table 1 and section 2.2), Megatron-LM flags.
# Shape: 32 layers, hidden 4096, 32 heads (multi-head, no GQA), head dim 128, SwiGLU FFN 11008,
#   seq 4096, rotary positions (base 10000), RMSNorm (eps 1e-5), no biases, untied output layer,
#   no dropout, init std 0.02.
# Parameters: 6.74B with vocabulary 32000 (padded to 32256 at TP 4);
#   tokenizer: its sentencepiece tokenizer.model (SentencePieceTokenizer).
# Schedule: batch 1024 x 4096 = 4.2M tokens, lr 3.0e-4 -> 3.0e-5 cosine, warm-up 2000 iterations,
#   2T tokens (476837 iterations), AdamW betas (0.9, 0.95), eps 1e-5, weight decay 0.1,
#   clip 1.0 (the Llama 2 recipe).
# Layout: 1 node x 8 x 80 GB GPUs = 8; TP 4, PP 1, DP 2, micro batch 1,
#   global batch 1024 -> 512 microbatches per DP rank per step; --bf16.
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 1.65B parameters on the fullest GPU x 18 B
#     (bf16 weights, fp32 grads, fp32 main weights + moments) = 30 GB;
#     with DIST_OPT=1, DP 2: x (6 + 12/2) = 12.0 B = 20 GB.
#   activations: s*b*(12h + 4*g*d + 6*ffn)/TP bytes per layer and microbatch = 135 MB
#     x 32 layers = 4.3 GB (no recompute; flash attention: no s^2 term);
#   logits (s*b*V/TP x ~12 B, last stage) 0.4 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~38 GB of 80 GB with DIST_OPT=0; with DIST_OPT=1 (default) ~29 GB.
#   With the distributed optimizer (default) a smaller layout also fits: TP=2 (DP 4) with DIST_OPT=1 needs ~43 GB per GPU.
# Needs:
#   tensor parallelism 4 + sequence parallelism 
#   distributed optimizer with overlapped reduce-scatter/all-gather (DIST_OPT=1, the default)
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), TOKENIZER_MODEL (unset: NullTokenizer with VOCAB_SIZE ids),
#   TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR, WANDB_PROJECT, GPUS_PER_NODE, NNODES,
#   NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.  Extra flags are appended.
#
# Usage:  DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama-2/tokenizer.model scripts/pretrain_llama2_7b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_llama2_7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=llama2_7b
NNODES=${NNODES:-1}
TP=${TP:-4}
PP=${PP:-1}
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
LR=${LR:-3.0e-4}
MIN_LR=${MIN_LR:-3.0e-5}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 11008
    --num-attention-heads 32
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
