"""What every reader of a parameter needs to know about its parallel layout, in one typed record.

The layers set a :class:`ParamInfo` on each parameter when they create it
(:func:`set_param_info`); checkpointing, DDP, ``finalize_model_grads``, the optimizer, gradient
clipping and conversion read it through :func:`param_info` instead of probing loose attributes.
A parameter nobody marked reads as :data:`REPLICATED` (replicated, reduced over data parallel).

Fields:

* ``tensor_parallel`` (bool): split over tensor-parallel ranks along ``partition_dim`` with
  ``partition_stride`` (1, or 2 for a fused ``[gate; up]`` SwiGLU weight whose TP rank ``r``
  holds ``[gate_r; up_r]``: the full tensor is cut into ``stride * tp`` chunks along the dim and
  rank ``r`` holds chunks ``r, r + tp, ...``, Megatron's convention).  ``partition_dim`` is ``-1``
  and ``partition_stride`` 1 when replicated.  For an ``expert`` parameter the split is over the
  expert-tensor-parallel group (``ProcessGroups.etp``, ``--expert-tensor-parallel-size``) instead.
* ``sequence_parallel`` (bool): each TP rank computed a partial gradient (norms, row-parallel
  biases, routers and experts under sequence parallelism): summed over TP after backward.
* ``expert`` (bool): an MoE expert parameter, reduced over the expert-data-parallel group
  instead of the data-parallel group (Megatron's ``allreduce = False``).
* ``tied`` (bool): the tied word-embedding / output weight (Megatron's ``shared_embedding``):
  its gradient is summed over the embedding group when the two live on different stages.
* ``vocab_unpadded`` (int or None): the true vocabulary size of a padded embedding / output
  weight (rows past it are padding, never saved).
* ``copy_of`` (str or None): the canonical name of the parameter this one is a copy of (the last
  pipeline stage's tied output weight: the word embedding); a checkpoint stores the source only
  and loads the copy from it.
* ``qkv_split_shapes`` (tuple or None): a fused QKV weight's rows per query group, ``(query rows,
  key rows, value rows)``, in Megatron's grouped layout (each group's ``[q heads; k; v]`` rows one
  after the other, so a TP shard holds whole groups); set by the attention layer, read by Muon's
  ``--muon-split-qkv`` (Megatron's ``qkv_split_shapes``).

Compatibility with Megatron's loose attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``sequence_parallel``, ``allreduce``, ``shared_embedding``,
``vocab_unpadded``): :func:`set_param_info` also writes them, derived from the record, for
readers not yet moved to :func:`param_info`; and a parameter without a record (a user module
marked the Megatron way) reads as the record those attributes describe.  Once a record is set
the attributes are only its view: write through :func:`set_param_info`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megalm.errors import MegalmError

_RECORD = "megalm_param_info"
_LEGACY = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "allreduce",
    "shared_embedding",
    "vocab_unpadded",
)


class ParamLayoutError(MegalmError, ValueError):
    """A parallel layout record that cannot describe a parameter."""


@dataclass(frozen=True)
class ParamInfo:
    tensor_parallel: bool = False
    partition_dim: int = -1
    partition_stride: int = 1
    sequence_parallel: bool = False
    expert: bool = False
    tied: bool = False
    vocab_unpadded: Optional[int] = None
    copy_of: Optional[str] = None
    qkv_split_shapes: Optional[Tuple[int, int, int]] = None

    @property
    def replicated(self) -> bool:
        """The same values on every tensor-parallel rank (not split)."""
        return not self.tensor_parallel

    def __post_init__(self) -> None:
        if self.tensor_parallel and self.partition_stride < 1:
            raise ParamLayoutError(f"partition_stride must be >= 1, got {self.partition_stride}")
        if not self.tensor_parallel and (self.partition_dim != -1 or self.partition_stride != 1):
            raise ParamLayoutError(
                f"a replicated parameter has partition_dim -1 and partition_stride 1, got "
                f"{self.partition_dim} and {self.partition_stride}"
            )


REPLICATED = ParamInfo()


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parallel layout record of ``param`` (from Megatron's attributes when no record was set,
    :data:`REPLICATED` when neither)."""
    record = param.__dict__.get(_RECORD)
    return _from_legacy_attributes(param.__dict__) if record is None else record


def _from_legacy_attributes(attributes: dict) -> ParamInfo:
    if not any(name in attributes for name in _LEGACY):
        return REPLICATED
    split = bool(attributes.get("tensor_model_parallel", False))
    return ParamInfo(
        tensor_parallel=split,
        partition_dim=int(attributes.get("partition_dim", -1)) if split else -1,
        partition_stride=int(attributes.get("partition_stride", 1)) if split else 1,
        sequence_parallel=bool(attributes.get("sequence_parallel", False)),
        expert=attributes.get("allreduce", True) is False,
        tied=bool(attributes.get("shared_embedding", False)),
        vocab_unpadded=attributes.get("vocab_unpadded"),
    )


def set_param_info(param: torch.Tensor, **changes) -> ParamInfo:
    """Replace fields of ``param``'s record (``dataclasses.replace`` of the current one); returns it."""
    info = dataclasses.replace(param_info(param), **changes)
    setattr(param, _RECORD, info)
    _write_legacy_attributes(param, info)
    return info


def _write_legacy_attributes(param: torch.Tensor, info: ParamInfo) -> None:
    """Megatron's attribute names, derived from ``info`` (see the module docstring)."""
    param.tensor_model_parallel = info.tensor_parallel
    param.partition_dim = info.partition_dim
    param.partition_stride = info.partition_stride
    param.sequence_parallel = info.sequence_parallel
    param.allreduce = not info.expert
    if info.tied:
        param.shared_embedding = True
    elif "shared_embedding" in param.__dict__:
        del param.shared_embedding
    if info.vocab_unpadded is not None:
        param.vocab_unpadded = info.vocab_unpadded
    elif "vocab_unpadded" in param.__dict__:
        del param.vocab_unpadded
