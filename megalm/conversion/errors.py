"""The one error type of the conversion tools: a checkpoint or config that cannot be mapped."""

from __future__ import annotations

from megalm.errors import MegalmError


class ConversionError(MegalmError, ValueError):
    """The message names the offending field, file or tensor and what would be accepted."""
