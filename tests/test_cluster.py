"""tools/cluster/run.py: the simulated multi-node cluster (network namespaces on a bridge, tc-shaped links).

The tests that launch it need root (CAP_NET_ADMIN) and iproute2; without them they skip with the
launcher's own one-line reason.  They use their own cluster name and subnet, so a cluster a user
runs beside them (default name ``mlc``) is not touched.  Asserted:

* a 2-node x 2-process pretrain_gpt.py run (TP 2 inside a node, DP 2 across) trains and its losses
  and grad norms are *bit-identical* to a 4-process single-host run of the same flags: the ranks,
  the data and gloo's collective algorithms are the same, only the transport differs;
* on the cluster, ranks are node-contiguous, every TP group lies inside one node, intra-node
  collectives never touch the shaped link (they go over ``lo``) and inter-node ones do;
* the link is shaped: 4 MB at 50 Mbit/s takes at least the analytic time, unshaped far less;
* ``scripts/slurm/pretrain.sbatch`` + ``scripts/common.sh`` launched on the cluster with NNODES=2;
* every namespace, link and process is gone after success, a failing command, a timeout and
  SIGINT to the launcher; a second run refuses while one is active; a stale lock is taken over;
* a network cut (node 1's switch port leaves the bridge) shorter than the collective timeout is
  survived (the collective in flight stalls); a longer one ends every rank with gloo's timeout error.

The launches that train or wait on purpose are marked ``slow`` (``-m "not slow"``: ~25 s).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megalm.launch.cluster import ClusterOptions, exit_code, node_command, node_env
from megalm.launch.netns import (
    ClusterError,
    ClusterNet,
    ClusterPrivilegeError,
    check_privileges,
    rate_bits,
    tbf_burst_bytes,
)
from tests.training_runs import tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "tools", "cluster", "run.py")
NAME, SUBNET = "mlct", "10.213.9.0/24"
ADDR0, ADDR1 = "10.213.9.10", "10.213.9.11"
LOCK = f"/tmp/megalm-cluster-{NAME}.lock"
ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")


def _privilege_problem():
    try:
        check_privileges()
    except ClusterPrivilegeError as e:
        return str(e)
    return None


needs_cluster = pytest.mark.skipif(_privilege_problem() is not None, reason=str(_privilege_problem()))


def launcher(*args, name=NAME):
    return [sys.executable, RUN, "--name", name, "--subnet", SUBNET, *args]


def launch(*args, timeout=120, **kw):
    """Run the launcher to its end; (returncode, stdout, stderr)."""
    proc = subprocess.run(launcher(*args, **kw), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def node_lines(stdout, node):
    prefix = f"[node {node}] "
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


def assert_clean(pids=()):
    """No namespace of the test cluster, no lock, none of ``pids`` alive, no interface added to the host."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not [line for line in namespaces.splitlines() if line.startswith(f"{NAME}-")], namespaces
    assert not os.path.exists(LOCK)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"process {pid} outlived the launcher"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert "uplink" not in links and "br0" not in links


# --- pure parts (no privileges needed) ---------------------------------------------------------


def test_rates_and_names():
    assert rate_bits("200mbit") == 200_000_000 and rate_bits("1gbit") == 10**9 and rate_bits("12.5kbit") == 12_500
    assert tbf_burst_bytes(50_000_000) == 128 * 1024 and tbf_burst_bytes(10**10) == 5_000_000
    for bad in ("200", "fast", "200mbps", "1bit"):
        with pytest.raises(ClusterError):
            rate_bits(bad)
    net = ClusterNet("mlc", 12, "10.213.7.0/24", "1gbit")
    assert [net.address(i) for i in (0, 1, 11)] == ["10.213.7.10", "10.213.7.11", "10.213.7.21"]
    assert net.namespaces()[:2] == ["mlc-n0", "mlc-n1"] and net.switch == "mlc-sw"
    # c10d orders nodes by their address string: node order must survive that sort.
    addrs = [net.address(i) for i in range(12)]
    assert sorted(addrs) == addrs
    for bad in (
        {"name": "Bad-name", "nodes": 2},
        {"name": "x", "nodes": 2, "subnet": "8.8.8.0/24"},
        {"name": "x", "nodes": 2, "subnet": "10.0.0.0/16"},
        {"name": "x", "nodes": 0},
        {"name": "x", "nodes": 2, "bandwidth": "fast"},
    ):
        with pytest.raises(ClusterError):
            ClusterNet(**bad)


def test_node_command_is_torchrun_c10d():
    opts = ClusterOptions(nodes=2, procs_per_node=2, name="mlc", command=["pretrain_gpt.py", "--mock-data"])
    argv = node_command(opts, opts.net(), 1)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    flags = argv[3:-2]
    assert dict(zip(flags[::2], flags[1::2])) == {
        "--nnodes": "2",
        "--node-rank": "1",
        "--nproc-per-node": "2",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "10.213.7.10:29500",
        "--rdzv-id": "mlc",
        "--rdzv-conf": "is_host=0",
        "--local-addr": "10.213.7.11",
        "--max-restarts": "0",
    }
    assert argv[-2:] == ["pretrain_gpt.py", "--mock-data"]
    assert exit_code(-2) == 130 and exit_code(3) == 3


def test_node_env_shares_the_cores_among_every_simulated_rank(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    opts = ClusterOptions(nodes=4, procs_per_node=1, name="mlc")
    env = node_env(opts, opts.net(), 3)
    assert env["OMP_NUM_THREADS"] == "4" and env["NODE_RANK"] == "3" and env["MASTER_ADDR"] == "10.213.7.10"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
    assert node_env(opts, opts.net(), 0)["OMP_NUM_THREADS"] == "2"


def test_without_privileges_says_so_in_one_line():
    env = dict(ENV, PATH="/nonexistent")  # no ip, no tc
    proc = subprocess.run(
        launcher("--raw", "--", "true"), env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "[megalm] cluster: the simulated cluster needs iproute2's ip and tc (not found)"


# --- on the cluster ------------------------------------------------------------------------------

TINY = tiny_flags(
    lr="1e-3",
    seed="5",
    micro_batch_size="2",
    global_batch_size="8",
    train_iters="3",
    tensor_model_parallel_size="2",
)


@pytest.mark.slow
@needs_cluster
def test_two_nodes_train_like_one_host(tmp_path):
    """2 nodes x 2 ranks over a 200 Mbit/s link vs 4 ranks on one host: identical numbers.  Both
    runs go side by side (the single-host one on loopback, outside the cluster)."""
    single = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "pretrain_gpt.py",
            *TINY,
            "--metrics-file",
            str(tmp_path / "single.jsonl"),
        ],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        code, out, err = launch(
            "--nodes",
            "2",
            "--procs-per-node",
            "2",
            "--inter-node-bandwidth",
            "200mbit",
            "--timeout",
            "150",
            "--",
            "pretrain_gpt.py",
            *TINY,
            "--metrics-file",
            str(tmp_path / "cluster.jsonl"),
            timeout=200,
        )
        single_out, _ = single.communicate(timeout=150)
    finally:
        single.kill()
    assert code == 0, out[-3000:] + err[-2000:]
    assert single.returncode == 0, single_out[-3000:]
    assert any("iteration        3/       3" in line for line in node_lines(out, 0) + node_lines(out, 1)), out[-2000:]

    def metrics(name):
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in rows if "lm_loss" in r]

    cluster, reference = metrics("cluster"), metrics("single")
    assert [it for it, _, _ in cluster] == [1, 2, 3]
    assert cluster == reference  # bit for bit
    assert cluster[-1][1] < cluster[0][1]  # and it trains
    assert_clean()


PROBE = r"""
import json, os, socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
from megalm import parallel_state as ps
from megalm.topology import topology_report

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((os.environ["MASTER_ADDR"], 9))  # UDP connect: picks the source address, sends nothing
addrs = [None] * world
dist.all_gather_object(addrs, s.getsockname()[0])
ps.initialize_model_parallel(tensor_model_parallel_size=2, timeout=timedelta(seconds=60))
pg = ps.get_process_groups()

def tx():
    with open("/sys/class/net/uplink/statistics/tx_bytes") as f:
        return int(f.read())

def sent_during_all_reduces(group):
    dist.barrier()
    before = tx()
    t = torch.ones(1 << 20)  # 4 MB
    for _ in range(2):
        dist.all_reduce(t, group=group)
    after = tx()
    dist.barrier()
    return after - before

moved = {"tp": sent_during_all_reduces(pg.tp), "dp": sent_during_all_reduces(pg.dp)}
every = [None] * world
dist.all_gather_object(every, moved)
if rank == 0:
    print("PROBE " + json.dumps({"addrs": addrs, "moved": every, "report": topology_report(world, 2, tp=2)}))
dist.barrier()
sys.stdout.flush()
# Leave without gloo's C++ teardown: at exit a rank across the link can abort in it ("terminate called
# without an active exception", seen in CI after the PROBE line); the subject here is the layout.
os._exit(0)
"""


@needs_cluster
def test_layout_on_the_cluster_and_intra_node_traffic_stays_off_the_link(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    code, out, err = launch(
        "--nodes", "2", "--procs-per-node", "2", "--inter-node-bandwidth", "1gbit", "--timeout", "90", "--", str(probe)
    )
    assert code == 0, out[-3000:] + err[-2000:]
    line = next(x for x in node_lines(out, 0) if x.startswith("PROBE "))
    probe_result = json.loads(line[len("PROBE ") :])
    assert probe_result["addrs"] == [ADDR0, ADDR0, ADDR1, ADDR1]  # ranks are node-contiguous
    for group in ([0, 1], [2, 3]):  # TP groups of compute_layout(4, tp=2)
        assert len({probe_result["addrs"][r] for r in group}) == 1
    assert probe_result["report"] == (
        "topology: 2 nodes x 2 ranks (TP 2, CP 1, EP 1, DP 2, PP 1): DP group spans 2 nodes, TP group inside one node"
    )
    for moved in probe_result["moved"]:
        assert moved["tp"] < 64 * 1024, probe_result  # intra-node all-reduce of 8 MB: over lo
        assert moved["dp"] >= 8 * 10**6, probe_result  # inter-node: 2 x 4 MB ring all-reduce leaves the node
    assert_clean()


XFER = r"""
import os, socket, sys, threading, time
N = 4 * 10**6
node, addrs = int(os.environ["NODE_RANK"]), os.environ["CLUSTER_NODE_ADDRS"].split()

def serve(addr, port, ready):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    got = 0
    while got < N:
        chunk = conn.recv(1 << 20)
        assert chunk
        got += len(chunk)
    conn.sendall(b"k")

def send(addr, port):
    for _ in range(200):
        try:
            c = socket.create_connection((addr, port), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    start = time.perf_counter()
    c.sendall(b"x" * N)
    assert c.recv(1) == b"k"
    return time.perf_counter() - start

if node == 1:
    serve(addrs[1], 5601, threading.Event())
else:
    ready = threading.Event()
    threading.Thread(target=serve, args=(addrs[0], 5602, ready), daemon=True).start()
    ready.wait()
    print(f"intra {send(addrs[0], 5602):.4f}")
    print(f"inter {send(addrs[1], 5601):.4f}")
"""


@needs_cluster
@pytest.mark.parametrize("bandwidth", ["50mbit", None])
def test_link_is_shaped(tmp_path, bandwidth):
    script = tmp_path / "xfer.py"
    script.write_text(XFER)
    shaping = ["--inter-node-bandwidth", bandwidth] if bandwidth else []
    code, out, err = launch("--nodes", "2", *shaping, "--timeout", "60", "--raw", "--", sys.executable, str(script))
    assert code == 0, out + err
    seconds = dict(line.split() for line in node_lines(out, 0))
    intra, inter = float(seconds["intra"]), float(seconds["inter"])
    analytic = 4 * 10**6 * 8 / 50e6  # 0.64 s at 50 Mbit/s
    if bandwidth:
        # The token bucket starts full: its depth goes through at once, the rest at the rate.
        assert inter >= (4 * 10**6 - tbf_burst_bytes(50_000_000)) * 8 / 50e6, seconds
        assert inter < 3 * analytic, seconds
        assert intra < inter / 5, seconds  # inside a node: loopback, not shaped
    else:
        assert inter < analytic / 3, seconds
    assert_clean()


def slurm_stand_ins(bin_dir):
    """scontrol/srun stand-ins: the job's nodes are the cluster's, each task is its node's NODE_RANK."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "%s\\n" $CLUSTER_NODE_ADDRS\n')
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nSLURM_NODEID=$NODE_RANK exec "$@"\n'
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)


def sbatch_on_cluster(tmp_path, env_words, *flags):
    """``scripts/slurm/pretrain.sbatch scripts/pretrain_gpt_tiny_cpu.sh`` on 2 nodes x 2 processes."""
    wrapper = (
        f"export PATH={tmp_path / 'bin'}:$PATH SLURM_NNODES=$NNODES SLURM_JOB_NODELIST=sim "
        f"SLURM_SUBMIT_DIR={REPO} RUN_DIR={tmp_path / 'run'} {env_words}; unset MASTER_ADDR; "
        f"exec bash scripts/slurm/pretrain.sbatch scripts/pretrain_gpt_tiny_cpu.sh {' '.join(flags)}"
    )
    return launch(
        "--nodes",
        "2",
        "--procs-per-node",
        "2",
        "--port",
        "6000",
        "--inter-node-bandwidth",
        "200mbit",
        "--timeout",
        "120",
        "--raw",
        "--",
        "bash",
        "-c",
        wrapper,
        timeout=180,
    )


@pytest.mark.slow
@needs_cluster
def test_slurm_script_runs_on_two_nodes(tmp_path):
    """scripts/slurm/pretrain.sbatch + scripts/common.sh on the cluster with NNODES=2 (Slurm's
    scontrol/srun are stand-ins): DRY_RUN shows each node's torchrun with --nnodes 2, its own
    --node_rank and node 0's address; then 2 real iterations train over torchrun's static rendezvous."""
    slurm_stand_ins(tmp_path / "bin")
    code, out, err = sbatch_on_cluster(tmp_path, "DRY_RUN=1", "--log-interval", "1")
    assert code == 0, out + err
    for node in (0, 1):
        command = next(x for x in node_lines(out, node) if x.startswith("[megalm] cd "))
        words = shlex.split(command)
        assert words[1:5] == ["cd", REPO, "&&", "torchrun"], command
        opts = dict(zip(words[5:15:2], words[6:15:2]))
        assert opts == {
            "--nproc_per_node": "2",
            "--nnodes": "2",
            "--node_rank": str(node),
            "--master_addr": ADDR0,
            "--master_port": "6000",
        }, command
        assert words[-2:] == ["--log-interval", "1"]
    assert_clean()

    code, out, err = sbatch_on_cluster(tmp_path, "TRAIN_ITERS=2 EVAL_ITERS=0 LOG_INTERVAL=1")
    assert code == 0, out[-3000:] + err
    for node in (0, 1):
        assert any(
            line.startswith(f"[megalm] gpt_tiny_cpu: node {node} of 2, 2 processes, TP 2")
            for line in node_lines(out, node)
        ), out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in rows if "lm_loss" in r] == [1, 2] and losses[1] < losses[0], rows
    assert_clean()


# --- teardown on every path, and the lock --------------------------------------------------------

SLEEPER = 'echo "pid $$"; exec sleep 60'


def pids_of(stdout):
    return [int(line.split()[1]) for node in (0, 1) for line in node_lines(stdout, node) if line.startswith("pid ")]


@needs_cluster
def test_cleanup_after_success_and_failure_and_timeout():
    code, out, _ = launch("--nodes", "2", "--raw", "--", "bash", "-c", 'echo "pid $$"; exit 0')
    assert code == 0 and len(pids_of(out)) == 2
    assert_clean(pids_of(out))
    # Node 1 fails with 3 while node 0 would sleep: node 0 is stopped after --fail-grace, exit 3.
    start = time.monotonic()
    code, out, err = launch(
        "--nodes",
        "2",
        "--fail-grace",
        "0.5",
        "--raw",
        "--",
        "bash",
        "-c",
        'echo "pid $$"; [[ $NODE_RANK == 1 ]] && exit 3; exec sleep 60',
    )
    assert code == 3 and time.monotonic() - start < 20, out + err
    assert "a node failed" in err
    assert_clean(pids_of(out))
    code, out, err = launch("--nodes", "2", "--timeout", "1", "--raw", "--", "bash", "-c", SLEEPER)
    assert code == 124 and "timed out after 1 s" in err, out + err
    assert_clean(pids_of(out))


@needs_cluster
def test_sigint_to_the_launcher_removes_everything():
    proc = subprocess.Popen(
        launcher("--nodes", "2", "--raw", "--", "bash", "-c", SLEEPER),
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    try:
        while len(seen) < 2:
            line = proc.stdout.readline()
            assert line, "launcher ended early"
            seen.append(line)
        pids = pids_of("".join(seen))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err
    assert_clean(pids)


@needs_cluster
def test_second_run_refuses_and_stale_lock_is_taken_over(tmp_path):
    with open(LOCK, "w") as f:
        f.write(f"{os.getpid()}\n")  # a live owner: this test process
    try:
        code, out, err = launch("--nodes", "2", "--raw", "--", "true")
    finally:
        os.unlink(LOCK)
    assert code == 2 and out == ""
    assert err.strip() == (
        "[megalm] cluster: a simulated cluster is already running "
        f"(pid {os.getpid()}, lock {LOCK}); wait for it or stop it"
    )
    # A dead owner that left its namespaces behind (killed with SIGKILL): taken over and cleaned.
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(LOCK, "w") as f:
        f.write(f"{dead.pid}\n")
    subprocess.run(["ip", "netns", "add", f"{NAME}-n0"], check=True, timeout=10)
    code, out, err = launch("--nodes", "2", "--raw", "--", "bash", "-c", "echo up")
    assert code == 0 and node_lines(out, 0) == ["up"] and node_lines(out, 1) == ["up"], out + err
    assert "removing what a previous launcher" in err
    assert_clean()


# --- a network failure ---------------------------------------------------------------------------

CUT_LOOP = r"""
import os, time
from datetime import timedelta
import torch, torch.distributed as dist

timeout = float(os.environ["CUT_TEST_TIMEOUT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
loop_for = float(os.environ["CUT_TEST_LOOP_FOR"])
t, flag = torch.ones(1 << 16), torch.zeros(1)
slowest, steps = 0.0, 0
try:
    while True:
        start = time.monotonic()
        dist.all_reduce(t)
        slowest, steps = max(slowest, time.monotonic() - start), steps + 1
        if steps == 1:  # every rank is up: the loop's and the launcher's cut clocks start
            until = time.time() + loop_for
            if dist.get_rank() == 0:
                open(os.environ["CUT_TEST_READY"], "w").close()
        flag.fill_(float(time.time() > until))
        dist.broadcast(flag, 0)  # rank 0's clock decides for everyone
        if flag.item():
            break
        time.sleep(0.05)
except RuntimeError as e:  # named as pretrain names it (imported here: start-up stays as short as before)
    from megalm.distributed.collective_errors import describe_failure

    message = describe_failure(e, None, timeout)
    if message is None:
        raise
    os.write(1, f"[rank{dist.get_rank()}] {message}\n".encode())
    raise SystemExit(1)
# one write(2): two ranks share the node's stdout, and print() writes text and newline apart
os.write(1, f"rank {dist.get_rank()} steps {steps} slowest {slowest:.2f}\n".encode())
dist.barrier()
# Leave without running gloo's C++ destructors: a pair whose socket saw the cut can abort in them
# ("terminate called without an active exception", seen once in CI after every rank had finished).
# The subject here is the cut, not process teardown.
os._exit(0)
"""


def cut_run(tmp_path, collective_timeout, cut_for, loop_for):
    """2 nodes x 2 ranks all-reducing in a loop for ``loop_for`` s after their first all-reduce; node 1's
    link cut 3 s after that first all-reduce for ``cut_for`` s; collectives time out after
    ``collective_timeout`` s."""
    script, ready = tmp_path / "loop.py", tmp_path / "ready"
    script.write_text(CUT_LOOP)
    env = dict(
        ENV, CUT_TEST_TIMEOUT=str(collective_timeout), CUT_TEST_LOOP_FOR=str(loop_for), CUT_TEST_READY=str(ready)
    )
    proc = subprocess.run(
        launcher(
            "--nodes",
            "2",
            "--procs-per-node",
            "2",
            "--cut-node",
            "1",
            "--cut-after",
            "3",
            "--cut-after-file",
            str(ready),
            "--cut-for",
            str(cut_for),
            "--timeout",
            "90",
            "--fail-grace",
            "60",
            "--",
            str(script),
        ),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
@needs_cluster
def test_short_cut_is_survived(tmp_path):
    """A 3 s cut with a 20 s collective timeout: TCP retransmits, the collective in flight stalls
    (at least the cut) and the run goes on."""
    code, out, err = cut_run(tmp_path, collective_timeout=20, cut_for=3, loop_for=10)
    assert code == 0, out[-3000:] + err
    assert "cut node 1's link for 3.0 s" in err and "restored node 1's link" in err
    slowest = [float(x) for x in re.findall(r"rank \d+ steps \d+ slowest ([\d.]+)", out)]
    assert len(slowest) == 4 and min(slowest) >= 2.5, out[-3000:]
    assert_clean()


@pytest.mark.slow
@needs_cluster
def test_cut_longer_than_the_timeout_ends_every_rank_with_the_timeout(tmp_path):
    """An 8 s cut with a 4 s collective timeout: no hang; every rank's collective fails with gloo's
    timeout error, named by megalm's wrapper (the world group and its ranks), and both nodes'
    torchrun exit 1 on their own (once the link is back, node 1's agent can close the rendezvous
    on node 0)."""
    code, out, err = cut_run(tmp_path, collective_timeout=4, cut_for=8, loop_for=60)
    assert code == 1, out[-3000:] + err
    named = "timed out after 4 s (--distributed-timeout-minutes 0.0666667) in the world group, ranks [0, 1, 2, 3]"
    for node in (0, 1):
        lines = [line for line in node_lines(out, node) if "Timed out waiting 4000ms" in line]
        failed = {line.split("]")[0] for line in lines}
        assert failed == ({"[rank0", "[rank1"} if node == 0 else {"[rank2", "[rank3"}), out[-5000:]
        assert all(named in line for line in lines), out[-5000:]  # the error names the group
    assert_clean()
