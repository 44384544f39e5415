#!/usr/bin/env python
"""Step time with one data-parallel rank 2x slower, before and after ``--straggler-rebalance-interval``.

    python3 bench/straggler_rebalance.py --iters 60                    # slow rank sleeps
    sudo python3 bench/straggler_rebalance.py --iters 60 --slowdown cgroup

Two ranks (torchrun --standalone), the tiny GPT with --calculate-per-token-loss, 8 micro-batches
per global batch.  The slow rank: ``--slowdown sleep`` (default) sleeps, per micro-batch, a quarter of
the ``equal`` run's step time (a little more than its forward-backward per micro-batch: at least
2x slower; sleeping costs no CPU, so the machine's load slows both ranks alike);
``--slowdown cgroup`` puts each rank in its own cgroup-v1 ``cpu`` group, rank 0 one core,
rank 1 ``--slow-quota`` of a core (on a loaded machine both get less than that and the throttle
hardly binds).  Three runs:
``equal`` (no slow rank), ``slow`` (rank 1 slowed, fixed 4 + 4 split) and ``rebalanced``
(the same with ``--straggler-rebalance-interval 5``).  The step time is the median ``elapsed_ms``
of the second half of the iterations.  The ideal for the slow node is the ``equal`` step x 4/3
(the fast rank does 2/3 of the micro-batches at full speed).  ``cgroup`` needs root; the machine
is shared: the load average is printed with the table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
CGROUP = "/sys/fs/cgroup/cpu"
FLAGS = (
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--mock-data --vocab-size 500 --num-workers 0 --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 "
    "--log-interval 1 --eval-iters 0 --seed 7 --micro-batch-size 1 --global-batch-size 8 "
    "--calculate-per-token-loss"
).split()


def _enter_cgroup(quota: float) -> None:
    """Move this process into a new cpu cgroup limited to ``quota`` cores."""
    path = os.path.join(CGROUP, f"{os.environ['MEGALM_BENCH_CGROUP']}{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
        f.write("100000")
    with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(int(quota * 100000)))
    with open(os.path.join(path, "tasks"), "w") as f:
        f.write(str(os.getpid()))


def worker(argv):
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    rank = int(os.environ["RANK"])
    forward_step = pretrain_gpt.forward_step
    if os.environ.get("MEGALM_BENCH_QUOTAS"):
        _enter_cgroup([float(q) for q in os.environ["MEGALM_BENCH_QUOTAS"].split(",")][rank])
    sleep = float(os.environ.get("MEGALM_BENCH_SLEEP", "0"))
    if sleep and rank == 1:
        inner = forward_step

        def forward_step(data_iterator, model):
            time.sleep(sleep)
            return inner(data_iterator, model)

    pretrain_gpt.main(argv, forward_step)
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank


def run(name, slow, extra, args, tmp, per_microbatch=0.0):
    """One training; ``slow``: rank 1 is slowed (by ``per_microbatch`` seconds of sleep, or its cgroup)."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.abspath(__file__), "--worker", *FLAGS, "--train-iters", str(args.iters)]
    cmd += ["--metrics-file", metrics, *extra]
    prefix = f"megalm-straggler-{os.getpid()}-"
    env = dict(ENV, MEGALM_BENCH_CGROUP=prefix)
    if args.slowdown == "cgroup":
        env["MEGALM_BENCH_QUOTAS"] = f"1.0,{args.slow_quota if slow else 1.0}"
    elif slow:
        env["MEGALM_BENCH_SLEEP"] = str(per_microbatch)
    try:
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    finally:  # the ranks' cgroups, empty once they exited
        for name in os.listdir(CGROUP) if os.path.isdir(CGROUP) else []:
            if name.startswith(prefix):
                os.rmdir(os.path.join(CGROUP, name))
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(metrics) if line.strip().endswith("}")]
    times = [r["elapsed_ms"] for r in rows if "elapsed_ms" in r][args.iters // 2 :]
    lines = (out.stdout + out.stderr).splitlines()
    moves = [line.split("] ", 1)[-1] for line in lines if "straggler rebalance" in line]
    return statistics.median(times), moves


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--slowdown", choices=["sleep", "cgroup"], default="sleep")
    p.add_argument("--slow-quota", type=float, default=0.5, help="cgroup: cores of the slow rank")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        equal, _ = run("equal", False, [], args, tmp)
        per_microbatch = equal / 1000 / 4  # seconds of one micro-batch: 4 per rank per step
        slow, _ = run("slow", True, [], args, tmp, per_microbatch)
        rebalance = ["--straggler-rebalance-interval", "5"]
        rebalanced, moves = run("rebalanced", True, rebalance, args, tmp, per_microbatch)
    load_after = os.getloadavg()
    ideal = equal * 4 / 3
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"command: python3 {' '.join(sys.argv)}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {cpu}, {os.cpu_count()} cores, {platform.node()}; {when}")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    print(
        f"slowdown: {args.slowdown}"
        + (f" ({per_microbatch * 1000:.1f} ms per micro-batch)" if args.slowdown == "sleep" else "")
    )
    print("| run | median step (ms) | vs ideal (equal x 4/3) |")
    print("|---|---|---|")
    table = (("equal", equal), ("slow rank, 4+4", slow), ("slow rank, rebalanced", rebalanced))
    for name, value in table:
        print(f"| {name} | {value:.1f} | {value / ideal:.2f} |")
    print("rebalance log: " + ("; ".join(moves) if moves else "none"))


if __name__ == "__main__":
    main()
