#!/usr/bin/env python
"""Host memory of a checkpoint save and load with the NVMe optimizer offload, on one process.

A stack of ``--layers`` bias-free ``--hidden`` x ``--hidden`` fp32 linear layers takes one AdamW step with its
whole optimizer state in swap files (``--optimizer-offload-device nvme``, files under ``--offload-path``),
then is saved and loaded through megalm's checkpointer (DCP).  For each phase: the peak of the CPU allocator's
live bytes above the phase's start (:class:`megalm.training.memory.TrackedAllocations`) and the kernel's
peak RSS above the start (``VmHWM`` after ``/proc/self/clear_refs``; glibc told to return freed blocks), next
to the same phases of the same model without offload and of the NVMe run with its state materialized first
(what a save did before checkpoints streamed the swap files).  Bytes, not times.

    python bench/nvme_checkpoint_memory.py [--hidden 2048 --layers 8 --offload-path /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.abspath(os.path.join(HERE, os.path.pardir))
if _root not in sys.path:
    sys.path.insert(0, _root)

from bench.context_parallel import _peak_rss_since_reset_mb, _reset_peak_rss, _return_freed_memory  # noqa: E402

MiB = 2**20


def _measure(fn):
    from megalm.training.memory import TrackedAllocations

    _reset_peak_rss()
    with open("/proc/self/statm") as f:
        start = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB
    with TrackedAllocations() as tracked:
        fn()
    return tracked.peak / MiB, _peak_rss_since_reset_mb() - start


def main() -> None:
    import torch

    from megalm.checkpoint.load import load_checkpoint
    from megalm.checkpoint.save import save_checkpoint
    from tests.training_runs import offload_optimizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--offload-path", default=tempfile.gettempdir())
    a = ap.parse_args()
    _return_freed_memory()
    rows = []
    for mode in ("no offload", "nvme, materialized first", "nvme, streamed"):
        with tempfile.TemporaryDirectory(dir=a.offload_path) as d:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(a.hidden, a.hidden, bias=False) for _ in range(a.layers)])
            nvme = mode.startswith("nvme")
            _, _, opt = offload_optimizer(model, offload="nvme" if nvme else None, path=d)
            model(torch.randn(4, a.hidden)).square().mean().backward()
            assert opt.step()[0]
            model.zero_grad(set_to_none=True)
            ck = os.path.join(d, "ck")

            def save():
                if mode == "nvme, materialized first":
                    opt.materialize_offload()
                save_checkpoint(ck, 1, [model], opt)

            save_peak, save_rss = _measure(save)
            if mode == "nvme, materialized first":
                opt.offload.refresh()  # back to the files: the load below starts from nothing in memory
            load_peak, load_rss = _measure(lambda: load_checkpoint(ck, [model], opt))
            opt.close()
        rows.append((mode, save_peak, save_rss, load_peak, load_rss))
    params = a.layers * a.hidden**2
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"python bench/nvme_checkpoint_memory.py --hidden {a.hidden} --layers {a.layers}")
    print(
        f"{cpu}, {time.strftime('%Y-%m-%d')}; {params / 1e6:.1f}M fp32 parameters, Adam state "
        f"{8 * params / MiB:.0f} MiB (largest tensor's moment {4 * a.hidden**2 / MiB:.0f} MiB)\n"
    )
    print("| run | save: allocator peak MiB | save: RSS peak MiB | load: allocator peak MiB | load: RSS peak MiB |")
    print("|---|---|---|---|---|")
    for mode, sp, sr, lp, lr in rows:
        print(f"| {mode} | {sp:.1f} | {sr:.1f} | {lp:.1f} | {lr:.1f} |")


if __name__ == "__main__":
    main()
