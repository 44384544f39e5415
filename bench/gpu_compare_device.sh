#!/usr/bin/env bash
# The one command a session with a lent GPU runs (device tool, repository root, carry [".whl"]):
#     bash bench/gpu_compare_device.sh                # both shapes, all importable rows, ~8 min
#     bash bench/gpu_compare_device.sh --shapes llama1b --rows megalm-local,plain-eager,mcore-local
# Installs the wheels carried in .whl/ (megatron-core, torchtitan and the few pure-Python packages
# torchtitan imports; the GPU machine reaches no package registry) into /tmp/site without
# dependencies, says which peers import, then runs bench/gpu_compare.py writing into $OUT.
# Extra arguments go to gpu_compare.py.  See docs/benchmarks.md, "One-GPU comparison".
set -uo pipefail
OUT=${OUT:-$PWD/gpu_compare_out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if compgen -G ".whl/*.whl" > /dev/null; then
    # all at once; if one wheel does not fit this Python (megatron-core is cp312), one by one
    pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl 2> "$OUT/pip.log" || \
        for w in .whl/*.whl; do
            pip install --quiet --no-index --no-deps --target "$SITE" "$w" >> "$OUT/pip.log" 2>&1 \
                || echo "not installed: $w (see pip.log)"
        done
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no .whl/ folder: megatron-core and torchtitan rows will be skipped unless installed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
for m in megatron.core.models.gpt.gpt_model torchtitan.models.llama3 transformer_engine.pytorch; do
    python3 -c "import $m" > /dev/null 2>&1 && echo "import $m: ok" \
        || echo "import $m: $(python3 -c "import $m" 2>&1 | tail -1)"
done
timeout 470 python3 bench/gpu_compare.py --out "$OUT" --budget-s 330 "$@"
rc=$?
echo "gpu_compare rc=$rc; results in $OUT/gpu_compare.json"
exit $rc
