"""megalm's log lines: a warning shows its level on every rank that logs it; INFO stays on one rank
without a level; and no library message fakes a warning as INFO with a "warning:" prefix."""

from __future__ import annotations

import ast
import io
import os

from megalm.log import get_logger
from tests.logs import megalm_logs

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megalm")


def test_warning_shows_its_level_on_every_rank():
    logger = get_logger("megalm.test_log")
    for rank, expected in ((0, "[megalm rank 0] info line\n"), (1, "")):
        out = io.StringIO()
        with megalm_logs(out, rank=rank, world_size=2):
            logger.info("info line")
            logger.warning("disk almost full on %s", "node-1")
            logger.error("error: %s", "bad flag")  # as the entry points write errors
        assert out.getvalue() == (
            f"{expected}[megalm rank {rank}] WARNING: disk almost full on node-1\n"
            f"[megalm rank {rank}] error: bad flag\n"
        )
    out = io.StringIO()
    with megalm_logs(out):
        logger.warning("one process")
    assert out.getvalue() == "[megalm] WARNING: one process\n"


def _message_prefix(call: ast.Call) -> str:
    if not call.args:
        return ""
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    if isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant):
        return str(first.values[0].value)
    return ""


def test_no_warning_disguised_as_info():
    """``logger.<level>("warning: ...")`` anywhere in megalm/: a warning is ``logger.warning(...)``,
    whose line already reads ``WARNING:``."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "warn")
                    and _message_prefix(node).lower().startswith("warning")
                ):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert found == []
