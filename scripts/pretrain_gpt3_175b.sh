#!/usr/bin/env bash
# GPT-3 175B: the `gpt3_175b` preset (megalm/presets/table.py: shape, layout, schedule, sources).
#   python3 tools/presets.py gpt3_175b            # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset gpt3_175b   # memory per GPU and step time of its layout
#   Tokenizer: GPT-2 BPE, VOCAB_FILE + MERGE_FILE (GPT2BPETokenizer), or a tokenizer.json as
#   TOKENIZER_MODEL (HuggingFaceTokenizer).
#   16 nodes x 8 GPUs (GPUS_PER_NODE x NNODES = 128), 1F1B pipeline; see scripts/slurm/pretrain.sbatch.
# Environment: scripts/common.sh lists every variable (DATA_PATH unset: --mock-data; DRY_RUN=1:
#   print the command, launch nothing; TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, ...
#   override the preset).  Flags given to the script are appended last and win.
#
# Usage:  DATA_PATH=data/pile_text_document VOCAB_FILE=data/gpt2-vocab.json MERGE_FILE=data/gpt2-merges.txt \
#             scripts/pretrain_gpt3_175b.sh
#         sbatch --nodes 16 scripts/slurm/pretrain.sbatch scripts/pretrain_gpt3_175b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch gpt3_175b "$@"
