"""Collective failures that name their group.

gloo reports a collective that waited past ``--distributed-timeout-minutes`` as ``Timed out
waiting 4000ms for recv operation to complete``, and a peer that died or dropped its link as
``Connection closed by peer [10.0.0.2]:43210`` (NCCL: ``Watchdog caught collective operation
timeout``): neither says which group, nor which rank is missing.  :func:`named_collective_failures`
turns such an error into a :class:`CollectiveFailure` whose message says, e.g.::

    collective timed out after 240 s (--distributed-timeout-minutes 4) in the data-parallel group,
    ranks [0, 2] (all_reduce, from megalm/distributed/param_and_grad_buffer.py:159 in
    finish_grad_sync); rank(s) [2] did not reach a collective of this group within 2 s after
    that; gloo: Timed out waiting 240000ms for recv operation to complete

Nothing is added to the step: the error is caught once, around the whole run
(:func:`megalm.training.training.pretrain`), and the group found afterwards in the frames of the
error's traceback, innermost first: a ``group`` (``pg``, ``process_group``) argument or any
process group held in a local (``torch.distributed``'s own frames; ``group=None`` there is the
world), a ``torch.distributed.P2POp`` (its group and peer), or, in megalm's communicating
modules (distributed, pipeline_parallel, optimizer, tensor_parallel, transformer), a group held by
the object whose work handle was waited on (``self`` and its attributes, e.g. a gradient bucket's
buffer).  An error whose frames hold no group passes unchanged.  The
group is named from the rank's :class:`megalm.parallel_state.ProcessGroups` (fields holding the
same group object; a group spanning the world is the world group itself, named first, with the
fields it serves after it).

Which ranks did not arrive: every rank whose collective failed writes
``megalm/collective-failed/<group ranks>/<rank>`` into the default group's store (torchrun's
rendezvous store, or rank 0's), waits ``min(5 s, timeout / 4)``, and reads which members of the
group wrote theirs.  A member that did not is named: it is stuck elsewhere (another group's
collective, a long computation), dead, or cut off.  Members that wrote their key failed in this
group too: with every member there, the ranks waited in different collectives of the group (or
a link between them failed).  A store that does not answer in that time (a cut network link)
leaves the missing ranks unknown, and the message says so.  Communication: only these store
operations, on the failing ranks, after the failure.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import Callable, Iterator, List, Optional, Tuple

import torch.distributed as dist

from megalm.errors import MegalmError

# What gloo and NCCL say when a collective fails for time or a lost peer.
TIMEOUT_MARKERS = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

GROUP_LABELS = {
    "tp": "tensor-parallel",
    "cp": "context-parallel",
    "dp": "data-parallel",
    "dp_cp": "data+context-parallel",
    "pp": "pipeline-parallel",
    "mp": "model-parallel (tensor x pipeline)",
    "tp_cp": "tensor+context-parallel",
    "tp_dp_cp": "pipeline-stage (tensor x data x context)",
    "ep": "expert-parallel",
    "etp": "expert-tensor-parallel",
    "expt_dp": "expert-data-parallel",
    "tp_ep": "expert tensor x expert-parallel",
    "tp_ep_pp": "expert-model-parallel",
    "embd": "embedding (first and last stage)",
    "pos_embd": "position-embedding",
    "dp_cp_intra": "intra-node data-parallel",
    "dp_cp_inter": "inter-node data-parallel",
    "expt_dp_intra": "intra-node expert-data-parallel",
    "expt_dp_inter": "inter-node expert-data-parallel",
    "dp_cp_instance": "distributed-optimizer instance (data-parallel shard group)",
    "dp_cp_across_instances": "across distributed-optimizer instances",
}
_GROUP_ARGS = ("group", "pg", "process_group")
_STORE_PREFIX = "megalm/collective-failed"
_WRAPPERS = tuple(  # megalm frames that are not the call site
    os.path.join("megalm", *p)
    for p in (("distributed", "comm.py"), ("tensor_parallel", "utils.py"), ("distributed", "collective_errors.py"))
)


# megalm's modules whose objects hold the groups they communicate over (a bucket, a chain, a communicator)
_COMMUNICATING = tuple(
    os.path.join(os.sep + "megalm", d) + os.sep
    for d in ("distributed", "pipeline_parallel", "optimizer", "tensor_parallel", "transformer")
)


class CollectiveFailure(MegalmError, RuntimeError):
    """A collective timed out or lost a peer; the message names the group and, where known,
    the ranks that did not arrive."""


def failure_kind(exc: BaseException) -> Optional[str]:
    """``"timed out"``, ``"lost a peer"`` or None (not a collective failure)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, MegalmError):
        return None
    text = str(exc)
    if any(m in text for m in TIMEOUT_MARKERS):
        return "timed out"
    if any(m in text for m in PEER_MARKERS):
        return "lost a peer"
    return None


def _is_group(value) -> bool:
    return isinstance(value, dist.ProcessGroup)


def _group_in(frame_locals: dict, in_torch: bool, search_self: bool):
    """The process group a frame's locals point at (see the module docstring), else None;
    ``(group, peer)`` where a P2POp gives the peer.  ``search_self``: also the groups held by
    ``self`` and its attributes (frames of megalm's communicating modules only)."""
    for name in _GROUP_ARGS:
        if name in frame_locals:
            value = frame_locals[name]
            if _is_group(value):
                return value, None
            if value is None and in_torch:
                return dist.group.WORLD, None
    for value in frame_locals.values():
        if _is_group(value):
            return value, None
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], dist.P2POp):
            return value[0].group or dist.group.WORLD, value[0].peer
    holder = frame_locals.get("self") if search_self else None
    if holder is not None and hasattr(holder, "__dict__"):
        from megalm.parallel_state import ProcessGroups

        for attr in vars(holder).values():  # the waited-on object, then what it holds
            if _is_group(attr):
                return attr, None
        for attr in vars(holder).values():
            if hasattr(attr, "__dict__") and not isinstance(attr, ProcessGroups):
                for inner in vars(attr).values():
                    if _is_group(inner):
                        return inner, None
    return None


def failed_group(tb) -> Tuple[Optional[object], Optional[int], str]:
    """``(group, peer, where)`` from a traceback: the innermost group found (None if none), the
    P2P peer when known, and ``"<op>, from <file>:<line> in <function>"`` (innermost torch
    function, innermost megalm frame)."""
    frames = [(f, lineno) for f, lineno in traceback.walk_tb(tb)]
    op, origin = None, None
    found = None
    for frame, lineno in reversed(frames):
        path = frame.f_code.co_filename
        in_torch = f"{os.sep}torch{os.sep}" in path
        if in_torch and op is None and not frame.f_code.co_name.startswith("_") and frame.f_code.co_name != "wrapper":
            op = frame.f_code.co_name
        if origin is None and f"{os.sep}megalm{os.sep}" in path and not path.endswith(_WRAPPERS):
            rel = path[path.rindex(f"{os.sep}megalm{os.sep}") + 1 :]
            origin = f"{rel}:{lineno} in {frame.f_code.co_name}"
        if found is None:
            found = _group_in(frame.f_locals, in_torch, any(d in path for d in _COMMUNICATING))
    group, peer = found if found is not None else (None, None)
    where = ", ".join(p for p in ((op or ""), f"from {origin}" if origin else "") if p)
    return group, peer, where


def describe_group(group, groups) -> Tuple[str, List[int]]:
    """``("the data-parallel group", [0, 2])``: names of the ``ProcessGroups`` fields holding
    ``group`` (the world when none), and its global ranks."""
    ranks = list(dist.get_process_group_ranks(group))
    names = ["world"] if group is dist.group.WORLD else []
    if groups is not None:
        names += [GROUP_LABELS.get(n, n) for n in groups.group_names() if getattr(groups, n) is group]
    if not names:
        return "a process group", ranks
    also = f" (also the {', '.join(names[1:4])} group)" if len(names) > 1 else ""
    return f"the {names[0]} group{also}", ranks


def missing_ranks(members: List[int], grace_s: float) -> Optional[List[int]]:
    """Members that did not mark a failure in this group within ``grace_s`` (see the module
    docstring); None when the store does not answer in time (or there is none)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or torch without it
        return None
    tag = "-".join(map(str, members))
    answer: dict = {}

    def ask() -> None:
        try:
            store.set(f"{_STORE_PREFIX}/{tag}/{dist.get_rank()}", "1")
            threading.Event().wait(grace_s)
            answer["missing"] = [r for r in members if not store.check([f"{_STORE_PREFIX}/{tag}/{r}"])]
        except Exception:  # noqa: BLE001 - an unreachable store: unknown
            pass

    worker = threading.Thread(target=ask, name="collective-failure-check", daemon=True)
    worker.start()
    worker.join(grace_s + 2.0)
    return answer.get("missing")


def describe_failure(exc: BaseException, groups, timeout_s: float, check_store: bool = True) -> Optional[str]:
    """The message for a collective failure ``exc``: None when it is not one (its text is not a
    timeout or lost peer, or no process group is found in its frames)."""
    kind = failure_kind(exc)
    if kind is None:
        return None
    group, peer, where = failed_group(exc.__traceback__)
    minutes = f"{timeout_s / 60:g}"
    head = f"collective {kind}" + (
        f" after {timeout_s:g} s (--distributed-timeout-minutes {minutes})" if kind == "timed out" else ""
    )
    if group is None:  # no process group in its frames: not a collective's error (e.g. a DataLoader timeout)
        return None
    name, ranks = describe_group(group, groups)
    text = f"{head} in {name}, ranks {ranks}" + (f" ({where})" if where else "")
    if peer is not None:
        text += f", exchanging with rank {peer}"
    if check_store and dist.is_initialized():
        grace = min(5.0, timeout_s / 4)
        missing = missing_ranks(ranks, grace)
        if missing is None:
            text += "; which ranks did not arrive is unknown (the store did not answer)"
        elif missing:
            text += f"; rank(s) {missing} did not reach a collective of this group within {grace:g} s after that"
        else:
            text += "; every rank of the group failed in it too (different collectives, or a link down)"
    return f"{text}; gloo: {exc}"


@contextlib.contextmanager
def named_collective_failures(groups: Callable[[], object], timeout_s: float) -> Iterator[None]:
    """Re-raise a collective's timeout or lost peer inside the block as :class:`CollectiveFailure`
    naming its group; ``groups()`` gives the rank's :class:`megalm.parallel_state.ProcessGroups`
    at that point (None before they exist)."""
    try:
        yield
    except RuntimeError as e:
        message = describe_failure(e, groups(), timeout_s)
        if message is None:
            raise
        raise CollectiveFailure(message) from e
