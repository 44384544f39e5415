import pytest
import torch
import torch.distributed as dist

from megalm.testing import DistributedTestError, run_distributed


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


def test_harness_runs_real_ranks_and_reports_errors():
    assert run_distributed(_sum_ranks, 3, timeout=60) == [3.0, 3.0, 3.0]
    with pytest.raises(DistributedTestError, match="boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
