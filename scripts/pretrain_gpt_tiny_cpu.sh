#!/usr/bin/env bash
# Tiny GPT that trains on a CPU-only machine: 4 processes on one node, TP 2 (+ sequence parallel)
# x DP 2, gloo, 2 microbatches per DP rank per step (gradient accumulation); PRECISION=auto: bf16
# (fp32 main weights) where the CPU has native bf16 instructions, else fp32.
# The `gpt_tiny_cpu` preset (megalm/presets/table.py):
#   python3 tools/presets.py gpt_tiny_cpu                          # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset gpt_tiny_cpu --device cpu    # memory per process
# Time (2 cores, 4 ranks oversubscribing them): ~1.4 s per iteration in fp32 (AVX2 CPU), ~1.5 s in bf16 on a CPU with native bf16;
#   20 iterations by default, about a minute with start-up.
# Environment: the same as the GPU scripts (scripts/common.sh); GPUS_PER_NODE is the number of
#   processes (default 4).  Checkpoints go to runs/gpt_tiny_cpu/checkpoints and a rerun resumes from
#   there (rm -rf runs/gpt_tiny_cpu to start over).
#
# Usage:  scripts/pretrain_gpt_tiny_cpu.sh
#         TRAIN_ITERS=100 scripts/pretrain_gpt_tiny_cpu.sh --log-interval 1
#         DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=data/tok.model \
#             TOKENIZER_TYPE=SentencePieceTokenizer scripts/pretrain_gpt_tiny_cpu.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch gpt_tiny_cpu "$@"
