#!/usr/bin/env python
"""Recovery of torchft replica groups (issue #32): a group SIGKILLed mid-run, the survivor trains on
without a restart, a replacement group started at once rejoins from the survivor's memory.

    python3 bench/recovery_torchft.py --iters 300 --kill-at 20 --step-seconds 0.1
    python3 bench/recovery.py --cluster --paths torchft ...   # the same, on the simulated cluster

Two replica groups of one rank each on loopback (``--ft-replica-group-id 0/1``, a lighthouse in this
process), or each in its node's network namespace of the simulated cluster (:func:`measure` with the
``nodes`` of ``bench/recovery.py --cluster``: the lighthouse runs on node 0 beside group A, the
groups' gloo and the recovery transfer go over the nodes' ``uplink``), the tiny GPT of
``bench/recovery.py`` (global batch 4 of micro-batches of 2: one micro-batch per group, two for a
group alone); each forward step also sleeps ``--step-seconds`` (a step of a real model: the survivor
must still be training when the new group is up, or that one starts alone from scratch). Group B
SIGKILLs itself at its ``--kill-at``-th forward step; a new B is started at once (what a scheduler
does), its imports and set-up included in its time to rejoin. Columns as in ``bench/recovery.py``:
"steps lost" = committed iterations the survivor had to redo (0: only the step in flight is redone);
"seconds to resume" = from the SIGKILL to the survivor's first step committed alone (failure
detection, the lighthouse's heartbeat timeout, the redone step); "final loss" against an
uninterrupted one-process run of the same global batch; rejoin: the bytes the new B received from A,
the seconds from its start to its first step, and of these the seconds of its first quorum with the
recovery transfer (the rest is interpreter start, imports and set-up).
"""

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--mock-data --vocab-size 500 --num-workers 2 --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 "
    "--log-interval 1 --eval-iters 0 --seed 7 --micro-batch-size 2 --global-batch-size 4 "
    "--use-distributed-optimizer --device-peak-flops 1e12"
).split()


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}") and "lm_loss" in line]


def _spawn(args, log, env, prefix=()):
    return subprocess.Popen(
        [*prefix, sys.executable, os.path.abspath(__file__), *args],
        env=dict(ENV, **env),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _group(gid, name, tmp, lighthouse, args, nodes, node, **env):
    """Replica group ``gid``'s one rank (its own world of 1) on ``node`` (of ``nodes``, or loopback)."""
    from megalm.device import free_port

    train = [*FLAGS, "--train-iters", str(args.iters), "--metrics-file", os.path.join(tmp, f"{name}.jsonl")]
    train += ["--ft-replica-group-id", str(gid), "--ft-num-replica-groups", "2", "--ft-lighthouse", lighthouse]
    # The group's store: the other groups reach it at MASTER_ADDR (torchft's quorum names it).
    addr = nodes.net.address(node) if nodes and nodes.net else "127.0.0.1"
    rank = dict(MASTER_ADDR=addr, MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env = dict(env, MEGALM_BENCH_STEP_SECONDS=str(args.step_seconds), **(nodes.env(node) if nodes else {}))
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    prefix = nodes.prefix(node) if nodes else ()
    return _spawn(["--worker", *train], log, dict(rank, LOCAL_WORLD_SIZE="1", **env), prefix), log.name


class _Lighthouse:
    """``torchft_lighthouse`` (min 1 replica): in this process on loopback, else a process in node
    0's namespace (reachable from every node)."""

    def __init__(self, args, tmp, nodes):
        from megalm.device import free_port

        self.server = self.proc = None
        beat = str(args.heartbeat_timeout_ms)
        if nodes is None or nodes.net is None:
            from torchft._torchft import LighthouseServer

            self.server = LighthouseServer(
                bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=int(beat)
            )
            self.url = "http://127.0.0.1:" + self.server.address().rsplit(":", 1)[1]
            return
        bind = f"{nodes.net.address(0)}:{free_port()}"
        log = open(os.path.join(tmp, "lighthouse.log"), "w")
        self.proc = _spawn(["--lighthouse", bind, beat], log, {}, nodes.prefix(0))
        self.url = f"http://{bind}"

    def close(self):
        if self.server is not None:
            self.server.shutdown()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def measure(args, tmp, nodes=None):
    """The uninterrupted run and the torchft run; returns the two table rows.  ``nodes``: the
    simulated cluster's nodes of ``bench/recovery.py`` (group A and the lighthouse on node 0, B on
    node 1), or None: loopback."""
    plain_metrics = os.path.join(tmp, "plain.jsonl")
    plain = [*FLAGS, "--train-iters", str(args.iters), "--metrics-file", plain_metrics]
    with open(os.path.join(tmp, "plain.log"), "w") as log:
        pause = {"MEGALM_BENCH_STEP_SECONDS": str(args.step_seconds)}
        if _spawn(["--worker", *plain], log, pause).wait(timeout=args.timeout) != 0:
            raise RuntimeError(f"the uninterrupted run failed; see {log.name}")
    straight = _records(plain_metrics)[-1]["lm_loss"]
    server = _Lighthouse(args, tmp, nodes)
    lighthouse = server.url
    stamp = os.path.join(tmp, "killed")
    procs = []
    try:
        a, a_log = _group(0, "a", tmp, lighthouse, args, nodes, 0)
        kill = dict(MEGALM_BENCH_KILL_AT=str(args.kill_at), MEGALM_BENCH_STAMP=stamp)
        b, _ = _group(1, "b", tmp, lighthouse, args, nodes, 1, **kill)
        procs += [a, b]
        b.wait(timeout=args.timeout)
        b2_start = time.time()
        b2, b2_log = _group(1, "b2", tmp, lighthouse, args, nodes, 1)
        procs.append(b2)
        for p, log in ((a, a_log), (b2, b2_log)):
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"a replica group failed; see {log}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.close()
    killed_at = float(open(stamp).read())
    rows, b2_rows = _records(os.path.join(tmp, "a.jsonl")), _records(os.path.join(tmp, "b2.jsonl"))
    iterations = [r["iteration"] for r in rows]
    alone = next(r for r in rows if r["ft_replica_groups"] == 1 and r["_time"] > killed_at)
    b2_text = open(b2_log).read()
    got = re.search(r"recovered the state of iteration \d+ from a healthy peer \((\d+) bytes", b2_text)
    quorum = re.search(r"rejoined at iteration \d+: quorum and recovery in ([\d.]+) s", b2_text)
    return [
        {"path": "uninterrupted", "final_loss": straight, "loss_diff": 0.0},
        {
            "path": "torchft (no restart)",
            "world_after": 1,
            "steps_lost": len(iterations) - len(set(iterations)),
            "seconds_to_resume": alone["_time"] - killed_at,
            "final_loss": rows[-1]["lm_loss"],
            "loss_diff": rows[-1]["lm_loss"] - straight,
            "rejoin_bytes": int(got.group(1)) if got else None,
            "rejoin_s": b2_rows[0]["_time"] - b2_start if b2_rows else None,
            "rejoin_recovery_s": float(quorum.group(1)) if quorum else None,
        },
    ]


def worker(argv):
    """One replica group's rank: ``pretrain_gpt.main``; ``MEGALM_BENCH_KILL_AT=N``: SIGKILL at the N-th
    forward step (the time goes to ``MEGALM_BENCH_STAMP``); every metrics record gets its wall time."""
    import pretrain_gpt
    from megalm.device import shutdown_distributed
    from megalm.training import metrics

    log_iteration = metrics.MetricsWriter.log_iteration

    def stamped(self, record):
        return log_iteration(self, dict(record, _time=time.time()))

    metrics.MetricsWriter.log_iteration = stamped
    call, calls = int(os.environ.get("MEGALM_BENCH_KILL_AT", "0")), {"n": 0}
    pause = float(os.environ.get("MEGALM_BENCH_STEP_SECONDS", "0"))

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            with open(os.environ["MEGALM_BENCH_STAMP"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(pause)
        return pretrain_gpt.forward_step(data_iterator, model)

    pretrain_gpt.main(argv, forward_step)
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank


def lighthouse(bind, heartbeat_timeout_ms):
    """``--lighthouse BIND MS``: a lighthouse serving until killed (run inside node 0's namespace)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(  # noqa: F841 (it serves while referenced)
        bind=bind, min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=int(heartbeat_timeout_ms)
    )
    while True:
        time.sleep(3600)


def main():
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse in this process: its quorums at INFO otherwise
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--lighthouse":
        return lighthouse(*sys.argv[2:4])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=20, help="forward step of group B at which it dies")
    p.add_argument("--step-seconds", type=float, default=0.1, help="sleep in each forward step (a longer step)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse's --heartbeat_timeout_ms")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(args, tmp)
    load_after = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"command: python3 {' '.join(sys.argv)}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.node()}; {when}")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    print(
        f"replica groups: 2 x 1 rank, loopback; lighthouse --heartbeat_timeout_ms {args.heartbeat_timeout_ms}; "
        f"{args.step_seconds} s sleep per forward step"
    )
    print(
        "| path | world after | steps lost | seconds to resume | final loss | vs uninterrupted "
        "| rejoin: bytes from peer, s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        secs = f"{r['seconds_to_resume']:.1f}" if "seconds_to_resume" in r else "-"
        rejoin = f"{r['rejoin_bytes']}, {r['rejoin_s']:.1f}" if r.get("rejoin_bytes") else "-"
        if r.get("rejoin_recovery_s") is not None:
            rejoin += f" (quorum + transfer {r['rejoin_recovery_s']:.2f})"
        print(
            f"| {r['path']} | {r.get('world_after', '-')} | {r.get('steps_lost', 0)} | {secs} | {r['final_loss']:.6f} "
            f"| {r['loss_diff']:+.2e} | {rejoin} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "load_before": load_before, "load_after": load_after}, f, indent=1)


if __name__ == "__main__":
    main()
