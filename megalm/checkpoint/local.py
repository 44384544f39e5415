"""Local, replicated checkpoints in RAM: ``--non-persistent-ckpt-type local`` (Megatron-LM's flags).

Every ``--non-persistent-save-interval K`` iterations each rank serializes its own shard (the same
blocks a disk checkpoint writes: model, optimizer, the registered states' blocks and files, the
scheduler, the RNG, the consumed samples) into one byte string and

* writes it to ``<--non-persistent-local-ckpt-dir>/<run id>/<node>/`` (use a tmpfs: ``/dev/shm``),
* with ``--replication``, sends it (one gloo send/recv over the network) to rank
  ``(rank + J) mod world`` (``--replication-jump J``, default the ranks per node: the same local
  rank on the next node), which writes it to *its* node's directory; with
  ``--replication-factor K`` (default 2: the rank's own copy and one replica) to the ``K - 1`` ranks
  ``rank + J, rank + 2J, ... rank + (K-1) J`` (mod world), which must be on ``K - 1`` other nodes,
  all different: the shard then survives the loss of any ``K - 1`` nodes.

Why files in the node's ``/dev/shm`` and not the trainer's memory: torchrun restarts *every*
worker of every node after a failure, so a copy kept in a worker process dies with the restart.
A tmpfs file lives in the node's RAM until the node goes down (or the file is removed), outside
any process.  After a node is lost, its ranks' shards survive in their peers' ``/dev/shm`` on
other nodes; the survivors' own shards are in their own ``/dev/shm``.

Restore (:meth:`LocalCheckpoint.restore`, collective at start-up, before the disk load): every
rank lists its node's directory, one ``all_gather_object`` shares the lists, and the newest
iteration that every rank's shard has somewhere (under the same world size) is taken when it is
at least the newest disk checkpoint's.  A rank whose shard is on its node reads it there; otherwise
the rank holding it sends it (gloo point-to-point).  The shard must have been saved by this run's
configuration (else every rank falls back to the disk checkpoint, with a warning naming why).  Copies
saved under another world size (an elastic resize) are resharded when they are the newest
(:mod:`megalm.checkpoint.local_reshard`: each new rank receives its blocks of the surviving copies).

The byte string is ``torch.save`` of tensors and plain values, read back with
``torch.load(weights_only=True)``: nothing in it runs code.  The ``<run id>`` is torchrun's
``--rdzv-id`` (``TORCHELASTIC_RUN_ID``): another job's copies are never read.

Communication: :meth:`LocalCheckpoint.save`: the registered states' ``sharded_state_dict`` hooks (as
a disk save); then (in a background thread while training goes on with ``--async-save``, one copy
in flight: the next save waits for it) the tmpfs write, one batched send/recv pair and one barrier
over ``group``; :meth:`restore`: one
``all_gather_object``, point-to-point sends of the shards not on their rank's node, and one
``all_gather_object`` of the outcome.  ``group`` is a gloo group over the world (CPU tensors).
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.checkpoint.common_json import FORMAT_VERSION, layout
from megalm.checkpoint.errors import CheckpointError, first_line, gather_errors
from megalm.checkpoint.local_reshard import choose_reshard, fill_blocks, restore_resharded
from megalm.checkpoint.save import COMMON_KEYS
from megalm.checkpoint.stateful import (
    CheckpointStates,
    LoadInfo,
    common_states,
    sharded_load_plans,
    sharded_states,
)
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups

logger = get_logger(__name__)

_NAME = re.compile(r"rank(\d{5})_of(\d{5})_iter(\d{7})\.pt")


def shard_file_name(owner: int, world: int, iteration: int) -> str:
    return f"rank{owner:05d}_of{world:05d}_iter{iteration:07d}.pt"


@dataclass(frozen=True)
class Held:
    """A shard file in a node's directory: whose, under which world size, which iteration, how big."""

    owner: int
    world: int
    iteration: int
    nbytes: int


def replica_ranks(nodes: List[str], jump: int, factor: int) -> List[List[int]]:
    """For every rank ``r`` (``nodes[r]``: its node), the ``factor - 1`` ranks its replicas go to:
    ``r + j jump`` (mod world) for ``j = 1 .. factor - 1``.  :class:`CheckpointError` unless they are
    on ``factor - 1`` nodes other than ``r``'s and all different (each copy must survive the
    others' nodes)."""
    world = len(nodes)
    if factor < 2:
        raise CheckpointError(f"--replication-factor {factor}: at least 2 (the rank's own copy and one replica)")
    out = []
    for r in range(world):
        peers = [(r + j * jump) % world for j in range(1, factor)]
        where = [nodes[r]] + [nodes[p] for p in peers]
        if len(set(where)) != len(where):
            raise CheckpointError(
                f"--replication: rank {r}'s {factor} copies would go to ranks {[r] + peers} on nodes {where}, "
                f"not {factor} different nodes, and would not survive the loss of one; give --replication-jump a "
                f"multiple of the ranks per node and --replication-factor at most the number of nodes "
                f"({len(set(nodes))}) (nodes by rank: {nodes})"
            )
        out.append(peers)
    return out


def list_held(directory: str) -> List[Held]:
    """The complete shard files in ``directory`` (a file being written has a temporary name)."""
    held = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        m = _NAME.fullmatch(name)
        if m:
            size = os.path.getsize(os.path.join(directory, name))
            held.append(Held(int(m.group(1)), int(m.group(2)), int(m.group(3)), size))
    return held


def choose_restore(
    holdings: List[Tuple[str, List[Held]]], world: int, newer_than: Optional[int]
) -> Optional[Tuple[int, Dict[int, Tuple[int, int]]]]:
    """Given every rank's ``(node, shards on its node)``: the newest iteration ``>= newer_than`` whose
    shard every owner ``0..world-1`` has somewhere, and for each owner ``(holder rank, bytes)``: the
    owner itself when the shard is on its node, else the lowest rank holding it.  None if none."""
    where: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for rank, (_, held) in enumerate(holdings):
        for h in held:
            if h.world == world and h.owner < world:
                where.setdefault((h.owner, h.iteration), []).append((rank, h.nbytes))
    iterations = {it for _, it in where}
    complete = [it for it in iterations if all((o, it) in where for o in range(world))]
    complete = [it for it in complete if newer_than is None or it >= newer_than]
    if not complete:
        return None
    it = max(complete)
    plan = {}
    for owner in range(world):
        holders = dict(where[(owner, it)])
        plan[owner] = (owner, holders[owner]) if owner in holders else min(holders.items())
    return it, plan


class LocalCheckpoint:
    """This rank's side of the local checkpoints (see the module docstring).

    ``directory`` (``--non-persistent-local-ckpt-dir``), ``run_id`` (torchrun's ``--rdzv-id``) and
    ``node`` (this node's name) make this node's directory; ``group``: a gloo group over the world;
    ``replication``: the replica goes to rank ``(rank + jump) mod world`` (``jump`` None: the ranks
    per node, counted by node name).  Collective
    (one ``all_gather_object``): a replica on the same node as its owner raises
    :class:`CheckpointError`, since it would not survive the node.  On fewer nodes than ``factor`` (an
    elastic job that lost nodes) each shard gets one copy per node, with a warning (one node: none)."""

    def __init__(
        self,
        directory: str,
        run_id: str,
        node: str,
        group,
        replication: bool,
        jump: Optional[int] = None,
        background: bool = False,
        factor: int = 2,
    ):
        self.group = group
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.node = node
        self.dir = os.path.join(directory, run_id, node)
        os.makedirs(self.dir, exist_ok=True)
        self.nodes = [None] * self.world
        dist.all_gather_object(self.nodes, node, group=group)
        self.peers: List[int] = []  # the ranks this rank's replicas go to
        self.sources: List[int] = []  # the ranks whose replicas this rank keeps (the same order)
        n_nodes = len(set(self.nodes))
        if replication and n_nodes < factor:  # an elastic job on fewer nodes than copies: as many as there are
            kept = "no replica: a shard does not survive its node" if n_nodes == 1 else f"{n_nodes} copies"
            logger.warning(f"--replication-factor {factor} on {n_nodes} node(s): {kept}")
            factor = n_nodes
        if replication and factor >= 2:
            jump = jump or self.nodes.count(self.nodes[0])  # default: the ranks per node
            self.peers = replica_ranks(self.nodes, jump, factor)[self.rank]
            self.sources = [(self.rank - j * jump) % self.world for j in range(1, factor)]
        self.written: List[str] = []  # this rank's files of the newest local checkpoint
        self.background = background  # the copy in a background thread (--async-save)
        self._thread: Optional[threading.Thread] = None  # the copy in flight
        self._error: Optional[BaseException] = None

    # -- save --
    def save(self, iteration: int, config: Optional[dict], states: CheckpointStates, groups: ProcessGroups) -> dict:
        """Collective over the world.  ``states``: every registered state (the trainer's: the model and
        optimizer, the scheduler, the data position...): their blocks and ``common.json`` entries as a disk
        save's, and each one's ``local_state_dict()`` when it has one (the RNG: the generators, also under
        ``--no-save-rng``), else ``state_dict()``.  Returns ``{"bytes", "sent", "seconds"}`` for the log."""
        start = time.perf_counter()
        specs = sharded_states(states)  # collective per state, as a disk save
        common = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "world_size": self.world,
            "layout": layout(groups),
            "config": config,
            **common_states(states, taken=COMMON_KEYS),
        }
        blocks = {
            k: [
                {"offsets": list(s.offsets), "global_shape": list(s.global_shape), "data": _cpu_copy(s.data())}
                for s in _as_list(v)
            ]
            for k, v in specs.items()
        }
        payload = {
            "common_json": json.dumps(common),  # as common.json: the same values a disk load reads
            "blocks": blocks,
            "states": _state_dicts(states),
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)
        self.wait()  # the previous copy is complete (one in flight)
        if self.background:
            self._thread = threading.Thread(
                target=self._copy, args=(iteration, data), name="megalm-local-ckpt", daemon=True
            )
            self._thread.start()
        else:
            self._copy(iteration, data)
            self.wait()  # raises if it failed
        seconds = time.perf_counter() - start
        return {"bytes": data.numel(), "sent": data.numel() * len(self.peers), "seconds": seconds}

    def _copy(self, iteration: int, data: torch.Tensor) -> None:
        """In the background: this rank's file, the exchange with the peers and their file, a barrier, then
        the older files go (only the newest complete local checkpoint is kept)."""
        try:
            start = time.perf_counter()
            written = [shard_file_name(self.rank, self.world, iteration)]
            self._write(written[0], data)
            for peer, source in zip(self.peers, self.sources):  # one ring shift per copy
                received = self._exchange(data, peer, source)
                written.append(shard_file_name(source, self.world, iteration))
                self._write(written[-1], received)
            dist.barrier(group=self.group)  # every rank's copies are written: the older ones can go
            for name in self.written:
                if name not in written:
                    _remove(os.path.join(self.dir, name))
            self.written = written
            logger.debug(f"local checkpoint at iteration {iteration} copied in {time.perf_counter() - start:.3f} s")
        except BaseException as e:  # noqa: BLE001 - reported by wait(), in the training thread
            self._error = e

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the background copy in flight (at most ``timeout`` seconds); a failed one raises
        :class:`CheckpointError`."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"local checkpoint copy failed: {first_line(error)}") from error

    def _exchange(self, data: torch.Tensor, peer: int, source: int) -> torch.Tensor:
        """Send ``data`` to ``peer``, receive ``source``'s shard (sizes first)."""
        size, their_size = torch.tensor([data.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self._swap(size, their_size, peer, source)
        received = torch.empty(int(their_size.item()), dtype=torch.uint8)
        self._swap(data, received, peer, source)
        return received

    def _swap(self, send: torch.Tensor, recv: torch.Tensor, peer: int, source: int) -> None:
        ops = [dist.P2POp(dist.isend, send, peer, self.group)]
        _p2p(ops + [dist.P2POp(dist.irecv, recv, source, self.group)])

    def _write(self, name: str, data: torch.Tensor) -> None:
        path = os.path.join(self.dir, name)
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(data.numpy()))
            os.replace(tmp, path)
        except OSError as e:
            raise CheckpointError(f"cannot write local checkpoint {path}: {e}") from e

    def close(self, timeout: float = 60.0) -> None:
        """However the run ends: let the copy in flight finish (at most ``timeout`` seconds); its failure
        is logged, not raised (the run is ending with its own outcome)."""
        try:
            self.wait(timeout)
        except CheckpointError as e:
            logger.warning(str(e))

    def remove_all(self) -> None:
        """Remove this rank's files of the newest local checkpoint (the run is over)."""
        self.wait()
        for name in self.written:
            _remove(os.path.join(self.dir, name))
        self.written = []

    # -- restore --
    def restore(
        self, config: Optional[dict], newer_than: Optional[int], states: CheckpointStates, groups: ProcessGroups
    ) -> Optional[dict]:
        """Collective.  Restore the newest local checkpoint of iteration ``>= newer_than`` (the disk
        checkpoint's, None: any) into ``states`` (registration order: each one's blocks, its ``common.json``
        entries, then its state dict, as a disk load); returns its common record plus ``path``, ``held``
        (this rank's state dicts, for the states restored later through
        :func:`megalm.checkpoint.load.load_states` ``held=``: the RNG, after the data loaders are built) and
        ``bytes_from_peer``; or None (nothing to restore, or refused: the reason is logged)."""
        start = time.perf_counter()
        holdings = [None] * self.world
        dist.all_gather_object(holdings, (self.node, list_held(self.dir)), group=self.group)
        choice = choose_restore(holdings, self.world, newer_than)
        other, why_not = choose_reshard(holdings, self.world, newer_than)
        if other is not None and (choice is None or other[1] > choice[0]):  # the newest; equal: no resharding
            now = layout(groups)
            check = lambda common: _mismatch(common, config, self.world, now, reshard=True)  # noqa: E731
            restored = restore_resharded(self, *other, check, newer_than, states, groups, start)
            if restored is not None:  # the old world's copies on this node go at the next save, once it is complete
                old = [shard_file_name(o, other[0], other[1]) for o in range(other[0])]
                self.written = [n for n in old if os.path.isfile(os.path.join(self.dir, n))]
            return restored
        if choice is None:
            disk = "" if newer_than is None else f" at or after the disk checkpoint's iteration {newer_than}"
            why = f"; {why_not}" if why_not else ""
            logger.info(f"no complete local checkpoint for world {self.world}{disk} in {self.dir} and its peers{why}")
            return None
        iteration, plan = choice
        payload, error = None, None
        try:
            data = self._fetch(iteration, plan)
            payload = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
            now_layout = layout(groups)
            common = json.loads(payload["common_json"])
            error = _mismatch(common, config, self.world, now_layout)
        except Exception as e:  # noqa: BLE001 - an unreadable or refused shard: every rank falls back to disk
            error = f"cannot read rank {self.rank}'s shard of iteration {iteration}: {first_line(e)}"
        if self._refused(iteration, error):
            return None
        blocks = payload["blocks"]
        saved = {k: tuple(v[0]["global_shape"]) for k, v in blocks.items() if v}
        info = LoadInfo(f"local:{self.dir}", common, now_layout, saved)
        try:
            fill_blocks(sharded_load_plans(states, info), blocks)
            error = None
        except CheckpointError as e:  # the disk load that follows overwrites what was filled
            error = str(e)
        if self._refused(iteration, error):
            if newer_than is None:  # partly filled, and no disk checkpoint overwrites it: not a fresh start
                raise CheckpointError(
                    f"local checkpoint of iteration {iteration} cannot be restored and --load has none"
                )
            return None
        for name, state in states.items():
            hook = getattr(state, "load_common_state_dict", None)
            if hook is not None:
                hook(info)
            if name in payload["states"]:
                state.load_state_dict(payload["states"][name])
            elif hasattr(state, "not_restored"):
                state.not_restored(info, "it has none")
        holder, nbytes = plan[self.rank]
        from_peer = nbytes if holder != self.rank else 0
        where = f"{nbytes} bytes from rank {holder} (node {self.nodes[holder]!r})" if from_peer else "read on this node"
        seconds = time.perf_counter() - start
        message = f"restored iteration {iteration} from the local checkpoint: {where} in {seconds:.2f} s"
        logger.info(message, extra={"on_rank": None})  # every rank: where its shard came from
        # The files this rank would have written are removed at the next save (or the end of the run).
        mine = [shard_file_name(r, self.world, iteration) for r in {self.rank, *self.sources}]
        self.written = [n for n in mine if os.path.isfile(os.path.join(self.dir, n))]
        return dict(common, path=f"local:{self.dir}", held=payload["states"], bytes_from_peer=from_peer)

    def _fetch(self, iteration: int, plan: Dict[int, Tuple[int, int]]) -> torch.Tensor:
        """This rank's shard: read on this node, or received from its holder; this rank sends the shards it
        holds for owners on other nodes."""
        ops, mine = [], None
        for owner, (holder, nbytes) in sorted(plan.items()):
            if holder == self.rank and owner != self.rank:
                ops.append(dist.P2POp(dist.isend, self._read(owner, iteration), owner, self.group))
        holder, nbytes = plan[self.rank]
        if holder == self.rank:
            mine = self._read(self.rank, iteration)
        else:
            mine = torch.empty(nbytes, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, mine, holder, self.group))
        if ops:
            _p2p(ops)
        return mine

    def _read(self, owner: int, iteration: int, world: Optional[int] = None) -> torch.Tensor:
        path = os.path.join(self.dir, shard_file_name(owner, world or self.world, iteration))
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)

    def _refused(self, iteration: int, error: Optional[str]) -> bool:
        """Collective: whether any rank found ``error``; if so every rank warns and the disk checkpoint loads."""
        failed = gather_errors(error, self.group)
        if failed:
            rank, why = failed[0]
            logger.warning(f"local checkpoint of iteration {iteration} not used (rank {rank}: {why}): loading disk")
        return bool(failed)


def _mismatch(
    common: dict, config: Optional[dict], world: int, now_layout: dict, reshard: bool = False
) -> Optional[str]:
    """Why a copy is not this run's (None: it is).  ``reshard``: another world size and layout are
    expected (the blocks are resharded); the model, data, seed, optimizer and batch must still match."""
    if common.get("world_size") != world and not reshard:
        return f"saved by world {common.get('world_size')}, now {world}"
    if common.get("layout") != now_layout and not reshard:
        return f"saved with layout {common.get('layout')}, now {now_layout}"
    if config is not None:
        saved, now = _flat(common.get("config") or {}), _flat(config)
        keys = [k for k in set(saved) | set(now) if _identifies_run(k) and not (reshard and k.startswith("parallel."))]
        diff = sorted(k for k in keys if saved.get(k) != now.get(k))
        if diff:
            return f"saved by another run ({', '.join(f'{k}: {saved.get(k)!r}, now {now.get(k)!r}' for k in diff[:3])})"
    return None


# What makes a shard this run's: its model, layout, optimizer, seed, batch and data (paths, intervals,
# logging and --train-iters may change between two attempts of one job).
_RUN_IDENTITY = ("model.", "parallel.", "data.data_path", "data.train_data_path", "data.mock_data", "data.split")
_RUN_IDENTITY_TRAINING = ("seed", "optimizer", "global_batch_size", "micro_batch_size", "rampup_batch_size")


def _identifies_run(key: str) -> bool:
    if key == "parallel.distributed_timeout_minutes":
        return False
    return key.startswith(_RUN_IDENTITY) or key in {f"training.{k}" for k in _RUN_IDENTITY_TRAINING}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _state_dicts(states: Optional[CheckpointStates]) -> dict:
    """The registered states' ``local_state_dict()`` (where they have one) or ``state_dict()`` values, by
    name (a None one is left out, as on disk)."""
    out = {}
    for name, state in states.items() if states is not None else ():
        value = getattr(state, "local_state_dict", state.state_dict)()
        if value is not None:
            out[name] = value
    return out


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _p2p(ops) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
