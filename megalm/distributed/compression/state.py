"""The compression state a checkpoint keeps per rank: error-feedback residuals, PowerSGD's
warm-start ``Q``s, the stochastic-rounding generator.

It is per rank (every data-parallel rank has its own residuals) and only meaningful for the
layout and settings it was made with (the residuals are laid out like the gradient buckets).
:func:`compression_state` collects it from the DDP-wrapped model chunks with a signature
(method, its settings, bucket size, distributed optimizer or not, parallel layout);
:func:`restore_compression_state` puts it back when the signature matches and otherwise says
why not (the caller logs it and the state restarts from zero: a reset loses at most the residual of one step per rank).
"""

from __future__ import annotations

from typing import Optional, Sequence


def _compressed_chunks(model_chunks: Sequence) -> list:
    return [(i, c) for i, c in enumerate(model_chunks) if getattr(c, "compressor", None) is not None]


def signature(model_chunks: Sequence, layout: dict) -> Optional[str]:
    """What the state depends on, as one string; None without compression."""
    chunks = _compressed_chunks(model_chunks)
    if not chunks:
        return None
    c = chunks[0][1]
    buckets = f"bucket size {c.bucket_size}" + (" (distributed optimizer)" if c.use_distributed_optimizer else "")
    return f"{c.compressor.signature}; {buckets}; chunks {len(model_chunks)}; layout {layout}"


def compression_state(model_chunks: Sequence, layout: dict) -> Optional[dict]:
    """``{"signature": str, "state": {"<chunk>/<key>": tensor}}`` of this rank, or None without
    compression (tensors are copied to the CPU)."""
    sig = signature(model_chunks, layout)
    if sig is None:
        return None
    state = {}
    for i, chunk in _compressed_chunks(model_chunks):
        for k, v in chunk.compressor.state_dict().items():
            state[f"{i}/{k}"] = v.detach().to("cpu", copy=True)
    return {"signature": sig, "state": state}


def restore_compression_state(model_chunks: Sequence, layout: dict, saved: Optional[dict]) -> Optional[str]:
    """Load ``saved`` (of :func:`compression_state`) into the chunks' compressors; returns None when
    restored (or nothing to restore), else why it was not (the state then starts from zero)."""
    sig = signature(model_chunks, layout)
    if sig is None:
        return None
    if saved is None:
        return "the checkpoint has no gradient-compression state (saved without --grad-compression)"
    if saved.get("signature") != sig:
        return f"it was saved for {saved.get('signature')}, this run is {sig}"
    for i, chunk in _compressed_chunks(model_chunks):
        prefix = f"{i}/"
        device = next(chunk.module.parameters()).device
        chunk.compressor.load_state_dict(
            {k[len(prefix) :]: v.to(device) for k, v in saved["state"].items() if k.startswith(prefix)}
        )
    return None
