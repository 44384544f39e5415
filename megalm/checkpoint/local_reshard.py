"""Restoring a local checkpoint (:mod:`megalm.checkpoint.local`) saved under another world size: an
elastic resize (``torchrun --nnodes MIN:MAX``) restarts with fewer or more ranks than the copies were
saved by, and the surviving copies are resharded as a disk checkpoint is.

Every copy is a list of blocks of global tensors (offsets in the full tensor, as the DCP checkpoint
stores them): the model's blocks (the same on every data-parallel rank) and the distributed
optimizer's blocks (a different flat range of every parameter on each data-parallel rank).  The new
ranks' targets are blocks too (each registered state's ``sharded_load_plan``, as a disk load asks
for), so resharding is cutting overlaps:

1. :func:`choose_reshard`: the newest iteration of another world size whose every old rank's copy
   survives on some node, and for each old rank the new rank that reads its copy (the holders spread
   by bytes).  Some old rank's copy lost on every node: refused, with the reason logged, and the disk
   checkpoint loads.
2. Each holder reads the copies assigned to it; one ``all_gather_object`` shares their block index
   (names, offsets, shapes) and the checkpoint's common record.
3. Every new rank builds its targets from that record (:class:`LoadInfo` of the old layout), one
   ``all_gather_object`` shares them.
4. Each holder cuts, for every new rank, the overlaps of its copies' blocks with that rank's targets
   (a block that several old ranks hold, a replicated model tensor, is sent from the lowest old rank
   only) and sends them (one ``all_gather_object`` of the sizes, then gloo point-to-point); the
   receiver fills its targets (:func:`fill_blocks`: every value covered once).
5. The per-rank states (RNG, compression residuals...) are not restored, as a disk load under another
   layout does not (``not_restored``): the common record (iteration, consumed samples, scheduler) is.

Bytes moved: each new rank receives its model blocks and its share of the optimizer state, not whole
copies.
"""

from __future__ import annotations

import io
import json
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.checkpoint.common_json import layout
from megalm.checkpoint.errors import CheckpointError, first_line
from megalm.checkpoint.stateful import LoadInfo, load_rank_states, sharded_load_plans
from megalm.log import get_logger
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec

logger = get_logger(__name__)

Plan = Dict[int, Tuple[int, int]]  # old rank -> (new rank holding its copy, bytes)
Index = Dict[str, List[Tuple[tuple, tuple]]]  # tensor name -> [(offsets, shape)] of its blocks


def choose_reshard(holdings, world: int, newer_than: Optional[int]) -> Tuple[Optional[Tuple[int, int, Plan]], str]:
    """Given every new rank's ``(node, shards on its node)`` (:class:`megalm.checkpoint.local.Held`): the
    newest ``(old world, iteration, plan)`` of a world size other than ``world`` (iteration ``>=
    newer_than``) whose every old rank's copy is on some node, and an empty reason; or None and why not
    (the newest incomplete one's missing ranks), for the log."""
    where: Dict[Tuple[int, int], Dict[int, Dict[int, int]]] = {}  # (world, it) -> owner -> holder -> bytes
    for rank, (_, held) in enumerate(holdings):
        for h in held:
            if h.world != world and h.owner < h.world:
                where.setdefault((h.world, h.iteration), {}).setdefault(h.owner, {})[rank] = h.nbytes
    candidates = sorted(
        (k for k in where if newer_than is None or k[1] >= newer_than), key=lambda k: (k[1], k[0]), reverse=True
    )
    for old_world, it in candidates:
        owners = where[(old_world, it)]
        missing = [o for o in range(old_world) if o not in owners]
        if missing:
            continue
        load: Dict[int, int] = {}
        plan: Plan = {}
        for owner in range(old_world):  # the biggest copies first would balance better; sizes are alike
            holder = min(owners[owner], key=lambda r: (load.get(r, 0), r))
            load[holder] = load.get(holder, 0) + owners[owner][holder]
            plan[owner] = (holder, owners[owner][holder])
        return (old_world, it, plan), ""
    if not candidates:
        return None, ""
    old_world, it = candidates[0]
    missing = [o for o in range(old_world) if o not in where[(old_world, it)]]
    return None, (
        f"the copies of iteration {it} saved by world {old_world} miss rank(s) {missing[:8]}"
        f"{' ...' if len(missing) > 8 else ''}: no surviving node holds them"
    )


def block_index(blocks: Dict[str, list]) -> Index:
    """The names, offsets and shapes of a copy's blocks (no data)."""
    return {k: [(tuple(b["offsets"]), tuple(b["data"].shape)) for b in v] for k, v in blocks.items()}


def target_index(targets) -> Index:
    """The same for this rank's targets (``ShardedStateDict``)."""
    out: Index = {}
    for key, value in targets.items():
        for spec in value if isinstance(value, list) else [value]:
            out.setdefault(key, []).append((tuple(spec.offsets), tuple(spec.local.shape)))
    return out


def sources(indexes: Dict[int, Index]) -> Dict[Tuple[str, tuple, tuple], int]:
    """For every distinct block ``(name, offsets, shape)`` of the old ranks' copies, the lowest old rank
    holding it: only that one is sent (a replicated model tensor is in every data-parallel rank's copy)."""
    out: Dict[Tuple[str, tuple, tuple], int] = {}
    for owner in sorted(indexes):
        for key, blocks in indexes[owner].items():
            for offsets, shape in blocks:
                out.setdefault((key, offsets, shape), owner)
    return out


def overlap(a_off, a_shape, b_off, b_shape) -> Optional[Tuple[tuple, tuple]]:
    """The intersection ``(offsets, shape)`` of two blocks of one tensor, or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= low for h, low in zip(hi, lo)):
        return None
    return tuple(lo), tuple(h - low for h, low in zip(hi, lo))


def cut_pieces(
    copies: Dict[int, Dict[str, list]], chosen: Dict[Tuple[str, tuple, tuple], int], wanted: Index
) -> Dict[str, list]:
    """The blocks of ``copies`` (old rank -> its blocks) that one new rank needs: for each of its targets
    (``wanted``), the overlap with every block these copies are the chosen source of."""
    out: Dict[str, list] = {}
    for owner, blocks in copies.items():
        for key, saved in blocks.items():
            targets = wanted.get(key)
            if not targets:
                continue
            for block in saved:
                offsets, data = tuple(block["offsets"]), block["data"]
                if chosen.get((key, offsets, tuple(data.shape))) != owner:
                    continue
                for t_off, t_shape in targets:
                    common = overlap(offsets, tuple(data.shape), t_off, t_shape)
                    if common is None:
                        continue
                    piece = data
                    for dim, (start, size) in enumerate(zip(common[0], common[1])):
                        piece = piece.narrow(dim, start - offsets[dim], size)
                    entry = {"offsets": list(common[0]), "global_shape": block["global_shape"], "data": piece.clone()}
                    out.setdefault(key, []).append(entry)
    return out


def exchange_pieces(outgoing: Dict[int, Dict[str, list]], rank: int, world: int, group) -> Dict[str, list]:
    """Collective: send every new rank its pieces (``outgoing[rank]``: ``{name: [blocks]}``), receive this
    rank's from every holder; returns them merged (``torch.save`` bytes, read with ``weights_only``)."""
    payloads: Dict[int, torch.Tensor] = {}
    for dest, pieces in outgoing.items():
        if dest != rank and pieces:
            buffer = io.BytesIO()
            torch.save(pieces, buffer)
            payloads[dest] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = [0] * world
    for dest, data in payloads.items():
        sizes[dest] = data.numel()
    table: List[Optional[List[int]]] = [None] * world
    dist.all_gather_object(table, sizes, group=group)
    ops, received = [], {}
    for dest, data in payloads.items():
        ops.append(dist.P2POp(dist.isend, data, dest, group))
    for src in range(world):
        n = table[src][rank]
        if src != rank and n:
            received[src] = torch.empty(n, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, received[src], src, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    merged: Dict[str, list] = {k: list(v) for k, v in outgoing.get(rank, {}).items()}
    for src in sorted(received):
        pieces = torch.load(io.BytesIO(received[src].numpy().tobytes()), weights_only=True)
        for key, blocks in pieces.items():
            merged.setdefault(key, []).extend(blocks)
    return merged


def shared_record(gathered) -> Tuple[Optional[dict], Dict[int, Index], Dict[str, tuple], Optional[str]]:
    """From every new rank's ``(error, common_json or None, {old rank: (index, global shapes)})``: the
    checkpoint's common record (old rank 0's: the holder of its copy sends it), every old rank's block
    index, the saved tensors' global shapes, and the first error (``"rank R: why"``) or None."""
    common, indexes, shapes = None, {}, {}
    for rank, (error, common_json, copies) in enumerate(gathered):
        if error is not None:
            return None, {}, {}, f"rank {rank}: {error}"
        if common is None and common_json is not None:
            common = json.loads(common_json)
        for owner, (index, owner_shapes) in copies.items():
            indexes[owner] = index
            shapes.update(owner_shapes)
    return common, indexes, shapes, None


def restore_resharded(
    ckpt, old_world: int, iteration: int, plan, check, newer_than, states, groups, start: float
) -> Optional[dict]:
    """Collective.  Restore the copies of ``iteration`` saved by ``old_world`` ranks (``plan``:
    :func:`choose_reshard`'s) into this world's layout for ``ckpt`` (a
    :class:`megalm.checkpoint.local.LocalCheckpoint`); ``check(common)``: why the copies are not this
    run's, or None.  None when refused (every rank logs why); see the module docstring."""
    copies, record, error = {}, (None, {}), None
    try:
        for owner, (holder, _) in sorted(plan.items()):
            if holder == ckpt.rank:
                data = ckpt._read(owner, iteration, old_world)
                payload = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
                copies[owner] = payload["blocks"]
                shapes = {k: tuple(v[0]["global_shape"]) for k, v in payload["blocks"].items() if v}
                common_json = payload["common_json"] if owner == 0 else record[0]  # old rank 0's, as on disk
                record = (common_json, {**record[1], owner: (block_index(payload["blocks"]), shapes)})
    except Exception as e:  # noqa: BLE001 - an unreadable copy: every rank falls back to disk
        error = f"cannot read rank {owner}'s copy of iteration {iteration} (world {old_world}): {first_line(e)}"
    gathered = [None] * ckpt.world
    dist.all_gather_object(gathered, (error, *record), group=ckpt.group)
    common, indexes, saved, error = shared_record(gathered)  # the same on every rank
    if error is None:
        error = check(common)
    if error is not None:
        ckpt._refused(iteration, error)
        return None
    info = LoadInfo(f"local:{ckpt.dir}", common, layout(groups), saved, held={})
    targets, error = {}, None
    try:
        targets = sharded_load_plans(states, info)
    except CheckpointError as e:
        error = str(e)
    wanted = [None] * ckpt.world
    dist.all_gather_object(wanted, target_index(targets) if error is None else None, group=ckpt.group)
    if ckpt._refused(iteration, error):
        return None
    chosen = sources(indexes)
    outgoing = {dest: cut_pieces(copies, chosen, wanted[dest]) for dest in range(ckpt.world)}
    received = exchange_pieces(outgoing, ckpt.rank, ckpt.world, ckpt.group)
    try:
        fill_blocks(targets, received)
    except CheckpointError as e:  # the disk load that follows overwrites what was filled
        error = str(e)
    if ckpt._refused(iteration, error):
        if newer_than is None:  # partly filled, and no disk checkpoint overwrites it: not a fresh start
            raise CheckpointError(f"local checkpoint of iteration {iteration} cannot be restored and --load has none")
        return None
    load_rank_states(info, states)  # common.json's entries; the per-rank ones not (another layout), as on disk
    from_peers = sum(b["data"].numel() * b["data"].element_size() for k in received for b in received[k])
    from_peers -= sum(b["data"].numel() * b["data"].element_size() for v in outgoing[ckpt.rank].values() for b in v)
    holders = sorted({holder for holder, _ in plan.values()})
    seconds = time.perf_counter() - start
    message = (
        f"restored iteration {iteration} from the local checkpoint saved by world {old_world}, resharded to "
        f"world {ckpt.world}: {from_peers} bytes of tensor blocks from other ranks (copies read by ranks "
        f"{holders}) in {seconds:.2f} s"
    )
    logger.info(message, extra={"on_rank": None})
    return dict(common, path=f"local:{ckpt.dir}", held={}, bytes_from_peer=from_peers)


def fill_blocks(targets: ShardedStateDict, saved: Dict[str, list]) -> None:
    """Copy into every target block the overlapping parts of the saved blocks of the same tensor
    (``saved[key]``: ``{"offsets", "data"}`` dicts).  A target not covered completely raises
    :class:`CheckpointError` (the shard was saved under another layout)."""
    for key, value in targets.items():
        for spec in value if isinstance(value, list) else [value]:
            covered = 0
            for block in saved.get(key, ()):
                if tuple(block["global_shape"]) != tuple(spec.global_shape):
                    raise CheckpointError(
                        f"local checkpoint's {key} has shape {tuple(block['global_shape'])}, the model's "
                        f"{tuple(spec.global_shape)}"
                    )
                covered += _copy_overlap(spec, block["offsets"], block["data"])
            if covered != spec.local.numel():
                raise CheckpointError(f"local checkpoint holds {covered} of the {spec.local.numel()} values of {key}")


def _copy_overlap(spec: ShardedTensorSpec, offsets, data: torch.Tensor) -> int:
    dst, src = spec.local, data
    for dim, (t_off, s_off) in enumerate(zip(spec.offsets, offsets)):
        lo = max(t_off, s_off)
        hi = min(t_off + spec.local.shape[dim], s_off + data.shape[dim])
        if hi <= lo:
            return 0
        dst, src = dst.narrow(dim, lo - t_off, hi - lo), src.narrow(dim, lo - s_off, hi - lo)
    spec.fill(dst, src)  # in memory, or into the block's source (an NVMe swap file)
    return dst.numel()
