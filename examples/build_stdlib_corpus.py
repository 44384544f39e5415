#!/usr/bin/env python
"""Build a JSON Lines text corpus from the Python standard library's sources on this machine.

Every machine with Python has this text, so the quickstart needs no download.  Each
module becomes one document ``{"text": ...}``; files are taken in sorted order (the
corpus is the same on every run of the same Python) until ``--max-mb`` is reached.

    python examples/build_stdlib_corpus.py --output corpus.jsonl --max-mb 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig


def stdlib_files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith((".py", ".txt", ".rst")):
                yield os.path.join(dirpath, name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSON Lines file to write")
    parser.add_argument("--max-mb", type=float, default=20.0, help="stop after this many MB of text")
    parser.add_argument(
        "--root", default=sysconfig.get_paths()["stdlib"], help="directory to read (default: the stdlib)"
    )
    args = parser.parse_args(argv)
    limit = int(args.max_mb * 1e6)
    written = docs = 0
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for path in stdlib_files(args.root):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if len(text.strip()) < 64:
                continue
            out.write(json.dumps({"text": text, "source": os.path.relpath(path, args.root)}) + "\n")
            written += len(text.encode("utf-8"))
            docs += 1
            if written >= limit:
                break
    os.replace(tmp, args.output)
    print(f"[corpus] {docs} documents, {written / 1e6:.1f} MB of text from {args.root} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
