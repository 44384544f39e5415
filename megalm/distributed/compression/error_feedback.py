"""Error feedback around a compression method, and the compressed all-reduce as a chain of stages.

Per bucket (key ``"<buffer>.<bucket>"``) a rank keeps the residual ``e`` of what it did not send
(fp32, the bucket's length).  One compressed all-reduce of the gradient ``g`` (already scaled by
``1/DP``, so the sum is the mean) over ``K`` ranks:

1. ``a = g + e`` (compensate);
2. the method sends an encoding of ``a``; ``sent`` is what this rank's encoding decodes to, and the
   result is ``sum_k sent_k`` (every method here decodes linearly);
3. ``e <- a - sent``, ``g <- sum_k sent_k``.

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

from typing import Dict, List, Optional

import torch

from megalm.distributed.compression.segments import Segment
from megalm.distributed.hierarchical import CollectiveChain
from megalm.parallel_state import group_size


class CompressionJob:
    """One bucket's compressed all-reduce in flight (the fields the method's stages share)."""

    def __init__(self, key: str, flat: torch.Tensor, matrices: List[Segment], group, kind: str):
        self.key, self.flat, self.matrices, self.group, self.kind = key, flat, matrices, group, kind
        self.group_size = group_size(group)
        self.numel, self.device = flat.numel(), flat.device
        self.a: Optional[torch.Tensor] = None  # compensated gradient (fp32)
        self.poison: Optional[torch.Tensor] = None
        self.sent: Optional[torch.Tensor] = None  # what this rank's encoding decodes to
        self.out: Optional[torch.Tensor] = None  # the sum over ranks


class GradCompressor:
    """A compression method with error feedback; one per DDP-wrapped model chunk.

    ``method``: a :class:`~.powersgd.PowerSGD`, :class:`~.topk.TopK` or :class:`~.int8.Int8`.
    """

    def __init__(self, method, signature: str = ""):
        self.method = method
        self.signature = signature or method.name  # what its state depends on (checkpoints compare it)
        self.residuals: Dict[str, torch.Tensor] = {}

    @property
    def name(self) -> str:
        return self.method.name

    def all_reduce(self, key: str, flat: torch.Tensor, matrices: List[Segment], group, kind: str = "grad"):
        """SUM-all-reduce ``flat`` in place, compressed, over ``group`` (size > 1): a
        :class:`CollectiveChain` with its first stage launched (``wait()`` runs the rest)."""
        job = CompressionJob(key, flat, matrices, group, kind)
        inner = self.stages(job)
        chain = CollectiveChain(inner)
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
            flat.copy_(job.out)

        return [compensate_and_send, *inner[1:], commit]

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
