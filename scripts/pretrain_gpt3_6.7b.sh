#!/usr/bin/env bash
# GPT-3 6.7B (Brown et al. 2020, Table 2.1), Megatron-LM flags.
# Shape: 32 layers, hidden 4096, 32 heads (head dim 128), FFN 16384 (4h, GELU), seq 2048,
#   learned absolute positions, LayerNorm, biases, tied input/output embeddings, dropout 0.1,
#   init std 0.01 (~sqrt(2/(5h)); Megatron's 175B example uses 0.006).
# Parameters: 6.66B with the GPT-2 BPE vocabulary (50257, padded to 50688 at TP 4).
# Schedule (paper): 2M-token batch (1024 x 2048), lr 1.2e-4 -> 1.2e-5 cosine over 260B tokens,
#   warm-up 375M tokens (178 iterations), 300B tokens in all (143051 iterations), Adam
#   betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0.  Not reproduced: the paper's batch
#   ramp-up (megalm's --rampup-batch-size needs sample-based --lr-*-samples flags it lacks).
# Layout: 1 node x 8 x 80 GB GPUs = 8; TP 4, PP 1, DP 2, micro batch 2,
#   global batch 1024 -> 256 microbatches per DP rank per step; --bf16.
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 1.67B parameters on the fullest GPU x 18 B
#     (bf16 weights, fp32 grads, fp32 main weights + moments) = 30 GB;
#     with DIST_OPT=1, DP 2: x (6 + 12/2) = 12.0 B = 20 GB.
#   activations: 34*s*b*h/TP bytes per layer and microbatch = 143 MB
#     x 32 layers = 4.6 GB (no recompute; flash attention: no s^2 term);
#   logits (s*b*V/TP x ~12 B, last stage) 0.6 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~39 GB of 80 GB with DIST_OPT=0; with DIST_OPT=1 (default) ~29 GB.
#   With the distributed optimizer (default) a smaller layout also fits: TP=2 (DP 4) with DIST_OPT=1 needs ~44 GB per GPU.
# Needs:
#   tensor parallelism 4 + sequence parallelism 
#   distributed optimizer with overlapped reduce-scatter/all-gather (DIST_OPT=1, the default)
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), VOCAB_FILE + MERGE_FILE (GPT-2 BPE) or TOKENIZER_MODEL
#   (unset: NullTokenizer with VOCAB_SIZE ids), TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR,
#   WANDB_PROJECT, GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.  Extra flags are appended.
#
# Usage:  DATA_PATH=/data/pile_text_document VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#             scripts/pretrain_gpt3_6.7b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_gpt3_6.7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=gpt3_6.7b
NNODES=${NNODES:-1}
TP=${TP:-4}
PP=${PP:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1024}
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
LR=${LR:-1.2e-4}
MIN_LR=${MIN_LR:-1.2e-5}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --num-attention-heads 32
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --hidden-dropout 0.1
    --attention-dropout 0.1
    --init-method-std 0.01
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
