"""--optimizer-offload-device nvme --offload-path DIR: the offloaded parameters' fp32 copies and optimizer
state live in swap files (one per bucket), read and written each step by a background thread.

* fp32 / bf16, plain and distributed optimizer (ZeRO-2, ZeRO-3; one rank), fractions 0.5 and 1, AdamW and
  Lion: weights after 3 clipped steps bit-identical to the CPU offload's and to no offload's; bytes read =
  bytes written = steps x (4 + state bytes) per offloaded element (the formula), counted on the files; the
  files hold header + payload; between steps no state tensor of the offloaded parameters is in memory;
* a checkpoint (sharded state dict: the state, not the files) saved with NVMe offload loads into a fresh
  NVMe-offloaded optimizer and into a CPU-offloaded one, and both continue exactly;
* errors before training: a missing, non-directory or unwritable path, too little free space, a swap file
  of another run (live: named; the files are removed at close), config combinations.
"""

import os

import pytest
import torch

from megalm.config.fields import ConfigError
from megalm.optimizer.swap_files import HEADER_BYTES, SwapError
from tests.test_optimizer_offload import _blocks, _build, _steps


def _build_nvme(dtype, strategy, fraction, path, optimizer="adam"):
    from megalm.config import ParallelConfig
    from megalm.distributed import DistributedDataParallel
    from megalm.optimizer import build_optimizer
    from megalm.parallel_state import get_process_groups
    from tests.configs import optimizer_config
    from tests.test_ddp import OPTIMIZER
    from tests.test_distrib_optimizer import _mlp

    model = _mlp(dtype)
    cfg = optimizer_config(OPTIMIZER)
    cfg.training.optimizer = optimizer
    cfg.training.optimizer_offload_device = "nvme"
    cfg.training.offload_path = str(path)
    cfg.training.optimizer_offload_fraction = fraction
    chunk = model
    if strategy is not None:
        cfg.parallel.data_parallel_sharding_strategy = strategy
        chunk = DistributedDataParallel(
            model, ParallelConfig(data_parallel_sharding_strategy=strategy), process_groups=get_process_groups()
        )
    return model, chunk, build_optimizer(cfg, [chunk], report_memory=False, process_groups=get_process_groups())


@pytest.mark.parametrize(
    "dtype, strategy, fraction, optimizer",
    [
        (torch.float32, None, 1.0, "adam"),
        (torch.bfloat16, "optim_grads", 0.5, "adam"),
        (torch.float32, "optim_grads_params", 1.0, "adam"),
        (torch.float32, None, 1.0, "lion"),
    ],
)
def test_nvme_offload_is_bit_identical_to_cpu_offload(tmp_path, dtype, strategy, fraction, optimizer):
    ref = _steps(*_build(dtype, strategy, None), 3) if optimizer == "adam" else None
    cpu = _steps(*_build(dtype, strategy, fraction), 3) if optimizer == "adam" else None
    model, chunk, opt = _build_nvme(dtype, strategy, fraction, tmp_path, optimizer)
    off = opt.offload
    assert len(off.buckets) >= 2
    got = _steps(model, chunk, opt, 3)
    if optimizer == "adam":
        for a, b, c in zip(got, cpu, ref):
            assert torch.equal(a, b) and torch.equal(a, c)
    else:  # Lion: the same layout without offload
        from megalm.optimizer import build_optimizer
        from megalm.parallel_state import get_process_groups
        from tests.configs import optimizer_config
        from tests.test_ddp import OPTIMIZER
        from tests.test_distrib_optimizer import _mlp

        plain = _mlp(dtype)
        cfg = optimizer_config(OPTIMIZER)
        cfg.training.optimizer = "lion"
        plain_opt = build_optimizer(cfg, [plain], report_memory=False, process_groups=get_process_groups())
        for a, b in zip(got, _steps(plain, plain, plain_opt, 3)):
            assert torch.equal(a, b)
    state_bytes = 8 if optimizer == "adam" else 4  # two moments / one momentum, fp32
    per_step = (4 + state_bytes) * off.numel
    # each step reads and writes every bucket once; building wrote the initial state once
    assert off.files.bytes_read == 3 * per_step == 3 * off.disk_bytes
    assert opt.offload_io_bytes() == (3 * per_step, 4 * per_step)
    assert off.numel == (244 if fraction == 1.0 else 64 + 128)
    sizes = [os.path.getsize(p) for p in off.files.paths]
    assert sizes == [HEADER_BYTES + n for n in off.payload_bytes]
    for _, host in off.pairs:  # nothing of the offloaded state between steps
        assert host.numel() == 0
        assert all(t.numel() <= 1 for t in opt.optimizer.state[host].values())
    staging = 2 * (max(off.payload_bytes) + max(4 * sum(m.numel() for m, _ in b) for b in off.buckets))
    assert opt.memory_breakdown()["host"] == staging < 2 * per_step
    opt.close()
    assert not any(os.path.exists(p) for p in off.files.paths)


def test_nvme_checkpoint_round_trip(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, chunk, opt = _build_nvme(torch.bfloat16, "optim_grads", 1.0, tmp_path / "a")
    _steps(model, chunk, opt, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(zip(opt.names, opt.model_params))
    state = {k: [b.local.clone() for b in _blocks(v)] for k, v in opt.sharded_state_dict(params).items()}
    assert any(k.endswith("exp_avg_sq") for k in state) and opt.offload.resident
    ref = _steps(model, chunk, opt, 1, seed=1)  # the step folds the materialized state back
    assert not opt.offload.resident
    opt.close()

    for kind in ("nvme", "cpu"):
        if kind == "nvme":
            model2, chunk2, fresh = _build_nvme(torch.bfloat16, "optim_grads", 1.0, tmp_path / "b")
        else:
            model2, chunk2, fresh = _build(torch.bfloat16, "optim_grads", 1.0)
        model2.load_state_dict(saved)
        for k, v in fresh.sharded_state_dict(dict(zip(fresh.names, fresh.model_params))).items():
            for block, t in zip(_blocks(v), state[k]):
                block.local.copy_(t)
        fresh.load_sharded_state_dict(fresh.common_state_dict(), main_params_loaded=True)
        got = _steps(model2, chunk2, fresh, 1, seed=1)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), kind
        fresh.close()


def _validate(**flags):
    from tests.configs import optimizer_config
    from tests.test_ddp import OPTIMIZER

    cfg = optimizer_config(OPTIMIZER)
    for k, v in flags.items():
        setattr(cfg.training, k, v)
    cfg.training.validate()


def test_nvme_offload_errors(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, match in [(tmp_path / "missing", "does not exist"), (afile, "not a directory")]:
        with pytest.raises(ConfigError, match=match):
            _validate(optimizer_offload_device="nvme", offload_path=str(path))
        with pytest.raises(SwapError, match=match):  # the optimizer checks again when it creates the files
            _build_nvme(torch.float32, None, 1.0, path)
    if os.geteuid() != 0:  # root writes anywhere: then only a read-only mount would show it
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(ConfigError, match="not writable"):
            _validate(optimizer_offload_device="nvme", offload_path=str(locked))

    # another run's files: named, refused; gone after close, then usable
    _, _, first = _build_nvme(torch.float32, None, 1.0, tmp_path)
    owner = rf"already exists: it belongs to run {first.offload.files.run} \(pid {os.getpid()} on"
    with pytest.raises(SwapError, match=owner):
        _build_nvme(torch.float32, None, 1.0, tmp_path)
    first.close()
    _, _, again = _build_nvme(torch.float32, None, 1.0, tmp_path)
    again.close()

    # too little free space: checked against statvfs before any file is written
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))
    with pytest.raises(SwapError, match=r"MiB free, this rank's optimizer swap files need"):
        _build_nvme(torch.float32, None, 1.0, tmp_path)
    monkeypatch.undo()
    assert not list(tmp_path.glob("megalm-optim-*"))

    for flags, match in [
        (dict(optimizer_offload_device="nvme"), "needs --offload-path"),
        (dict(offload_path=str(tmp_path)), "--offload-path needs --optimizer-offload-device nvme"),
        (dict(optimizer_offload_device="nvme", offload_path=str(tmp_path), optimizer="lamb"), "element-wise"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _validate(**flags)
    _validate(optimizer_offload_device="nvme", offload_path=str(tmp_path))
