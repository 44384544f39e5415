"""``--non-persistent-ckpt-type local``: the trainer's side of :mod:`megalm.checkpoint.local`
(this node's name, the job's id, the gloo group the shards travel on, the replica's rank distance).

The node's name is ``MEGALM_NODE_NAME`` when set (several simulated nodes on one host, which share
its hostname and its ``/dev/shm``), else the hostname; the job's id is torchrun's ``--rdzv-id``
(``TORCHELASTIC_RUN_ID``; ``none`` outside torchrun).
"""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch.distributed as dist

from megalm.checkpoint.local import LocalCheckpoint
from megalm.log import get_logger

logger = get_logger(__name__)


def node_name() -> str:
    return os.environ.get("MEGALM_NODE_NAME") or socket.gethostname()


def build_local_checkpoint(checkpoint_cfg) -> Optional[LocalCheckpoint]:
    """The rank's :class:`LocalCheckpoint` with ``--non-persistent-ckpt-type local`` (collective: a new
    gloo group and one ``all_gather_object``), else None."""
    c = checkpoint_cfg
    if c.non_persistent_ckpt_type != "local":
        return None
    group = dist.new_group(backend="gloo")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    local = LocalCheckpoint(
        c.non_persistent_local_ckpt_dir,
        run_id,
        node_name(),
        group,
        c.replication,
        c.replication_jump,
        background=c.async_save,
        factor=c.replication_factor,
    )
    if not c.replication:
        logger.warning(
            "--non-persistent-ckpt-type local without --replication: a shard lives only on its own node and "
            "does not survive the node's loss"
        )
    return local


def describe_save(local: LocalCheckpoint, iteration: int, outcome: dict) -> str:
    line = f"local checkpoint at iteration {iteration}: {outcome['bytes']} bytes to {local.dir}"
    if local.peers:
        to = ", ".join(f"rank {p} (node {local.nodes[p]!r})" for p in local.peers)
        line += f", {outcome['sent']} bytes sent to {to}"
    if local.background:
        return line + f" (serialized in {outcome['seconds']:.3f} s; written and sent in the background)"
    return line + f" in {outcome['seconds']:.3f} s"
