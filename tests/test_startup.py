"""Start-up that never hangs (issue #32, item 1).

(a) DataLoader workers are not forked from the trainer: a lock held by the trainer when the
    workers start is not held in the workers (a forked worker inherits it locked and hangs: the
    control run with a ``fork`` context times out).
(b) forkserver workers give the same batches as in-process loading, from the start and resumed
    from ``consumed_samples``; the dataset reaches them with its memory-mapped indices as file
    references (the pickle is small).
(c) ``--first-step-timeout-seconds``: unit (one store, two ranks' deadlines) and a real
    ``torchrun`` of two ranks where rank 1 stalls in its first step: every rank exits with code
    75 and one line naming rank 1, long before the collective timeout.

Run as a script (``torchrun tests/test_startup.py ARGS``) this file is the training entry point
of (c): ``pretrain_gpt.main`` with ``MEGALM_TEST_STALL=RANK`` (rank RANK sleeps in its first
forward step).
"""

import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from tests.test_data_gpt_dataset import write_dataset
from tests.training_runs import sleep_on_rank, tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")

# Held by the test (the "trainer") while the loader starts its workers.
TRAINER_LOCK = threading.Lock()


class LockedDataset(torch.utils.data.Dataset):
    """Items need :data:`TRAINER_LOCK`, as Python's after-fork code needs locks other threads held."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        with TRAINER_LOCK:
            return torch.tensor([i])


def _first_batch(loader, timeout):
    loader.timeout = timeout  # DataLoader raises RuntimeError when a worker sends nothing for this long
    TRAINER_LOCK.acquire()  # held while the workers start
    try:
        iterator = iter(loader)
    finally:
        TRAINER_LOCK.release()
    try:
        return next(iterator).tolist()
    finally:
        del iterator


def test_workers_do_not_inherit_the_trainers_locks():
    from megalm.data.loaders import build_pretraining_data_loader, shutdown_loader_workers

    loader = build_pretraining_data_loader(LockedDataset(), 0, 2, 0, 1, num_workers=2)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    assert _first_batch(loader, 60) == [[0], [1]]
    shutdown_loader_workers(loader)
    # Control: the same loader with forked workers hangs on the inherited lock.
    forked = torch.utils.data.DataLoader(
        LockedDataset(), batch_size=2, num_workers=1, multiprocessing_context="fork", timeout=3
    )
    with pytest.raises(RuntimeError, match="timed out"):
        _first_batch(forked, 3)


def _gpt_dataset(tmp_path):
    from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megalm.data.indexed_dataset import IndexedDataset

    prefix = tmp_path / "corpus"
    write_dataset(prefix, num_docs=200, max_len=60)
    cfg = GPTDatasetConfig(seq_length=16, seed=5, eod=0, cache_dir=str(tmp_path / "cache"))
    ds = IndexedDataset(str(prefix))
    documents = np.arange(len(ds), dtype=np.int32)
    GPTDataset(ds, documents, 300, "train", cfg)  # builds and caches the indices
    return GPTDataset(ds, documents, 300, "train", cfg)  # maps them


def test_forkserver_workers_read_the_same_batches_and_resume(tmp_path):
    from megalm.data.loaders import build_pretraining_data_loader, shutdown_loader_workers

    dataset = _gpt_dataset(tmp_path)
    assert isinstance(dataset.shuffle_index, np.memmap)
    index_bytes = sum(a.nbytes for a in (dataset.document_index, dataset.sample_index, dataset.shuffle_index))
    pickled = pickle.dumps(dataset)
    assert len(pickled) < index_bytes / 2, (len(pickled), index_bytes)  # references, not copies
    copy = pickle.loads(pickled)
    assert isinstance(copy.shuffle_index, np.memmap) and torch.equal(copy[7]["tokens"], dataset[7]["tokens"])

    def batches(consumed, workers, kind, n):
        loader = build_pretraining_data_loader(
            dataset, consumed, 2, 1, 2, num_workers=workers, dataloader_type=kind, seed=3
        )
        out = []
        for batch in loader:
            out.append(batch["tokens"])
            if len(out) == n:
                break
        shutdown_loader_workers(loader)
        return torch.stack(out)

    for kind in ("single", "cyclic"):
        inline = batches(0, 0, kind, 8)
        assert torch.equal(batches(0, 2, kind, 8), inline), kind
        assert torch.equal(batches(12, 2, kind, 5), inline[3:]), kind  # 3 steps of mbs 2 x dp 2 consumed


# --- (c) --first-step-timeout-seconds ------------------------------------------------------


def test_first_step_deadline_names_the_missing_rank():
    from megalm.device import free_port
    from megalm.training.first_step import EXIT_CODE, FirstStepDeadline

    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    exits = {0: [], 1: []}
    ranks = [FirstStepDeadline(1.0, store, r, 2, exit=exits[r].append) for r in (0, 1)]
    ranks[0].step_done()
    ranks[0].step_done()  # once only: the count stays 1
    for d in ranks:
        d._thread.join(timeout=20)
    assert exits == {0: [EXIT_CODE], 1: [EXIT_CODE]}
    assert ranks[0].stages() == [2, 0]
    for d in ranks:
        assert d.message.startswith("rank 1 (") and "stuck after 'set-up done'" in d.message, d.message
        assert "rank 0" not in d.message.split("did not")[0] and "\n" not in d.message
    # Every rank done in time: nobody exits.
    store2 = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    quiet = []
    ok = [FirstStepDeadline(0.5, store2, r, 2, exit=quiet.append) for r in (0, 1)]
    for d in ok:
        d.step_done()
    for d in ok:
        d._thread.join(timeout=20)
    assert quiet == [] and all(d.message is None for d in ok)


def test_a_rank_stalled_in_its_first_step_fails_the_job_fast(tmp_path):
    argv = tiny_flags(train_iters="5", hidden_size="32", seq_length="16", num_workers="0")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        os.path.abspath(__file__),
        *argv,
        "--first-step-timeout-seconds",
        "6",
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=dict(ENV, MEGALM_TEST_STALL="1"), cwd=REPO, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the stalled start was not detected: {(e.stdout or b'')[-3000:]!r}")
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "did not finish the first training step" in line]
    assert lines, out[-3000:]
    assert len(lines) == 2, lines  # one line per rank
    for line in lines:
        named = line.split("] ", 1)[1].split(" did not")[0]
        assert named.startswith("rank 1 (") and "rank 0" not in named, line
        assert "stuck after 'set-up done'" in line, line
    assert "exitcode  : 75" in out or "exitcode: 75" in out.replace(" ", ""), out[-3000:]
    assert elapsed < 200, elapsed  # the collective timeout (10 min) was not waited for


if __name__ == "__main__":
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    # Test hook: global rank MEGALM_TEST_STALL stalls in its first forward step.
    pretrain_gpt.main(sys.argv[1:], sleep_on_rank(pretrain_gpt.forward_step, "MEGALM_TEST_STALL", 3600))
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank
