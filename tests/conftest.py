"""Test-suite settings.

Compiled fusions (``torch.compile``) cost 10-20 s per process the first time on 2 cores, and
most tests spawn several ranks: outside ``tests/test_fusions*.py`` they run as their eager
references (``TORCHDYNAMO_DISABLE=1``, torch's own switch, inherited by spawned ranks).  The
fusion tests switch compilation back on and check every fusion against its reference, and a
model with all fusions on against one with all off.

The suite is the CPU/gloo suite (what CI runs): on a machine with a GPU it still runs on the CPU
(``MEGALM_FORCE_CPU=1``, read by :mod:`megalm.device`; the tests build CPU inputs and spawn several
gloo ranks on one machine).  GPU paths are checked by ``bench/cuda_check.sh`` on a GPU machine.

Spawned ranks are reused between tests of the same world size (``MEGALM_TEST_RANK_POOL=1``, read by
:func:`tests.distributed_harness.run_distributed`; ``0``: every call gets fresh processes).  A reused rank holds no
process group between calls (a rank that would retires: see :mod:`tests.distributed_harness`), so idle ranks have no
gloo threads.

Subprocesses (``python tools/<tool>.py``, scripts) import the megalm of this checkout: the repo root
leads ``PYTHONPATH`` (the tools add nothing to ``sys.path``; outside the tests megalm is installed).

Hangs fail instead of stalling CI:

* a test (setup, call and teardown) that runs longer than ``HANG_S`` seconds (``MEGALM_TEST_HANG_S``,
  default 1200) dumps every thread's stack to stderr and ends pytest
  (:func:`faulthandler.dump_traceback_later`);
* at the end of the session, DataLoader workers still alive are killed.  A test that fails keeps
  its frames, and with them its iterators and their workers; those ignore SIGTERM
  (:func:`megalm.data.loaders.ignore_sigterm_in_worker`), so multiprocessing's exit handler, which
  terminates daemonic children and then joins them, waited forever (seen: pytest printed
  "1 failed" and never exited).
"""

import faulthandler
import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("MEGALM_FORCE_CPU", "1")
os.environ.setdefault("MEGALM_TEST_RANK_POOL", "1")  # see the module docstring
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO] + _PATHS)

HANG_FD = pytest.StashKey[int]()
# The slowest test takes ~60 s on a quiet 2-core machine; a module's spawned groups may each use their
# whole timeout (up to 4 x 300 s) before they fail on their own.
HANG_S = float(os.environ.get("MEGALM_TEST_HANG_S", "1200"))


def pytest_configure(config):
    """Keep a descriptor of the real stderr (pytest's capture redirects fd 2 during tests) for the dump.

    ``global_and_fixture_disabled`` is the capture manager's own way to reach the real descriptors;
    suspending and resuming its global capture by hand here broke pytest's output after a collection
    error ("I/O operation on closed file" instead of the import error)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        config.stash[HANG_FD] = os.dup(2)
        return
    with capman.global_and_fixture_disabled():
        config.stash[HANG_FD] = os.dup(2)


# What makes a test module start processes (ranks, torchrun, tools run as scripts): its tests get the
# ``spawns`` marker, so ``pytest -m "not spawns"`` is the in-process unit tier.
SPAWNING_NAMES = ("run_distributed", "run_trainings", "subprocess", "torchrun", "multiprocessing", "spawn_ranks")


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that names a process starter with ``spawns`` (read from its source once)."""
    spawning = {}
    for item in items:
        path = str(item.path)
        if path not in spawning:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            spawning[path] = any(name in source for name in SPAWNING_NAMES)
        if spawning[path]:
            item.add_marker(pytest.mark.spawns)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=item.config.stash[HANG_FD])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def kill_daemonic_children() -> None:
    """End of session: kill the daemonic children left (DataLoader workers of a failed test's
    iterators), as multiprocessing's exit handler would, but with SIGKILL, which they do not ignore.
    Torch's SIGCHLD check of its workers is switched off first: the session is over."""
    import multiprocessing
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()
            p.join()


def pytest_sessionfinish(session, exitstatus):
    from tests.distributed_harness import close_rank_pools

    close_rank_pools()
    kill_daemonic_children()
