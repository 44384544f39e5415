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

Compressed reduce-scatter (the distributed optimizer, flat data parallelism: ``job.shard`` set,
rank ``j`` owns ``[j S, (j+1) S)``, ``S = N/K``): the same quantization of the whole bucket, then
one all-to-all in which rank ``r`` sends rank ``j`` the int8 values of shard ``j`` and the scales
of the chunks overlapping it (``M = max_j`` of their count, zero-padded): ``(K-1) (S + 4 M)``
bytes sent per rank, about half of the all-gather's, against ``(K-1)/K x 4N`` for the exact fp32
reduce-scatter.  Decode: ``sum_r q_r s_r`` over the shard in rank order, the same products added
in the same order as the all-gather's decode, so the shard is bit for bit what the all-reduce
gives there.

The rounding to 8 bits is a codec (:class:`Int8Codec` here; :mod:`.fp8` plugs in fp8 values with
the same chunks, scales, payload layout, collectives and byte counts).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megalm.distributed import comm


def payload_bytes(numel: int, chunk: int) -> int:
    return numel + 4 * (-(-numel // chunk))


def round_to_integers(x: torch.Tensor, generator: Optional[torch.Generator], limit: int) -> torch.Tensor:
    """``x`` rounded to integers in ``[-limit, limit]`` (fp32): nearest without ``generator``, else stochastic
    (``floor(x + u)``, ``u`` uniform in [0, 1): unbiased)."""
    if generator is None:
        q = torch.round(x)
    else:
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        q = torch.floor(x + u)
    return q.clamp_(-limit, limit)


class Int8Codec:
    """Integers in ``[-127, 127]`` as int8 bytes: nearest (``round``) or stochastic (``floor(x + u)``)."""

    name = "int8"
    max = 127.0

    def round(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(codes uint8, their values fp32)`` of ``x`` (fp32, ``|x| <= max``)."""
        q = round_to_integers(x, generator, 127)
        return q.to(torch.int8).view(torch.uint8), q

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8).float()


INT8 = Int8Codec()


def encode(
    a: torch.Tensor,
    chunk: int,
    poison: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    codec=INT8,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(payload uint8, sent fp32 [N])``; ``generator`` given: stochastic rounding."""
    q, scale, sent = quantize(a, chunk, poison, generator, codec)
    return torch.cat([q, scale.view(torch.uint8)]), sent


def quantize(
    a: torch.Tensor,
    chunk: int,
    poison: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    codec=INT8,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [N], scale + poison fp32 [ceil(N/C)], sent fp32 [N])`` of the 1-D fp32 ``a``:
    per chunk ``s_c = max|a_c| / codec.max`` and the codec's rounding of ``a / s_c``."""
    n = a.numel()
    chunks = -(-n // chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.float32, device=a.device)
    padded[:n] = a
    blocks = padded.view(chunks, chunk)
    scale = blocks.abs().amax(dim=1) / codec.max
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes, q = codec.round((blocks / safe[:, None]).clamp_(-codec.max, codec.max), generator)
    sent = (q * scale[:, None]).view(-1)[:n]
    return codes.reshape(-1)[:n], scale + poison, sent


def shard_chunks(shard: int, chunk: int, k: int) -> Tuple[List[int], int]:
    """First chunk index overlapping each of the ``k`` shards of ``shard`` elements, and ``M``, the
    most chunks any shard overlaps (the scales each all-to-all block carries)."""
    first = [j * shard // chunk for j in range(k)]
    return first, max(-(-(j + 1) * shard // chunk) - f for j, f in enumerate(first))


def scatter_payload(q: torch.Tensor, scale: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """The all-to-all input ``[k, S + 4 M]`` uint8: block ``j`` = shard ``j``'s values, its chunks' scales."""
    shard = q.numel() // k
    first, most = shard_chunks(shard, chunk, k)
    padded = torch.cat([scale, scale.new_zeros(most)])
    scales = torch.stack([padded[f : f + most] for f in first])  # [k, M]
    return torch.cat([q.view(k, shard), scales.view(torch.uint8)], dim=1)


def decode_shard(received: torch.Tensor, j: int, shard: int, chunk: int, k: int, codec=INT8) -> torch.Tensor:
    """Shard ``j`` of the sum over ranks, fp32 ``[S]``, from the all-to-all output ``[k, S + 4 M]``."""
    first, _ = shard_chunks(shard, chunk, k)
    which = torch.arange(j * shard, (j + 1) * shard, device=received.device) // chunk - first[j]
    out = torch.zeros(shard, dtype=torch.float32, device=received.device)
    for row in received:
        scale = row[shard:].clone().view(torch.float32)
        out += codec.values(row[:shard]) * scale[which]
    return out


def decode(gathered: torch.Tensor, numel: int, chunk: int, codec=INT8) -> torch.Tensor:
    """The sum over ranks of the payloads ``gathered`` (``[K, bytes]`` uint8), as fp32 ``[numel]``."""
    chunks = -(-numel // chunk)
    out = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
    for row in gathered:
        q = torch.zeros(chunks * chunk, dtype=torch.float32, device=gathered.device)
        q[:numel] = codec.values(row[:numel])
        scale = row[numel:].clone().view(torch.float32)  # a copy: views need 4-byte alignment
        out += (q.view(chunks, chunk) * scale[:, None]).view(-1)
    return out[:numel]


class Int8:
    """``--grad-compression int8`` (``--int8-chunk-size``, ``--int8-rounding``); with another ``codec``
    the same per-chunk scaled 8-bit scheme (:class:`~.fp8.FP8`)."""

    name = "int8"
    reduces_scatter = True  # has a compressed reduce-scatter (all-to-all), see the module docstring

    def __init__(self, chunk: int, stochastic: bool, seed: int = 0, device=None, codec=INT8):
        self.chunk, self.codec = chunk, codec
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed) if stochastic else None

    def stages(self, job) -> List:
        if job.shard is not None:
            return self._reduce_scatter_stages(job)
        n = job.numel
        gathered = torch.empty(job.group_size, payload_bytes(n, self.chunk), dtype=torch.uint8, device=job.device)

        def send():
            payload, job.sent = encode(job.a, self.chunk, job.poison, self.generator, self.codec)
            return comm.all_gather_into_tensor(
                gathered.view(-1),
                payload,
                group=job.group,
                async_op=True,
                kind=f"{job.kind}_{self.name}_all_gather",
                stats=job.stats,
            )

        def receive():
            job.out = decode(gathered, n, self.chunk, self.codec)

        return [send, receive]

    def _reduce_scatter_stages(self, job) -> List:
        k, (lo, hi) = job.group_size, job.shard
        shard = hi - lo
        width = shard + 4 * shard_chunks(shard, self.chunk, k)[1]
        received = torch.empty(k, width, dtype=torch.uint8, device=job.device)

        def send():
            q, scale, job.sent = quantize(job.a, self.chunk, job.poison, self.generator, self.codec)
            payload = scatter_payload(q, scale, self.chunk, k)
            kind = f"{job.kind}_{self.name}_all_to_all"
            return comm.all_to_all_single(
                received.view(-1), payload.view(-1), group=job.group, async_op=True, kind=kind, stats=job.stats
            )

        def receive():
            job.out = decode_shard(received, lo // shard, shard, self.chunk, k, self.codec)

        return [send, receive]

    def state_dict(self) -> dict:
        return {} if self.generator is None else {"rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.generator is not None and "rng" in state:
            self.generator.set_state(state["rng"])
