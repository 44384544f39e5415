#!/usr/bin/env python
"""A second text corpus from what a Linux machine already holds: manual pages and license texts.

``bench/comm_efficient_dp.py`` trains on the quickstart corpus (Python's standard library) and on
this one, which megalm's quickstart never saw: English prose of another kind (man pages, package
copyright files, ``/usr/share/common-licenses``).  Man pages are gzip'd roff: request lines (``.TH``,
``.SH`` ...) keep their text, font escapes (``\\fB`` ...) are dropped.  Files are read in sorted order,
identical texts once, until ``--max-mb``; the same machine gives the same corpus.

    python3 bench/system_corpus.py --output system.jsonl --max-mb 10
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys

ROOTS = ("/usr/share/man", "/usr/share/common-licenses", "/usr/share/doc")
MAN_SHARE = 0.7  # man pages fill at most this share of the corpus, license texts the rest
_ESCAPE = re.compile(r"\\(f[BIRP]|f\(..|s[-+]?\d|\(..|\*\(..|\*.|[&\-e|^0 ])")
_REQUEST = re.compile(r"^\.\s*[A-Za-z]{1,3}\b\s?")


class CorpusTooSmall(Exception):
    """Fewer bytes of text than asked for were found under the roots."""


def roff_to_text(src: str) -> str:
    """The words of a man page: comments and macro definitions dropped, requests keep their arguments."""
    out = []
    lines = src.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith((".TH", ".Dd"))), 0)  # after the preamble
    for line in lines[start:]:
        if line.startswith(('.\\"', "'\\\"", ".de", "..", ".if", ".ie", ".el", ".ds", ".nr", ".tr")):
            continue
        line = _REQUEST.sub("", line) if line.startswith(".") else line
        line = _ESCAPE.sub(lambda m: "-" if m.group(1) == "-" else "", line).replace('"', "")
        if line.strip() and line.count("\\") * 8 < len(line):  # not a macro's body
            out.append(line.strip())
    return "\n".join(out)


def files(roots):
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if dirpath == root and root.endswith("/man"):  # English pages only (man1 ... man8, not de/, fr/ ...)
                dirnames[:] = [d for d in dirnames if d.startswith("man")]
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if root.endswith("/man") and name.endswith(".gz"):
                    yield path, "man"
                elif root.endswith("/doc") and name == "copyright":
                    yield path, "text"
                elif root.endswith("common-licenses"):
                    yield path, "text"


def read(path: str, kind: str):
    try:
        if kind == "man":
            with gzip.open(path, "rt", encoding="utf-8", errors="strict") as f:
                return roff_to_text(f.read())
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError, EOFError):
        return None


def build(output: str, max_mb: float, roots=ROOTS, min_mb: float = 1.0) -> int:
    """Write the corpus (JSON Lines, ``{"text", "source"}``); the number of bytes of text written."""
    limit, written, seen = int(max_mb * 1e6), 0, set()
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        skip_man = False
        for path, kind in files(roots):
            if skip_man and kind == "man":
                continue
            text = read(path, kind)
            if not text or len(text.strip()) < 200:
                continue
            digest = hashlib.sha1(text.encode("utf-8")).digest()
            if digest in seen:
                continue
            seen.add(digest)
            out.write(json.dumps({"text": text, "source": path}) + "\n")
            written += len(text.encode("utf-8"))
            if written >= limit:
                break
            if kind == "man" and written >= MAN_SHARE * limit:
                skip_man = True

    if written < min_mb * 1e6:
        os.unlink(tmp)
        raise CorpusTooSmall(f"only {written / 1e6:.2f} MB of man pages / license text under {', '.join(roots)}")
    os.replace(tmp, output)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="JSON Lines file to write")
    p.add_argument("--max-mb", type=float, default=10.0, help="stop after this many MB of text")
    args = p.parse_args(argv)
    n = build(args.output, args.max_mb)
    print(f"[corpus] {n / 1e6:.1f} MB of man pages and license text -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
