"""megalm/device.py: the one port picker, shared by the library's single-process rendezvous and the tests."""

from __future__ import annotations

import os
import socket

import pytest

import megalm.device as device
import tests.distributed_harness as testing


def test_one_port_picker_for_library_and_tests(monkeypatch):
    assert testing.free_port is device.free_port
    assert all(20000 <= device.free_port() < 32768 for _ in range(20))

    # A single process without torchrun's environment rendezvouses on a port from the same picker.
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    monkeypatch.setattr(os, "environ", env)  # what initialize_distributed sets stays in this dict
    seen = {}
    monkeypatch.setattr(device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device.dist, "init_process_group", lambda **kw: seen.update(port=env["MASTER_PORT"]))
    monkeypatch.setattr(device, "configure_cpu_threads", lambda: 1)
    monkeypatch.setattr(device, "use_cuda", lambda: False)
    device.initialize_distributed()
    assert 20000 <= int(seen["port"]) < 32768


def test_no_free_port_is_a_megalm_error(monkeypatch):
    class Busy(socket.socket):
        def bind(self, address):
            raise OSError("Address already in use")

    monkeypatch.setattr(device.socket, "socket", Busy)
    with pytest.raises(device.NoFreePort, match="no free port in 20000-32767"):
        device.free_port()
    assert issubclass(device.NoFreePort, (device.MegalmError, OSError))
