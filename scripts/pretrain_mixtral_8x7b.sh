#!/usr/bin/env bash
# Mixtral 8x7B shape (Jiang et al. 2024, Mixtral of Experts; its config.json), Megatron-LM flags.
# Shape: 32 layers, hidden 4096, 32 heads, 8 key/value groups (GQA), head dim 128, rotary positions
#   (base 1e6), RMSNorm (eps 1e-5), no biases, untied output layer, no dropout; every layer is an
#   MoE layer: 8 SwiGLU experts of FFN 14336, top-2 softmax routing (top-2 logits, then softmax).
# Parameters: 46.70B in all, 12.88B active per token (2 of 8 experts), vocabulary 32000
#   (sentencepiece tokenizer.model, SentencePieceTokenizer); FLOPs/MFU count the active ones.
# Schedule and MoE settings: Megatron-LM's examples/mixtral recipe (the paper publishes none):
#   batch 256 x 4096 = 1M tokens, lr 1e-4 -> 1e-5 cosine over 320k iterations, warm-up 500,
#   500k iterations, AdamW betas (0.9, 0.95), weight decay 0.1, clip 1.0, init std 0.01;
#   load-balancing loss 1e-2 (switch, per micro-batch), router in fp32, alltoall token
#   dispatcher, grouped GEMM, dropless (no capacity factor).
# Layout: 4 nodes x 8 x 80 GB GPUs = 32; TP 1, PP 4, EP 8 (one expert per layer per GPU),
#   DP 8 (expert DP 1), micro batch 1, global batch 256 -> 32 microbatches per DP rank per step;
#   --bf16; full activation recompute (RECOMPUTE=full, uniform, 1 layer).
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 1.88B parameters on the fullest GPU (8 layers of attention +
#     router = 0.34B, the embedding or output layer 0.13B, 8 local experts of 176M = 1.41B) x 18 B
#     = 34 GB; with DIST_OPT=1: dense part x (6 + 12/8) B, experts x (6 + 12/1) B (expert DP 1)
#     = 29 GB.
#   activations with full recompute: the layer input s*b*h*2 B = 34 MB per layer and microbatch
#     x 8 layers x 4 microbatches in flight (1F1B, first stage) = 1.1 GB, plus one layer
#     recomputed: s*b*(12h + 4*g*d + k*(6*ffn + 8h)) = 1.2 GB (k = 2 routed copies of each token);
#     without recompute 32 x 1.2 GB = 38 GB (too much next to the weights);
#   logits (s*b*V/TP x ~12 B, last stage) 1.6 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~42 GB of 80 GB with DIST_OPT=0; with DIST_OPT=1 (default) ~37 GB.
# Needs:
#   mixture of experts with expert parallelism 8, alltoall dispatcher ; experts
#     are not split over tensor-parallel ranks in megalm, so keep TP 1 for this model
#   pipeline parallelism 4 (1F1B): being added; until it lands the trainer refuses
#     --pipeline-model-parallel-size > 1 (PP=1 NNODES=... shrinks the run meanwhile)
#   4 nodes x 8 GPUs (GPUS_PER_NODE x NNODES = 32); see scripts/slurm/pretrain.sbatch
#   DIST_OPT=1 (distributed optimizer): being added; becomes the default when it lands
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), TOKENIZER_MODEL (unset: NullTokenizer with VOCAB_SIZE ids),
#   TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR, WANDB_PROJECT, GPUS_PER_NODE, NNODES,
#   NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, EP (expert parallel size), MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.
#   Extra flags are appended.
#
# Usage:  DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/mixtral/tokenizer.model scripts/pretrain_mixtral_8x7b.sh
#         sbatch --nodes 4 scripts/slurm/pretrain.sbatch scripts/pretrain_mixtral_8x7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=mixtral_8x7b
NNODES=${NNODES:-4}
TP=${TP:-1}
PP=${PP:-4}
EP=${EP:-8}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
SEQ_LENGTH=4096
TOKENIZER_TYPE=${TOKENIZER_TYPE:-Llama2Tokenizer}  # sentencepiece, BOS before each document
VOCAB_SIZE=${VOCAB_SIZE:-32000}
RECOMPUTE=${RECOMPUTE:-full}

# Megatron's Mixtral example: 500k iterations, cosine decay over the first 320k, 500 warm-up.
TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$(( TRAIN_ITERS * 320 / 500 ))}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-500}
megalm_fix_schedule
LR=${LR:-1.0e-4}
MIN_LR=${MIN_LR:-1.0e-5}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --init-method-std 0.01
    # Mixture of experts
    --num-experts 8
    --moe-ffn-hidden-size 14336
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-router-dtype fp32
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm
    --expert-model-parallel-size "$EP"
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
    --exit-signal-handler
)

megalm_launch "$@"
