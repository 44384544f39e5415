#!/usr/bin/env python
"""Describe a megalm checkpoint without loading its tensors (DCP metadata and common.json only).

    python tools/checkpoint/inspect.py CKPT_DIR [--iteration N] [--all] [--full-config] [--json]

Prints the iteration, samples consumed, the layout it was saved with, the config, each model
tensor's global name, shape and dtype, the total parameter count, and a summary of the
optimizer tensors (``--all`` lists them).  ``CKPT_DIR`` is a ``--save`` directory (latest
iteration unless ``--iteration``) or one ``iter_XXXXXXX`` directory.
"""

from __future__ import annotations

import os
import sys

# This file is named inspect.py: keep its directory off sys.path so that the standard library's
# inspect module (imported by torch) is not shadowed by this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.abspath(os.path.join(_HERE, os.pardir, os.pardir)))

import argparse  # noqa: E402
import json  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="Checkpoint root (--save directory) or an iter_XXXXXXX directory.")
    parser.add_argument("--iteration", type=int, default=None, help="Iteration to describe (default: latest).")
    parser.add_argument("--all", action="store_true", help="Also list optimizer tensors.")
    parser.add_argument("--full-config", action="store_true", help="Print every config section, not only model/parallel.")
    parser.add_argument("--json", action="store_true", help="Print the description as JSON.")
    args = parser.parse_args(argv)
    from megalm.checkpointing import CheckpointError
    from megalm.conversion.checkpoint_info import describe, format_description
    from megalm.conversion.errors import ConversionError
    from megalm.errors import MegalmError

    try:
        info = describe(args.checkpoint, args.iteration)
    except (MegalmError, CheckpointError, ConversionError) as e:
        print(f"[inspect] error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_description(info, all_tensors=args.all, full_config=args.full_config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
