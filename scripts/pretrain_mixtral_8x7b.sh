#!/usr/bin/env bash
# Mixtral 8x7B (8 experts, top-2): the `mixtral_8x7b` preset (megalm/presets/table.py: shape, layout, schedule, sources).
#   python3 tools/presets.py mixtral_8x7b            # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset mixtral_8x7b   # memory per GPU and step time of its layout
#   Tokenizer: its sentencepiece tokenizer.model as TOKENIZER_MODEL (Llama2Tokenizer).
#   4 nodes x 8 GPUs (GPUS_PER_NODE x NNODES = 32), EP (expert-parallel size) 8; experts are
#   split over EP ranks, not over TP ranks, so keep TP 1; FLOPs/MFU count the active experts.
# Environment: scripts/common.sh lists every variable (DATA_PATH unset: --mock-data; DRY_RUN=1:
#   print the command, launch nothing; TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, ...
#   override the preset).  Flags given to the script are appended last and win.
#
# Usage:  DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=data/mixtral/tokenizer.model scripts/pretrain_mixtral_8x7b.sh
#         sbatch --nodes 4 scripts/slurm/pretrain.sbatch scripts/pretrain_mixtral_8x7b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch mixtral_8x7b "$@"
