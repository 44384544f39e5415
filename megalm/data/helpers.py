"""Index building for GPT and blended datasets (Megatron-LM's algorithms, vectorized).

Every function here is pure: the same inputs give the same arrays on every rank and
machine.  None loops over samples in Python: the sample index is one ``searchsorted``,
and the blending index (an inherently sequential greedy rule) runs in a small C helper
compiled on first use, as Megatron compiles its ``helpers.cpp``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import numpy as np

from megalm.log import get_logger

logger = get_logger(__name__)


# --- GPT dataset indices ---------------------------------------------------------------


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Document ids repeated ``num_epochs`` times and shuffled (Megatron's document index).

    Without ``separate_final_epoch`` all epochs are shuffled together; with it, the first
    ``num_epochs - 1`` epochs are shuffled together and the last epoch separately, so a
    final partial epoch draws from every document evenly.
    """
    documents = np.asarray(documents, dtype=np.int32)
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents, num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def num_samples_in(total_tokens: int, seq_length: int) -> int:
    """Whole samples of ``seq_length + 1`` tokens (consecutive samples share one token)."""
    return max(0, (total_tokens - 1) // seq_length)


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Start of every sample as ``(position in document_index, token offset)`` rows.

    Documents are laid end to end in ``document_index`` order; sample ``i`` covers stream
    tokens ``[i*seq_length, (i+1)*seq_length]`` (``seq_length + 1`` tokens: inputs and
    shifted labels), so row ``i`` locates stream position ``i*seq_length`` and row ``i+1``
    the sample's last token.  Identical to Megatron's ``build_sample_idx`` with
    ``drop_last_partial_sequence=True``: a position ``p`` belongs to the document ``j``
    whose tokens span ``[start_j, end_j)``, found by ``searchsorted`` on the cumulative
    ends (empty documents are skipped; row 0 is ``(0, 0)`` as in Megatron).
    Shape ``(num_samples + 1, 2)``.
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = num_samples_in(total, seq_length)
    # Offsets are within one document (int32 lengths); positions in document_index may need int64.
    dtype = np.int32 if len(document_index) < np.iinfo(np.int32).max else np.int64
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, positions, side="right")
    starts = ends - lengths
    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[:, 0] = doc_pos
    sample_index[:, 1] = positions - starts[np.minimum(doc_pos, len(ends) - 1)]
    sample_index[0] = (0, 0)
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``range(total_size)``: the first ``num_samples`` and the rest shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


# --- blending index --------------------------------------------------------------------

_BLEND_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
/* Megatron's greedy blending: each sample goes to the dataset furthest behind its target
   share, weight * max(i, 1) - taken; ties go to the lowest dataset id. */
int build_blending_indices(int16_t *dataset_index, int64_t *dataset_sample_index,
                           const double *weights, int32_t num_datasets, int64_t size) {
    int64_t *taken = (int64_t *)calloc((size_t)num_datasets, sizeof(int64_t));
    if (!taken) return 1;
    for (int64_t i = 0; i < size; ++i) {
        double t = i > 1 ? (double)i : 1.0;
        int32_t best = 0;
        double best_err = weights[0] * t - (double)taken[0];
        for (int32_t d = 1; d < num_datasets; ++d) {
            double err = weights[d] * t - (double)taken[d];
            if (err > best_err) { best_err = err; best = d; }
        }
        dataset_index[i] = (int16_t)best;
        dataset_sample_index[i] = taken[best];
        taken[best] += 1;
    }
    free(taken);
    return 0;
}
"""

# The compiled helper library, loaded on first use and kept for the process's lifetime (False: no C
# compiler here, the Python reference runs).  The one module-level cache of megalm's data code: a
# library handle, not state of a run.
_LIB = None


def _cache_dir() -> str:
    base = os.environ.get("MEGALM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megalm")
    try:
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return tempfile.gettempdir()


def _compile_helper() -> Optional[ctypes.CDLL]:
    """Compile (once per machine, cached by source hash) and load the C blending helper."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    tag = hashlib.md5((_BLEND_SOURCE + sys.platform).encode()).hexdigest()[:12]
    lib_path = os.path.join(_cache_dir(), f"megalm_blend_{tag}.so")
    if not os.path.exists(lib_path):
        tmp_dir = tempfile.mkdtemp(prefix="megalm_blend_")
        try:
            src = os.path.join(tmp_dir, "blend.c")
            with open(src, "w") as f:
                f.write(_BLEND_SOURCE)
            tmp_lib = os.path.join(tmp_dir, "blend.so")
            subprocess.run(
                [compiler, "-O2", "-shared", "-fPIC", "-o", tmp_lib, src],
                check=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            shutil.move(tmp_lib, lib_path + f".{os.getpid()}")
            os.replace(lib_path + f".{os.getpid()}", lib_path)  # atomic: concurrent ranks are safe
        except (OSError, subprocess.CalledProcessError) as e:
            logger.warning("could not compile the blending helper (%s); using the slow Python loop", e)
            return None
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    lib = ctypes.CDLL(lib_path)
    lib.build_blending_indices.restype = ctypes.c_int
    lib.build_blending_indices.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int64,
    ]
    return lib


def _helper_lib():
    global _LIB
    if _LIB is None:
        _LIB = _compile_helper() or False
    return _LIB or None


def _blending_indices_python(weights: np.ndarray, size: int):
    """Reference implementation (used only when no C compiler is available)."""
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * len(weights)
    w = [float(x) for x in weights]
    for i in range(size):
        t = float(max(i, 1))
        best = max(range(len(w)), key=lambda d: (w[d] * t - taken[d], -d))
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


def build_blending_indices(weights, size: int):
    """``(dataset_index[size], dataset_sample_index[size])`` for normalized ``weights``.

    Sample ``i`` is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``;
    each dataset's samples are taken in order, and after ``n`` samples every dataset has
    been used ``weights[d] * n`` times to within one sample (Megatron's greedy rule).
    """
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or len(w) > np.iinfo(np.int16).max:
        raise ValueError(f"need between 1 and {np.iinfo(np.int16).max} weights, got {len(w)}")
    lib = _helper_lib()
    if lib is None:
        return _blending_indices_python(w, size)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    rc = lib.build_blending_indices(
        dataset_index.ctypes.data, dataset_sample_index.ctypes.data, w.ctypes.data, len(w), size
    )
    if rc != 0:
        raise MemoryError("blending helper could not allocate its counters")
    return dataset_index, dataset_sample_index
