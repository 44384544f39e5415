"""``tools/estimate.py``: pretrain_gpt.py's flags (megalm's own parser and validate_config) plus
the planner's (``--world-size``, ``--gpu-memory-gb``, ``--mfu``, ``--device``, ``--reserve-gb``).

``--preset NAME`` puts the preset's flags (``python3 tools/presets.py NAME``: the flags its script
passes on mock data) and its world size first; flags given with it come after and win."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import List, Optional, Tuple

from megalm.config import ConfigError, MegalmConfig, build_parser, config_from_args, validate_config, with_vocab_size
from megalm.estimate.planner import PlannerOptions, format_plan, plan
from megalm.presets import get_preset, preset_flags
from megalm.topology import TopologyOptions, topology_report


def _vocab_size(cfg: MegalmConfig) -> int:
    """The tokenizer's vocabulary, as the trainer would set it: without --tokenizer-type the trainer
    builds NullTokenizer, whose vocabulary is --vocab-size + 1 (the end-of-document id)."""
    d, m = cfg.data, cfg.model
    if d.tokenizer_type in (None, "NullTokenizer"):
        if m.vocab_size is None:
            raise ConfigError("give --vocab-size (or --tokenizer-type/--tokenizer-model) for the vocabulary")
        return m.vocab_size + 1
    from megalm.tokenizers import build_tokenizer

    try:
        return build_tokenizer(d, m).vocab_size
    except (OSError, ValueError) as e:
        if m.vocab_size is not None:
            return m.vocab_size
        raise ConfigError(f"cannot read the tokenizer ({e}); give --vocab-size") from None


def expand_preset(argv: list[str]) -> list[str]:
    """``--preset NAME`` (or ``--preset=NAME``) -> the preset's flags and ``--world-size``, then the
    rest of ``argv``; raises :class:`megalm.presets.PresetError` for an unknown name."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    known, rest = pre.parse_known_args(argv)
    if known.preset is None:
        return list(argv)
    world = get_preset(known.preset).layout.world_size
    return preset_flags(known.preset) + ["--world-size", str(world)] + rest


def parse(argv: Optional[List[str]] = None) -> Tuple[MegalmConfig, PlannerOptions]:
    """The training config and the planner's options of ``argv``."""
    return parse_all(argv)[:2]


def parse_all(argv: Optional[List[str]] = None) -> Tuple[MegalmConfig, PlannerOptions, TopologyOptions]:
    """:func:`parse`, plus the node layout flags (``--procs-per-node``)."""
    parser = build_parser(
        "megalm memory and speed planner; --preset NAME plans a preset of megalm.presets "
        "(python3 tools/presets.py lists them), overridable by the flags that follow",
        extra_sections={"planner": PlannerOptions, "topology": TopologyOptions},
        exit_on_error=False,
    )
    args = parser.parse_args(expand_preset(list(sys.argv[1:] if argv is None else argv)))
    values = vars(args)
    options = PlannerOptions(**{f.name: values[f"planner.{f.name}"] for f in dataclasses.fields(PlannerOptions)})
    cfg = config_from_args(args)
    p = cfg.parallel
    world = options.world_size or (
        p.tensor_model_parallel_size
        * p.pipeline_model_parallel_size
        * p.context_parallel_size
        * p.expert_model_parallel_size
    )
    cfg = validate_config(cfg, world_size=world)  # raises ConfigError (tools/estimate.py: exit 2)
    cfg = with_vocab_size(cfg, _vocab_size(cfg))
    options.world_size = world
    topology = TopologyOptions(**{f.name: values[f"topology.{f.name}"] for f in dataclasses.fields(TopologyOptions)})
    return cfg, options, topology


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    if as_json:
        argv.remove("--json")
    cfg, options, topology = parse_all(argv)
    result = plan(cfg, options)
    print(json.dumps(result, indent=1) if as_json else format_plan(cfg, result))
    if topology.procs_per_node and not as_json:
        p = cfg.parallel
        print(
            topology_report(
                options.world_size,
                topology.procs_per_node,
                p.tensor_model_parallel_size,
                p.pipeline_model_parallel_size,
                p.context_parallel_size,
                p.expert_model_parallel_size,
                p.expert_tensor_parallel_size or 1,
            )
        )
    return 0
