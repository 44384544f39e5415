"""Building a model on the meta device (``--init-model-with-meta-device``) and filling its parameters later.

Under :class:`MetaDeviceMode` every tensor factory (``torch.empty``, ``zeros``, ``arange``...) returns a
meta tensor, whatever device it was asked for: the model's parameters have shapes and dtypes but no
storage, and :func:`~megalm.tensor_parallel.initialization.initialize_weights` records each parameter's
init rule (:data:`DEFERRED_INIT`) instead of drawing it.  Whoever gives a parameter its storage then calls
:func:`initial_value` for its values: DDP's buffers do, bucket by bucket (ZeRO-3 keeps only this rank's
shard of each bucket, so a rank never holds the whole model; the other strategies fill their buffers or the
parameters one at a time).  The values are the normal build's bit for bit: the same layout-independent
rule (one generator per parameter, seeded by its global name), the same TP shard, the same cast.

Buffers and other tensors a module keeps are made again on their requested device by replaying the
factory call that made them (:meth:`MetaDeviceMode.materialize_buffers`); one computed from other tensors
at construction cannot be replayed and is refused, naming it.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils.weak import WeakIdKeyDictionary

from megalm.errors import MegalmError

DEFERRED_INIT = "megalm_deferred_init"  # attribute: () -> this parameter's initial (TP-local) fp32 values


class MetaInitError(MegalmError, ValueError):
    """A model cannot be built on the meta device (a tensor computed at construction, a parameter
    without an init rule)."""


class MetaDeviceMode(TorchFunctionMode):
    """Every factory call returns a meta tensor; remembers each call to replay it for buffers."""

    def __init__(self):
        super().__init__()
        self.factories = _device_constructors()
        self.calls = WeakIdKeyDictionary()  # meta tensor -> (factory, args, kwargs as asked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.factories:
            return func(*args, **kwargs)
        out = func(*args, **{**kwargs, "device": torch.device("meta")})
        if isinstance(out, torch.Tensor):
            self.calls[out] = (func, args, kwargs)
        return out

    @torch.no_grad()
    def materialize_buffers(self, modules: Iterable[nn.Module]) -> None:
        """Every meta buffer (and tensor attribute) of ``modules`` made again by its own factory call,
        on the device it asked for (the default device if none); parameters are left on meta."""
        for root in modules:
            for mname, module in root.named_modules():
                for name, value in list(vars(module).items()) + list(module._buffers.items()):
                    if isinstance(value, nn.Parameter) or not isinstance(value, torch.Tensor) or not value.is_meta:
                        continue
                    call = self.calls.get(value)
                    if call is None:
                        raise MetaInitError(
                            f"--init-model-with-meta-device: {mname or 'model'}.{name} is a tensor computed at "
                            "construction (not made by one factory call), it cannot be rebuilt off the meta device"
                        )
                    func, args, kwargs = call
                    real = func(*args, **kwargs)
                    if name in module._buffers:
                        module._buffers[name] = real
                    else:
                        setattr(module, name, real)


def initial_value(param: nn.Parameter) -> torch.Tensor:
    """The initial (TP-local, fp32, host) values of a parameter built on the meta device (its recorded
    rule is used once and dropped)."""
    init = getattr(param, DEFERRED_INIT, None)
    if init is None:
        raise MetaInitError(f"a meta parameter of shape {tuple(param.shape)} has no recorded init rule")
    delattr(param, DEFERRED_INIT)
    return init()


def set_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, also for a meta parameter: its tensor type differs from ``data``'s, so its
    contents are swapped (``torch.utils.swap_tensors``), keeping the Python object (modules, hooks and
    maps hold it) and its attributes (init rule, :class:`~megalm.tensor_parallel.param_info.ParamInfo`)."""
    if not param.is_meta:
        param.data = data
        return
    attrs = dict(vars(param))
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))
    vars(param).update(attrs)


@torch.no_grad()
def materialize(param: nn.Parameter, device: Union[str, torch.device]) -> None:
    """Give one meta parameter its own storage on ``device``, filled with its initial values."""
    real = torch.empty(param.shape, dtype=param.dtype, device=device)
    real.copy_(initial_value(param))
    set_data(param, real)


def materialize_remaining(modules: Iterable[nn.Module], device: Union[str, torch.device]) -> None:
    """Parameters still on meta (those no DDP buffer took) get their storage, one at a time."""
    for module in modules:
        for param in module.parameters():
            if param.is_meta:
                materialize(param, device)
