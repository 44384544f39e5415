"""Data parallelism across *replica groups* through torchft (``--ft-replica-group-id``): a group
that dies drops out of the quorum and the others keep training without a restart; a group that
returns receives the weights and optimizer state of a healthy peer over the network.

*Layout.*  Each replica group is its own job (its own ``torchrun``, its own world) running
megalm's layout inside: TP/PP/CP and data parallelism over its ``d`` data-parallel ranks, the
distributed optimizer included.  Across groups, rank ``i`` of every group belongs to one torchft
process group (gloo on CPU, NCCL on GPU: :func:`megalm.device.fault_tolerant_process_group`),
reconfigured by torchft's :class:`torchft.Manager` at every quorum change; the groups meet through
a ``torchft_lighthouse``.

*One step* (:meth:`ReplicaGroups.step`):

1. the parameter all-gathers in flight are finished, then ``start_quorum`` (synchronous): the
   lighthouse answers which groups take part (``n`` of them, this one ``r``-th); a group behind
   the others (a returning one) receives a healthy peer's state here, before its forward pass;
2. the global batch of ``G`` samples (``M = G / micro_batch_size`` micro-batch slots) is split
   evenly over the ``n x d`` data-parallel ranks of the quorum: rank ``i`` of group ``r`` reads the
   contiguous slots ``[(r d + i) s, (r d + i + 1) s)``, ``s = M / (n d)`` (a
   :class:`megalm.data.samplers.ShareSampler`).  Survivors of a smaller quorum run more
   micro-batches, so the global batch (and the loss curve) stays that of the full run; global batch
   ``k`` is always samples ``[k G, (k+1) G)``;
3. forward-backward over the ``s`` micro-batches, the group's own gradient reduction, then
   all-reduces (average over the ``n`` groups) of the gradients this rank's optimizer reads (each
   gradient buffer; with the distributed optimizer or ZeRO-2 this rank's shard of each bucket: rank
   ``i`` of every group holds the same ones) and of the reported values' sums and counts (with
   ``--calculate-per-token-loss`` the token counts first: see :func:`megalm.training.step.train_step`);
4. ``should_commit``: every group's vote.  On yes the optimizer steps and the iteration and
   ``consumed_samples`` advance; on no (a peer died during the step, a collective failed) nothing
   changed and the same global batch is redone with the new quorum: no sample is skipped or
   repeated.

*Local SGD / DiLoCo* (``--local-sgd-interval``): the replicas are the groups.  Between syncs step
3 all-reduces only the reported values (no gradients cross groups); every ``H`` steps
:class:`megalm.distributed.local_sgd.OuterSync` averages the weights over :class:`OuterReplicas`
(this rank and rank ``i`` of the quorum's other groups), then the groups vote on the sync; on no the
survivors form a new quorum (``shrink_only``) and average again.  A recovering group also receives
the outer state (``x_0`` and the outer momentum).

*Recovery.*  The state a peer sends (:meth:`ReplicaGroups.state_dict`) is this rank's model
tensors, optimizer tensors (moments, step, fp32 main weights), the loss scaler, the learning-rate
schedule and the counters (iteration, consumed samples), with a sha256 digest of the tensors; the
receiver copies them in place, recomputes the digest from its own tensors and stops if it differs.
torchft's HTTP transport carries it (pickled, from a peer of the same job: the trust of the job's
own collectives; checkpoint *files* never execute code).  RNG states are not sent: dropout masks
of the returning group start from its own seed.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from megalm.checkpoint.model_state import finish_param_sync, optimizer_sharded_state
from megalm.config.fault_tolerance import ft_enabled
from megalm.distributed.local_sgd import FaultTolerantOuter
from megalm.errors import MegalmError
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups, group_rank, group_size

logger = get_logger(__name__)

MAX_DISCARDED_IN_A_ROW = 20  # a step redone this many times in a row stops the run


class TorchftUnavailable(MegalmError):
    """The torchft flags were given but torchft is not installed."""


class ReplicaGroupError(MegalmError):
    """A torchft replica group cannot go on: a quorum larger than declared, a state received from a
    peer that does not match this group's layout or digest, or steps that never commit."""


class StepNotCommitted(Exception):
    """Control flow inside :meth:`ReplicaGroups.step`: the replica groups voted not to commit the
    step (never leaves it)."""


def require_torchft():
    """The torchft package, or :class:`TorchftUnavailable` naming the extra to install."""
    # torchft's Rust side logs every quorum and vote at INFO, several lines per step and rank:
    # warnings only, unless RUST_LOG says otherwise (read when torchft is first imported).
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as e:
        raise TorchftUnavailable(
            f"--ft-replica-group-id needs torchft, which is not installed ({e}): pip install 'megalm[ft]' "
            "(torchft==0.2.0), which also brings the torchft_lighthouse coordinator"
        ) from None
    return torchft


def tensor_digest(tensors: Dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors`` in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class ReplicaGroups:
    """This rank's torchft manager and what it needs to split batches and hand state over.

    Built early in the set-up (the group then heartbeats to the lighthouse, so that a group starting
    its first step waits for the others still setting up instead of training alone);
    :meth:`attach` gives it the trainer's model, optimizer, scheduler and counters ``state`` (what a
    peer receives; the counters it advances) before the first step."""

    def __init__(self, cfg, groups: ProcessGroups, state):
        require_torchft()
        from torchft import Manager

        from megalm.device import fault_tolerant_process_group, get_device
        from megalm.resilience.torchft_compression import build_cross_group_compressor

        p, t = cfg.parallel, cfg.training
        self.group_id, self.max_groups = p.ft_replica_group_id, p.ft_num_replica_groups
        self.state = state
        self.model = self.optimizer = self.scheduler = self.outer_sync = None  # attach()
        self.outer = OuterReplicas(self)  # --local-sgd-interval: the outer group of the local-SGD sync
        self.dp_rank, self.dp_size = group_rank(groups.dp), group_size(groups.dp)
        self.micro_batch_size = t.micro_batch_size
        self.slots = t.global_batch_size // t.micro_batch_size  # micro-batches of this step's global batch
        self.microbatches = None  # attach(): the run's MicrobatchCalculator (--rampup-batch-size)
        self.quorum = None  # (this group's rank, groups taking part) of the last step
        self.reset_data = True  # the data iterator must restart at the consumed samples
        self.recoveries = 0
        # --grad-compression int8: the groups' gradient average in 8 bits, after the warm-up
        self.compressor = build_cross_group_compressor(cfg, dist.get_rank(), get_device())
        self.compression_warmup = p.grad_compression_warmup_iters
        timeout = timedelta(seconds=p.ft_timeout_seconds)
        lighthouse = p.ft_lighthouse or os.environ["TORCHFT_LIGHTHOUSE"]
        # The address the other groups reach this rank at (its manager server, its recovery
        # transfers): the one of the interface that routes to the lighthouse.  torchft's default,
        # the host name, may resolve to an address the peers cannot reach (a node's network
        # namespace, a host whose name resolves to 127.0.1.1).
        self.address = route_address(lighthouse)
        self.manager = Manager(
            pg=fault_tolerant_process_group(timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=p.ft_min_replicas,
            use_async_quorum=False,  # the quorum (and a recovery) completes before the forward pass
            timeout=timeout,
            quorum_timeout=2 * timeout,
            connect_timeout=timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse,
            replica_id=f"megalm_{self.group_id}",
            hostname=self.address,
            checkpoint_transport=addressed_http_transport(self.address, timeout),
            init_sync=False,  # every group initializes from the same --seed
        )
        self.manager.register_state_dict_fn("megalm", self.load_state_dict, self.state_dict)
        logger.info(
            f"torchft: replica group {self.group_id} of up to {self.max_groups} joined the lighthouse {lighthouse} as "
            f"{self.address} (at least {p.ft_min_replicas} group(s) commit a step)"
        )

    # -- set-up --
    def attach(self, model, optimizer, scheduler, microbatches=None, outer_sync=None) -> None:
        """The trainer's state a peer receives, and its
        :class:`megalm.training.microbatches.MicrobatchCalculator` (each step's global batch, which
        ``--rampup-batch-size`` grows; None: always ``--global-batch-size``); ``outer_sync``: the
        :class:`megalm.distributed.local_sgd.OuterSync` of ``--local-sgd-interval`` (its outer state,
        the global weights at the last sync and the outer momentum, is sent too), or None."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.microbatches, self.outer_sync = microbatches, outer_sync

    def resume_at(self, iteration: int) -> None:
        """A run resumed from a checkpoint at ``iteration``: torchft's step follows it (a group
        behind the others is then recovered from a peer at its first step)."""
        self.manager.load_state_dict({"step": iteration, "batches_committed": 0})

    @property
    def participants(self) -> int:
        return self.quorum[1] if self.quorum else self.max_groups

    @property
    def local_microbatches(self) -> int:
        """This rank's micro-batches of the current step."""
        return self.slots // (self.participants * self.dp_size)

    # -- the step --
    def step(self, run_step: Callable, data_iterator, loader):
        """``run_step(data_iterator)`` (the training step, which calls :meth:`reduce_gradients`,
        :meth:`average` and :meth:`commit`) until the replica groups commit it; returns
        ``(its result, the data iterator to go on with)``.  ``loader``: this rank's training
        DataLoader (None on ranks that read no data)."""
        for _ in range(MAX_DISCARDED_IN_A_ROW):
            data_iterator = self._begin(data_iterator, loader)
            try:
                return run_step(data_iterator), data_iterator
            except StepNotCommitted as e:
                logger.warning(f"torchft: iteration {self.state.iteration + 1} not committed ({e}): redoing it")
                self.reset_data = True
        raise ReplicaGroupError(
            f"torchft: iteration {self.state.iteration + 1} was not committed {MAX_DISCARDED_IN_A_ROW} times in a row "
            "(peers keep failing, or fewer than --ft-min-replicas groups are left)"
        )

    def _begin(self, data_iterator, loader):
        """Quorum (and recovery) for the next step; the data iterator restarted at the consumed
        samples with this group's slots when the quorum or the position changed."""
        finish_param_sync(self.model)  # the weights a recovering peer may read are complete
        if self.quorum is None:
            logger.info(f"torchft: replica group {self.group_id} asks for its first quorum")
        start, recoveries = time.perf_counter(), self.recoveries
        self.manager.start_quorum()
        if self.recoveries != recoveries:  # this group was behind: it received a peer's state
            logger.info(
                f"torchft: replica group {self.group_id} rejoined at iteration {self.state.iteration + 1}: quorum and "
                f"recovery in {time.perf_counter() - start:.2f} s"
            )
        n, r = self.manager.num_participants(), self.manager.participating_rank()
        slots = self.slots
        if self.microbatches is not None:  # this step's global batch (after a recovery: the peer's position)
            self.microbatches.update(self.state.consumed_train_samples)
            self.slots = self.microbatches.current_global_batch_size // self.micro_batch_size
        if r is None or n < 1:
            raise ReplicaGroupError(f"torchft: replica group {self.group_id} is not part of the quorum ({n} groups)")
        if n > self.max_groups:
            raise ReplicaGroupError(
                f"torchft: {n} replica groups joined the quorum but --ft-num-replica-groups is {self.max_groups} "
                "(every group must give the same --ft-num-replica-groups, and each its own --ft-replica-group-id)"
            )
        if (r, n) != self.quorum:
            logger.info(
                f"torchft: quorum of {n} replica group(s) at iteration {self.state.iteration + 1}, this group is "
                f"replica {r}: {self.slots // (n * self.dp_size)} micro-batch(es) per data-parallel rank"
            )
        if self.slots % (n * self.dp_size):
            raise ReplicaGroupError(
                f"torchft: the global batch of {self.slots} micro-batches at iteration {self.state.iteration + 1} "
                f"cannot be split over {n} replica group(s) of {self.dp_size} data-parallel rank(s)"
            )
        if (r, n) != self.quorum or self.reset_data or self.slots != slots:
            self.quorum = (r, n)
            if loader is not None:
                sampler = loader.batch_sampler
                sampler.shares = [self.slots // (n * self.dp_size)] * (n * self.dp_size)
                sampler.rank = r * self.dp_size + self.dp_rank
                sampler.consumed_samples = self.state.consumed_train_samples
                data_iterator = iter(loader)
            self.reset_data = False
        return data_iterator

    def reduce_gradients(self, model) -> None:
        """Average this rank's reduced gradients (the whole buffers, or the distributed optimizer's
        shard) with rank ``i`` of every other group in the quorum; with ``--grad-compression int8``
        after its warm-up, in 8 bits (:mod:`megalm.resilience.torchft_compression`)."""
        tensors = _gradient_tensors(model)
        if self.compressor is not None and self.state.iteration + 1 > self.compression_warmup:
            n = self.manager.num_participants()
            self.compressor.average(lambda t, op: self.manager.allreduce(t, reduce_op=op), n, tensors)
            return
        works = [self.manager.allreduce(t) for t in tensors]
        for work in works:
            work.wait()

    def average(self, values):
        """A tensor, or a dict of tensors, averaged over the quorum's groups (float64, one
        all-reduce): the reported values' ``[sum, count]`` pairs, the per-token loss's token count."""
        if isinstance(values, torch.Tensor):
            return self.average({"": values})[""]
        if not values:
            return values
        keys = sorted(values)
        stacked = torch.stack([values[k].to(torch.float64) for k in keys])
        self.manager.allreduce(stacked).wait()
        return {k: stacked[i] for i, k in enumerate(keys)}

    def commit(self) -> None:
        """The vote: returns when every group may step; :class:`StepNotCommitted` otherwise."""
        if not self.manager.should_commit():
            error = self.manager.errored()
            raise StepNotCommitted(str(error).splitlines()[0] if error else "fewer groups than --ft-min-replicas")
        if self.compressor is not None:
            self.compressor.commit()  # the residual of this step's int8 average

    def metrics(self) -> dict:
        """Per log line: the groups of the last step and this group's place."""
        r, n = self.quorum or (None, None)
        return {"ft_replica_groups": n, "ft_replica_rank": r, "ft_recoveries": self.recoveries}

    # -- recovery --
    def _tensors(self) -> Dict[str, torch.Tensor]:
        """This rank's model tensors (parameters and persistent buffers of each chunk) and optimizer
        tensors (live; the same names on rank ``i`` of every group, which share the layout)."""
        out = {}
        for i, chunk in enumerate(self.model):
            for name, t in chunk.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor):
                    out[f"model.{i}.{name}"] = t.detach()
        # The optimizer's blocks as a checkpoint has them (live tensors: the distributed optimizer's
        # ranges too, the NVMe offload's swapped state read into memory), tied embedding copies included.
        self.optimizer.materialize_offload()
        for key, spec in optimizer_sharded_state(self.optimizer, self.model, tied_copies=True).items():
            for j, block in enumerate(spec if isinstance(spec, list) else [spec]):
                out[f"{key}.{j}"] = block.local
        if self.outer_sync is not None:  # local SGD / DiLoCo: x_0 (the global weights) and the outer momentum
            for kind, tensors in (("anchor", self.outer_sync.anchor), ("momentum", self.outer_sync.momentum)):
                out.update({f"local_sgd.{kind}.{name}": t for name, t in tensors.items()})
        return out

    def state_dict(self) -> dict:
        """What a recovering peer receives (called by torchft's quorum thread while this rank's
        training thread waits for the quorum, so nothing changes under it)."""
        tensors = self._tensors()
        digest = tensor_digest(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        logger.info(
            f"torchft: sending the state of iteration {self.state.iteration} to a recovering replica group "
            f"({size} bytes, sha256 {digest})"
        )
        s = self.state
        return {
            "tensors": tensors,
            "digest": digest,
            "optimizer": self.optimizer.common_state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "counters": {
                "iteration": s.iteration,
                "consumed_train_samples": s.consumed_train_samples,
                "consumed_valid_samples": s.consumed_valid_samples,
                "skipped_iterations": s.skipped_iterations,
                "nan_iterations": s.nan_iterations,
            },
        }

    def load_state_dict(self, received: dict) -> None:
        """Copy a peer's :meth:`state_dict` into this rank's tensors and counters (torchft calls it
        in the training thread, inside ``start_quorum``); the digest of the result must be the peer's."""
        start = time.perf_counter()
        mine, theirs = self._tensors(), received["tensors"]
        if set(mine) != set(theirs):
            missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            raise ReplicaGroupError(
                f"torchft: the state received from a peer does not match this group's model (missing {missing[:3]}, "
                f"unexpected {extra[:3]}): every replica group must use the same model and TP/PP/DP layout"
            )
        with torch.no_grad():
            for name, t in mine.items():
                src = theirs[name]
                if src.shape != t.shape or src.dtype != t.dtype:
                    raise ReplicaGroupError(
                        f"torchft: {name} received from a peer is {src.dtype} {tuple(src.shape)}, this group's is "
                        f"{t.dtype} {tuple(t.shape)}: every replica group must use the same layout and precision"
                    )
                t.copy_(src)
        self.optimizer.load_sharded_state_dict(received["optimizer"], main_params_loaded=True)
        self.scheduler.load_state_dict(received["scheduler"])
        for key, value in received["counters"].items():
            setattr(self.state, key, value)
        digest = tensor_digest(self._tensors())
        if digest != received["digest"]:
            raise ReplicaGroupError(
                f"torchft: the state received from a peer has sha256 {digest} once loaded, the peer sent "
                f"{received['digest']}"
            )
        self.recoveries += 1
        self.reset_data = True
        if self.compressor is not None:  # the peer's residual is what the peer still owes: start from zero
            self.compressor.reset()
        size = sum(t.numel() * t.element_size() for t in mine.values())
        logger.info(
            f"torchft: replica group {self.group_id} recovered the state of iteration {self.state.iteration} from a "
            f"healthy peer ({size} bytes, sha256 {digest}, applied in {time.perf_counter() - start:.2f} s)"
        )

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class OuterReplicas(FaultTolerantOuter):
    """The outer group of ``--local-sgd-interval`` across replica groups: this rank and rank ``i`` of
    every other group of the current quorum, through torchft's manager."""

    def __init__(self, replicas: ReplicaGroups):
        self.replicas = replicas

    def size(self) -> int:
        return self.replicas.manager.num_participants()

    def all_reduce_sum(self, tensor: torch.Tensor):
        return self.replicas.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)

    def commit(self) -> bool:
        """The groups' vote on the outer sync; on no, a new quorum of the groups still there (none
        joins, none recovers: ``shrink_only``) for the sync's next attempt."""
        manager = self.replicas.manager
        if manager.should_commit():
            return True
        error = manager.errored()
        reason = str(error).splitlines()[0] if error else "fewer groups than --ft-min-replicas"
        logger.warning(
            f"torchft: the local-SGD outer sync was not committed ({reason}): redoing it with the groups left"
        )
        manager.start_quorum(allow_heal=False, shrink_only=True)
        return False

    def synced(self, iteration, weights) -> None:
        """Log the committed sync with a fingerprint of the new weights (float64 sum and sum of squares:
        groups holding the same weights log the same numbers)."""
        total = sum(w.detach().double().sum() for w in weights)
        squares = sum(w.detach().double().square().sum() for w in weights)
        logger.info(
            f"torchft: local-SGD outer sync of iteration {iteration} over {self.size()} replica group(s): weights "
            f"sum {float(total)!r}, sum of squares {float(squares)!r}"
        )


def route_address(url: str) -> str:
    """This host's address on the interface that routes to ``url``'s host (no packet is sent: a
    UDP socket's ``connect`` only picks the route)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "//" in url else f"http://{url}")
    host = parts.hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, parts.port or 29510))
            return s.getsockname()[0]
    except OSError as e:
        raise ReplicaGroupError(f"torchft: no route to the lighthouse {url} ({e})") from None


def addressed_http_transport(address: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport, advertising ``address`` instead of the host name."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            host = f"[{address}]" if ":" in address else address
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def _gradient_tensors(model):
    """The tensors holding the reduced gradients this rank's optimizer reads: the whole buffer
    without the distributed optimizer; with it, each bucket's shard of this rank (the rest of the
    buffer was reduce-scattered to the other ranks of the group: the cross-group all-reduce carries
    ``1/d`` of the gradients); under ZeRO-2 the sharded buffer; without data-parallel wrapping the
    parameters' ``.grad``."""
    out = []
    for chunk in model:
        buffers = getattr(chunk, "all_buffers", None)
        if buffers is None:
            out.extend(p.grad for p in chunk.parameters() if p.grad is not None)
            continue
        for buf in buffers:
            grads = buf.reduced_grad_data
            if getattr(buf, "use_distributed_optimizer", False) and grads is getattr(buf, "grad_data", None):
                for bucket in buf.buckets:  # the whole buffer: only this rank's shard of each bucket
                    start, end = bucket.shard_range(buf.data_parallel_rank)
                    out.append(grads[start:end])
            else:
                out.append(grads)
    return out


def full_quorum_shares(cfg, dp_size: int) -> Optional[Sequence[int]]:
    """Micro-batch shares of every data-parallel rank of a full quorum (the training data loader is
    built with them; each step sets those of its quorum), or None without torchft."""
    p, t = cfg.parallel, cfg.training
    if not ft_enabled(p):
        return None
    n = p.ft_num_replica_groups * dp_size
    return [t.global_batch_size // t.micro_batch_size // n] * n


def build_replica_groups(cfg, groups, state) -> Optional[ReplicaGroups]:
    """``--ft-replica-group-id``'s :class:`ReplicaGroups` (joined to the lighthouse), else None."""
    if not ft_enabled(cfg.parallel):
        return None
    return ReplicaGroups(cfg, groups, state)
