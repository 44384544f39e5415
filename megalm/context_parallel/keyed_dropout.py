"""Position-keyed attention dropout: a mask that does not depend on how the sequence is split.

The keep decision of attention weight ``(batch i, head h, query position a, key position j)`` is a
pure function of ``(key, layer, i, h, a, j)``, where ``a`` and ``j`` are GLOBAL sequence positions
and ``key`` is a pair of 32-bit integers drawn once per forward call of a layer from the tracker's
model-parallel stream (:meth:`KeyedDropout.draw`; identical on every context-parallel rank, and
restored for recomputation and from checkpoints with the stream).  So any core that computes any
block of the attention matrix (a ring step, an all-gathered chunk, a head slice of Ulysses, the
whole matrix in one process) draws exactly the entries one process would, and the backward
regenerates them from positions instead of storing an ``s x s`` mask.

The hash is a counter-based one in plain int64 tensor ops (same bits on CPU and GPU): two 32-bit
lanes ``A = mix(mix(mix(k0 ^ mix(layer)) ^ i) ^ h)``, ``C`` the same from ``k1``; per query row
``A_a = mix(A ^ a)``, ``C_a = mix(C ^ a)``; per entry ``x = mix(mix(A_a ^ j) ^ C_a)``, uniform on
``[0, 2^32)``; the entry is kept when ``x >= p 2^32`` and then scaled by ``1 / (1 - p)``.  ``mix`` is
a bijection of 32-bit values (xor-shifts and multiplications by odd constants below ``2^31``, so
no int64 product overflows).  Two lanes make two rows' masks unrelated unless 64 bits collide.
Cost: about 16 int64 operations per attention weight, in forward and again in backward.
No communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of ``[0, 2^32)`` (int64 tensors), a lowbias32-style finalizer."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x6D2B79F5) & _MASK32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class KeyedDropout:
    """The attention-dropout mask of one forward call of one layer.

    ``key``: int64 ``[2]`` in ``[0, 2^32)``; ``layer``: the global layer number; ``head_offset``:
    the index of this core's first head among the tensor-parallel rank's heads (Ulysses gives each
    context-parallel rank a slice of them)."""

    p: float
    key: torch.Tensor
    layer: int
    head_offset: int = 0

    @staticmethod
    def draw(p: float, layer: int, device) -> "KeyedDropout":
        """Draw the call's key from the current default generator (call it inside the tracker's fork)."""
        return KeyedDropout(p, torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device), layer)

    def heads_from(self, offset: int) -> "KeyedDropout":
        """The same mask for a core whose head 0 is head ``offset`` of this one's."""
        return dataclasses.replace(self, head_offset=self.head_offset + offset)

    def bits(self, batch: int, heads: int, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """The uniform 32-bit draws ``x`` (int64 ``[batch, heads, len(query_pos), len(key_pos)]``)."""
        device = self.key.device
        i = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        h = torch.arange(self.head_offset, self.head_offset + heads, device=device).view(1, heads, 1, 1)
        layer = _mix(torch.tensor(self.layer, dtype=torch.int64, device=device))
        a_lane, c_lane = (_mix(_mix(_mix(k ^ layer) ^ i) ^ h) for k in self.key)
        rows = query_pos.to(device=device, dtype=torch.int64).view(1, 1, -1, 1)
        a_lane, c_lane = _mix(a_lane ^ rows), _mix(c_lane ^ rows)
        return _mix(_mix(a_lane ^ key_pos.to(device=device, dtype=torch.int64).view(1, 1, 1, -1)) ^ c_lane)

    def scale(
        self, batch: int, heads: int, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``keep / (1 - p)`` (``dtype`` ``[batch, heads, len(query_pos), len(key_pos)]``): what the
        attention probabilities of those positions are multiplied by."""
        keep = self.bits(batch, heads, query_pos, key_pos) >= int(self.p * 2**32)
        return keep.to(dtype).mul_(1.0 / (1.0 - self.p))
