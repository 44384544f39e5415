"""Error feedback around a compression method, and the compressed all-reduce as a chain of stages.

Per bucket (key ``"<buffer>.<bucket>"``) a rank keeps the residual ``e`` of what it did not send
(fp32, the bucket's length).  One compressed all-reduce of the gradient ``g`` (already scaled by
``1/DP``, so the sum is the mean) over ``K`` ranks:

1. ``a = g + e`` (compensate);
2. the method sends an encoding of ``a``; ``sent`` is what this rank's encoding decodes to, and the
   result is ``sum_k sent_k`` (every method here decodes linearly);
3. ``e <- a - sent``, ``g <- sum_k sent_k``.

Reduce-scatter (the distributed optimizer: :meth:`GradCompressor.reduce_scatter`): the same
compensation and residual over the whole bucket, but the result is only this rank's shard
``[lo, hi)`` of ``sum_k sent_k`` (the rest of ``g`` keeps its local values, never read, as after
the exact reduce-scatter).  Methods with a compressed reduce-scatter (:mod:`.int8`) send less for
it; the others run their all-reduce and the rank keeps its shard: the same math either way.

So over steps ``sum_t sent_t + e_T = sum_t g_t`` on every rank: nothing is lost, only delayed
(exact for top-k, whose residual is ``a`` with the sent entries zeroed; up to one rounding per
step otherwise).

Non-finite gradients (fp16 overflow, or a NaN): the compensated gradient's finiteness is folded
into the payload (``poison``: 0, or NaN when ``a`` holds a non-finite value, added to the values
sent), so the reduced gradient is non-finite on every rank whenever it is on any, and the loss
scaler's / NaN check's inf test on the reduced gradient still sees it (no extra collective, no
host sync).  The residual and the method's state are then left as they were (``torch.where`` on
the reduced result's finiteness): a skipped step changes nothing.

Communication happens only in the method's stages; see :mod:`.powersgd`, :mod:`.topk`,
:mod:`.int8` for what each sends.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalm.distributed import comm
from megalm.distributed.compression.segments import Segment
from megalm.distributed.hierarchical import CollectiveChain
from megalm.parallel_state import group_size


class CompressionJob:
    """One bucket's compressed all-reduce in flight (the fields the method's stages share)."""

    def __init__(
        self,
        key: str,
        flat: torch.Tensor,
        matrices: List[Segment],
        group,
        kind: str,
        shard: Optional[Tuple[int, int]] = None,
        into: Optional[Tuple[torch.Tensor, int, int]] = None,
        *,
        stats: Optional[comm.CommStats],
    ):
        self.stats = stats  # where the method's collectives are counted (None: not counted)
        self.key, self.flat, self.matrices, self.group, self.kind = key, flat, matrices, group, kind
        self.shard = shard  # (lo, hi): a reduce-scatter whose result is flat[lo:hi]; None: all-reduce
        self.into = into  # (tensor, lo, hi): the result's [lo, hi) goes there instead of into flat
        self.group_size = group_size(group)
        self.numel, self.device = flat.numel(), flat.device
        self.a: Optional[torch.Tensor] = None  # compensated gradient (fp32)
        self.poison: Optional[torch.Tensor] = None
        self.sent: Optional[torch.Tensor] = None  # what this rank's encoding decodes to
        self.out: Optional[torch.Tensor] = None  # the sum over ranks (of the shard when ``shard``)

    def all_reduce(self, tensor: torch.Tensor, what: str):
        """Asynchronous SUM all-reduce of ``tensor`` in place over the job's group (counted as
        ``<kind>_<what>``): the work handle, or None for a group of one."""
        return comm.all_reduce(tensor, group=self.group, async_op=True, kind=f"{self.kind}_{what}", stats=self.stats)


class GradCompressor:
    """A compression method with error feedback; one per DDP-wrapped model chunk.

    ``method``: a :class:`~.powersgd.PowerSGD`, :class:`~.topk.TopK` or :class:`~.int8.Int8`.
    """

    def __init__(self, method, signature: str = "", comm_stats: Optional[comm.CommStats] = None):
        self.method = method
        self.comm_stats = comm_stats  # where its collectives are counted (None: not counted)
        self.signature = signature or method.name  # what its state depends on (checkpoints compare it)
        self.residuals: Dict[str, torch.Tensor] = {}
        self.exact = False  # --grad-compression-warmup-iters: the buffers reduce exactly (set per step by DDP)

    @property
    def name(self) -> str:
        return self.method.name

    def all_reduce(self, key: str, flat: torch.Tensor, matrices: List[Segment], group, kind: str = "grad"):
        """SUM-all-reduce ``flat`` in place, compressed, over ``group`` (size > 1): a
        :class:`CollectiveChain` with its first stage launched (``wait()`` runs the rest)."""
        return self._launch(CompressionJob(key, flat, matrices, group, kind, stats=self.comm_stats))

    def reduce_scatter(
        self, key: str, flat: torch.Tensor, shard, matrices: List[Segment], group, kind: str = "grad", into=None
    ):
        """``flat[lo:hi]`` (``shard``, this rank's) <- that shard of the compressed SUM over ``group``:
        the method's compressed reduce-scatter when it has one (``reduces_scatter``), else its
        all-reduce of the whole bucket.  ``into`` (a tensor of ``hi - lo`` elements, e.g. the sharded
        gradient of ZeRO-2/3): the shard goes there and ``flat`` is left as it was.  A
        :class:`CollectiveChain` with its first stage launched."""
        scatter = getattr(self.method, "reduces_scatter", False)
        target = None if into is None else (into, *shard)
        job = CompressionJob(
            key, flat, matrices, group, kind, shard if scatter else None, target, stats=self.comm_stats
        )
        return self._launch(job)

    def _launch(self, job: CompressionJob):
        chain = CollectiveChain(self.stages(job))
        chain.advance()
        return chain

    def stages(self, job: CompressionJob) -> List:
        """The stages of ``job``: compensate + the method's first send, its later stages, commit."""
        flat = job.flat
        inner = self.method.stages(job)

        def compensate_and_send():
            residual = self.residuals.get(job.key)
            job.a = flat.float() if residual is None else flat.float() + residual
            job.poison = torch.where(torch.isfinite(job.a).all(), 0.0, float("nan")).to(job.a.device)
            return inner[0]()

        def commit():
            residual = self.residuals.get(job.key)
            if residual is None:
                residual = torch.zeros_like(job.a)
            self.residuals[job.key] = torch.where(torch.isfinite(job.out).all(), job.a - job.sent, residual)
            if job.into is not None:
                into, lo, hi = job.into
                into.copy_(job.out if job.shard is not None else job.out[lo:hi])
            else:
                (flat if job.shard is None else flat[job.shard[0] : job.shard[1]]).copy_(job.out)

        return [compensate_and_send, *inner[1:], commit]

    def flush(self, key: str, flat: torch.Tensor) -> None:
        """A bucket that compresses nothing (a group of one, or one node under hierarchical
        reduction) but holds a residual (resharded from a checkpoint of a larger group,
        :mod:`.reshard`): ``flat <- flat + e`` before its exact reduction, and no residual is kept
        (a step skipped for an fp16 overflow right then loses it).  No communication."""
        residual = self.residuals.pop(key, None)
        if residual is not None:
            flat.copy_(flat.float() + residual)

    def residual_sum(self) -> float:
        """Sum of every residual (tests)."""
        return float(sum(r.double().sum() for r in self.residuals.values()))

    def state_dict(self) -> dict:
        state = {f"residual/{k}": v for k, v in self.residuals.items()}
        state.update({f"method/{k}": v for k, v in getattr(self.method, "state_dict", dict)().items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k[len("residual/") :]: v for k, v in state.items() if k.startswith("residual/")}
        load = getattr(self.method, "load_state_dict", None)
        if load is not None:
            load({k[len("method/") :]: v for k, v in state.items() if k.startswith("method/")})
