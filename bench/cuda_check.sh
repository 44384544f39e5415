#!/usr/bin/env bash
# One-shot CUDA/NCCL check for a lent single-GPU machine (run from the repository root).
# Trains the GPT-3 125M and tiny MoE scripts on one GPU through the real launch path
# (torchrun + NCCL, mock data), in bf16 and fp16, with the distributed optimizer and with
# recompute, and runs the single-process unit tests that have CUDA branches.  Logs go to
# $OUT (or ./cuda_check_out).  Prints one summary line per run: iterations/s, tokens/s, MFU.
set -uo pipefail
OUT=${OUT:-$PWD/cuda_check_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 GPUS_PER_NODE=1 TORCHRUN=/tmp/megalm_torchrun
export WANDB_MODE=disabled
printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' > /tmp/megalm_torchrun; chmod +x /tmp/megalm_torchrun
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); sys.exit(0 if torch.cuda.is_available() else 1)" || exit 1
run() {  # name, env assignments..., -- extra flags
    local name=$1; shift
    local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
    local t0=$SECONDS
    env "${envs[@]}" RUN_DIR="$OUT/run_$name" MASTER_PORT=$((29500 + RANDOM % 1000)) \
        timeout 240 bash "${SCRIPT}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc ($((SECONDS - t0)) s): $(grep -iE 'iteration' "$OUT/$name.log" | tail -1 | cut -c1-400)"
    tail -1 "$OUT/run_$name/metrics.jsonl" 2>/dev/null | cut -c1-600
    [[ $rc == 0 ]] || tail -25 "$OUT/$name.log"
}
COMMON=(TRAIN_ITERS=30 LOG_INTERVAL=10 EVAL_INTERVAL=1000 EVAL_ITERS=2 SAVE_INTERVAL=1000000 TOKENIZER_TYPE=NullTokenizer VOCAB_SIZE=50304 MICRO_BATCH_SIZE=8 GLOBAL_BATCH_SIZE=32)
SCRIPT=scripts/pretrain_gpt3_125m.sh
run gpt125m_bf16_distopt "${COMMON[@]}" PRECISION=bf16 DIST_OPT=1 -- --seq-length 1024 --max-position-embeddings 1024
run gpt125m_bf16_ddp "${COMMON[@]}" PRECISION=bf16 DIST_OPT=0 -- --seq-length 1024 --max-position-embeddings 1024
run gpt125m_fp16 "${COMMON[@]}" PRECISION=fp16 DIST_OPT=1 -- --seq-length 1024 --max-position-embeddings 1024
run gpt125m_bf16_recompute "${COMMON[@]}" PRECISION=bf16 RECOMPUTE=full -- --seq-length 1024 --max-position-embeddings 1024 --calculate-per-token-loss
SCRIPT=scripts/pretrain_moe_tiny_cpu.sh
run moe_tiny_bf16 TP=1 TRAIN_ITERS=20 LOG_INTERVAL=10 PRECISION=bf16 -- --expert-model-parallel-size 1
echo "== the CPU suite's fast single-process files on this machine (MEGALM_FORCE_CPU=1 set by tests/conftest.py)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_linear_cross_entropy.py tests/test_blocked_attention.py 2>&1 | tail -4
