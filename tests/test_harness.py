import pytest
import torch
import torch.distributed as dist

from megalm.parallel_state import get_process_groups
from tests.distributed_harness import DistributedTestError, run_distributed


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


@pytest.fixture(autouse=True)
def _no_reused_ranks_left():
    """The reused ranks these tests start stop with them (idle ones keep gloo threads busy)."""
    from tests import distributed_harness as testing

    yield
    testing.close_rank_pools()


def test_harness_runs_real_ranks_and_reports_errors(monkeypatch):
    from tests import distributed_harness as testing

    monkeypatch.setenv(testing.POOL_ENV, "1")
    assert run_distributed(_sum_ranks, 3, timeout=60) == [3.0, 3.0, 3.0]
    with pytest.raises(DistributedTestError, match="boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert 2 not in testing._POOLS  # a failed call kills its ranks


# --- reused ranks (MEGALM_TEST_RANK_POOL=1) ------------------------------------------------------


def _dirty_the_process():
    """Changes what a reused rank must restore; returns this process's id."""
    import os

    os.environ["MEGALM_HARNESS_LEFTOVER"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(dist.get_rank() + 100)
    torch.rand(5)
    return os.getpid()


def _fresh_view():
    """What a fresh process sees: (pid, leftover variable, default dtype, seed of the default generator)."""
    import os

    return os.getpid(), os.environ.get("MEGALM_HARNESS_LEFTOVER"), torch.get_default_dtype(), torch.initial_seed()


def _monkeypatch_megalm():
    import os

    from megalm import device

    device.use_cuda = _fresh_view  # rebinds a megalm function to one of this module's, never undone
    return os.getpid()


def test_reused_ranks_are_restored_and_retire_after_leftovers(monkeypatch):
    from tests import distributed_harness as testing

    monkeypatch.setenv(testing.POOL_ENV, "1")
    pids = run_distributed(_dirty_the_process, 2, timeout=60)
    views = run_distributed(_fresh_view, 2, timeout=60)
    for rank, (pid, (view_pid, leftover, dtype, seed)) in enumerate(zip(pids, views)):
        assert view_pid == pid and leftover is None and dtype == torch.float32
        assert seed != rank + 100  # reseeded from the OS, as a fresh process starts
    assert run_distributed(_monkeypatch_megalm, 2, timeout=60) == pids  # the same processes ran it
    assert 2 not in testing._POOLS  # and retired after it: the next call of 2 ranks starts fresh ones


def _ddp_step():
    """A gradient step of a ``DistributedDataParallel`` over the layout's groups, left as a test leaves it
    (nothing destroyed or closed by hand); returns (pid, group threads after the step)."""
    import os

    import torch.distributed.checkpoint  # noqa: F401 - first import binds torch.distributed.nn.functional's defaults

    from megalm import parallel_state
    from megalm.config import ParallelConfig
    from megalm.distributed import DistributedDataParallel
    from tests import distributed_harness as testing

    parallel_state.initialize_model_parallel()
    model = DistributedDataParallel(torch.nn.Linear(4, 3), ParallelConfig(), process_groups=get_process_groups())
    model(torch.ones(2, 4)).sum().backward()
    model.finish_grad_sync()
    return os.getpid(), testing.group_thread_count()


_KEPT_GROUPS = []


def _keep_a_group():
    _KEPT_GROUPS.append(dist.new_group([0, 1]))  # a reference the call leaves behind
    return dist.get_rank()


def test_reused_ranks_free_process_groups(monkeypatch, tmp_path):
    """A DDP step leaves no process group alive (its gradient hooks hold it weakly): the idle ranks have no
    group threads and serve the next call; a call that keeps a group retires them."""
    from tests import distributed_harness as testing

    log = tmp_path / "pool.log"
    monkeypatch.setenv(testing.POOL_ENV, "1")
    monkeypatch.setenv(testing.POOL_ENV + "_LOG", str(log))
    pids = None
    for _ in range(2):
        got, during = zip(*run_distributed(_ddp_step, 2, timeout=60))
        assert pids is None or got == pids  # the same ranks served the second call
        pids = got
        assert min(during) >= 3  # each group: two gloo workers and a tcp loop
        assert [testing.group_thread_count(p) for p in pids] == [0, 0]  # idle: every group's threads ended
    assert run_distributed(_keep_a_group, 2, timeout=60) == [0, 1]
    assert 2 not in testing._POOLS
    assert "threads of destroyed process groups still running" in log.read_text()
