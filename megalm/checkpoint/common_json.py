"""``common.json``: what rank 0 records about a checkpoint (format version, iteration, consumed
samples, config, the parallel layout, the scheduler and the optimizer's non-tensor state), and
the parallel layout record that decides whether per-rank files apply to this run."""

from __future__ import annotations

import json
import os

from megalm import parallel_state
from megalm.checkpoint.errors import CheckpointError

FORMAT_VERSION = 1


def read_common(path: str) -> dict:
    try:
        with open(os.path.join(path, "common.json")) as f:
            common = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}/common.json: {e}") from None
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {common.get('format_version')!r}")
    return common


def layout() -> dict:
    """The layout a checkpoint records (per-rank state such as compression residuals is kept only under an
    equal one); the expert-tensor-parallel size only when > 1, so earlier checkpoints keep comparing equal."""
    layout = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
    }
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    return layout if etp == 1 else {**layout, "expert_tensor_parallel_size": etp}
