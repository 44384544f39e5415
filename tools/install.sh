#!/usr/bin/env bash
# Install megalm and what it needs into the current Python environment.
# torch: installed as torch==2.13.0 only when absent (a CPU wheel on machines without a GPU
# build available); an existing torch (e.g. the CUDA build on a GPU cluster) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] torch not found: installing torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[all]"
"$PY" -c "import torch, megalm; print(f'[install] megalm ready (torch {torch.__version__})')"
