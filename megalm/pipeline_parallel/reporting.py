"""Give every pipeline stage the values only the last stage computed (losses for logging).

Communication: two broadcasts over the pipeline group from its last stage: the length of the
JSON-encoded ``{name: float}`` (one int64), then its bytes (uint8).  Every rank of the pipeline
group must call it, whatever it holds.  Nothing is pickled.
"""

from __future__ import annotations

import json
from typing import Dict

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.device import get_device


def broadcast_from_last_stage(values: Dict[str, float]) -> Dict[str, float]:
    """The last pipeline stage's ``values`` on every stage (as they are without pipelining)."""
    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_ranks()[-1]
    device = get_device()
    is_src = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    payload = json.dumps({k: float(v) for k, v in values.items()}).encode() if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if is_src
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    if int(size.item()) > 0:
        dist.broadcast(data, src, group=group)
    return {k: float(v) for k, v in json.loads(bytes(data.cpu().tolist()).decode() or "{}").items()}
