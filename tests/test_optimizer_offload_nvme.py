"""--optimizer-offload-device nvme --offload-path DIR: the offloaded parameters' fp32 copies and optimizer
state live in swap files (one per bucket), read and written each step by a background thread.

* fp32 / bf16, plain and distributed optimizer (ZeRO-2, ZeRO-3; one rank), fractions 0.5 and 1, AdamW and
  Lion: weights after 3 clipped steps bit-identical to the CPU offload's and to no offload's; bytes read =
  bytes written = steps x (4 + state bytes) per offloaded element (the formula), counted on the files; the
  files hold header + payload; between steps no state tensor of the offloaded parameters is in memory;
* checkpoints stream the swap files (fp32 plain, bf16 distributed optimizer): a save with NVMe offload reads
  each swapped moment once and holds nothing, and writes the in-memory run's checkpoint (same metadata, same
  bytes); it loads without offload, the in-memory one loads with it (written straight into the files), and
  both continue exactly; an --async-save snapshot (stage_to_cpu) reads the in-memory run's values from the
  files, an in-memory checkpoint's restore (fill_blocks) writes them; on the CPU allocator's count a save
  holds one swapped tensor at a time (the whole state when materialized), a load DCP's own read plus one; a
  swap block reads and writes any view of its tensor (slices, flat ranges, transposes) as memory would;
* errors before training: a missing, non-directory or unwritable path, too little free space, a swap file
  of another run (live: named; the files are removed at close), config combinations.
"""

import os

import pytest
import torch

from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.local import fill_blocks
from megalm.checkpoint.model_state import optimizer_sharded_state
from megalm.checkpoint.safe_metadata import load_metadata
from megalm.checkpoint.save import save_checkpoint, stage_to_cpu
from megalm.config.fields import ConfigError
from megalm.optimizer.swap_files import HEADER_BYTES, SwapError
from megalm.training.memory import TrackedAllocations
from tests.test_distrib_optimizer import _mlp
from tests.test_optimizer_offload import _blocks, _build, _steps
from tests.training_runs import offload_optimizer


def _build_nvme(dtype, strategy, fraction, path, optimizer="adam"):
    return offload_optimizer(_mlp(dtype), strategy, offload="nvme", fraction=fraction, path=path, optimizer=optimizer)


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
        for a, b in zip(got, _steps(*offload_optimizer(_mlp(dtype), optimizer="lion"), 3)):
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


@pytest.mark.parametrize("dtype, strategy", [(torch.float32, None), (torch.bfloat16, "optim_grads")])
def test_nvme_checkpoints_stream_the_swap_files(tmp_path, dtype, strategy):
    for d in ("swap_a", "swap_b"):
        (tmp_path / d).mkdir()
    nvme = _build_nvme(dtype, strategy, 1.0, tmp_path / "swap_a")
    plain = offload_optimizer(_mlp(dtype), strategy)
    for model, chunk, opt in (nvme, plain):
        _steps(model, chunk, opt, 2)
        save_checkpoint(str(tmp_path / ("nvme" if opt is nvme[2] else "plain")), 2, [chunk], opt)
    off = nvme[2].offload
    assert off.files.ranges_read == 8 * off.numel and not off.resident  # each moment read once, nothing held
    # the in-memory run's checkpoint: the same tensors (keys, shapes, dtypes, places in the files), the same bytes
    saved = {k: f"{tmp_path}/{k}/iter_0000002" for k in ("nvme", "plain")}
    meta = {k: load_metadata(v) for k, v in saved.items()}
    assert meta["nvme"].state_dict_metadata == meta["plain"].state_dict_metadata
    assert meta["nvme"].storage_data == meta["plain"].storage_data
    assert any(k.endswith(".exp_avg_sq") for k in meta["nvme"].state_dict_metadata)
    files = sorted(f for f in os.listdir(saved["plain"]) if f.endswith(".distcp"))
    assert files and files == sorted(f for f in os.listdir(saved["nvme"]) if f.endswith(".distcp"))
    for f in files:
        assert (tmp_path / saved["nvme"] / f).read_bytes() == (tmp_path / saved["plain"] / f).read_bytes()
    # an --async-save's snapshot reads the blocks from the files; an in-memory checkpoint's restore writes them
    want = optimizer_sharded_state(plain[2], [plain[1]])
    blocks = {
        k: [{"offsets": s.offsets, "global_shape": s.global_shape, "data": s.local.clone()} for s in _blocks(v)]
        for k, v in want.items()
    }
    specs = optimizer_sharded_state(nvme[2], [nvme[1]])
    assert specs.keys() == want.keys() and any(s.source is not None for v in specs.values() for s in _blocks(v))
    for key, value in stage_to_cpu(specs).items():
        assert [b.source for b in _blocks(value)] == [None] * len(blocks[key])
        assert all(torch.equal(b.local, w["data"]) for b, w in zip(_blocks(value), blocks[key]))
    (tmp_path / "swap_c").mkdir()
    local = _build_nvme(dtype, strategy, 1.0, tmp_path / "swap_c")
    fill_blocks(optimizer_sharded_state(local[2], [local[1]]), blocks)
    local[2].materialize_offload()
    for key, value in optimizer_sharded_state(local[2], [local[1]]).items():
        assert all(torch.equal(b.local, w["data"]) for b, w in zip(_blocks(value), blocks[key]))
    local[2].close()

    ref = _steps(*plain, 1, seed=1)
    nvme[2].close()
    into_plain = offload_optimizer(_mlp(dtype), strategy)  # saved with NVMe offload, loaded without
    load_checkpoint(str(tmp_path / "nvme"), [into_plain[1]], into_plain[2])
    into_nvme = _build_nvme(dtype, strategy, 1.0, tmp_path / "swap_b")  # and the other way
    load_checkpoint(str(tmp_path / "plain"), [into_nvme[1]], into_nvme[2])
    off = into_nvme[2].offload
    assert off.files.ranges_written == 8 * off.numel and not off.resident  # written to the files as read
    for run in (into_plain, into_nvme):
        for a, b in zip(_steps(*run, 1, seed=1), ref):
            assert torch.equal(a, b)
    into_nvme[2].close()


def test_nvme_checkpoint_holds_one_block_in_memory(tmp_path):
    """Save and load counted on the CPU allocator: one swapped tensor at a time, never the state; a save without
    offload copies one weight at a time out of DDP's buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    _, _, opt = offload_optimizer(model, offload="nvme", path=tmp_path)
    model(torch.randn(4, 64)).square().mean().backward()
    assert opt.step()[0]
    block = 64 * 64 * 4  # one moment of one weight; the state is 16 of them
    with TrackedAllocations() as saving:
        save_checkpoint(str(tmp_path / "ck"), 1, [model], opt)
    with TrackedAllocations() as loading:
        load_checkpoint(str(tmp_path / "ck"), [model], opt)
    with TrackedAllocations() as materializing:  # what a save held before: the whole state
        opt.materialize_offload()
    assert saving.allocated >= 16 * block and saving.peak <= block
    assert loading.peak <= 3 * block  # DCP's own read of a tensor (2 blocks) and the one on its way to the file
    assert materializing.peak == 16 * block
    opt.close()
    # without offload, a ZeRO-2 save copies each weight out of DDP's buffer (DCP's writer kept every copy)
    _, chunk, zero2 = offload_optimizer(model, "optim_grads")
    zero2.init_state()  # the moments (a save creates them when no step was taken)
    with TrackedAllocations() as saving:
        save_checkpoint(str(tmp_path / "zero2"), 1, [chunk], zero2)
    assert saving.allocated >= 8 * block and saving.peak <= block


def test_swap_block_reads_and_writes_views(tmp_path):
    """A checkpoint block of a swapped tensor may be any view (a TP slice, a range of the distributed optimizer,
    a resharded load's piece): read and written in the file exactly as in memory."""
    _, _, opt = _build_nvme(torch.float32, None, 1.0, tmp_path)
    off = opt.offload
    host = next(h for _, h in off.pairs if off.shapes[id(h)] == (16, 8))
    stand_in = off.checkpoint_state(host, opt.optimizer.state[host])["exp_avg"]
    block = off.take_blocks()[id(stand_in)]
    assert stand_in.is_meta and off.blocks == {}
    expected = torch.arange(128.0).view(16, 8)
    block.write(stand_in, expected)
    g = torch.Generator().manual_seed(0)
    for view in (stand_in.narrow(1, 2, 3), stand_in.view(-1)[5:40].view(5, 7), stand_in.t()[1:3], stand_in[3]):
        values = torch.randn(view.shape, generator=g)
        block.write(view, values)
        for t in (expected.narrow(1, 2, 3), expected.view(-1)[5:40].view(5, 7), expected.t()[1:3], expected[3]):
            if t.shape == view.shape and t.stride() == view.stride() and t.storage_offset() == view.storage_offset():
                t.copy_(values)
        assert torch.equal(block.read(stand_in), expected)
        assert torch.equal(block.read(view), values) and block.read(view).is_contiguous()
    # --ckpt-format fsdp_dtensor cuts a gated fc1's blocks into its two halves: they keep the source
    from megalm.checkpoint.fsdp_dtensor import _split_block
    from megalm.param_layout import ShardedTensorSpec

    for mode, local in (("select", stand_in.view(2, 8, 8)), ("halves", stand_in)):
        whole = expected.view(2, 8, 8) if mode == "select" else expected
        parts = _split_block(ShardedTensorSpec(local, tuple(local.shape), (0,) * local.dim(), block), mode)
        assert len(parts) == 2 and all(p.source is block for _, p in parts)
        assert torch.equal(torch.stack([p.data() for _, p in parts]), whole.reshape(2, 8, 8))
    opt.materialize_offload()
    assert torch.equal(opt.optimizer.state[host]["exp_avg"], expected)
    opt.close()


def _validate(**flags):
    from tests.configs import optimizer_config
    from tests.test_ddp import OPTIMIZER

    optimizer_config(OPTIMIZER, **flags).training.validate()


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
