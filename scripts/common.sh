# Shared plumbing for scripts/pretrain_*.sh.  Sourced, not run.
#
# A model script calls `megalm_launch PRESET "$@"`.  The preset (megalm/presets/table.py: shape,
# default layout, schedule) gives every model and training flag through
# `python3 tools/presets.py PRESET --shell`, which applies the layout and schedule overrides
# below; this file adds only what is machine-specific: data, tokenizer files, outputs, rendezvous.
# Everything comes from the environment (defaults in brackets; "preset": the preset's value):
#
#   GPUS_PER_NODE [preset, 8]  NNODES [preset]  NODE_RANK [0]
#   MASTER_ADDR [localhost]  MASTER_PORT [6000]  TORCHRUN [torchrun]  PYTHON [python3]
#   DATA_PATH         Megatron .bin/.idx prefix, or a blend "0.7 data/a 0.3 data/b" (relative paths
#                     are relative to the repository root, where the run starts).
#                     Unset: synthetic --mock-data (for smoke tests and benchmarks only).
#   SPLIT [969,30,1]  DATA_CACHE_PATH []  NUM_WORKERS [2, or preset]
#   VOCAB_FILE, MERGE_FILE   GPT-2 BPE files (gpt2-vocab.json, gpt2-merges.txt): GPT2BPETokenizer
#   TOKENIZER_MODEL   sentencepiece .model, or a Hugging Face tokenizer.json / directory
#                     (local files only).  Neither: NullTokenizer with VOCAB_SIZE ids.
#   TOKENIZER_TYPE [preset]  with TOKENIZER_MODEL: SentencePieceTokenizer | GPTSentencePieceTokenizer |
#                     Llama2Tokenizer | HuggingFaceTokenizer
#   VOCAB_SIZE [preset]  the tokenizer's vocabulary, used only with NullTokenizer
#   RUN_DIR [<repo>/runs/$MODEL_NAME]   CHECKPOINT_DIR [$RUN_DIR/checkpoints]
#   LOAD_DIR [$CHECKPOINT_DIR]  (--load; the default resumes when a checkpoint exists, else starts fresh)
#   TENSORBOARD_DIR [$RUN_DIR/tensorboard]  METRICS_FILE [$RUN_DIR/metrics.jsonl]
#   WANDB_PROJECT []  WANDB_EXP_NAME [$MODEL_NAME]
#   SAVE_INTERVAL [1000]  LOG_INTERVAL [10]  EVAL_INTERVAL [1000]  EVAL_ITERS [10]  (or preset)
#   TIMING_LOG_LEVEL [0]  (0 | 1 | 2: per-phase timers in the log; above 0 also to TensorBoard)
#   ASYNC_SAVE [0]    1: --async-save (checkpoints written in the background)
#   DRY_RUN [0]       1: print the command and the pretrain_gpt.py flags, launch nothing
#
# Layout and schedule overrides, read by megalm.presets (megalm/presets/flags.py):
#   TP, PP, EP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE [preset]
#   TRAIN_TOKENS, TRAIN_ITERS, LR_DECAY_ITERS, LR_WARMUP_ITERS, LR, MIN_LR [preset; iterations
#                     follow TRAIN_TOKENS and the global batch; warm-up is cut to fit a short run]
#   PRECISION [preset: bf16 | fp16 | fp32 | auto: bf16 on a GPU or a CPU with native bf16
#                     instructions, else fp32]
#   SEQUENCE_PARALLEL [1]  (adds --sequence-parallel when TP > 1)
#   RECOMPUTE [preset, none]  (none | selective | full; full uses uniform chunks of RECOMPUTE_NUM_LAYERS [1])
#   VP_LAYERS []      layers per virtual pipeline stage (interleaved 1F1B; needs PP > 1)
#   DIST_OPT [1]      1: --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather; 0: off
#
# Flags given to the script are appended last, so they override anything above
# (argparse keeps the last value of a repeated flag).

MEGALM_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

megalm_warn() { echo "[megalm] $*" >&2; }
megalm_die() { echo "[megalm] error: $*" >&2; exit 2; }

# PRECISION=auto -> bf16 or fp32 (asks torch through PYTHON [python3], from the repository
# root).  Without native bf16 instructions a CPU runs a bf16 matmul ~100x slower than fp32.
megalm_resolve_precision() {
    if [[ "${PRECISION:-}" == auto ]]; then
        PRECISION=$(cd "$MEGALM_REPO_ROOT" && "${PYTHON:-python3}" -c "import torch; \
from megalm.flops import cpu_has_native_bf16; \
print('bf16' if torch.cuda.is_available() or cpu_has_native_bf16() else 'fp32')") \
            || megalm_die "PRECISION=auto: could not ask torch through ${PYTHON:-python3} (is megalm installed?)"
        megalm_warn "PRECISION=auto: $PRECISION"
    fi
}

# Evaluate the preset's bash (megalm/presets/cli.py: shell_code): MODEL_NAME, the resolved
# layout (GPUS_PER_NODE, NNODES, TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, PRECISION,
# VOCAB_SIZE), the preset's launcher defaults and the arrays RECIPE_ARGS and NULL_TOKENIZER_ARGS.
megalm_load_preset() {
    local code
    code=$(cd "$MEGALM_REPO_ROOT" && "${PYTHON:-python3}" tools/presets.py "$1" --shell) \
        || megalm_die "could not load preset '$1' through ${PYTHON:-python3} tools/presets.py (error above)"
    eval "$code"
}

megalm_launch() {
    (( $# >= 1 )) || megalm_die "usage: megalm_launch PRESET [extra pretrain_gpt.py flags]"
    megalm_load_preset "$1"
    shift
    : "${NODE_RANK:=0}" "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=6000}" "${TORCHRUN:=torchrun}" "${DRY_RUN:=0}"
    : "${RUN_DIR:=$MEGALM_REPO_ROOT/runs/$MODEL_NAME}"
    : "${CHECKPOINT_DIR:=$RUN_DIR/checkpoints}" "${LOAD_DIR:=$CHECKPOINT_DIR}"
    : "${TENSORBOARD_DIR:=$RUN_DIR/tensorboard}" "${METRICS_FILE:=$RUN_DIR/metrics.jsonl}"
    : "${SAVE_INTERVAL:=1000}" "${LOG_INTERVAL:=10}" "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}"
    : "${TIMING_LOG_LEVEL:=0}" "${ASYNC_SAVE:=0}"
    : "${SPLIT:=969,30,1}" "${NUM_WORKERS:=2}"

    local data=()
    if [[ -n "${DATA_PATH:-}" ]]; then
        local paths
        read -r -a paths <<< "$DATA_PATH"
        data+=(--data-path "${paths[@]}" --split "$SPLIT")
    else
        megalm_warn "DATA_PATH is not set: training on synthetic --mock-data"
        data+=(--mock-data)
    fi
    if [[ -n "${DATA_CACHE_PATH:-}" ]]; then
        data+=(--data-cache-path "$DATA_CACHE_PATH")
    fi
    data+=(--num-workers "$NUM_WORKERS")
    if [[ -n "${VOCAB_FILE:-}" || -n "${MERGE_FILE:-}" ]]; then
        [[ -n "${VOCAB_FILE:-}" && -n "${MERGE_FILE:-}" ]] || megalm_die "GPT-2 BPE needs both VOCAB_FILE and MERGE_FILE"
        [[ -z "${TOKENIZER_MODEL:-}" ]] || megalm_die "give VOCAB_FILE/MERGE_FILE (GPT-2 BPE) or TOKENIZER_MODEL, not both"
        data+=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
    elif [[ -n "${TOKENIZER_MODEL:-}" && "${TOKENIZER_TYPE:-}" != NullTokenizer ]]; then
        : "${TOKENIZER_TYPE:?TOKENIZER_TYPE must be set with TOKENIZER_MODEL}"
        data+=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
    else
        if [[ -n "${DATA_PATH:-}" ]]; then
            megalm_warn "no TOKENIZER_MODEL or VOCAB_FILE/MERGE_FILE: NullTokenizer with $VOCAB_SIZE ids (end-of-document id $(( VOCAB_SIZE - 1 )))"
        fi
        # --vocab-size VOCAB_SIZE - 1: NullTokenizer adds the end-of-document id (megalm/presets/flags.py).
        data+=("${NULL_TOKENIZER_ARGS[@]}")
    fi

    # Megatron's auto-resume: with --load = --save, the first launch starts from scratch and every
    # later one resumes.  A LOAD_DIR of its own must hold a checkpoint (megalm fails otherwise).
    local checkpoint=(--save "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL" --load "$LOAD_DIR")
    if [[ "$ASYNC_SAVE" == 1 ]]; then
        checkpoint+=(--async-save)
    fi

    local logging=(--log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
                   --tensorboard-dir "$TENSORBOARD_DIR" --metrics-file "$METRICS_FILE"
                   --timing-log-level "$TIMING_LOG_LEVEL")
    if [[ "$TIMING_LOG_LEVEL" != 0 ]]; then
        logging+=(--log-timers-to-tensorboard)
    fi
    if [[ -n "${WANDB_PROJECT:-}" ]]; then
        logging+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-$MODEL_NAME}"
                  --wandb-save-dir "$RUN_DIR/wandb")
    fi

    local args=("${RECIPE_ARGS[@]}" "${data[@]}" "${checkpoint[@]}" "${logging[@]}"
                ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "$@")
    local cmd=("$TORCHRUN" --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
               --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" pretrain_gpt.py "${args[@]}")

    if [[ "$DRY_RUN" == 1 ]]; then
        printf '[megalm] cd %q &&' "$MEGALM_REPO_ROOT"
        printf ' %q' "${cmd[@]}"
        printf '\n---- pretrain_gpt.py flags ----\n'
        printf '%s\n' "${args[@]}"
        exit 0
    fi

    cd "$MEGALM_REPO_ROOT"
    mkdir -p "$CHECKPOINT_DIR" "$TENSORBOARD_DIR" "$(dirname "$METRICS_FILE")"
    echo "[megalm] $MODEL_NAME: node $NODE_RANK of $NNODES, $GPUS_PER_NODE processes, TP $TP PP $PP," \
         "micro $MICRO_BATCH_SIZE global $GLOBAL_BATCH_SIZE, $TRAIN_ITERS iterations" >&2
    exec "${cmd[@]}"
}
