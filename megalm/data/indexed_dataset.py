"""Megatron-LM's IndexedDataset: a ``.bin`` of raw tokens and an ``.idx`` describing it.

``.idx`` layout (little-endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (see DTYPE_CODES)
    uint64    N, number of sequences
    uint64    D, number of document boundaries (documents + 1)
    int32[N]  sequence lengths (tokens)
    int64[N]  sequence pointers (byte offset of each sequence in .bin)
    int64[D]  document indices: 0, then one past the last sequence of each document

``.bin`` is the tokens of all sequences back to back.  Files written here are byte for
byte what Megatron-LM writes for the same sequences, and Megatron-LM's files load here.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import List, Optional, Sequence, Union

import numpy as np

from megalm.errors import MegalmError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every id fits comfortably (vocab < 65,500), else int32 (Megatron's rule)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class DataError(MegalmError, ValueError):
    """Training data that cannot be used as given (a missing or damaged file, token ids out of range)."""


class IndexedDatasetError(DataError):
    """A .idx/.bin pair that is missing, truncated or not in Megatron's format."""


def _missing_file_hint(prefix: str) -> str:
    """A hint for the usual mistake of naming a file instead of the prefix."""
    if prefix.endswith((".bin", ".idx")):
        return f" (give the prefix without its extension: {prefix[:-4]})"
    return ""


# ---------------------------------------------------------------------------------------
class _Index:
    """Parsed .idx file (memory-mapped; the arrays are views into the mapping)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"index file {path} does not exist{_missing_file_hint(path[:-4])}")
        size = os.path.getsize(path)
        n, d = self._read_header(path, size)
        expected = HEADER_BYTES + n * 4 + n * 8 + d * 8
        if size == expected + n:
            raise IndexedDatasetError(f"{path} is a multimodal index (sequence modes present); not supported")
        if size != expected:
            raise IndexedDatasetError(
                f"{path}: {size} bytes on disk does not match its header, which describes "
                f"{n} sequences and {d} document indices in {expected} bytes "
                f"(truncated or garbled index)"
            )
        self.path = path
        self._mmap = np.memmap(path, mode="r", dtype=np.uint8)
        buf = self._mmap
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=HEADER_BYTES + 12 * n)
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexedDatasetError(
                f"{path}: document indices must start at 0 and end at the number of sequences {n} (garbled index)"
            )

    def _read_header(self, path: str, size: int):
        """``(N, D)`` from the header; sets ``dtype``.  Raises on a short or foreign header."""
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[: len(MAGIC)] != MAGIC[: len(header)]:
            raise IndexedDatasetError(
                f"{path} is not a Megatron IndexedDataset index (magic {header[:9]!r}, expected {MAGIC!r})"
            )
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(
                f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header (truncated index)"
            )
        version, code, n, d = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: index version {version} is not supported (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} (garbled index)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        return n, d

    def data_bytes(self) -> int:
        """Size the .bin must have."""
        if len(self.sequence_lengths) == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin`` / ``<prefix>.idx``.

    Opening parses the .idx and checks the .bin's size, but does not open the .bin: it is
    mapped on the first read.  ``ds[i]`` is sequence ``i`` as a numpy array (a view into
    the mapping); ``ds.get(i, offset, length)`` a slice of it.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        self._index = _Index(index_file_path(path_prefix))
        bin_path = data_file_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(
                f"data file {bin_path} does not exist (its index {index_file_path(path_prefix)} does)"
            )
        expected = self._index.data_bytes()
        actual = os.path.getsize(bin_path)
        if actual != expected:
            what = "truncated .bin" if actual < expected else "mismatched .bin/.idx"
            raise IndexedDatasetError(
                f"{bin_path}: {actual} bytes, but its index {index_file_path(path_prefix)} "
                f"describes {expected} bytes (truncated or mismatched .bin/.idx: {what})"
            )
        self._bin: Optional[np.ndarray] = None

    # -- metadata -------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._index.document_indices

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    # -- validation (O(tokens); callers cache the result, see megalm.data.token_ids) -------
    def check_layout(self) -> None:
        """Raise unless every sequence and document boundary lies inside the files (a garbled .idx)."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        itemsize, path = self.dtype.itemsize, index_file_path(self.path_prefix)
        if lengths.size and int(lengths.min()) < 0:
            raise IndexedDatasetError(
                f"{path}: sequence {int(np.argmin(lengths))} has negative length {int(lengths.min())} (garbled index)"
            )
        ends = pointers + lengths.astype(np.int64) * itemsize
        bad = np.flatnonzero((pointers < 0) | (pointers % itemsize != 0) | (ends > self._index.data_bytes()))
        if bad.size:
            i = int(bad[0])
            raise IndexedDatasetError(
                f"{path}: sequence {i} spans bytes [{int(pointers[i])}, {int(ends[i])}), "
                f"outside the {self._index.data_bytes()} bytes of its .bin (garbled index)"
            )
        if np.any(np.diff(self.document_indices) < 0):
            raise IndexedDatasetError(f"{path}: document indices are not non-decreasing (garbled index)")

    def token_id_range(self, chunk_tokens: int = 1 << 24) -> tuple[int, int] | None:
        """``(smallest, largest)`` token id in the .bin (None when it holds no tokens).

        Reads the mapped .bin in chunks of ``chunk_tokens``, so memory stays small.
        """
        data = self._data()
        if data.size == 0:
            return None
        lo, hi = None, None
        for start in range(0, data.size, chunk_tokens):
            chunk = data[start : start + chunk_tokens]
            c_lo, c_hi = chunk.min(), chunk.max()
            lo = c_lo if lo is None else min(lo, c_lo)
            hi = c_hi if hi is None else max(hi, c_hi)
        return int(lo), int(hi)

    # -- reads ----------------------------------------------------------------------------
    def _data(self) -> np.ndarray:
        if self._bin is None:
            n_tokens = self._index.data_bytes() // self.dtype.itemsize
            if n_tokens == 0:
                self._bin = np.empty(0, dtype=self.dtype)
            else:
                self._bin = np.memmap(data_file_path(self.path_prefix), mode="r", dtype=self.dtype, shape=(n_tokens,))
        return self._bin

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (to its end when length is None)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self.path_prefix}: slice [{offset}, {offset + length}) is outside sequence {idx} of length {size}"
            )
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._data()[start : start + length]

    def __getitem__(self, idx: Union[int, np.integer, slice]) -> Union[np.ndarray, List[np.ndarray]]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous")
            return [self.get(i) for i in range(start, stop)]
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        return self.get(int(idx) % len(self))

    def __getstate__(self):
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"])


# ---------------------------------------------------------------------------------------
class IndexedDatasetBuilder:
    """Write ``<prefix>.bin`` / ``<prefix>.idx`` in Megatron's format, safely.

    Tokens go to ``<prefix>.bin.tmp-<pid>``; :meth:`finalize` writes the index under a
    temporary name and renames both into place (the .idx last), so a crash or interrupt
    never leaves an ``.idx`` that looks complete.  :meth:`abort` (or leaving a ``with``
    block by an exception) deletes the temporary files.
    """

    def __init__(self, path_prefix: str, dtype=np.int32):
        dtype = np.dtype(dtype)
        if dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {dtype} cannot be stored in a Megatron index")
        self.path_prefix = path_prefix
        self.dtype = dtype
        directory = os.path.dirname(os.path.abspath(path_prefix))
        os.makedirs(directory, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = data_file_path(path_prefix) + suffix
        self._tmp_idx = index_file_path(path_prefix) + suffix
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: List[np.ndarray] = []
        self._doc_ends: List[np.ndarray] = []
        self._num_sequences = 0
        self._pending_lengths: List[int] = []

    # -- adding ---------------------------------------------------------------------------
    def add_item(self, tokens: Sequence[int]) -> None:
        """Append one sequence (the document continues until :meth:`end_document`)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._pending_lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document (all sequences added since the last call)."""
        self._flush_pending()
        self._doc_ends.append(np.array([self._num_sequences], dtype=np.int64))

    def add_document(self, tokens: Sequence[int], lengths: Sequence[int]) -> None:
        """Append one document made of sequences of the given lengths (Megatron's signature)."""
        self.add_documents(np.asarray(tokens), np.asarray(lengths, dtype=np.int64), np.array([len(lengths)]))

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: Optional[np.ndarray] = None
    ) -> None:
        """Append many sequences at once; by default each sequence is one document."""
        self._flush_pending()
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"sequence lengths add up to {int(lengths.sum())} tokens but {tokens.size} were given")
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("sequence lengths must be in [0, 2**31)")
        self._bin.write(tokens.tobytes(order="C"))
        self._lengths.append(lengths.astype(np.int32))
        if sequences_per_document is None:
            ends = self._num_sequences + np.arange(1, lengths.size + 1, dtype=np.int64)
        else:
            ends = self._num_sequences + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64))
        self._num_sequences += lengths.size
        self._doc_ends.append(ends)

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (used to merge datasets)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {path_prefix} (dtype {other.dtype}) into a {self.dtype} dataset")
        self._flush_pending()
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._doc_ends.append(self._num_sequences + np.asarray(other.document_indices[1:], dtype=np.int64))
        self._num_sequences += len(other)
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)

    def _flush_pending(self) -> None:
        if self._pending_lengths:
            self._lengths.append(np.array(self._pending_lengths, dtype=np.int32))
            self._num_sequences += len(self._pending_lengths)
            self._pending_lengths = []

    # -- finishing ------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self._num_sequences + len(self._pending_lengths)

    def finalize(self, index_path: Optional[str] = None) -> None:
        """Write the index and move both files into place (.bin first, then .idx)."""
        if index_path is not None and index_path != index_file_path(self.path_prefix):
            raise ValueError(f"index path {index_path} must be {index_file_path(self.path_prefix)}")
        if self._pending_lengths:
            raise ValueError("sequences were added after the last end_document(); close the document first")
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        doc_indices = np.concatenate([np.zeros(1, np.int64)] + self._doc_ends)
        write_index(self._tmp_idx, self.dtype, lengths, doc_indices)
        final_idx = index_file_path(self.path_prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)  # never pair an old .idx with the new .bin
        os.replace(self._tmp_bin, data_file_path(self.path_prefix))
        os.replace(self._tmp_idx, final_idx)

    def abort(self) -> None:
        """Delete the temporary files; nothing is left at the final paths."""
        if not self._bin.closed:
            self._bin.close()
        self.remove_temporary(self.path_prefix)

    @staticmethod
    def remove_temporary(path_prefix: str) -> None:
        """Delete this process's temporary files of ``path_prefix`` if any: also those of a builder whose
        construction was interrupted (a ``KeyboardInterrupt`` after it opened its ``.bin.tmp-<pid>`` but
        before a ``with`` or ``ExitStack`` could register its :meth:`abort`)."""
        suffix = f".tmp-{os.getpid()}"
        for path in (data_file_path(path_prefix) + suffix, index_file_path(path_prefix) + suffix):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a .idx file for sequences of ``sequence_lengths`` tokens of ``dtype``."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[dtype], len(lengths), len(doc)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc.astype("<i8").tobytes())
