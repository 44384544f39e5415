"""One simulated cluster of a name at a time: a lock file holding the owner's pid.

A second launcher finds the file, sees its pid alive and refuses; a file whose pid is dead (a
launcher killed with SIGKILL) is stale and taken over, and the caller then removes whatever the
dead launcher left (namespaces, processes).
"""

from __future__ import annotations

import errno
import os

from megalm.launch.netns import ClusterError


class ClusterBusyError(ClusterError):
    """Another live launcher holds this cluster's lock."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: str):
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


class ClusterLock:
    """``with ClusterLock(path) as took_over:`` holds the lock; ``took_over`` is True when a
    stale lock of a dead launcher was replaced."""

    def __init__(self, path: str):
        self.path = path
        self.held = False

    def __enter__(self) -> bool:
        took_over = False
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except OSError as e:
                if e.errno != errno.EEXIST:
                    raise ClusterError(f"cannot create the lock file {self.path}: {e}") from None
                owner = _read_pid(self.path)
                if owner > 0 and pid_alive(owner):
                    raise ClusterBusyError(
                        f"a simulated cluster is already running (pid {owner}, lock {self.path}); "
                        f"wait for it or stop it"
                    ) from None
                os.unlink(self.path)  # stale: its launcher is gone
                took_over = True
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            return took_over
        raise ClusterBusyError(f"could not take the lock {self.path} (another launcher keeps re-creating it)")

    def __exit__(self, *exc) -> None:
        if self.held and _read_pid(self.path) == os.getpid():
            os.unlink(self.path)
        self.held = False
