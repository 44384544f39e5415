#!/usr/bin/env bash
# GPT-3 175B (Brown et al. 2020, Table 2.1), Megatron-LM flags.
# Shape: 96 layers, hidden 12288, 96 heads (head dim 128), FFN 49152 (4h, GELU), seq 2048,
#   learned absolute positions, LayerNorm, biases, tied input/output embeddings, dropout 0.1,
#   init std 0.006 (~sqrt(2/(5h)); Megatron's 175B example uses 0.006).
# Parameters: 174.62B with the GPT-2 BPE vocabulary (50257, padded to 51200 at TP 8).
# Schedule (paper): 3.2M-token batch (1536 x 2048), lr 0.6e-4 -> 0.6e-5 cosine over 260B tokens,
#   warm-up 375M tokens (119 iterations), 300B tokens in all (95367 iterations), Adam
#   betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0.  Not reproduced: the paper's batch
#   ramp-up (megalm's --rampup-batch-size needs sample-based --lr-*-samples flags it lacks).
# Layout: 16 nodes x 8 x 80 GB GPUs = 128; TP 8, PP 16, DP 1, micro batch 1,
#   global batch 1536 -> 1536 microbatches per DP rank per step; --bf16.
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 1.44B parameters on the fullest GPU x 18 B
#     (bf16 weights, fp32 grads, fp32 main weights + moments) = 26 GB;
#     (DP 1: the distributed optimizer's 6 + 12/d B saves nothing until NNODES grows).
#   activations: 34*s*b*h/TP bytes per layer and microbatch = 107 MB
#     x 6 layers per stage x 16 microbatches in flight (1F1B, first stage) = 10 GB;
#   logits (s*b*V/TP x ~12 B, last stage) 0.2 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~40 GB of 80 GB.
#   With the distributed optimizer (default) a smaller layout also fits: NNODES=32 (DP 2) with DIST_OPT=1 needs ~32 GB per GPU.
# Needs:
#   tensor parallelism 8 + sequence parallelism 
#   pipeline parallelism 16 (1F1B)
#   16 nodes x 8 GPUs (GPUS_PER_NODE x NNODES = 128); see scripts/slurm/pretrain.sbatch
#   distributed optimizer with overlapped reduce-scatter/all-gather (DIST_OPT=1, the default)
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), VOCAB_FILE + MERGE_FILE (GPT-2 BPE) or TOKENIZER_MODEL
#   (unset: NullTokenizer with VOCAB_SIZE ids), TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR,
#   WANDB_PROJECT, GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.  Extra flags are appended.
#
# Usage:  DATA_PATH=/data/pile_text_document VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#             scripts/pretrain_gpt3_175b.sh
#         sbatch --nodes 16 scripts/slurm/pretrain.sbatch scripts/pretrain_gpt3_175b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=gpt3_175b
NNODES=${NNODES:-16}
TP=${TP:-8}
PP=${PP:-16}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1536}
SEQ_LENGTH=2048
# GPT-2 BPE: VOCAB_FILE + MERGE_FILE (GPT2BPETokenizer), or a tokenizer.json as TOKENIZER_MODEL.
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
VOCAB_SIZE=${VOCAB_SIZE:-50257}

# GPT-3 schedule in tokens: 300B in all, cosine decay over the first 260B, warm-up 375M.
TRAIN_TOKENS=${TRAIN_TOKENS:-300000000000}
TRAIN_ITERS=${TRAIN_ITERS:-$(( TRAIN_TOKENS / (GLOBAL_BATCH_SIZE * SEQ_LENGTH) ))}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$(( TRAIN_ITERS * 260 / 300 ))}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( 375000000 / (GLOBAL_BATCH_SIZE * SEQ_LENGTH) ))}
megalm_fix_schedule
LR=${LR:-0.6e-4}
MIN_LR=${MIN_LR:-0.6e-5}

MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --hidden-dropout 0.1
    --attention-dropout 0.1
    --init-method-std 0.006
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
    --adam-eps 1e-8
    --weight-decay 0.1
    --clip-grad 1.0
    --exit-signal-handler
)

megalm_launch "$@"
