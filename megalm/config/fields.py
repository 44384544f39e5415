"""What every configuration section shares: the flag field, the error, the check, and the
freeze that makes a validated section read-only."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from megalm.errors import MegalmError


class ConfigError(MegalmError, ValueError):
    """An invalid configuration; the message names the offending flags and values."""


def flag_field(default, help: str, **meta):
    """A dataclass field carrying its flag documentation (``help``) and argparse options
    (``flag``, ``aliases``: other spellings of the flag, ``action``, ``choices``, ``nargs``, ``derived``)."""
    meta["help"] = help
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def check(cond, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (naming the flags) unless ``cond``."""
    if not cond:
        raise ConfigError(message)


class Section:
    """Base of the config dataclasses: fields are assignable while the config is built and
    validated; :meth:`freeze` (called by :func:`megalm.config.validate_config` last) makes every
    later assignment raise :class:`dataclasses.FrozenInstanceError`.  A copy
    (``copy.deepcopy``, ``dataclasses.replace``) is a new, unfrozen config: edit it, then
    validate it again."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: the configuration is frozen after validation "
                f"(derive a copy with dataclasses.replace / copy.deepcopy and validate it)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(f"cannot delete {type(self).__name__}.{name}: frozen")
        object.__delattr__(self, name)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)

    def __getstate__(self):
        """Copies and pickles carry the fields, not the freeze."""
        state = dict(self.__dict__)
        state.pop("_frozen", None)
        return state
