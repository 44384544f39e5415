#!/usr/bin/env python
"""torchft replica groups with a layout inside each group (issue #32), checked against one process.

    python3 bench/torchft_layouts.py --layout zero2 --kill-at 10
    python3 bench/torchft_layouts.py --layout vpp --kill-at 40
    python3 bench/torchft_layouts.py --layout int8 --kill-at 10
    python3 bench/torchft_layouts.py --layout diloco --kill-at 10

Two replica groups of 2 ranks (each its own ``torchrun``, a lighthouse in this process) train the
tiny GPT (4 layers, hidden 32, global batch 16 of micro-batches of 2, per-token loss with
``--eod-mask-loss``) with ``--layout``: ``optim`` (DP 2, the distributed optimizer), ``zero2``
(DP 2, ``--data-parallel-sharding-strategy optim_grads``), ``vpp`` (PP 2 with 2 virtual stages,
the distributed optimizer) or ``int8`` (DP 2, the distributed optimizer, ``--grad-compression int8``:
the cross-group average in 8 bits, so the one-process run is matched only up to the quantization)
or ``diloco`` (DP 2, ``--local-sgd-interval 4 --outer-lr 0.7 --outer-momentum 0.9``, global batch 8,
no per-token loss; the reference is megalm's DiLoCo over two torchrun "nodes" of 2 ranks with
``--hierarchical-grad-reduce``, compared up to B's death, and every sync A and B both made must
print the same weight fingerprint on every rank).
With ``--kill-at N`` group B's ranks SIGKILL themselves at their N-th forward call
(``bench/recovery_torchft.py``'s worker; every forward call also sleeps ``--step-seconds``) and a
new B is started at once: it rejoins from A.  A one-process run of the same global batch is the
reference: prints the worst relative difference of every logged loss and
gradient norm, whether A logged every iteration once, and the rejoin lines of the logs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

LAYOUTS = {
    "optim": ["--use-distributed-optimizer"],
    "zero2": ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"],
    "int8": ["--use-distributed-optimizer", "--grad-compression", "int8"],  # the groups' average in 8 bits
    # DiLoCo across the groups (DP 2 inside each: rank i averages chunk i of the weights); its reference
    # is the same DiLoCo over 2 data-parallel ranks without torchft up to the kill (per-token loss: off)
    "diloco": ["--local-sgd-interval", "4", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
    "vpp": [
        *("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
        "--use-distributed-optimizer",
    ],
}


def main():
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    from megalm.device import free_port
    from tests.training_runs import tiny_flags

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="zero2")
    p.add_argument("--kill-at", type=int, default=0, help="group B dies at this forward call (0: never)")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--step-seconds", type=float, default=0.3, help="sleep per forward call")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    env["MEGALM_BENCH_STEP_SECONDS"] = str(args.step_seconds)
    flags = tiny_flags(
        hidden_size="32",
        vocab_size="128",
        num_layers="4",
        micro_batch_size="2",
        global_batch_size="8" if args.layout == "diloco" else "16",  # diloco: 1 micro-batch per rank, as DP 4
        train_iters=str(args.iters),
        calculate_per_token_loss=True if args.layout != "diloco" else None,  # local SGD: per replica only
        eod_mask_loss=True,
    )
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=1000)
    url = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    out = tempfile.mkdtemp(prefix="torchft-layouts-")

    def torchrun(n, extra, name, launch=None, **more):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n)]
        cmd += launch or ["--master-port", str(free_port())]
        cmd += [os.path.join(REPO, "bench", "recovery_torchft.py"), "--worker"]
        cmd += [*flags, *extra, "--metrics-file", os.path.join(out, f"{name}.jsonl")]
        log = open(os.path.join(out, f"{name}.log"), "w")
        return subprocess.Popen(cmd, env=dict(env, **more), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def ft(g):
        return [*LAYOUTS[args.layout], "--ft-replica-group-id", str(g), "--ft-num-replica-groups", "2"]

    if args.layout != "diloco":
        plain = torchrun(1, [], "plain")
    else:  # megalm's DiLoCo over 2 "nodes" of 2 ranks, exact inside a node (--hierarchical-grad-reduce)
        port, hier = str(free_port()), [*LAYOUTS["diloco"], "--hierarchical-grad-reduce"]
        nodes = [["--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port]
                 for r in range(2)]  # fmt: skip
        plain, plain_node1 = (torchrun(2, hier, f"plain{'' if r == 0 else r}", nodes[r]) for r in range(2))
    a = torchrun(2, [*ft(0), "--ft-lighthouse", url], "a")
    kill = {"MEGALM_BENCH_KILL_AT": str(args.kill_at), "MEGALM_BENCH_STAMP": os.path.join(out, "killed")}
    b = torchrun(2, [*ft(1), "--ft-lighthouse", url], "b", **(kill if args.kill_at else {}))
    groups = ["a", "b"]
    if args.kill_at:
        b.wait(timeout=args.timeout)
        b = torchrun(2, [*ft(1), "--ft-lighthouse", url], "b2")
        groups.append("b2")
    codes = [proc.wait(timeout=args.timeout) for proc in (a, b, plain)]
    if args.layout == "diloco":
        codes.append(plain_node1.wait(timeout=args.timeout))
    server.shutdown()
    print(f"logs in {out}; exit codes (A, last B, one process): {codes}")

    def rows(name):
        with open(os.path.join(out, f"{name}.jsonl")) as f:
            return [json.loads(line) for line in f if "lm_loss" in line]

    ref = {r["iteration"]: r for r in rows("plain")}
    worst_loss = worst_norm = 0.0
    # diloco: the reference has no quorum of 1 nor the rejoin's copy of A: compared up to B's death
    alone = [r["iteration"] for r in rows("a") if r["ft_replica_groups"] == 1]
    last = min(alone) - 1 if args.layout == "diloco" and alone else args.iters
    for g in groups:
        for r in rows(g):
            e = ref[r["iteration"]]
            if r["iteration"] > last:
                continue
            assert r["consumed_samples"] == e["consumed_samples"], (r, e)
            worst_loss = max(worst_loss, abs(r["lm_loss"] - e["lm_loss"]) / abs(e["lm_loss"]))
            if g == "a" or args.layout != "diloco":  # diloco: each group has its own gradient (ref: rank 0's)
                worst_norm = max(worst_norm, abs(r["grad_norm"] - e["grad_norm"]) / abs(e["grad_norm"]))
    if args.layout == "diloco":  # the reference only up to the kill; then every sync A and B made agrees
        print(f"diloco: iterations 1-{last} (before B's death) compared to the reference")
        syncs = {g: _syncs(os.path.join(out, f"{g}.log")) for g in groups}
        agree = [it for g in groups[1:] for it, v in syncs[g].items() if syncs["a"].get(it) == v]
        print(f"diloco: A's syncs (iteration: groups): {[(it, v[0][1]) for it, v in sorted(syncs['a'].items())]}")
        print(f"diloco: syncs of B / the new B with A's weights on every rank: {sorted(agree)}")
    quorums = [r["ft_replica_groups"] for r in rows("a")]
    print(
        f"A: every iteration once: {[r['iteration'] for r in rows('a')] == list(range(1, args.iters + 1))}; "
        f"steps alone: {quorums.count(1)}"
    )
    for g in groups:
        with open(os.path.join(out, f"{g}.log")) as f:
            lines = [line.strip()[:200] for line in f if "recovered the state" in line or "rejoined" in line]
        for line in lines:
            print(f"{g}: {line}")
    print(
        f"layout {args.layout}: worst relative difference to one process: loss {worst_loss:.1e}, "
        f"gradient norm {worst_norm:.1e}"
    )


def _syncs(log):
    """``{iteration: sorted (rank, groups, fingerprint)}`` of the local-SGD outer syncs in a group's log."""
    out = {}
    with open(log) as f:
        for line in f:
            if "local-SGD outer sync of iteration" in line:
                rank = line.split("rank ")[1].split("]")[0] if "rank " in line else "0"
                it = int(line.split("outer sync of iteration ")[1].split()[0])
                groups = int(line.split(" over ")[1].split()[0])
                out.setdefault(it, []).append((rank, groups, line.split("weights sum ")[1].strip()))
    return {it: sorted(v) for it, v in out.items()}


if __name__ == "__main__":
    main()
