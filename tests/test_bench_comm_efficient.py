"""bench/comm_efficient_dp.py without the cluster: its second corpus, its metrics arithmetic, its resumable
JSON-lines cells, its table and its verdict on issue 35's goal (in-process, synthetic cells)."""

import gzip
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import comm_efficient_dp as bench  # noqa: E402
import comm_efficient_report as rep  # noqa: E402
import system_corpus  # noqa: E402

PAGE = """.\\" a comment
.de Vb \\" macro definition
.ft CW
..
.TH LS 1 "2024" "coreutils"
.SH NAME
ls \\- list directory contents
.SH DESCRIPTION
List information about the \\fBFILEs\\fR (the current directory by default).
"""


def test_system_corpus_reads_english_man_pages_and_licenses_once(tmp_path):
    text = system_corpus.roff_to_text(PAGE)
    assert text.splitlines() == [
        'LS 1 "2024" "coreutils"'.replace('"', ""),
        "NAME",
        "ls - list directory contents",
        "DESCRIPTION",
        "List information about the FILEs (the current directory by default).",
    ]
    man, lic = tmp_path / "man", tmp_path / "common-licenses"
    for d in ("man1", "de/man1"):
        (man / d).mkdir(parents=True)
    body = PAGE + "More words about listing files. " * 20
    for d, name in (("man1", "ls.1.gz"), ("man1", "dir.1.gz"), ("de/man1", "ls.1.gz")):
        with gzip.open(man / d / name, "wt") as f:
            f.write(body)  # dir.1 is ls.1's copy: written once
    lic.mkdir()
    (lic / "MIT").write_text("Permission is hereby granted, free of charge, to any person. " * 10)
    out = tmp_path / "c.jsonl"
    n = system_corpus.build(str(out), max_mb=1.0, roots=(str(man), str(lic)), min_mb=0.0)
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [os.path.relpath(d["source"], tmp_path) for d in docs] == ["man/man1/dir.1.gz", "common-licenses/MIT"]
    assert n == sum(len(d["text"].encode()) for d in docs)
    with pytest.raises(system_corpus.CorpusTooSmall, match="only 0.00 MB"):
        system_corpus.build(str(out), max_mb=1.0, roots=(str(man), str(lic)), min_mb=0.5)


def _metrics(step_ms, losses, valid_every):
    rows = []
    for i, (ms, loss) in enumerate(zip(step_ms, losses), 1):
        rows.append({"iteration": i, "lm_loss": loss, "elapsed_ms": ms, "inter_node_bytes": 4e6})
        if i % valid_every == 0:
            rows.append({"iteration": i, "split": "validation", "loss": loss + 0.5})
    return rows


def test_parse_metrics_excludes_the_first_iteration_and_evaluations():
    r = bench.parse_metrics(_metrics([9000, 500, 500, 1000], [9.0, 8.0, 7.0, 6.0], 2))
    assert r["tokens_per_s"] == pytest.approx(3 * bench.TOKENS_PER_ITER / 2.0)
    assert r["valid"] == [(2 * 2048, 9.5, 8.5), (4 * 2048, 11.0, 6.5)]
    assert r["valid_loss"] == 6.5 and r["inter_node_MB_per_step"] == pytest.approx(4.0)
    with pytest.raises(bench.BenchInputError, match="no training iteration"):
        bench.parse_metrics([{"iteration": 1, "split": "validation", "loss": 1.0}])


def _cell(corpus, seed, method, tps, valid, link="100mbit", iters=256):
    return {
        "corpus": corpus, "bandwidth": link, "seed": seed, "method": method, "iters": iters, "tokens_per_iter": 2048,
        "started": "2026-11-29T07:00:00+00:00", "load_before": [3.0, 3, 3], "load_after": [5.0, 5, 5],
        "cpu": "test CPU", "nproc": 2, "tokens_per_s": tps, "valid_loss": valid, "inter_node_MB_per_step": 1.0,
        "valid": [(iters * 2048, 100.0, valid)], "curve": [(1.0, 9.0), (100.0, valid)],
    }  # fmt: skip


def _table(int8_gaps=(0.001, 0.002), int8_x=3.5):
    cells = []
    for corpus in ("quickstart", "system"):
        for seed, g in zip((1, 2), int8_gaps):
            cells += [_cell(corpus, seed, "plain", 600.0, 5.0), _cell(corpus, seed, "hierarchical", 800.0, 5.0)]
            cells.append(_cell(corpus, seed, "int8", 600.0 * int8_x, 5.0 * (1 + g)))
    return cells


def test_report_ratios_gaps_and_verdict():
    cells = _table()
    table = rep.compared(cells)[("quickstart", "100mbit", 256)]
    (c,) = [c for c in table["int8"] if c["seed"] == 2]
    assert (c["x_plain"], c["x_hier"], c["gap"]) == pytest.approx((3.5, 2100 / 800, 0.002))
    text = rep.report(cells, bench.METHODS)
    row = "| int8 inter-node, hierarchical | 2 | 2100 | 3.50 | 2.62 | 1.000 | 5.0050 to 5.0100 | +0.10% to +0.20% |"
    assert row in text
    assert "1-min load average 3.0-5.0" in text
    ceiling = rep.report(cells + [_cell("system", 1, "hierarchical", 2400.0, 5.0, link="unshaped")], bench.METHODS)
    assert "No link limit (hierarchical DP, unshaped, seeds [1], 1-min load 3.0-5.0): 2400 tokens/s, 4.00x" in ceiling
    holds, x, gap, spread, reasons = rep.judge(cells, "int8")
    assert holds and reasons == [] and (x, gap, spread) == pytest.approx((3.5, 0.002, 0.001))
    assert "best: int8 inter-node, hierarchical, 3.50x plain DP at worst, loss margin 1.80 pts" in rep.verdict(
        cells, bench.METHODS
    )
    # each way of missing the goal, with its reason
    assert rep.judge(_table(int8_x=2.9), "int8")[4] == ["2.90x < 3x"]
    assert rep.judge(_table(int8_gaps=(0.019, 0.021)), "int8")[4] == ["loss gap +2.10% > 2%"]
    assert rep.judge(_table(int8_gaps=(0.01, 0.019)), "int8")[4] == ["spread 0.90 pts >= margin 0.10 pts"]
    one_corpus = [c for c in cells if c["corpus"] == "quickstart" or c["seed"] == 1]
    assert rep.judge(one_corpus, "int8")[4] == ["system: 1 of 2 seeds measured"]
    short = [dict(c, iters=128) for c in cells]
    assert "not measured on the goal's cells" in rep.verdict(short, bench.METHODS)
    assert "best: none meets the goal" in rep.verdict(short, bench.METHODS)


def test_measure_appends_cells_and_resumes(tmp_path, monkeypatch, capsys):
    ran = []

    def fake_cell(corpus, data_dir, bandwidth, seed, method, args, tmp):
        ran.append((corpus, bandwidth, seed, method))
        return _cell(corpus, seed, method, 1000.0, 5.0, link=bandwidth, iters=args.iters)

    monkeypatch.setattr(bench, "run_cell", fake_cell)
    monkeypatch.setattr(bench, "prepare_corpus", lambda name, root: str(tmp_path / name))
    results = str(tmp_path / "r.jsonl")
    base = ["--results", results, "--corpora", "system", "--bandwidths", "100mbit", "--methods", "plain,int8"]
    assert bench.main(base + ["--seeds", "1"]) == 0
    assert ran == [("system", "100mbit", 1, "plain"), ("system", "100mbit", 1, "int8")]
    assert bench.main(base + ["--seeds", "1,2"]) == 0  # seed 1 is in the file: only seed 2 runs
    assert ran[2:] == [("system", "100mbit", 2, "plain"), ("system", "100mbit", 2, "int8")]
    assert len(bench.load_results([results])) == 4
    assert bench.main(base[:-1] + ["int2"]) == 2
    assert "unknown method int2; known: plain, hierarchical" in capsys.readouterr().err
    with open(results, "a") as f:
        f.write('{"corpus": "sys')  # a run killed mid-write
    assert bench.main(["--report", results]) == 2
    assert "r.jsonl:5: not a JSON line" in capsys.readouterr().err


def test_split_measurement_shares_loss_runs_and_checks_the_speed_runs_losses(tmp_path, monkeypatch, capsys):
    """--speed-window: one unshaped loss run per (corpus, seed, method) shared by every link (none for
    --speed-only), a short shaped speed run per link whose window gives tokens/s and whose training
    losses are compared with the loss run's (a difference is recorded and fails the goal)."""
    calls = []
    step_ms = {"unshaped": 100.0, "100mbit": 1000.0, "1gbit": 200.0}

    def fake_cluster(corpus, data_dir, bandwidth, seed, method, args, tmp, iters, tag="", extra=()):
        calls.append((bandwidth, method, iters, tag))
        ms = step_ms[bandwidth] / (4 if method == "int8" else 1)
        drift = 1e-3 if (method, bandwidth) == ("int8", "1gbit") else 0.0  # a speed run that is not the same math
        rows = [{"iteration": i, "lm_loss": 10.0 - i + (drift if tag else 0), "elapsed_ms": 9e3 if i == 1 else ms}
                for i in range(1, iters + 1)]  # fmt: skip
        return rows + ([{"iteration": iters, "split": "validation", "loss": 4.0}] if "--eval-interval" in extra else [])

    monkeypatch.setattr(bench, "run_cluster", fake_cluster)
    monkeypatch.setattr(bench, "prepare_corpus", lambda name, root: str(tmp_path / name))
    results = str(tmp_path / "r.jsonl")
    argv = ["--results", results, "--corpora", "system", "--bandwidths", "100mbit,1gbit", "--seeds", "1", "--iters",
            "8", "--speed-window", "2", "--speed-warmup", "2", "--methods", "plain,hierarchical,int8"]  # fmt: skip
    assert bench.main(argv) == 0
    assert calls == [("unshaped", "plain", 8, "_loss"), ("100mbit", "plain", 5, "_speed"),
                     ("100mbit", "hierarchical", 5, "_speed"), ("unshaped", "int8", 8, "_loss"),
                     ("100mbit", "int8", 5, "_speed"), ("1gbit", "plain", 5, "_speed"),
                     ("1gbit", "hierarchical", 5, "_speed"), ("1gbit", "int8", 5, "_speed")]  # fmt: skip
    records = bench.load_results([results])
    assert [r.get("kind") for r in records].count("loss_run") == 2
    cells = {(r["bandwidth"], r["method"]): r for r in rep.cells_of(records)}
    plain, int8 = cells[("100mbit", "plain")], cells[("100mbit", "int8")]
    assert plain["tokens_per_s"] == pytest.approx(2048.0) and int8["tokens_per_s"] == pytest.approx(4 * 2048.0)
    assert plain["speed_window"] == [3, 4] and plain["valid_loss"] == 4.0 and plain["unshaped_tokens_per_s"] > 0
    assert plain["loss_check"] == {"iterations": 5, "max_rel_diff": 0.0, "equal": True}
    assert (
        cells[("100mbit", "hierarchical")]["valid_loss"] is None
        and "loss_check" not in cells[("100mbit", "hierarchical")]
    )
    bad = cells[("1gbit", "int8")]["loss_check"]
    assert not bad["equal"] and bad["max_rel_diff"] == pytest.approx(1e-3 / 5.0)
    text = rep.report(records, bench.METHODS)
    assert "Measured: tokens/s: iterations 3-4 of a 5-iteration run at 100mbit; loss: a 8-iteration run" in text
    assert "1 of 2 cells bit for bit; largest relative difference 2.00e-04" in text
    int8["loss_check"] = bad  # the goal is not judged on a cell whose speed run is not its loss run's math
    assert (
        "system: speed runs' losses differ from the loss runs' (seeds [1])"
        in rep.judge([dict(r, iters=256) for r in records], "int8")[4]
    )
    assert bench.main(argv) == 0 and len(calls) == 8  # everything measured: nothing runs again
    # a window that is not a multiple of a method's period H
    assert bench.main(argv[:-1] + ["local_sgd_h8_overlap1"]) == 2
    assert "--speed-window 2 must be a multiple of every method's period H (not of local_sgd_h8_overlap1 (H=8))" in (
        capsys.readouterr().err
    )
    # a window inside a method's warm-up would time its exact steps
    assert bench.main(argv[:-1] + ["powersgd32_warm32"]) == 2
    assert "--speed-warmup 2 ends inside the warm-up of powersgd32_warm32 (32)" in capsys.readouterr().err
    # --quiet-grid: issue 35's cells; flags given explicitly override its values
    calls.clear()
    grid = ["--quiet-grid", "--results", str(tmp_path / "g.jsonl"), "--seeds", "1,2", "--iters", "8"]
    assert bench.main(grid + ["--corpora", "system", "--bandwidths", "100mbit"]) == 0
    g = bench.QUIET_GRID
    speed_iters = g["speed_warmup"] + g["speed_window"] + 1
    assert calls == [
        ("unshaped", "plain", 8, "_loss"), ("100mbit", "plain", speed_iters, "_speed"),
        ("100mbit", "hierarchical", speed_iters, "_speed"), ("unshaped", "int8", 8, "_loss"),
        ("100mbit", "int8", speed_iters, "_speed"), ("unshaped", "int4", 8, "_loss"),
        ("100mbit", "int4", speed_iters, "_speed"),
        ("unshaped", "plain", 8, "_loss"), ("unshaped", "int8", 8, "_loss"), ("unshaped", "int4", 8, "_loss"),
    ]  # fmt: skip
    # the second seed: its own loss runs, seed 1's speed runs (said so in the cell, no loss check)
    cells = {(r["seed"], r["method"]): r for r in rep.cells_of(bench.load_results([str(tmp_path / "g.jsonl")]))}
    again = cells[(2, "int8")]
    assert again["tokens_per_s"] == cells[(1, "int8")]["tokens_per_s"] and again["speed_of_seed"] == 1
    assert "tokens/s: seed 1's speed run" in again["measured"] and "loss_check" not in again
    assert "loss_check" in cells[(1, "int8")] and cells[(1, "int8")]["speed_of_seed"] == 1
