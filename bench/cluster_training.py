"""One training run on the simulated cluster, read back from its metrics file (shared by the cluster benchmarks).

:func:`cluster_training` starts ``tools/cluster/run.py`` (network namespaces, inter-node links shaped with
``tc``; needs root or CAP_NET_ADMIN) with ``pretrain_gpt.py`` on mock data, :data:`MODEL` (a ~1.9M-parameter
GPT: hidden 128, 4 layers, vocab 8192, sequence 64, micro batch 2) plus the caller's flags, ``--log-interval 1``
into a metrics file, and returns the median step time and the median ``inter_node_bytes`` (busiest node, per
iteration; as :mod:`megalm.distributed.comm` counts them) over the iterations after the first, the median
``tokens_per_sec`` and the final loss.  With ``wire=True`` it also polls node 0's link counters
(``ip -n <name>-n0 -s link show uplink``, every 0.2 s) and returns the bytes node 0 sent over its link in the
whole run (TCP/IP headers and the start-up rendezvous included; the last 0.2 s before the namespace is removed
may be missed): :func:`wire_bytes_per_step` turns two such runs into bytes per step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from typing import List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
SEQ_LENGTH, MICRO_BATCH, HIDDEN = 64, 2, 128
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    str(HIDDEN),
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ_LENGTH),
    "--max-position-embeddings",
    str(SEQ_LENGTH),
    "--mock-data",
    "--vocab-size",
    "8192",
    "--num-workers",
    "0",
    "--micro-batch-size",
    str(MICRO_BATCH),
    "--lr",
    "1e-3",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--ddp-bucket-size",
    "500000",
    "--overlap-grad-reduce",
]


def cluster_training(
    name: str,
    extra: List[str],
    tmp: str,
    *,
    nodes: int = 2,
    procs_per_node: int = 2,
    bandwidth: Optional[str] = None,
    iters: int = 5,
    global_batch: int = 8,
    cluster_name: str = "mlcbench",
    timeout: float = 600.0,
    wire: bool = False,
    threads: Optional[int] = None,
) -> dict:
    """Train ``iters`` iterations of :data:`MODEL` + ``extra`` on ``nodes`` x ``procs_per_node`` simulated ranks,
    inter-node links at ``bandwidth`` (tc units; None or ``"unshaped"``: not shaped); raise RuntimeError when the
    cluster run fails (with the tail of its output).  ``threads`` sets ``OMP_NUM_THREADS`` for every rank (else
    the launcher's: the host's cores divided by all simulated ranks, :func:`megalm.launch.cluster.node_env`)."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", str(nodes)]
    cmd += ["--procs-per-node", str(procs_per_node), "--name", cluster_name, "--timeout", str(timeout)]
    if bandwidth and bandwidth != "unshaped":
        cmd += ["--inter-node-bandwidth", bandwidth]
    cmd += ["--", os.path.join(ROOT, "pretrain_gpt.py")] + MODEL + ["--global-batch-size", str(global_batch)]
    cmd += ["--train-iters", str(iters), "--metrics-file", metrics] + extra
    stop, sent = threading.Event(), [0]
    poller = threading.Thread(target=_poll_sent, args=(f"{cluster_name}-n0", stop, sent), daemon=True)
    if wire:
        poller.start()
    env = dict(os.environ) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop.set()
    if wire:
        poller.join()
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the cluster run exited {done.returncode}:\n{done.stdout[-3000:]}")
    records = [json.loads(line) for line in open(metrics) if '"lm_loss"' in line]
    later = records[1:] or records
    return {
        "name": name,
        "step_ms": statistics.median(r["elapsed_ms"] for r in later),
        "inter_node_MB_per_step": statistics.median(r.get("inter_node_bytes", 0.0) for r in later) / 1e6,
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in later),
        "final_loss": records[-1]["lm_loss"],
        "iters": len(records),
    } | ({"node0_sent_bytes": sent[0]} if wire else {})


def _poll_sent(namespace: str, stop: threading.Event, sent: list) -> None:
    """Keep ``sent[0]`` at the last seen ``tx`` byte counter of ``uplink`` in ``namespace`` until ``stop``."""
    while not stop.wait(0.2):
        out = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "uplink"], capture_output=True)
        if out.returncode == 0:
            sent[0] = max(sent[0], json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def wire_bytes_per_step(short: dict, long: dict) -> float:
    """Bytes node 0 sent per training step: the difference of two ``wire=True`` runs of different lengths
    (start-up and shutdown traffic cancel)."""
    return (long["node0_sent_bytes"] - short["node0_sent_bytes"]) / (long["iters"] - short["iters"])
