"""Which global transformer layers each pipeline rank and virtual stage builds (Megatron's rule).

* Even split: rank ``r`` of ``p`` holds layers ``[r L/p, (r+1) L/p)``.
* Uneven split (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``):
  the first/last rank hold the given counts, the other ranks split the rest evenly.
* Virtual stages (interleaved 1F1B, ``v`` chunks per rank): the model is cut into ``p * v``
  chunks of ``L / (p v)`` layers; chunk ``c`` of rank ``r`` holds model chunk ``c * p + r``.
"""

from __future__ import annotations

from typing import List, Optional

from megalm.config.sections import ConfigError


def virtual_stages(parallel_cfg, num_layers: int) -> Optional[int]:
    """Virtual stages per pipeline rank (None without interleaving)."""
    p = parallel_cfg
    if p.virtual_pipeline_model_parallel_size is not None:
        return p.virtual_pipeline_model_parallel_size
    if p.num_virtual_stages_per_pipeline_rank is not None:
        return p.num_virtual_stages_per_pipeline_rank
    if p.num_layers_per_virtual_pipeline_stage is not None:
        per_rank = num_layers // p.pipeline_model_parallel_size
        return per_rank // p.num_layers_per_virtual_pipeline_stage
    return None


def layers_per_rank(cfg) -> List[int]:
    """Number of layers on each pipeline rank (all virtual stages together)."""
    num_layers, pp = cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size
    first = cfg.parallel.decoder_first_pipeline_num_layers
    last = cfg.parallel.decoder_last_pipeline_num_layers
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        if num_layers % pp:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by pipeline size {pp}")
        return [num_layers // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
        raise ConfigError(
            f"--num-layers {num_layers} does not split into --decoder-first-pipeline-num-layers {first}, "
            f"--decoder-last-pipeline-num-layers {last} and {middle_stages} even middle stages"
        )
    counts = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def layers_for_stage(cfg, pp_rank: int, vpp_rank: int = 0) -> List[int]:
    """Global 0-based layer indices built by pipeline rank ``pp_rank``, virtual stage ``vpp_rank``."""
    num_layers, pp = cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} out of range for pipeline size {pp}")
    vpp = virtual_stages(cfg.parallel, num_layers)
    if vpp is not None and vpp > 1:
        if (
            cfg.parallel.decoder_first_pipeline_num_layers is not None
            or cfg.parallel.decoder_last_pipeline_num_layers is not None
        ):
            raise ConfigError(
                "--decoder-first/last-pipeline-num-layers (uneven stages) are not supported with virtual stages"
            )
        if not 0 <= vpp_rank < vpp:
            raise ValueError(f"virtual stage {vpp_rank} out of range for {vpp} virtual stages")
        if num_layers % (pp * vpp):
            raise ConfigError(f"--num-layers {num_layers} is not divisible by pipeline x virtual stages {pp * vpp}")
        per_chunk = num_layers // (pp * vpp)
        start = (vpp_rank * pp + pp_rank) * per_chunk
        return list(range(start, start + per_chunk))
    if vpp_rank != 0:
        raise ValueError(f"virtual stage {vpp_rank} requested without virtual pipeline stages")
    counts = layers_per_rank(cfg)
    start = sum(counts[:pp_rank])
    return list(range(start, start + counts[pp_rank]))
