#!/usr/bin/env python
"""Recovery after a lost node (issue #32): steps lost, seconds to resume, final loss vs an
uninterrupted run, for each recovery path megalm has.

    python3 bench/recovery.py --iters 40 --kill-at 23 --save-interval 10
    python3 bench/recovery.py --cluster ...   # on the simulated cluster (tools/cluster: root, ip, tc)

Two "nodes" are two torchrun agents (c10d rendezvous, one rank each, the tiny GPT with the
distributed optimizer), on loopback or, with ``--cluster``, each in its network namespace of the
simulated cluster (:mod:`megalm.launch.netns`, gloo over the nodes' ``uplink``, links shaped with
``--inter-node-bandwidth``); the worker of node B SIGKILLs its agent and itself at its
``--kill-at``-th forward step (iteration ``kill-at``: one micro-batch per rank and step):

* ``disk``: ``--nnodes 2 --max-restarts 1`` and a replacement node started at once (what a
  scheduler does today): the job restarts on 2 nodes from the newest disk checkpoint.
* ``elastic``: ``--nnodes 1:2 --max-restarts 1``: the job restarts on the surviving node alone
  from the newest checkpoint, resharded to DP 1 with the same global batch.
* ``local``: as ``disk``, plus local checkpoints every ``--local-interval`` iterations replicated
  to the other node (``--non-persistent-ckpt-type local --replication``); node B's directory (its
  RAM) is removed with it, so the replacement receives its shard from node A over the network.
* ``elastic-local``: as ``elastic``, plus the local checkpoints of ``local``: node A restarts alone
  and restores the newest copies of world 2 (its own and node B's replica, both in its RAM),
  resharded to world 1 (:mod:`megalm.checkpoint.local_reshard`), instead of the disk checkpoint.
* ``scaleup`` (not a failure): node A starts alone under ``--nnodes 1:2`` with
  ``--exit-signal-handler``; once it logged iteration ``--kill-at`` node B starts: A's agent sees a
  node waiting, SIGTERMs its worker (which saves at the end of its step and exits), and the next
  round runs both nodes, from that checkpoint at DP 2.  "seconds to resume" is from B's start.
* ``torchft`` (no restart): ``bench/recovery_torchft.py``'s run on these nodes: two replica groups
  (one rank each, ``--ft-replica-group-id``), the lighthouse on node 0; group B SIGKILLs itself in
  its ``--kill-at``-th step, A trains on alone, a new B started at once rejoins from A's memory.
  Its own length (``--ft-iters``, ``--ft-step-seconds`` of sleep per step, so that A still trains
  when the new B is up) and its own uninterrupted one-process reference run.

"steps lost" = iterations finished before the failure minus the iteration resumed from; "seconds
to resume" = from the SIGKILL to the first iteration logged after the restart (rendezvous, process
start, imports, checkpoint load, first step).  For ``local`` the rejoining node's log line gives the
bytes it received from its peer and the seconds of that restore; for ``elastic-local`` node A's (the
bytes it received from other ranks: none, it holds both copies).  The machine is shared: the table records the load
average before and after.  Prints a markdown table (and ``--json`` writes the rows).
"""

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
ENV["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see docs/fault-tolerance.md
RUN_ID = (
    "recovery-bench"  # torchrun's --rdzv-id: the local checkpoints' directory under --non-persistent-local-ckpt-dir
)
FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--mock-data --vocab-size 500 --num-workers 2 --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 "
    "--log-interval 1 --eval-iters 0 --seed 7 --micro-batch-size 2 --global-batch-size 4 "
    "--use-distributed-optimizer --log-world-size-to-tensorboard"
).split()


class Nodes:
    """Where the agents run: loopback, or the simulated cluster's namespaces (``net``)."""

    def __init__(self, net=None):
        self.net = net

    def endpoint(self, port):
        return f"{self.net.address(0) if self.net else '127.0.0.1'}:{port}"

    def prefix(self, node):
        return ["ip", "netns", "exec", self.net.namespace(node)] if self.net else []

    def agent_flags(self, node):
        return ["--local-addr", self.net.address(node)] if self.net else []

    def env(self, node):
        env = {"MEGALM_NODE_NAME": f"node{node}"}
        if self.net:
            env.update(GLOO_SOCKET_IFNAME="uplink", TP_SOCKET_IFNAME="uplink")
        return env


def _agent(nodes, node, port, args, nnodes, max_restarts=1):
    return [
        *nodes.prefix(node),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        nodes.endpoint(port),
        "--rdzv-id",
        RUN_ID,
        "--rdzv-conf",
        f"is_host={int(node == 0)},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
        *nodes.agent_flags(node),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        os.path.abspath(__file__),
        "--worker",
        *args,
    ]


def _spawn(cmd, log, **env):
    return subprocess.Popen(
        cmd, env=dict(ENV, **env), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def _watch(metrics, procs, timeout):
    """Poll the metrics file; return ``[(seen_at, record)]`` once every process has exited."""
    seen, start = [], time.monotonic()
    while time.monotonic() - start < timeout:
        rows = [r for r in _records(metrics) if "lm_loss" in r]
        now = time.time()
        seen += [(now, r) for r in rows[len(seen) :]]
        if all(p.poll() is not None for p in procs):
            rows = [r for r in _records(metrics) if "lm_loss" in r]
            seen += [(time.time(), r) for r in rows[len(seen) :]]
            return seen
        time.sleep(0.05)
    raise TimeoutError("the run did not finish")


def _wait_for_iteration(metrics, iteration, proc, timeout):
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if any(r.get("iteration", 0) >= iteration for r in _records(metrics)) or proc.poll() is not None:
            return
        time.sleep(0.05)
    raise TimeoutError(f"iteration {iteration} was not reached")


def run(path, args, port, tmp, name, nodes):
    """One scenario; returns its metrics rows with the time each was seen, the kill time and the log."""
    metrics, stamp = os.path.join(tmp, f"{name}.jsonl"), os.path.join(tmp, f"{name}.killed")
    ckpt = os.path.join(tmp, f"{name}-ckpt")
    train = [*FLAGS, "--train-iters", str(args.iters), "--metrics-file", metrics]
    if path != "straight":
        train += ["--save", ckpt, "--load", ckpt, "--save-interval", str(args.save_interval)]
    shm = f"/dev/shm/megalm-recovery-{os.getpid()}-{name}"
    if path in ("local", "elastic-local"):
        train += ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", shm]
        train += ["--non-persistent-save-interval", str(args.local_interval), "--replication"]
        train += ["--async-save"] if args.local_async else []
    if path == "scaleup":
        train += ["--exit-signal-handler"]  # the agent's SIGTERM before the new round: save, then exit
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    nnodes = "1:2" if path in ("elastic", "elastic-local", "scaleup") else "2"
    kill = {"MEGALM_BENCH_KILL_AT": str(args.kill_at), "MEGALM_BENCH_KILL_STAMP": stamp}
    alone = {"MEGALM_BENCH_ALONE_SLEEP": str(args.alone_sleep)} if path == "scaleup" else {}
    a = _spawn(_agent(nodes, 0, port, train, nnodes), log, **nodes.env(0), **alone)
    procs = [a]
    try:
        if path == "scaleup":  # node A trains alone; node B joins once A logged iteration --kill-at
            _wait_for_iteration(metrics, args.kill_at, a, args.timeout)
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            procs.append(_spawn(_agent(nodes, 1, port, train, nnodes), log, **nodes.env(1)))
        else:
            time.sleep(args.stagger)  # node A's agent serves the rendezvous store
            procs.append(
                _spawn(
                    _agent(nodes, 1, port, train, nnodes), log, **nodes.env(1), **(kill if path != "straight" else {})
                )
            )
        b = procs[1]
        if path in ("disk", "local"):  # the scheduler replaces the node as soon as it is gone
            b.wait(timeout=args.timeout)
            shutil.rmtree(os.path.join(shm, RUN_ID, "node1"), ignore_errors=True)  # its RAM is gone with it
            procs.append(_spawn(_agent(nodes, 1, port, train, nnodes), log, **nodes.env(1)))
        if path == "elastic-local":  # no replacement; node B's RAM is gone with it
            b.wait(timeout=args.timeout)
            shutil.rmtree(os.path.join(shm, RUN_ID, "node1"), ignore_errors=True)
        seen = _watch(metrics, [a] + procs[2:] + ([b] if path == "scaleup" else []), args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(shm, ignore_errors=True)
    killed_at = float(open(stamp).read()) if os.path.exists(stamp) else None
    if a.returncode != 0:
        raise RuntimeError(f"{name}: node A exited with {a.returncode}; see {log.name}")
    log.close()
    return seen, killed_at, open(log.name).read()


def summarize(path, seen, killed_at, straight_loss, log="", kill_at=0):
    rows = [r for _, r in seen]
    if killed_at is None:
        return {"path": path, "final_loss": rows[-1]["lm_loss"], "loss_diff": 0.0}
    rejoin = re.search(
        r"rank 1\] restored iteration \d+ from the local checkpoint: (\d+) bytes from rank \d+.* in ([\d.]+) s", log
    ) or re.search(  # elastic-local: node A alone, the copies of world 2 resharded
        r"\] restored iteration \d+ from the local checkpoint saved by world \d+, resharded to world \d+: "
        r"(\d+) bytes .* in ([\d.]+) s",
        log,
    )
    if path == "scaleup":  # node A alone, then (after its save on SIGTERM) both: the first record at world 2
        i = next((i for i in range(1, len(rows)) if rows[i]["world-size"] != rows[i - 1]["world-size"]), None)
        if i is None:
            return {"path": path, "world_after": 1, "final_loss": rows[-1]["lm_loss"], "loss_diff": float("nan")}
    else:  # node B died in iteration kill_at: the first attempt logged 1 .. kill_at - 1, the rest is the restart
        i = kill_at - 1
        if [r["iteration"] for r in rows[:i]] != list(range(1, kill_at)):
            raise RuntimeError(f"{path}: the first attempt logged {[r['iteration'] for r in rows[: i + 1]]}")
    first_t, first = seen[i]
    done_before = rows[i - 1]["iteration"]
    return {
        "path": path,
        "steps_lost": done_before - (first["iteration"] - 1),
        "seconds_to_resume": first_t - killed_at,
        "world_after": first.get("world-size"),
        "final_loss": rows[-1]["lm_loss"],
        "loss_diff": rows[-1]["lm_loss"] - straight_loss,
        **({"rejoin_bytes": int(rejoin.group(1)), "rejoin_restore_s": float(rejoin.group(2))} if rejoin else {}),
    }


def torchft_rows(args, tmp, nodes):
    """The ``torchft`` path (``bench/recovery_torchft.py`` on ``nodes``): its reference row and its row."""
    from bench.recovery_torchft import measure

    ft = argparse.Namespace(
        iters=args.ft_iters,
        kill_at=args.kill_at,
        step_seconds=args.ft_step_seconds,
        heartbeat_timeout_ms=args.ft_heartbeat_timeout_ms,
        timeout=args.timeout,
    )
    os.makedirs(os.path.join(tmp, "torchft"), exist_ok=True)
    reference, row = measure(ft, os.path.join(tmp, "torchft"), nodes)
    reference["world_after"] = "-"
    reference["path"] = f"uninterrupted, one process ({args.ft_iters} iterations, for torchft)"
    row["path"] = "torchft (no restart)"
    return [reference, row]


@contextlib.contextmanager
def _nodes(args):
    """Loopback, or the simulated cluster (made here, removed however the bench ends)."""
    if not args.cluster:
        yield Nodes()
        return
    from megalm.launch.cluster import teardown
    from megalm.launch.lock import ClusterLock
    from megalm.launch.netns import ClusterNet, check_privileges

    check_privileges()
    net = ClusterNet("mlcrec", 2, "10.213.9.0/24", args.inter_node_bandwidth)
    with ClusterLock("/tmp/megalm-cluster-mlcrec.lock") as took_over:
        if took_over or net.existing():
            teardown(net, None, 5)
        try:
            net.create()
            yield Nodes(net)
        finally:
            teardown(net, None, 5)


def worker(argv):
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    call = int(os.environ.get("MEGALM_BENCH_KILL_AT", "0"))
    forward_step = pretrain_gpt.forward_step
    if call and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        calls = {"n": 0}
        inner = forward_step

        def forward_step(data_iterator, model):
            calls["n"] += 1
            if calls["n"] == call:
                with open(os.environ["MEGALM_BENCH_KILL_STAMP"], "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getppid(), signal.SIGKILL)  # the node's agent
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(data_iterator, model)

    alone = float(os.environ.get("MEGALM_BENCH_ALONE_SLEEP", "0"))
    if alone and os.environ.get("WORLD_SIZE") == "1":  # scaleup: slow while alone, so that node B can join
        slow = forward_step

        def forward_step(data_iterator, model):
            time.sleep(alone)
            return slow(data_iterator, model)

    pretrain_gpt.main(argv, forward_step)
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    from megalm.device import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=23, help="iteration during which node B dies")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--local-interval", type=int, default=2, help="local checkpoint interval of the local path")
    p.add_argument("--paths", default="disk,elastic,elastic-local,local,scaleup")
    p.add_argument("--local-async", action="store_true", help="local path: --async-save (the copies in the background)")
    p.add_argument("--cluster", action="store_true", help="run the nodes in the simulated cluster's namespaces")
    p.add_argument("--inter-node-bandwidth", help="with --cluster: tc rate of each node's link (e.g. 1gbit)")
    p.add_argument("--alone-sleep", type=float, default=3.0, help="scaleup: node A's sleep per step while alone")
    p.add_argument("--ft-iters", type=int, default=300, help="torchft path: iterations")
    p.add_argument("--ft-step-seconds", type=float, default=0.1, help="torchft path: sleep per forward step")
    p.add_argument("--ft-heartbeat-timeout-ms", type=int, default=1000, help="torchft path: the lighthouse's")
    p.add_argument("--stagger", type=float, default=1.0, help="seconds between starting node A and node B")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--workdir", help="keep the runs' logs, metrics and checkpoints here (default: a temporary one)")
    args = p.parse_args()
    load_before = os.getloadavg()
    results = []
    workdir = tempfile.TemporaryDirectory() if args.workdir is None else contextlib.nullcontext(args.workdir)
    with workdir as tmp, _nodes(args) as nodes:
        os.makedirs(tmp, exist_ok=True)
        if args.paths != "torchft":  # the reference of the restart paths (torchft has its own)
            seen, _, _ = run("straight", args, free_port(), tmp, "straight", nodes)
            straight_loss = seen[-1][1]["lm_loss"]
            results.append(summarize("uninterrupted", seen, None, straight_loss))
        for path in args.paths.split(","):
            if path == "torchft":
                results += torchft_rows(args, tmp, nodes)
                print(json.dumps(results[-1]), flush=True)
                continue
            seen, killed_at, log = run(path, args, free_port(), tmp, path, nodes)
            results.append(summarize(path, seen, killed_at, straight_loss, log, args.kill_at))
            print(json.dumps(results[-1]), flush=True)  # each row as soon as it is measured
    load_after = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"command: python3 {' '.join(sys.argv)}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.node()}; {when}")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    where = "simulated cluster, link " + (args.inter_node_bandwidth or "unshaped") if args.cluster else "loopback"
    print(f"nodes: 2 x 1 rank, {where}")
    print(
        "| path | world after | steps lost | seconds to resume | final loss | vs uninterrupted "
        "| rejoin: bytes from peer, s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        lost = r.get("steps_lost", 0)
        secs = f"{r['seconds_to_resume']:.1f}" if "seconds_to_resume" in r else "-"
        rejoin = f"{r['rejoin_bytes']}, {r['rejoin_restore_s']:.2f}" if "rejoin_restore_s" in r else "-"
        if r.get("rejoin_s") is not None:  # torchft: from the new group's start to its first step
            rejoin = f"{r['rejoin_bytes']}, {r['rejoin_s']:.1f} from its start"
            if r.get("rejoin_recovery_s") is not None:
                rejoin += f", of which quorum + transfer {r['rejoin_recovery_s']:.2f}"
        print(
            f"| {r['path']} | {r.get('world_after', 2)} | {lost} | {secs} | {r['final_loss']:.6f} "
            f"| {r['loss_diff']:+.2e} | {rejoin} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "load_before": load_before, "load_after": load_after}, f, indent=1)


if __name__ == "__main__":
    main()
