#!/usr/bin/env bash
# GPT-3 6.7B: the `gpt3_6.7b` preset (megalm/presets/table.py: shape, layout, schedule, sources).
#   python3 tools/presets.py gpt3_6.7b            # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset gpt3_6.7b   # memory per GPU and step time of its layout
#   Tokenizer: GPT-2 BPE, VOCAB_FILE + MERGE_FILE (GPT2BPETokenizer), or a tokenizer.json as
#   TOKENIZER_MODEL (HuggingFaceTokenizer).
# Environment: scripts/common.sh lists every variable (DATA_PATH unset: --mock-data; DRY_RUN=1:
#   print the command, launch nothing; TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, ...
#   override the preset).  Flags given to the script are appended last and win.
#
# Usage:  DATA_PATH=data/pile_text_document VOCAB_FILE=data/gpt2-vocab.json MERGE_FILE=data/gpt2-merges.txt \
#             scripts/pretrain_gpt3_6.7b.sh
#         sbatch --nodes 1 scripts/slurm/pretrain.sbatch scripts/pretrain_gpt3_6.7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch gpt3_6.7b "$@"
