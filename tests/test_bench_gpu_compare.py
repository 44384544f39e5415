"""bench/gpu_compare.py at the tiny shape on CPU: megalm and plain PyTorch rows run in their own worker
processes with equal parameter counts, the JSON carries device, torch version, date and per-row
numbers, and peers that do not import are skipped with a one-line reason (nothing is installed)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu_compare.py")
sys.path.insert(0, os.path.join(REPO, "bench"))


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_tiny_cpu_run_writes_rows_and_skips_missing_peers(tmp_path):
    rows = "megalm-local-nofuse,plain-eager,mcore-local,titan-eager,megalm-te"
    cmd = [sys.executable, SCRIPT, "--shapes", "tiny,tiny-gpt", "--precision", "fp32", "--rows", rows]
    cmd += ["--warmup", "1", "--rounds", "1", "--steps", "2", "--threads", "1", "--out", str(tmp_path)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_compare.json").read_text())

    for key in ("device", "torch", "date", "command", "precision", "peak_flops", "shapes", "rows", "skipped"):
        assert key in result, key
    assert result["device"].startswith("CPU: ") and result["torch"] == __import__("torch").__version__
    # GPT-3 style (LayerNorm, GELU, learned positions, biases, tied): megalm and plain agree too.
    gpt = {r["row"]: r["params"] for r in result["rows"] if r["shape"] == "tiny-gpt"}
    h, f, v, s = 128, 512, 1024, 128
    gpt_layer = 4 * h + 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h
    assert gpt == {
        "megalm-local-nofuse": v * h + s * h + 2 * h + 2 * gpt_layer,
        "plain-eager": gpt["megalm-local-nofuse"],
    }
    got = {r["row"]: r for r in result["rows"] if r["shape"] == "tiny"}
    assert set(got) >= {"megalm-local-nofuse", "plain-eager"}, proc.stdout
    megalm, plain = got["megalm-local-nofuse"], got["plain-eager"]
    # Same model: the tiny Llama with GQA (4 heads, 2 KV groups), counted by hand.
    h, f, v, layers, kv = 128, 352, 1024, 2, 2 * 32
    per_layer = 2 * h + h * (h + 2 * kv) + h * h + h * 2 * f + f * h
    assert megalm["params"] == plain["params"] == 2 * v * h + h + layers * per_layer
    for r in (megalm, plain):
        assert r["steps_timed"] == 2 and r["step_s"] > 0 and r["peak_mem_gib"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 128 / r["step_s"])
        assert 0 < r["mfu"] == pytest.approx(r["tflops"] * 1e12 / result["peak_flops"])
        # Random tokens over 1024 ids: the first loss is near ln(1024).
        assert abs(r["first_loss"] - 6.93) < 0.5, r
    skipped = {s["row"]: s["reason"] for s in result["skipped"] if s["shape"] == "tiny"}
    assert "torchtitan has no GPT-3" in next(
        s["reason"] for s in result["skipped"] if s["row"] == "titan-eager" and s["shape"] == "tiny-gpt"
    )
    if not _importable("megatron"):
        assert skipped["mcore-local"].startswith("megatron-core not importable")
        assert "skip tiny mcore-local: megatron-core not importable" in proc.stdout
    if not _importable("torchtitan"):
        assert skipped["titan-eager"].startswith("torchtitan not importable")
    if not _importable("transformer_engine"):
        assert skipped["megalm-te"].startswith("transformer_engine not importable")


def test_unknown_row_and_shape_are_rejected(tmp_path, capsys):
    import gpu_compare

    with pytest.raises(SystemExit):
        gpu_compare.main(["--out", str(tmp_path), "--rows", "megalm-locl"])
    assert "unknown row 'megalm-locl'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_compare.main(["--out", str(tmp_path), "--shapes", "llama2b"])
    assert "unknown shape 'llama2b'" in capsys.readouterr().err


def test_budget_stops_starting_groups(tmp_path, capsys):
    import gpu_compare

    args = ["--out", str(tmp_path), "--shapes", "tiny", "--rows", "plain-eager,megalm-local", "--live", "1"]
    assert gpu_compare.main(args + ["--budget-s", "0"]) == 0
    result = json.loads((tmp_path / "gpu_compare.json").read_text())
    assert result["rows"] == []
    skipped = [(s["row"], s["reason"]) for s in result["skipped"]]
    assert skipped == [("plain-eager", "budget"), ("megalm-local", "budget")]
    assert "budget 0 s spent: not run tiny plain-eager" in capsys.readouterr().out
