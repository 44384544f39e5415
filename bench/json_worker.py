"""A benchmark worker process that speaks JSON lines: commands on its stdin, one answer per command on
its stdout, everything else (prints, tracebacks) into a log file.  Used by ``bench/train_throughput.py``
and ``bench/gpu_compare.py``, each starting its own script with ``--_worker SPEC``."""

from __future__ import annotations

import json
import os
import subprocess
import sys


class WorkerError(RuntimeError):
    """The worker exited or answered with an error (the message ends with its log's tail)."""


class JsonWorker:
    def __init__(self, name: str, script: str, spec: dict, log_dir: str, env: dict, cwd: str, close_timeout=30.0):
        self.name, self.spec, self.close_timeout = name, spec, close_timeout
        self.log_path = os.path.join(log_dir, name.replace("/", "_").replace(" ", "_") + ".log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(script), "--_worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=cwd,
            env=env,
        )

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise WorkerError(f"worker {self.name} exited (code {self.proc.returncode}); log:\n{self.tail()}")
        msg = json.loads(line)
        if "error" in msg:
            raise WorkerError(f"worker {self.name} failed: {msg['error']}; log:\n{self.tail()}")
        return msg

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(cmd="exit")
                self.proc.wait(timeout=self.close_timeout)
        except (WorkerError, OSError, subprocess.TimeoutExpired, ValueError):
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
