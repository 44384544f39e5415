"""A CPU stand-in for NVIDIA Transformer Engine (``transformer_engine``), for tests only.

``transformer_engine/`` here implements, in plain PyTorch + ``torch.distributed``, exactly the part
of TE's PyTorch API megalm calls: ``transformer_engine.pytorch.{Linear, LayerNormLinear,
DotProductAttention, fp8_autocast}``, ``transformer_engine.pytorch.fp8.check_fp8_support`` and
``transformer_engine.common.recipe.{Format, DelayedScaling}``, with TE's constructor arguments,
parameter names and shapes, parameter attributes and tensor-parallel communication.  It does not
compute in fp8: ``fp8_autocast`` only records that it was entered (and with which recipe and
group), and modules record whether their forward ran inside it.

:func:`install` makes megalm find it as if on a GPU machine with TE installed (the directory on
``sys.path``, ``megalm.fusions.backends.use_cuda`` answering True for the optional-package
lookups only, their caches cleared); :func:`uninstall` undoes it.
"""

import os
import sys

STANDIN_DIR = os.path.dirname(os.path.abspath(__file__))


def _clear_backend_caches():
    from megalm.fusions import backends

    for fn in (backends.transformer_engine_module, backends.apex_norm_functions, backends.flash_attn_function):
        fn.cache_clear()


def _forget_modules():
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]


def install(monkeypatch=None):
    """Make ``transformer_engine`` (this stand-in) importable and usable by megalm.  With a pytest
    ``monkeypatch`` the changes are undone at the end of the test (call :func:`uninstall` too, to
    drop the imported modules); without one (spawned ranks) they last for the process."""
    from megalm.fusions import backends

    if monkeypatch is not None:
        monkeypatch.syspath_prepend(STANDIN_DIR)
        monkeypatch.setattr(backends, "use_cuda", lambda: True)
    else:
        sys.path.insert(0, STANDIN_DIR)
        backends.use_cuda = lambda: True
    _forget_modules()
    _clear_backend_caches()
    import transformer_engine.pytorch as te

    assert te.__file__.startswith(STANDIN_DIR), te.__file__
    return te


def uninstall():
    _forget_modules()
    _clear_backend_caches()
