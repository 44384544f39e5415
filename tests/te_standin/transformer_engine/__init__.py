"""CPU stand-in for NVIDIA Transformer Engine (see tests/te_standin/__init__.py)."""

from . import common  # noqa: F401
