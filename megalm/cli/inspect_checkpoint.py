"""Describe a megalm checkpoint without loading its tensors (DCP metadata and common.json only).

    python tools/checkpoint/inspect.py CKPT_DIR [--iteration N] [--all] [--full-config] [--json]
    python tools/checkpoint/inspect.py CKPT_DIR [--iteration N] --verify

Prints the iteration, samples consumed, the layout it was saved with, the config, each model
tensor's global name, shape and dtype, the total parameter count, and a summary of the
optimizer tensors (``--all`` lists them).  ``CKPT_DIR`` is a ``--save`` directory (latest
iteration unless ``--iteration``) or one ``iter_XXXXXXX`` directory.  ``--verify`` checks every
file against the checkpoint's manifest (sizes and sha256, as ``--load`` does) and exits 1 if
one differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="Checkpoint root (--save directory) or an iter_XXXXXXX directory.")
    parser.add_argument("--iteration", type=int, default=None, help="Iteration to describe (default: latest).")
    parser.add_argument("--all", action="store_true", help="Also list optimizer tensors.")
    parser.add_argument(
        "--full-config", action="store_true", help="Print every config section, not only model/parallel."
    )
    parser.add_argument("--json", action="store_true", help="Print the description as JSON.")
    parser.add_argument("--verify", action="store_true", help="Check every file against the manifest (sha256).")
    args = parser.parse_args(argv)
    if args.verify:
        return verify(args.checkpoint, args.iteration)
    from megalm.conversion.checkpoint_info import describe, format_description
    from megalm.errors import MegalmError  # CheckpointError, ConversionError, ... derive from it

    try:
        info = describe(args.checkpoint, args.iteration)
    except MegalmError as e:
        print(f"[inspect] error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_description(info, all_tensors=args.all, full_config=args.full_config))
    return 0


def verify(checkpoint: str, iteration=None) -> int:
    """Print ``verified: ...`` (0), ``corrupt: ...`` (1), or an error (2)."""
    import re

    from megalm.checkpoint import manifest as checkpoint_manifest
    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir, read_tracker, verify_checkpoint

    try:
        m = re.fullmatch(r"iter_(\d{7})", os.path.basename(os.path.normpath(checkpoint)))
        if m:
            path, iteration = checkpoint, int(m.group(1))
        else:
            iteration = iteration if iteration is not None else read_tracker(checkpoint)
            if iteration is None:
                tracker = TRACKER_FILENAME
                raise CheckpointError(f"no checkpoint in {checkpoint} (no {tracker})")
            path = checkpoint_dir(checkpoint, iteration)
        error = verify_checkpoint(path, iteration)
    except CheckpointError as e:
        print(f"[inspect] error: {e}", file=sys.stderr)
        return 2
    if error is not None:
        print(f"corrupt: checkpoint {path}: {error}")
        return 1
    index, _ = checkpoint_manifest.read_index(path)
    if index is None:
        print(f"unverified: checkpoint {path} has no manifest (written before megalm verified checkpoints)")
        return 0
    files = checkpoint_manifest.listed_files(path, index)
    size = sum(f["size"] for f in files.values())
    print(f"verified: checkpoint {path}: {len(files)} files, {size} bytes, {checkpoint_manifest.ALGORITHM}")
    return 0
