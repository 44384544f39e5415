"""The command line built from the configuration dataclasses: one flag per field, grouped by
section, parsed into a :class:`~megalm.config.sections.MegalmConfig` and validated."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import List, Optional, Union

from megalm.config.sections import SECTIONS, ConfigError, MegalmConfig
from megalm.config.validation import validate_config
from megalm.errors import TrainingStopped


def parse_moe_layer_freq(text) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an int, or a list written as a Python literal built from int lists with
    ``+`` and ``*`` (Megatron's form, e.g. ``"([0]+[1]*3)*2"``).  Evaluated without ``eval``."""
    import ast

    if isinstance(text, (int, list)):
        return text

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    try:
        out = value(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f'--moe-layer-freq {text!r} is neither an int nor a list such as "[0,1,1,1]" or "([0]+[1]*3)*2"'
        ) from None
    if isinstance(out, list) and not all(isinstance(v, int) for v in out):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} must be a flat list of 0/1 entries")
    return out


def parse_int_pair(text) -> List[int]:
    """``--window-size``: Megatron's ``left,right`` pair (``"127,0"`` or ``"(127,0)"``) -> ``[127, 0]``."""
    if isinstance(text, (list, tuple)):
        return [int(v) for v in text]
    try:
        values = [int(v) for v in str(text).strip("()[] ").split(",")]
    except ValueError:
        values = []
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two integers such as 127,0, got {text!r}")
    return values


# Flag parsers for fields whose type is not a plain int/float/str (metadata["type"]).
_FLAG_TYPES = {"moe_layer_freq": parse_moe_layer_freq, "int_pair": parse_int_pair}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, List):
        return _base_type(typing.get_args(tp)[0])
    return tp


def add_config_arguments(
    parser: argparse.ArgumentParser, extra_sections: Optional[dict] = None
) -> argparse.ArgumentParser:
    """Add one flag per config field (and its ``aliases``, other spellings), grouped by section."""
    sections = dict(SECTIONS, **(extra_sections or {}))
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("derived"):
                continue
            kw = {"dest": f"{section}.{f.name}", "help": f.metadata.get("help")}
            action = f.metadata.get("action")
            tp = hints[f.name]
            if action or _base_type(tp) is bool:
                kw["action"] = action or "store_true"
                kw["default"] = f.default
            else:
                kw["type"] = _FLAG_TYPES.get(f.metadata.get("type"), _base_type(tp))
                kw["default"] = _field_default(f)
                for key in ("choices", "nargs"):
                    if key in f.metadata:
                        kw[key] = f.metadata[key]
                if "choices" not in f.metadata:
                    kw["metavar"] = f.name.upper()
            group.add_argument(_flag(f), *f.metadata.get("aliases", ()), **kw)
    return parser


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


class RaisingArgumentParser(argparse.ArgumentParser):
    """An argparse parser for library callers: a bad flag raises :class:`ConfigError` with
    argparse's message instead of printing it and exiting; ``--help`` (printed by argparse)
    raises :class:`megalm.errors.TrainingStopped` with exit code 0."""

    def error(self, message):
        raise ConfigError(message)

    def exit(self, status=0, message=None):
        if status == 0 and message is None:  # --help / --version: argparse printed it
            raise TrainingStopped("help shown", exit_code=0)
        raise ConfigError(message or f"argument parsing stopped (status {status})")


def build_parser(
    description: str = "megalm", extra_sections: Optional[dict] = None, exit_on_error: bool = True
) -> argparse.ArgumentParser:
    """The parser of every config flag.  ``exit_on_error`` True: argparse's command-line behaviour
    (usage message, exit status 2), for entry points; False: a :class:`ConfigError` is raised."""
    cls = argparse.ArgumentParser if exit_on_error else RaisingArgumentParser
    parser = cls(description=description, allow_abbrev=False)
    return add_config_arguments(parser, extra_sections)


def config_from_args(args: argparse.Namespace) -> MegalmConfig:
    values = vars(args)
    kwargs = {}
    for section, cls in SECTIONS.items():
        kwargs[section] = cls(
            **{
                f.name: values[f"{section}.{f.name}"]
                for f in dataclasses.fields(cls)
                if f"{section}.{f.name}" in values
            }
        )
    return MegalmConfig(**kwargs)


def given_flags(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> set:
    """The ``section.field`` destinations set on the command line ``argv`` (not by a default)."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action in parser._actions:
            action.default = saved[action.dest]


def parse_config(argv: Optional[List[str]] = None, world_size: Optional[int] = None) -> MegalmConfig:
    """Parse Megatron-style flags and validate them (before any process group exists).

    A bad flag or combination raises :class:`ConfigError` (entry points print it after
    argparse's usage line and exit 2, see ``pretrain_gpt.main``); ``--help`` prints the help and
    raises ``TrainingStopped`` with exit code 0."""
    parser = build_parser(exit_on_error=False)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if cfg.checkpoint.use_checkpoint_args:
        from megalm.config.checkpoint_args import apply_checkpoint_args

        apply_checkpoint_args(cfg, given_flags(parser, argv))
    return validate_config(cfg, world_size=world_size)
