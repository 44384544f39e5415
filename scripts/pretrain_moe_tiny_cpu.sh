#!/usr/bin/env bash
# Tiny mixture-of-experts GPT that trains on a CPU-only machine: 4 processes on one node,
# TP 2 (+ sequence parallel: each TP rank routes its half of the sequence) x EP 2 (4 experts per
# rank and layer) x DP 2 for the dense layers, gloo; PRECISION=auto as in pretrain_gpt_tiny_cpu.sh.
# The `moe_tiny_cpu` preset (megalm/presets/table.py):
#   python3 tools/presets.py moe_tiny_cpu                          # the pretrain_gpt.py flags it passes
#   python3 tools/estimate.py --preset moe_tiny_cpu --device cpu    # memory per process
# Time (2 cores, 4 ranks oversubscribing them): ~1-2 s per iteration; 20 iterations by default.
# Environment: the same as the GPU scripts (scripts/common.sh); GPUS_PER_NODE is the number of
#   processes (default 4).  Checkpoints go to runs/moe_tiny_cpu/checkpoints and a rerun resumes from
#   there (rm -rf runs/moe_tiny_cpu to start over).
#
# Usage:  scripts/pretrain_moe_tiny_cpu.sh
#         TRAIN_ITERS=100 scripts/pretrain_moe_tiny_cpu.sh --log-interval 1 --moe-per-layer-logging
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

megalm_launch moe_tiny_cpu "$@"
