#!/usr/bin/env bash
# Llama-2 13B: the `llama2_13b` preset (megalm/presets/table.py: shape, layout, schedule, sources).
#   python3 tools/presets.py llama2_13b            # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset llama2_13b   # memory per GPU and step time of its layout
#   Tokenizer: its sentencepiece tokenizer.model as TOKENIZER_MODEL (Llama2Tokenizer: BOS before each document).
# Environment: scripts/common.sh lists every variable (DATA_PATH unset: --mock-data; DRY_RUN=1:
#   print the command, launch nothing; TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, ...
#   override the preset).  Flags given to the script are appended last and win.
#
# Usage:  DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=data/llama-2/tokenizer.model scripts/pretrain_llama2_13b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_llama2_13b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch llama2_13b "$@"
