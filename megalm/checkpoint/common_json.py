"""``common.json``: what rank 0 records about a checkpoint (format version, iteration, consumed
samples, config, the parallel layout, the scheduler and the optimizer's non-tensor state), and
the parallel layout record that decides whether per-rank files apply to this run."""

from __future__ import annotations

import json
import os

from megalm.checkpoint.errors import CheckpointError
from megalm.parallel_state import ProcessGroups, group_size

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


def layout(groups: ProcessGroups) -> dict:
    """The layout a checkpoint records (per-rank state such as compression residuals is kept only under an
    equal one): the sizes of ``groups``' tensor, pipeline, data (without context) and expert parallel
    groups; the expert-tensor-parallel size only when > 1, so earlier checkpoints keep comparing equal."""
    layout = {
        "tensor_model_parallel_size": group_size(groups.tp),
        "pipeline_model_parallel_size": group_size(groups.pp),
        "data_parallel_size": group_size(groups.dp),
        "expert_model_parallel_size": group_size(groups.ep),
    }
    etp = group_size(groups.etp)
    return layout if etp == 1 else {**layout, "expert_tensor_parallel_size": etp}
