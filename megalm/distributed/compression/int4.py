"""4-bit quantization with one fp32 scale per chunk, two values per byte, all-gathered
(``--grad-compression int4``): :mod:`.int8`'s scheme with half its value bytes.

Encode (compensated gradient ``a`` of ``N`` elements, chunks of ``C`` = ``--int8-chunk-size``): per
chunk ``s_c = max|a_c| / 7`` and ``q = round(a / s_c)`` (nearest) or ``floor(a / s_c + u)``,
``u ~ U[0, 1)`` (stochastic, ``--int8-rounding``: unbiased), in ``[-7, 7]``; each ``q`` is sent as the
nibble ``q + 8`` (1 ... 15), element ``2i`` in the low and ``2i + 1`` in the high half of byte ``i``.
The payload is ``[nibbles (ceil(N/2) bytes), s (ceil(N/C) fp32)]``.  Communication: one all-gather
over the ``K`` ranks, ``(K-1) (ceil(N/2) + 4 ceil(N/C))`` bytes sent per rank (ring), about half of
int8's and an eighth of the exact fp32 all-reduce's ``2 (K-1)/K x 4N``.  Decode: ``sum_r q_r s_r``
in rank order.  What this rank sent is ``q s``; the residual ``a - q s`` (at most ``s_c / 2`` per
entry with nearest rounding, 18x int8's bound) goes into the next step's gradient, as for every
method (:mod:`.error_feedback`).  Values ``k 2^-j`` with ``|k| <= 7`` and one ``|k| = 7`` per chunk
are sent exactly.

With the distributed optimizer it has no compressed reduce-scatter: the all-gather above, then the
rank keeps its shard (as PowerSGD and top-k).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megalm.distributed import comm
from megalm.distributed.compression.int8 import Int8, quantize, round_to_integers


def payload_bytes(numel: int, chunk: int) -> int:
    return -(-numel // 2) + 4 * (-(-numel // chunk))


class Int4Codec:
    """Integers in ``[-7, 7]`` as the nibbles ``q + 8`` (one per uint8 code, packed by :func:`pack`)."""

    name = "int4"
    max = 7.0

    def round(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(codes uint8 in [1, 15], their values fp32)`` of ``x`` (fp32, ``|x| <= 7``)."""
        q = round_to_integers(x, generator, 7)
        return (q + 8).to(torch.uint8), q

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.float() - 8


INT4 = Int4Codec()


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``ceil(N/2)`` bytes from ``N`` nibble codes (uint8 < 16): code ``2i`` low, ``2i + 1`` high."""
    n = codes.numel()
    padded = torch.zeros(n + n % 2, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    pairs = padded.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` nibble codes of :func:`pack`'s bytes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]


def encode(
    a: torch.Tensor, chunk: int, poison: torch.Tensor, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(payload uint8, sent fp32 [N])``; ``generator`` given: stochastic rounding."""
    codes, scale, sent = quantize(a, chunk, poison, generator, INT4)
    return torch.cat([pack(codes), scale.view(torch.uint8)]), sent


def decode(gathered: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """The sum over ranks of the payloads ``gathered`` (``[K, bytes]`` uint8), as fp32 ``[numel]``."""
    chunks, packed = -(-numel // chunk), -(-numel // 2)
    out = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
    for row in gathered:
        q = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
        q[:numel] = INT4.values(unpack(row[:packed], numel))
        scale = row[packed:].clone().view(torch.float32)  # a copy: views need 4-byte alignment
        out += (q.view(chunks, chunk) * scale[:, None]).view(-1)
    return out[:numel]


class Int4(Int8):
    """``--grad-compression int4`` (``--int8-chunk-size``, ``--int8-rounding``)."""

    name = "int4"
    reduces_scatter = False  # the distributed optimizer takes its shard of the all-gathered sum

    def __init__(self, chunk: int, stochastic: bool, seed: int = 0, device=None):
        super().__init__(chunk, stochastic, seed=seed, device=device, codec=INT4)

    def stages(self, job) -> List:
        n = job.numel
        gathered = torch.empty(job.group_size, payload_bytes(n, self.chunk), dtype=torch.uint8, device=job.device)

        def send():
            payload, job.sent = encode(job.a, self.chunk, job.poison, self.generator)
            return comm.all_gather_into_tensor(
                gathered.view(-1),
                payload,
                group=job.group,
                async_op=True,
                kind=f"{job.kind}_int4_all_gather",
                stats=job.stats,
            )

        def receive():
            job.out = decode(gathered, n, self.chunk)

        return [send, receive]
