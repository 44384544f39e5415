"""The presets on the command line (``tools/presets.py`` is the entry point):

    python3 tools/presets.py                  # list the presets
    python3 tools/presets.py NAME             # its pretrain_gpt.py flags, one per line (defaults)
    python3 tools/presets.py NAME --shell     # bash assignments for scripts/common.sh, with the
                                              # environment's overrides (TP, PP, LR, ...) applied
    python3 tools/presets.py --table          # the table of scripts/README.md

:func:`main` returns the exit status (2 for an unknown name or a bad override, reported on stderr).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from megalm.log import get_logger, setup_logging
from megalm.presets.flags import Launch, Overrides, get_preset, null_tokenizer_flags, recipe_flags, resolve
from megalm.presets.spec import PresetError
from megalm.presets.table import PRESETS

logger = get_logger(__name__)


def shell_code(launch: Launch) -> str:
    """Bash for ``eval``: the resolved layout, the preset's launcher defaults (``:=``, so the
    environment wins) and the arrays ``RECIPE_ARGS`` and ``NULL_TOKENIZER_ARGS``."""
    p, lay, run = launch.preset, launch.layout, launch.preset.run
    q = shlex.quote
    lines = [
        f"{k}={q(str(v))}"
        for k, v in (
            ("MODEL_NAME", p.name),
            ("GPUS_PER_NODE", lay.gpus_per_node),
            ("NNODES", lay.nnodes),
            ("TP", lay.tp),
            ("PP", lay.pp),
            ("MICRO_BATCH_SIZE", lay.micro_batch_size),
            ("GLOBAL_BATCH_SIZE", lay.global_batch_size),
            ("TRAIN_ITERS", launch.train_iters),
            ("PRECISION", lay.precision),
            ("VOCAB_SIZE", launch.vocab_size),
        )
    ]
    defaults = {
        "TOKENIZER_TYPE": p.tokenizer_type,
        "NUM_WORKERS": run.num_workers,
        "SAVE_INTERVAL": launch.train_iters if run.save_interval_is_train_iters else None,
        "LOG_INTERVAL": run.log_interval,
        "EVAL_INTERVAL": run.eval_interval,
        "EVAL_ITERS": run.eval_iters,
    }
    lines += [f': "${{{k}:={q(str(v))}}}"' for k, v in defaults.items() if v is not None]
    lines.append("RECIPE_ARGS=(" + " ".join(map(q, recipe_flags(launch))) + ")")
    lines.append("NULL_TOKENIZER_ARGS=(" + " ".join(map(q, null_tokenizer_flags(launch))) + ")")
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """One row per preset: its script, layout and batch (memory: tools/estimate.py --preset)."""
    rows = [
        "| script | model | TP | PP | DP | EP | micro / global batch | processes (nodes) | precision |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PRESETS.values():
        lay = p.layout
        dp = lay.world_size // (lay.tp * lay.pp)
        rows.append(
            f"| `pretrain_{p.name}.sh` | {p.title} | {lay.tp} | {lay.pp} | {dp} | {lay.ep or '-'} "
            f"| {lay.micro_batch_size} / {lay.global_batch_size} | {lay.world_size} ({lay.nnodes}) "
            f"| {lay.precision}{', recompute ' + lay.recompute if lay.recompute != 'none' else ''} |"
        )
    return "\n".join(rows) + "\n"


def _run(args: argparse.Namespace) -> str:
    if args.table:
        return markdown_table()
    if args.name is None:
        return "".join(f"{p.name:14s} {p.title} ({p.source})\n" for p in PRESETS.values())
    preset = get_preset(args.name)
    if args.shell:
        return shell_code(resolve(preset, Overrides.from_env(os.environ)))
    launch = resolve(preset)
    return "\n".join(recipe_flags(launch) + null_tokenizer_flags(launch)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/presets.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(PRESETS)}")
    parser.add_argument("--shell", action="store_true", help="bash assignments, with the environment's overrides")
    parser.add_argument("--table", action="store_true", help="the markdown table of scripts/README.md")
    args = parser.parse_args(argv)
    setup_logging(stream=sys.stderr)
    try:
        sys.stdout.write(_run(args))
    except PresetError as e:
        logger.error("error: %s", e)
        return 2
    return 0
