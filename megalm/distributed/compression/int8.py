"""8-bit quantization with one fp32 scale per chunk, all-gathered.

Encode (compensated gradient ``a`` of ``N`` elements, chunks of ``C``): per chunk ``c``,
``s_c = max|a_c| / 127`` and ``q = round(a / s_c)`` (nearest) or ``floor(a / s_c + u)``,
``u ~ U[0, 1)`` (stochastic: unbiased, ``E[q s_c] = a``), in ``[-127, 127]``; a chunk of zeros
has ``s_c = 0`` and sends zeros.  The payload is ``[q (N int8), s (ceil(N/C) fp32)]`` as bytes.
Communication: one all-gather over the ``K`` ranks, ``(K-1) (N + 4 ceil(N/C))`` bytes sent per
rank (ring), against ``2 (K-1)/K x 4N`` for the exact fp32 all-reduce.  Decode:
``sum_r q_r s_r`` in rank order.  What this rank sent is ``q s``; the residual is ``a - q s``.
Values that are integer multiples ``k 2^-j`` with ``|k| <= 127`` and one ``|k| = 127`` per chunk
are sent exactly.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megalm.distributed import comm


def payload_bytes(numel: int, chunk: int) -> int:
    return numel + 4 * (-(-numel // chunk))


def encode(
    a: torch.Tensor, chunk: int, poison: torch.Tensor, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(payload uint8, sent fp32 [N])``; ``generator`` given: stochastic rounding."""
    n = a.numel()
    chunks = -(-n // chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.float32, device=a.device)
    padded[:n] = a
    blocks = padded.view(chunks, chunk)
    scale = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    x = blocks / safe[:, None]
    if generator is None:
        q = torch.round(x)
    else:
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        q = torch.floor(x + u)
    q = q.clamp_(-127, 127)
    sent = (q * scale[:, None]).view(-1)[:n]
    scale = scale + poison
    payload = torch.cat([q.view(-1)[:n].to(torch.int8).view(torch.uint8), scale.view(torch.uint8)])
    return payload, sent


def decode(gathered: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """The sum over ranks of the payloads ``gathered`` (``[K, bytes]`` uint8), as fp32 ``[numel]``."""
    chunks = -(-numel // chunk)
    out = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
    for row in gathered:
        q = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
        q[:numel] = row[:numel].view(torch.int8).float()
        scale = row[numel:].clone().view(torch.float32)  # a copy: views need 4-byte alignment
        out += (q.view(chunks, chunk) * scale[:, None]).view(-1)
    return out[:numel]


class Int8:
    """``--grad-compression int8`` (``--int8-chunk-size``, ``--int8-rounding``)."""

    name = "int8"

    def __init__(self, chunk: int, stochastic: bool, seed: int = 0, device=None):
        self.chunk = chunk
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed) if stochastic else None

    def stages(self, job) -> List:
        n = job.numel
        gathered = torch.empty(job.group_size, payload_bytes(n, self.chunk), dtype=torch.uint8, device=job.device)

        def send():
            payload, job.sent = encode(job.a, self.chunk, job.poison, self.generator)
            return comm.all_gather_into_tensor(
                gathered.view(-1), payload, group=job.group, async_op=True, kind=f"{job.kind}_int8_all_gather"
            )

        def receive():
            job.out = decode(gathered, n, self.chunk)

        return [send, receive]

    def state_dict(self) -> dict:
        return {} if self.generator is None else {"rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.generator is not None and "rng" in state:
            self.generator.set_state(state["rng"])
