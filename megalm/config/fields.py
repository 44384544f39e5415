"""The dataclass field every configuration section uses: a default plus its flag's metadata."""

from __future__ import annotations

from dataclasses import field


def flag_field(default, help: str, **meta):
    """A dataclass field carrying its flag documentation (``help``) and argparse options
    (``flag``, ``aliases``: other spellings of the flag, ``action``, ``choices``, ``nargs``, ``derived``)."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
