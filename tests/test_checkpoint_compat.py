"""Checkpoints written by an earlier megalm (commit c2855cf, ``tests/fixtures/checkpoints_c2855cf``) load
with today's code and training continues with the losses that code had when it resumed from them, bit
for bit: int8 gradient compression under TP 2 x DP 2 (per-rank residuals and rounding generator) and
DiLoCo under PP 2 x DP 2 (each replica's weights and optimizer, the outer state).  4 gloo ranks."""

import json
import os
import shutil

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import losses

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "checkpoints_c2855cf")


def resume_each(tmp, expected):
    import torch.distributed as dist

    from tests.training_runs import run_trainings

    runs = []
    for name, case in expected["cases"].items():
        load = os.path.join(tmp, name)
        metrics = os.path.join(tmp, f"{name}.jsonl")
        runs.append(
            expected["tiny_argv"] + case["argv"] + ["--load", load, "--train-iters", "4", "--metrics-file", metrics]
        )
    codes = run_trainings(runs)
    dist.barrier()  # the logging rank has closed its metrics files
    return codes


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("compat"))
    with open(os.path.join(FIXTURES, "expected.json")) as f:
        expected = json.load(f)
    for name in expected["cases"]:
        shutil.copytree(os.path.join(FIXTURES, name), os.path.join(tmp, name))
    codes = run_distributed(resume_each, 4, args=(tmp, expected), timeout=300)
    return tmp, expected, codes


def test_checkpoints_of_c2855cf_resume_with_its_losses(resumed):
    tmp, expected, codes = resumed
    assert codes == [[0, 0]] * 4, codes
    for name, case in expected["cases"].items():
        got = losses(tmp, name)
        assert len(got) == 2 and got == case["resumed"], (name, got, case["resumed"])
        assert got != case["full"][:2]  # iterations 3 and 4, not a run from scratch
