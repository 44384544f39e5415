"""Metrics file, TensorBoard, W&B, log line, FLOPs accounting, device peaks and memory."""

import glob
import json
import math
import os
import time

import pytest
import torch

from megalm import flops
from megalm.training import memory
from megalm.training.metrics import MetricsWriter, WandbSetupError, check_wandb_ready, format_log_line
from tests.configs import make_config


def _record(iteration, loss):
    return {
        "iteration": iteration,
        "consumed_samples": 32 * iteration,
        "lm_loss": loss,
        "grad_norm": 1.0 / 7,
        "lr": 3e-4 * iteration / 10,
        "loss_scale": 1.0,
        "tokens_per_sec": 12345.678901234,
        "tflops_per_rank": 0.123456789,
        "elapsed_ms": 250.5,
        "global_batch_size": 32,
        "skipped_iterations": 0,
        "nan_iterations": 0,
        "load_balancing_loss": torch.tensor(0.25),
    }


def test_metrics_file_and_tensorboard(tmp_path):
    cfg = make_config(
        metrics_file=str(tmp_path / "out" / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"), validate=False
    )
    w = MetricsWriter(cfg, enabled=True)
    w.log_iteration(_record(10, 1.0 / 3))
    with open(cfg.logging.metrics_file) as f:  # flushed at once, before close
        assert json.loads(f.readline())["lm_loss"] == 1.0 / 3
    w.log_iteration(_record(20, 2.0 / 3))
    w.log_evaluation(20, "validation", 0.7)
    w.close()
    records = [json.loads(line) for line in open(cfg.logging.metrics_file)]
    assert len(records) == 3
    assert records[1] == {**_record(20, 2.0 / 3), "load_balancing_loss": 0.25}  # full precision, extras kept
    assert records[2] == {"iteration": 20, "split": "validation", "loss": 0.7, "ppl": math.exp(0.7)}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(events[0])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "loss-scale",
        "tokens-per-sec",
        "tflops-per-rank",
        "lm loss vs samples",
        "lm loss validation",
        "lm loss validation ppl",
        "load_balancing_loss",
    ):
        assert tag in tags
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [
        (10, pytest.approx(1 / 3)),
        (20, pytest.approx(2 / 3)),
    ]
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [320, 640]

    silent = tmp_path / "silent.jsonl"
    cfg.logging.metrics_file, cfg.logging.tensorboard_dir = str(silent), None
    off = MetricsWriter(cfg, enabled=False)  # not the logging rank
    off.log_iteration(_record(1, 1.0))
    off.log_evaluation(1, "validation", 1.0)
    off.close()
    assert not silent.exists()


def test_format_log_line():
    line = format_log_line(_record(10, 2.0), train_iters=1000)
    expected = [
        " iteration       10/    1000",
        "consumed samples:          320",
        "elapsed time per iteration (ms): 250.5",
        "learning rate: 3.000000E-04",
        "global batch size:    32",
        "lm loss: 2.000000E+00",
        "load balancing loss: 2.500000E-01",
        "loss scale: 1.0",
        "grad norm: 0.143",
        "number of skipped iterations:   0",
        "number of nan iterations:   0",
        "tokens per second: 12345.7",
        "TFLOP/s per rank: 0.123",
    ]
    assert line == " | ".join(expected) + " |"
    assert "grad norm" not in format_log_line({**_record(1, 1.0), "grad_norm": None}, 10)
    with_params = format_log_line({**_record(10, 2.0), "params_norm": 123.4567}, train_iters=1000)
    assert "grad norm: 0.143 | params norm: 123.457 | number of skipped" in with_params


# --- W&B -------------------------------------------------------------------------------------------


WANDB = dict(wandb_project="megalm-test", wandb_exp_name="unit")  # the tests add the save directory


def test_wandb_online_without_key_fails_at_startup(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    start = time.monotonic()
    with pytest.raises(WandbSetupError, match="WANDB_API_KEY.*WANDB_MODE=offline"):
        MetricsWriter(make_config(WANDB, wandb_save_dir=str(tmp_path / "wandb_runs"), validate=False), enabled=True)
    assert time.monotonic() - start < 2.0  # no network attempt
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    check_wandb_ready(
        make_config(WANDB, wandb_save_dir=str(tmp_path / "wandb_runs"), validate=False).logging
    )  # credentials found: no error


def test_wandb_offline_writes_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = make_config(WANDB, wandb_save_dir=str(tmp_path / "wandb_runs"), validate=False)
    w = MetricsWriter(cfg, enabled=True)
    w.log_iteration(_record(10, 1.5))
    w.log_evaluation(10, "validation", 1.4)
    w.close()
    runs = glob.glob(os.path.join(cfg.logging.wandb_save_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb"))


# --- FLOPs, peaks, memory ------------------------------------------------------------------------------


def test_flops_dense_gqa_swiglu_and_moe():
    B, s, L, h, V, heads = 4, 128, 2, 64, 1024, 4
    dense = flops.transformer_flops(B, s, L, h, heads, 4 * h, V)
    assert dense == pytest.approx(72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-12)
    assert dense == pytest.approx(603_979_776, rel=1e-12)  # by hand: 72*4*128*2*64^2 * (1 + 1/3 + 2/3)

    # GQA (2 groups of 4 heads, head dim 16) + SwiGLU (ffn 176): count each GEMM by hand.
    groups, d, f = 2, 16, 176
    fwd_per_token_layer = (
        2 * h * heads * d  # Q
        + 2 * 2 * h * groups * d  # K and V
        + 2 * heads * d * h  # output projection
        + 2 * 2 * s * heads * d  # QK^T and AV
        + 3 * 2 * h * f
    )  # SwiGLU: gate, up, down
    expected = 3 * B * s * (L * fwd_per_token_layer + 2 * h * V)  # x3: forward + two backward GEMMs
    got = flops.transformer_flops(B, s, L, h, heads, f, V, num_query_groups=groups, swiglu=True)
    assert got == pytest.approx(expected, rel=1e-12)

    shape = dict(num_layers=L, hidden_size=h, num_attention_heads=heads, seq_length=s, ffn_hidden_size=f, swiglu=True)
    gqa = dict(group_query_attention=True, num_query_groups=groups)
    cfg = make_config(shape, gqa, vocab_size=1000, make_vocab_size_divisible_by=128)
    assert cfg.model.padded_vocab_size == V
    assert flops.num_floating_point_operations(cfg, B) == pytest.approx(expected, rel=1e-12)

    # MoE hook: every layer MoE with top-2 routing doubles the MLP GEMMs
    moe = flops.transformer_flops(
        B, s, L, h, heads, f, V, num_query_groups=groups, swiglu=True, moe_router_topk=2, num_moe_layers=L
    )
    assert moe - got == pytest.approx(3 * B * s * L * 3 * 2 * h * f, rel=1e-12)


def test_device_peak_mfu_and_memory():
    assert flops.device_peak_flops(torch.bfloat16, override=5e12) == (5e12, "override")
    assert flops.DEVICE_PEAK_FLOPS["H100 SXM"]["bf16"] == 989e12 == flops.DEVICE_PEAK_FLOPS["H200"]["bf16"]
    assert flops.DEVICE_PEAK_FLOPS["A100"]["bf16"] == 312e12
    assert flops._table_entry("NVIDIA H100 80GB HBM3") is flops.DEVICE_PEAK_FLOPS["H100 SXM"]
    assert flops._table_entry("NVIDIA H100 PCIe") is flops.DEVICE_PEAK_FLOPS["H100 PCIe"]
    peak, source = flops.device_peak_flops(torch.float32, device=torch.device("cpu"))
    assert source.startswith("measured") and 1e9 < peak < 1e13
    for half, key in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        if not flops.cpu_has_native_half(half):  # this machine: the fp32 matmul, in milliseconds
            assert flops.device_peak_flops(half, device=torch.device("cpu")) == (
                flops.measure_matmul_flops(torch.float32),
                f"measured: 1024^3 fp32 matmul (this CPU has no native {key} instructions)",
            )
    assert flops.tflops_per_rank(8e12, 2.0, 2) == pytest.approx(2.0)
    assert flops.mfu(8e12, 2.0, 2, peak_flops=4e12) == pytest.approx(0.5)
    before = memory.peak_memory_bytes()
    blob = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB
    assert memory.peak_memory_bytes() >= before and memory.peak_memory_bytes() > 64 * 1024 * 1024
    del blob
    assert memory.peak_memory(torch.device("cpu"))["kind"] == "cpu_rss"
    assert "peak RSS" in memory.memory_report(rank=0)
    assert memory.gather_peak_memory() == [memory.peak_memory_bytes()]
