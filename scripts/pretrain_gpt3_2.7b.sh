#!/usr/bin/env bash
# GPT-3 2.7B (Brown et al. 2020, Table 2.1), Megatron-LM flags.
# Shape: 32 layers, hidden 2560, 32 heads (head dim 80), FFN 10240 (4h, GELU), seq 2048,
#   learned absolute positions, LayerNorm, biases, tied input/output embeddings, dropout 0.1,
#   init std 0.0125 (~sqrt(2/(5h)); Megatron's 175B example uses 0.006).
# Parameters: 2.65B with the GPT-2 BPE vocabulary (50257, padded to 50432 at TP 2).
# Schedule (paper): 1M-token batch (512 x 2048), lr 1.6e-4 -> 1.6e-5 cosine over 260B tokens,
#   warm-up 375M tokens (357 iterations), 300B tokens in all (286102 iterations), Adam
#   betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0.  Not reproduced: the paper's batch
#   ramp-up (megalm's --rampup-batch-size needs sample-based --lr-*-samples flags it lacks).
# Layout: 1 node x 8 x 80 GB GPUs = 8; TP 2, PP 1, DP 4, micro batch 4,
#   global batch 512 -> 32 microbatches per DP rank per step; --bf16.
# Memory per GPU (shared/README byte formulas; bf16 params, fp32 grads):
#   weights + grads + Adam state: 1.33B parameters on the fullest GPU x 18 B
#     (bf16 weights, fp32 grads, fp32 main weights + moments) = 24 GB;
#     with DIST_OPT=1, DP 4: x (6 + 12/4) = 9.0 B = 12 GB.
#   activations: 34*s*b*h/TP bytes per layer and microbatch = 357 MB
#     x 32 layers = 11 GB (no recompute; flash attention: no s^2 term);
#   logits (s*b*V/TP x ~12 B, last stage) 2.5 GB; runtime/NCCL/fragmentation ~4 GB.
#   Total ~42 GB of 80 GB with DIST_OPT=0; with DIST_OPT=1 (default) ~30 GB.
#   With the distributed optimizer (default) a smaller layout also fits: TP=1 (DP 8) with DIST_OPT=1 needs ~52 GB per GPU.
# Needs:
#   tensor parallelism 2 + sequence parallelism 
#   distributed optimizer with overlapped reduce-scatter/all-gather (DIST_OPT=1, the default)
# Environment (see scripts/common.sh for all of it):
#   DATA_PATH (unset: --mock-data), VOCAB_FILE + MERGE_FILE (GPT-2 BPE) or TOKENIZER_MODEL
#   (unset: NullTokenizer with VOCAB_SIZE ids), TOKENIZER_TYPE, CHECKPOINT_DIR, TENSORBOARD_DIR,
#   WANDB_PROJECT, GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, DIST_OPT, RECOMPUTE, DRY_RUN=1 (print, do not launch).
#   Layout: TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS.  Extra flags are appended.
#
# Usage:  DATA_PATH=/data/pile_text_document VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#             scripts/pretrain_gpt3_2.7b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_gpt3_2.7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_NAME=gpt3_2.7b
NNODES=${NNODES:-1}
TP=${TP:-2}
PP=${PP:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-512}
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
LR=${LR:-1.6e-4}
MIN_LR=${MIN_LR:-1.6e-5}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 2560
    --num-attention-heads 32
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --hidden-dropout 0.1
    --attention-dropout 0.1
    --init-method-std 0.0125
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
