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

from megalm.device import get_device
from megalm.parallel_state import ProcessGroups, group_size


def broadcast_from_last_stage(values: Dict[str, float], groups: ProcessGroups) -> Dict[str, float]:
    """The last pipeline stage's ``values`` on every stage (as they are without pipelining);
    ``groups``: the rank's process groups (``pp`` and its ranks are read)."""
    if groups.pp is None or group_size(groups.pp) == 1:
        return values
    group = groups.pp
    src = groups.ranks["pp"][-1]
    device = get_device()
    is_src = dist.get_rank() == src
    payload = json.dumps({k: float(v) for k, v in values.items()}).encode() if is_src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if is_src
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    if int(size.item()) > 0:
        dist.broadcast(data, src, group=group)
    return {k: float(v) for k, v in json.loads(bytes(data.cpu().tolist()).decode() or "{}").items()}


def losses_to_floats(losses: Dict[str, torch.Tensor], groups: ProcessGroups) -> Dict[str, float]:
    """Host values of reduced losses (one device-to-host copy), given to every pipeline stage
    (two broadcasts over the pipeline group when it has several stages: every rank calls this)."""
    keys = sorted(losses)
    floats = dict(zip(keys, torch.stack([losses[k] for k in keys]).tolist())) if keys else {}
    return broadcast_from_last_stage(floats, groups)
