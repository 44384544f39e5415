#!/usr/bin/env bash
# Llama-3 8B: the `llama3_8b` preset (megalm/presets/table.py: shape, layout, schedule, sources).
#   python3 tools/presets.py llama3_8b            # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset llama3_8b   # memory per GPU and step time of its layout
#   Tokenizer: its Hugging Face tokenizer directory or tokenizer.json as TOKENIZER_MODEL (HuggingFaceTokenizer).
# Environment: scripts/common.sh lists every variable (DATA_PATH unset: --mock-data; DRY_RUN=1:
#   print the command, launch nothing; TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, ...
#   override the preset).  Flags given to the script are appended last and win.
#
# Usage:  DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=data/Meta-Llama-3-8B scripts/pretrain_llama3_8b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_llama3_8b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch llama3_8b "$@"
