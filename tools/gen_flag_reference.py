#!/usr/bin/env python
"""Write docs/reference/flags.md from pretrain_gpt.py's argument parser (megalm/config/flag_reference.py).

python3 tools/gen_flag_reference.py            # rewrite the page
python3 tools/gen_flag_reference.py --check    # exit 1 when the page is out of date
"""

import argparse
import os
import sys

from megalm.config.flag_reference import COMMAND, PAGE, render

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))  # the page's repository


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 when the page differs.")
    args = parser.parse_args(argv)
    path = os.path.join(_ROOT, PAGE)
    text = render()
    if args.check:
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        if current != text:
            print(f"{PAGE} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
