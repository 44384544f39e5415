"""Finding and reading raw text inputs: jsonl, .jsonl.gz and parquet files.

``--input`` may be a file, a directory (every supported file under it, sorted) or a glob.
Reading is split in two so that preprocessing can parallelize it: :func:`iter_chunks`
cuts the inputs into chunks of raw records cheaply in one process, and
:func:`parse_records` (run in the workers) decodes and validates each record, reporting
bad ones by reason instead of failing.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

from megalm.errors import MegalmError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES

# Reasons a record is skipped (the keys of the summary's counters).
MALFORMED_JSON = "malformed JSON"
NON_UTF8 = "non-UTF-8 bytes"
EMPTY_DOCUMENT = "empty document"
TOKENIZER_ERROR = "tokenizer error"


def missing_key(key: str) -> str:
    return f"missing key {key!r}"


def not_a_string(key: str) -> str:
    return f"value of {key!r} is not a string"


class InputError(MegalmError, ValueError):
    """No usable input files, or an unsupported one."""


def _is_supported(path: str) -> bool:
    return path.endswith(SUPPORTED_SUFFIXES)


def resolve_inputs(spec: str) -> List[str]:
    """Files named by ``--input``: a file, a directory (searched recursively) or a glob."""
    if os.path.isdir(spec):
        found = [os.path.join(d, f) for d, _, files in os.walk(spec) for f in files]
        files = sorted(p for p in found if _is_supported(p))
        if not files:
            raise InputError(f"--input {spec}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files")
        return files
    if os.path.isfile(spec):
        return [spec]  # an explicit file is read as jsonl unless it is parquet
    if any(ch in spec for ch in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise InputError(f"--input {spec}: the pattern matches no files")
        return files
    raise InputError(f"--input {spec}: no such file or directory")


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIXES)


# --- chunks of raw records -------------------------------------------------------------


@dataclass
class Chunk:
    """Consecutive records of one file.

    ``kind`` is ``"jsonl"`` (``records``: raw lines as bytes) or ``"rows"`` (``records``:
    one list of values per json key, a value being ``None`` when absent).  ``first`` is the
    1-based line (or row) number of the first record.
    """

    source: int
    first: int
    kind: str
    records: object
    nbytes: int


def iter_chunks(
    files: Sequence[str], keys: Sequence[str], chunk_bytes: int = 1 << 20, parquet_rows: int = 1024
) -> Iterator[Chunk]:
    """Cut every input file into chunks of about ``chunk_bytes`` bytes (or ``parquet_rows`` rows)."""
    for source, path in enumerate(files):
        if is_parquet(path):
            yield from _parquet_chunks(source, path, keys, parquet_rows)
        else:
            yield from _jsonl_chunks(source, path, chunk_bytes)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _jsonl_chunks(source: int, path: str, chunk_bytes: int) -> Iterator[Chunk]:
    lines: List[bytes] = []
    nbytes, first, line_no = 0, 1, 0
    with _open_binary(path) as f:
        for line_no, line in enumerate(f, start=1):
            lines.append(line)
            nbytes += len(line)
            if nbytes >= chunk_bytes:
                yield Chunk(source, first, "jsonl", lines, nbytes)
                lines, nbytes, first = [], 0, line_no + 1
    if lines:
        yield Chunk(source, first, "jsonl", lines, nbytes)


def _parquet_chunks(source: int, path: str, keys: Sequence[str], rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    present = [k for k in keys if k in pf.schema_arrow.names]
    first = 1
    if not present:  # every row lacks every key: still report them row by row
        n = pf.metadata.num_rows
        for start in range(0, n, rows):
            count = min(rows, n - start)
            yield Chunk(source, start + 1, "rows", [[None] * count for _ in keys], 0)
        return
    for batch in pf.iter_batches(batch_size=rows, columns=present):
        columns = {k: batch.column(k).to_pylist() for k in present}
        count = batch.num_rows
        values = [columns[k] if k in columns else [None] * count for k in keys]
        nbytes = batch.nbytes
        yield Chunk(source, first, "rows", values, nbytes)
        first += count


# --- record validation -----------------------------------------------------------------


def parse_json_line(raw: bytes, keys: Sequence[str], first_in_file: bool = False):
    """``(texts, None)`` for a good line, ``(None, reason)`` for a bad one, ``(None, None)`` if blank."""
    if first_in_file and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip():
        return None, None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, NON_UTF8
    try:
        obj = json.loads(line)
    except ValueError:
        return None, MALFORMED_JSON
    if not isinstance(obj, dict):
        return None, MALFORMED_JSON
    return _texts_from(obj, keys)


def _texts_from(obj: dict, keys: Sequence[str]) -> tuple:
    texts = []
    for key in keys:
        value = obj.get(key)
        if value is None:  # absent, JSON null or a parquet null
            return None, missing_key(key)
        if not isinstance(value, str):
            return None, not_a_string(key)
        texts.append(value)
    return texts, None


@dataclass
class ParsedChunk:
    """Good records of a chunk (``texts[k][i]`` is key k of good record i) and the bad ones."""

    texts: List[List[str]]
    numbers: List[int]  # line/row number of each good record
    issues: List[Tuple[int, str, str]] = field(default_factory=list)  # (number, reason, detail)
    blank: int = 0


def parse_records(chunk: Chunk, keys: Sequence[str]) -> ParsedChunk:
    """Decode and validate every record of ``chunk``."""
    texts: List[List[str]] = [[] for _ in keys]
    out = ParsedChunk(texts, [])
    if chunk.kind == "jsonl":
        for i, raw in enumerate(chunk.records):
            number = chunk.first + i
            values, reason = parse_json_line(raw, keys, first_in_file=number == 1)
            _record(out, number, values, reason)
    else:
        columns = chunk.records
        for i in range(len(columns[0]) if columns else 0):
            row = {k: col[i] for k, col in zip(keys, columns)}
            values, reason = _texts_from(row, keys)
            _record(out, chunk.first + i, values, reason)
    return out


def _record(out: ParsedChunk, number: int, values: Optional[list], reason: Optional[str]) -> None:
    if values is None:
        if reason is None:
            out.blank += 1
        else:
            out.issues.append((number, reason, ""))
        return
    if any(v == "" for v in values):
        out.issues.append((number, EMPTY_DOCUMENT, ""))
        return
    for column, value in zip(out.texts, values):
        column.append(value)
    out.numbers.append(number)


def location(path: str, number: int, kind: str) -> str:
    """``file:line`` for jsonl, ``file: row N`` for parquet."""
    return f"{path}:{number}" if kind == "jsonl" else f"{path}: row {number}"


def iter_texts(files: Sequence[str], keys: Sequence[str], counts: Optional[dict] = None) -> Iterator[List[str]]:
    """Good records' texts in order (bad ones counted by reason in ``counts``); for simple readers."""
    for chunk in iter_chunks(files, keys):
        parsed = parse_records(chunk, keys)
        if counts is not None:
            for _, reason, _ in parsed.issues:
                counts[reason] = counts.get(reason, 0) + 1
        for i in range(len(parsed.numbers)):
            yield [column[i] for column in parsed.texts]
