"""Megatron-LM's pickled files, read without running code from them.

Megatron-LM writes two kinds of pickles next to the weights: the common state of a ``torch_dist``
checkpoint (``args``, the iteration, the scheduler: ``common.pt`` before megatron-core 0.17, since then
the ``common_state`` entry of the DCP checkpoint itself, a ``torch.save`` of ``[state]``) and the legacy
``model_optim_rng.pt`` (all of that plus the model, optimizer and RNG states).  Both are read with
``torch.load(weights_only=True)`` (PyTorch's restricted unpickler: tensors, containers, numbers,
strings, dtypes) inside ``torch.serialization.safe_globals`` for an exact list of further
``(module, name)`` pairs, each inert:

* ``argparse.Namespace`` (``args``), built by setting its ``__dict__``;
* the enums that ``args`` holds, Megatron-core's (``AttnBackend``, ``AttnMaskType``,
  ``CudaGraphScope``, ``InferenceCudaGraphScope``, ``ModelType``, ``Fp8Recipe``) and ``signal.Signals``
  (``--exit-signal``): Megatron is not imported; each name is bound to a stand-in class that only
  records the pickled value (:class:`MegatronEnum`);
* ``io.BytesIO`` (Transformer Engine's ``_extra_state`` in legacy files, never read);
* numpy's array reconstruction (``_reconstruct``, ``ndarray``, ``dtype``, ``UInt32DType``: the
  numpy RNG state of legacy files).

Anything else (``os.system``, any other class) makes PyTorch refuse before it is called:
:func:`load_megatron_pickle` raises :class:`MegatronPickleError` naming the file and the global.
No communication.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
from typing import Optional

import numpy as np
import torch

from megalm.conversion.errors import ConversionError


class MegatronPickleError(ConversionError):
    """A Megatron-LM pickle names something outside the allow-list (nothing from it was run)."""


class MegatronEnum:
    """Stand-in for one of Megatron-core's enum classes: holds the pickled member value only."""

    enum_name = ""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.enum_name}({self.value!r})"


def _enum_standin(qualified: str) -> type:
    return type(qualified.rsplit(".", 1)[1], (MegatronEnum,), {"enum_name": qualified})


_MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "signal.Signals",  # --exit-signal
)


def _numpy_globals() -> list:
    """numpy's array reconstruction under the names numpy 1.x and 2.x pickle it as."""
    multiarray = getattr(np, "_core", None) or np.core
    reconstruct = multiarray.multiarray._reconstruct
    out = [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (np.ndarray, "numpy.ndarray"),
        (np.dtype, "numpy.dtype"),
    ]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out.append((dtypes.UInt32DType, "numpy.dtypes.UInt32DType"))
    return out


SAFE_GLOBALS = tuple(
    [(argparse.Namespace, "argparse.Namespace"), (io.BytesIO, "_io.BytesIO")]
    + [(_enum_standin(name), name) for name in _MEGATRON_ENUMS]
    + _numpy_globals()
)


def load_megatron_object(path: str, data: Optional[bytes] = None):
    """The object pickled in ``path`` (or ``data``, bytes read from ``path``), read on the CPU with
    ``torch.load(weights_only=True)`` and :data:`SAFE_GLOBALS` only: nothing from the file runs."""
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"the global {found.group(1)}" if found else str(e).splitlines()[0]
        raise MegatronPickleError(
            f"{path}: refusing to unpickle {what}: Megatron-LM's pickles may hold tensors, numbers, strings, "
            f"argparse.Namespace and Megatron's enums only; nothing from the file was run. A newer Megatron "
            f"may store another inert class there (add its exact name to megalm/conversion/megatron_pickles.py "
            f"SAFE_GLOBALS after checking it), or the file was tampered with"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise ConversionError(f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def load_megatron_pickle(path: str, data: Optional[bytes] = None) -> dict:
    """The dict pickled in ``path`` (``common.pt`` or ``model_optim_rng.pt``; or ``data``, the bytes of a
    ``common_state`` entry read from ``path``, a ``[dict]``), read by :func:`load_megatron_object`."""
    obj = load_megatron_object(path, data)
    if data is not None and isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise ConversionError(f"{path} holds a {type(obj).__name__}, not Megatron-LM's checkpoint dict")
    return obj


def checkpoint_args(state: dict, path: str) -> dict:
    """``vars(args)`` of a Megatron-LM checkpoint dict read from ``path``."""
    args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(
            f"{path} has no Megatron-LM args (found {type(args).__name__}): cannot tell the model's architecture"
        )
    return dict(vars(args))
