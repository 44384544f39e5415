#!/usr/bin/env python
"""NVMe optimizer offload under a memory cap: what trains, what is killed, and what it costs.

One process trains an fp32 GPT (``pretrain_gpt.py``, mock data, Adam) three ways: no offload
(``none``), ``--optimizer-cpu-offload`` (``cpu``: the Adam state and fp32 copies in host memory; on a
CPU-only machine the "device" is host memory too, so it holds more than ``none``) and
``--optimizer-offload-device nvme --offload-path DIR`` (``nvme``: they live in swap files under DIR).

1. The disk's sequential bandwidth under DIR (write with fsync, read after dropping the pages from the
   cache: ``posix_fadvise(DONTNEED)``), so the swap traffic can be read against it.
2. Each mode uncapped: peak RSS (``wait4``), median step time of the last iterations, swap bytes per
   iteration from the log's metrics.
3. Each mode again inside a memory cgroup whose limit (``memory.max`` on cgroup v2, else
   ``memory.limit_in_bytes`` on v1; created by this script, which needs root) is ``--cap-mib``, by
   default halfway between the nvme and none peaks: a mode whose peak is above the cap is killed by the
   kernel's OOM killer (exit -9), nvme trains.  Page cache of the swap files counts toward the cgroup but is
   reclaimed (written back) under the cap rather than killing the process.

    python bench/nvme_offload.py --offload-path /var/tmp/megalm-swap [--hidden 768 --layers 8 --vocab 4096]
        [--iters 6] [--cap-mib N] [--out bench/results/nvme_offload.json]

Without a writable memory controller (not root, no cgroup mounted) step 3 is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.path.pardir))
MiB = 2**20
MODES = {
    "none": [],
    "cpu": ["--optimizer-cpu-offload"],
    "nvme": ["--optimizer-offload-device", "nvme"],  # + --offload-path
}


def model_flags(a) -> list:
    return [
        *("--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.hidden // 64)),
        *("--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--vocab-size", str(a.vocab)),
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0", "--eval-iters", "0"),
        *("--micro-batch-size", "1", "--train-iters", str(a.iters), "--log-interval", "1", "--lr", "1e-4"),
        *("--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion", "--no-norm-fusion"),
        *("--no-log-memory", "--first-step-timeout-seconds", "0"),
    ]


def disk_bandwidth(directory: str, mib: int) -> dict:
    """Sequential write (fsync'd) and uncached read of ``mib`` MiB under ``directory``, MB/s."""
    chunk = os.urandom(16 * MiB)
    fd, path = tempfile.mkstemp(dir=directory, prefix="megalm-bw-")
    try:
        t0 = time.perf_counter()
        for i in range(mib // 16):
            os.pwrite(fd, chunk, i * 16 * MiB)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(16 * MiB)
        t0 = time.perf_counter()
        for i in range(mib // 16):
            os.preadv(fd, [buf], i * 16 * MiB)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)
    return {"write_MBps": mib * MiB / write_s / 1e6, "read_MBps": mib * MiB / read_s / 1e6}


class MemoryCgroup:
    """A memory cgroup with a limit, made for this run (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``)."""

    def __init__(self, limit: int):
        v2 = "/sys/fs/cgroup"
        if os.path.exists(f"{v2}/cgroup.controllers") and "memory" in open(f"{v2}/cgroup.controllers").read():
            self.path, self.limit_file = f"{v2}/megalm-nvme-bench-{os.getpid()}", "memory.max"
        elif os.path.isdir("/sys/fs/cgroup/memory"):
            v1 = "/sys/fs/cgroup/memory"
            self.path, self.limit_file = f"{v1}/megalm-nvme-bench-{os.getpid()}", "memory.limit_in_bytes"
        else:
            raise OSError("no memory cgroup controller mounted (v2 with memory enabled, or v1 /sys/fs/cgroup/memory)")
        os.mkdir(self.path)
        with open(os.path.join(self.path, self.limit_file), "w") as f:
            f.write(str(limit))

    def enter(self) -> None:
        """In the child (preexec_fn): move this process into the cgroup."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def train(argv: list, metrics: str, cgroup=None, log=None) -> dict:
    """One ``pretrain_gpt.py`` run; exit status, peak RSS, step times and swap bytes from its metrics."""
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv, "--metrics-file", metrics]
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(log or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=cgroup.enter if cgroup else None)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    records = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            records = [r for r in map(json.loads, f) if r.get("kind", "train") == "train" and "elapsed_ms" in r]
    tail = [r["elapsed_ms"] for r in records[2:]] or [r["elapsed_ms"] for r in records]
    return {
        "exit": proc.returncode,
        "iterations": len(records),
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "step_ms": statistics.median(tail) if tail else None,
        "swap_read_bytes": records[-1].get("swap_read_bytes") if records else None,
        "swap_written_bytes": records[-1].get("swap_written_bytes") if records else None,
        "lm_loss": [r.get("lm_loss") for r in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--offload-path", required=True, help="an existing directory on the disk to test")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument("--cap-mib", type=int, help="the cgroup's limit (default: halfway between nvme's and none's peaks)")
    ap.add_argument("--out")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="megalm-nvme-bench-")
    base = model_flags(a)
    flags = {m: base + f + (["--offload-path", a.offload_path] if m == "nvme" else []) for m, f in MODES.items()}
    result = {"disk": disk_bandwidth(a.offload_path, a.bandwidth_mib), "uncapped": {}, "capped": {}}
    print("disk", result["disk"], flush=True)
    for mode, argv in flags.items():
        r = train(argv, os.path.join(work, f"{mode}.jsonl"), log=os.path.join(work, f"{mode}.log"))
        result["uncapped"][mode] = r
        print("uncapped", mode, {k: v for k, v in r.items() if k != "lm_loss"}, flush=True)
    up = result["uncapped"]
    ok = all(up[m]["exit"] == 0 for m in up)
    result["losses_equal"] = ok and up["none"]["lm_loss"] == up["nvme"]["lm_loss"] == up["cpu"]["lm_loss"]
    cap = a.cap_mib or int((up["nvme"]["peak_rss_mib"] + up["none"]["peak_rss_mib"]) / 2)
    result["cap_mib"] = cap
    try:
        for mode, argv in flags.items():
            group = MemoryCgroup(cap * MiB)
            try:
                log = os.path.join(work, f"{mode}_capped.log")
                r = train(argv, os.path.join(work, f"{mode}_capped.jsonl"), cgroup=group, log=log)
            finally:
                group.close()
            result["capped"][mode] = r
            print(f"capped at {cap} MiB", mode, {k: v for k, v in r.items() if k != "lm_loss"}, flush=True)
    except OSError as e:
        result["capped_skipped"] = f"no memory cgroup could be made: {e}"
        print(result["capped_skipped"])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    result["machine"] = f"{cpu}, {os.cpu_count()} cores"
    result["date"] = time.strftime("%Y-%m-%d")
    result["command"] = " ".join(["python", "bench/nvme_offload.py", *sys.argv[1:]])
    print(f"\n{result['command']}\n{result['machine']}, {result['date']}; disk under {a.offload_path}: write "
          f"{result['disk']['write_MBps']:.0f} MB/s, read {result['disk']['read_MBps']:.0f} MB/s\n")  # fmt: skip
    head = "| mode | peak RSS MiB | step ms | step / none | swap read MB/iter | swap written MB/iter |"
    print(f"{head} under {cap} MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in up.items():
        capped = result["capped"].get(mode)
        fate = "-" if capped is None else ("trains" if capped["exit"] == 0 else f"killed (exit {capped['exit']})")
        read, written = r["swap_read_bytes"], r["swap_written_bytes"]
        print(
            f"| {mode} | {r['peak_rss_mib']:.0f} | {r['step_ms']:.0f} | {r['step_ms'] / up['none']['step_ms']:.2f} | "
            f"{read / 1e6 if read else 0:.0f} | {written / 1e6 if written else 0:.0f} | {fate} |"
        )
    print(f"\nlosses equal bit for bit (none, cpu, nvme): {result['losses_equal']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
