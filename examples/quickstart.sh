#!/usr/bin/env bash
# megalm quickstart: a real, small pretraining run on a CPU-only machine, end to end.
#
#   1. installs megalm (tools/install.sh; torch==2.13.0 only if torch is missing)
#   2. builds a ~20 MB text corpus from this machine's Python standard library
#   3. trains an 8k-vocabulary sentencepiece BPE tokenizer (tools/train_tokenizer.py)
#   4. preprocesses the corpus to Megatron .bin/.idx (tools/preprocess_data.py)
#   5. trains a 4-layer GPT with 4 processes, tensor parallel 2 x pipeline parallel 2 (1F1B)
#      (torchrun + pretrain_gpt.py), evaluates validation/test perplexity, saves a checkpoint
#
# Everything goes to $OUT (default: quickstart_out/).  Takes about 5-8 minutes on 2 cores.
# Override: TRAIN_ITERS=100 bash examples/quickstart.sh
# Precision: PRECISION=auto (default) trains in bf16 (fp32 main weights) on a GPU or on a CPU with
# native bf16 instructions, else in fp32 (without them bf16 matmuls crawl); or PRECISION=bf16|fp32.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/quickstart_out}
TRAIN_ITERS=${TRAIN_ITERS:-300}
NPROC=${NPROC:-4}
PY=${PYTHON:-python3}
PRECISION=${PRECISION:-auto}
export WANDB_MODE=${WANDB_MODE:-offline}

bash "$ROOT/tools/install.sh"
source "$ROOT/scripts/common.sh"
PYTHON=$PY megalm_resolve_precision
case "$PRECISION" in
  bf16) PRECISION_ARGS=(--bf16) ;;
  fp32) PRECISION_ARGS=() ;;
  *) echo "PRECISION must be auto, bf16 or fp32, got '$PRECISION'" >&2; exit 2 ;;
esac
echo "[quickstart] precision: $PRECISION"
mkdir -p "$OUT"
cd "$OUT"

if [ ! -f corpus.jsonl ]; then
  "$PY" "$ROOT/examples/build_stdlib_corpus.py" --output corpus.jsonl --max-mb 20
fi
if [ ! -f tokenizer.model ]; then
  "$PY" "$ROOT/tools/train_tokenizer.py" --input corpus.jsonl --json-keys text --model-prefix tokenizer \
      --vocab-size 8192 --model-type bpe --byte-fallback
fi
if [ ! -f stdlib_text_document.idx ]; then
  "$PY" "$ROOT/tools/preprocess_data.py" --input corpus.jsonl --json-keys text --output-prefix stdlib \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod --workers 2 \
      --no-progress
fi

rm -rf checkpoints tensorboard metrics.jsonl
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "$ROOT/pretrain_gpt.py" \
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    "${PRECISION_ARGS[@]}" \
    --data-path stdlib_text_document --split 98,1,1 --num-workers 0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model \
    --log-interval 10 --eval-interval 100 --eval-iters 5 \
    --save checkpoints --save-interval "$TRAIN_ITERS" \
    --metrics-file metrics.jsonl --tensorboard-dir tensorboard \
    --wandb-project megalm-quickstart --wandb-exp-name quickstart --wandb-save-dir "$OUT"

echo
echo "[quickstart] done. Outputs in $OUT:"
echo "  checkpoint:   $OUT/checkpoints (latest_checkpointed_iteration.txt -> $(cat checkpoints/latest_checkpointed_iteration.txt))"
echo "  metrics:      $OUT/metrics.jsonl (one JSON record per logged iteration and evaluation)"
echo "  tensorboard:  tensorboard --logdir $OUT/tensorboard"
echo "  wandb:        $OUT/wandb (offline run; 'wandb sync' it to upload)"
