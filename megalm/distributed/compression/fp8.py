"""fp8 quantization with one fp32 scale per chunk (``--grad-compression fp8``): :mod:`.int8`'s scheme
with fp8 values instead of integers.

Encode (compensated gradient ``a``, chunks of ``C``): per chunk ``s_c = max|a_c| / F`` (``F`` the
largest finite value of the format: 448 for e4m3, 57344 for e5m2) and ``q = fp8(a / s_c)``, rounded
to the nearest fp8 value (ties to even, torch's cast) or stochastically: up to the next fp8 value
above ``|x|`` with probability ``(|x| - down) / (up - down)``, else down (unbiased, ``E[q s_c] = a``).
The payload is ``[q (N fp8 bytes), s (ceil(N/C) fp32)]``: the same bytes, collectives and formulas
as int8, ``(K-1) (N + 4 ceil(N/C))`` per rank for the all-gather and ``(K-1) (S + 4 M)`` for the
distributed optimizer's all-to-all reduce-scatter.  Against int8's uniform grid (an absolute step
of ``1/127`` of the chunk's largest magnitude, so entries below ``1/254`` of it round to zero) fp8
rounds each entry relative to itself, to at most ``2^-4`` (e4m3, 3 mantissa bits) or ``2^-3``
(e5m2) of it, down to ``2^-6 / 448`` (e4m3 normals) or ``2^-14 / 57344`` (e5m2) of the largest:
small entries are sent more precisely, the largest less.  Values ``v s`` with ``v`` an fp8 value,
``s`` a power of two and one ``|v| = F`` per chunk (so ``s`` is the scale) are sent exactly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megalm.distributed.compression.int8 import Int8

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class FP8Codec:
    """fp8 values (``fmt`` e4m3 or e5m2) as bytes, for :func:`megalm.distributed.compression.int8.quantize`."""

    def __init__(self, fmt: str):
        self.dtype = FORMATS[fmt]
        self.name = f"fp8 {fmt}"
        self.max = float(torch.finfo(self.dtype).max)
        self._max_bits = torch.tensor(self.max).to(self.dtype).view(torch.uint8)

    def round(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(codes uint8, their values fp32)`` of ``x`` (fp32, ``|x| <= max``)."""
        mag = x.abs()
        q = mag.to(self.dtype)
        if generator is not None:  # the two fp8 values around |x|: bit patterns of non-negative fp8 are ordered
            bits, near = q.view(torch.uint8), q.float()
            above = near > mag  # then bits >= 1
            other = torch.where(above, bits - 1, torch.minimum(bits + 1, self._max_bits.to(bits.device)))
            other = other.view(self.dtype).float()
            down, up = torch.where(above, other, near), torch.where(above, near, other)
            gap = up - down
            p = torch.where(gap > 0, (mag - down) / torch.where(gap > 0, gap, 1.0), 0.0)
            u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            q = torch.where(u < p, up, down).to(self.dtype)
        values = torch.where(x < 0, -q.float(), q.float())
        return values.to(self.dtype).view(torch.uint8), values

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(self.dtype).float()


class FP8(Int8):
    """``--grad-compression fp8`` (``--grad-fp8-format``, ``--grad-fp8-chunk-size``, ``--grad-fp8-rounding``)."""

    name = "fp8"

    def __init__(self, chunk: int, stochastic: bool, fmt: str = "e4m3", seed: int = 0, device=None):
        super().__init__(chunk, stochastic, seed=seed, device=device, codec=FP8Codec(fmt))
