"""Stand-in for ``transformer_engine.pytorch.fp8``: the ``fp8_autocast`` region (recorded, no fp8
arithmetic) and the hardware check."""

import contextlib

from transformer_engine.common.recipe import DelayedScaling

_STATE = {"enabled": False, "recipe": None, "group": None}
# (recipe, fp8_group) of every fp8_autocast(enabled=True) region entered, in order (tests read it).
ENTERED = []


def check_fp8_support():
    """``(available, reason)`` as TE 1.x's; tests monkeypatch it to play an older GPU."""
    return True, ""


def is_fp8_enabled() -> bool:
    return _STATE["enabled"]


def get_fp8_recipe():
    return _STATE["recipe"]


def get_fp8_group():
    return _STATE["group"]


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph: bool = False
):
    """TE modules inside run their GEMMs in fp8 (here: recorded only); ``fp8_recipe`` defaults to
    ``DelayedScaling()``; amaxes are reduced over ``fp8_group`` (here: recorded only)."""
    saved = dict(_STATE)
    if enabled:
        fp8_recipe = DelayedScaling() if fp8_recipe is None else fp8_recipe
        ENTERED.append((fp8_recipe, fp8_group))
        _STATE.update(enabled=True, recipe=fp8_recipe, group=fp8_group)
    else:
        _STATE.update(enabled=False, recipe=None, group=None)
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)
