"""bench/train_throughput.py: the --quick path runs end to end on a toy shape (no timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "train_throughput.py"


def test_quick_toy_rows_with_the_trainer_loop_row(tmp_path):
    """--quick on the toy shape: megalm's raw train_step row, its "through the full trainer loop" row
    (--trainer-loop: trains through Trainer.train_iteration, loss from its log) with their speed ratio,
    and the plain-PyTorch row; one invocation (each worker process compiles)."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--shape",
            "toy",
            "--only",
            "megalm,plain",
            "--precision",
            "fp32",
            "--fusions",
            "on",
            "--steps",
            "1",
            "--trainer-loop",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["impl"], r["precision"], r["fusions"], r["loop"]) for r in rows] == [
        ("megalm", "fp32", "on", False),
        ("megalm", "fp32", "on", True),
        ("plain", "fp32", None, False),
    ]
    raw, loop, plain = rows
    assert len({r["params"] for r in rows}) == 1 and raw["params"] > 0
    for r in rows:
        assert len(r["step_times_s"]) == 2  # --quick: 2 rounds of 1 step
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] > 0
        assert r["maxrss_mb"] > 0 and r["threads"] == 2
        assert 0 < r["first_loss"] < 10  # ~ln(256) = 5.5 at random init: all train the same task
    assert raw["vs_plain"] > 0 and plain["vs_plain"] == 1.0
    assert "| toy | megalm | fp32 | on |" in proc.stdout
    assert loop["implementation"] == "megalm through the full trainer loop"
    assert loop["vs_step"] == pytest.approx(raw["median_step_s"] / loop["median_step_s"], rel=1e-9)
    assert "full trainer loop / raw train_step tokens/s" in proc.stdout
    log = (tmp_path / "logs" / "toy-megalm-on+loop_fp32.log").read_text()
    assert log.count(" iteration ") >= 3  # a log line every iteration (warm-up + 2 timed steps)
