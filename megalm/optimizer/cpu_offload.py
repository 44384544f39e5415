"""Optimizer CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``): the update of
a fraction of the main parameters runs on the host.

Which: the main parameters (fp32 main weights, or the distributed optimizer's shard ranges) are
walked in order and each goes to the host while the elements offloaded before it are fewer than
``fraction x total`` (whole tensors, as Megatron's HybridDeviceOptimizer; ``fraction`` 1 offloads
all).  For each, a host copy (:func:`megalm.device.host_tensor_like`: pinned on CUDA, a separate CPU
tensor on a CPU-only machine) stands in for it in the torch optimizer, so its Adam moments are
created and kept on the host; the device keeps the main weight itself (and, for fp32 models, it is
the model weight).

Per step, after unscaling, the norm and clipping ran on the device gradients (so they are unchanged)::

    D2H  host.grad <- main.grad          (4 bytes per offloaded element, fp32)
    torch optimizer step                  (host tensors on the CPU, the rest on the device)
    H2D  main <- host                     (4 bytes per offloaded element), then main -> model as usual

Copies are blocking (``--overlap-cpu-optimizer-d2h-h2d`` is not built).  The arithmetic is the same
AdamW/SGD on the same fp32 values, so results equal the non-offloaded run exactly (tested on CPU,
where both "devices" are the CPU).  Loading a checkpoint or reloading main weights refreshes the
host copies (:meth:`CpuOffload.refresh`).  No communication.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megalm.device import host_tensor_like


class CpuOffload:
    """The host stand-ins of the offloaded main parameters (see the module docstring)."""

    def __init__(self, main_params: List[torch.nn.Parameter], fraction: float):
        total = sum(m.numel() for m in main_params)
        threshold, done = fraction * total, 0
        self.host: Dict[int, torch.nn.Parameter] = {}  # id(main) -> host copy
        self.pairs = []  # (main, host) in order
        for m in main_params:
            if done >= threshold:
                break
            host = torch.nn.Parameter(host_tensor_like(m.data), requires_grad=m.requires_grad)
            host.grad = None
            self.host[id(m)] = host
            self.pairs.append((m, host))
            done += m.numel()
        self.refresh()
        self.host_grads = {id(h): host_tensor_like(h.data) for _, h in self.pairs}  # persistent D2H targets

    @property
    def numel(self) -> int:
        """Elements whose update runs on the host."""
        return sum(m.numel() for m, _ in self.pairs)

    def torch_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        """What the torch optimizer updates for ``main``: its host copy, or ``main`` itself."""
        return self.host.get(id(main), main)

    @torch.no_grad()
    def refresh(self) -> None:
        """Host copies <- main weights (after construction, a checkpoint load, a reload)."""
        for main, host in self.pairs:
            host.data.copy_(main.data)

    @torch.no_grad()
    def gradients_to_host(self) -> None:
        """D2H: each host copy's ``.grad`` <- its main parameter's (final, clipped) gradient."""
        for main, host in self.pairs:
            if main.grad is None:
                host.grad = None
                continue
            g = self.host_grads[id(host)]
            g.copy_(main.grad)
            host.grad = g

    @torch.no_grad()
    def weights_to_device(self) -> None:
        """H2D: main weights <- updated host copies; the host gradients are released."""
        for main, host in self.pairs:
            main.data.copy_(host.data)
            host.grad = None

    def host_bytes(self, state: Dict[torch.Tensor, dict]) -> int:
        """Host bytes: copies, gradient buffers and optimizer state of the offloaded parameters."""
        out = 0
        for _, host in self.pairs:
            out += 2 * host.numel() * host.element_size()
            out += sum(t.numel() * t.element_size() for t in state[host].values() if t.dim() > 0)
        return out
