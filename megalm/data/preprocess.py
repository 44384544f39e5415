"""Tokenize text inputs into Megatron IndexedDatasets, in parallel, with ordered results.

The main process cuts the inputs into chunks of raw records (:mod:`text_sources`); worker
processes decode, validate and tokenize whole chunks (batched tokenizer calls); the main
process writes the results in chunk order.  Because every record is handled on its own and
results are written in input order, the output bytes do not depend on the worker count.
At most ``4 x workers`` chunks are in flight, so memory stays bounded on any input size.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np

from megalm.data import text_sources as ts
from megalm.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megalm.errors import MegalmError
from megalm.log import get_logger

logger = get_logger(__name__)
MAX_WARNINGS = 10


class PreprocessError(MegalmError, RuntimeError):
    """Bad input under --strict, or an input/output problem found before work starts."""


@dataclass
class PreprocessOptions:
    input: str
    output_prefix: str
    json_keys: Sequence[str] = ("text",)
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    strict: bool = False
    progress: bool = True
    chunk_bytes: int = 1 << 20

    def make_tokenizer(self):
        from megalm.tokenizers import create_tokenizer

        return create_tokenizer(
            self.tokenizer_type, self.tokenizer_model, self.vocab_size, self.vocab_file, self.merge_file
        )


@dataclass
class PreprocessSummary:
    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    blank_lines: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    outputs: List[str] = field(default_factory=list)
    dtype: str = ""

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def format(self) -> str:
        s = max(self.seconds, 1e-9)
        lines = [
            f"documents: {self.documents:,}   tokens: {self.tokens:,}   input: {self.bytes_read / 1e6:,.1f} MB   "
            f"time: {self.seconds:.1f} s",
            f"throughput: {self.documents / s:,.0f} docs/s   {self.tokens / s / 1e6:.2f} M tokens/s   "
            f"{self.bytes_read / s / 1e6:.1f} MB/s",
        ]
        if self.skipped:
            detail = ", ".join(f"{reason}: {n:,}" for reason, n in sorted(self.skipped.items()))
            lines.append(f"skipped records: {self.skipped_total:,} ({detail})")
        else:
            lines.append("skipped records: 0")
        if self.blank_lines:
            lines.append(f"blank lines ignored: {self.blank_lines:,}")
        for out in self.outputs:
            lines.append(f"wrote {out}.bin / {out}.idx ({self.dtype})")
        return "\n".join(lines)


# --- worker side -----------------------------------------------------------------------

# What each worker process of the tokenizing pool holds: set once by the pool's initializer in that
# worker (the tokenizer is built there, never pickled per task); the main process never reads or
# writes it.  Pool workers have no other place to keep what the initializer built.
_WORKER: dict = {}


def _init_worker(opts: PreprocessOptions, dtype: np.dtype) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles interrupts
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool.terminate() must just stop us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER["tokenizer"] = opts.make_tokenizer()
    _WORKER["keys"] = list(opts.json_keys)
    _WORKER["append_eod"] = opts.append_eod
    _WORKER["dtype"] = dtype


@dataclass
class ChunkResult:
    source: int
    kind: str
    tokens: List[np.ndarray]  # per key, flat
    lengths: List[np.ndarray]  # per key, one length per document
    issues: List[tuple]
    blank: int
    nbytes: int


def _tokenize_texts(tokenizer, texts: List[str]) -> List[Optional[List[int]]]:
    """Batched ids; a text the tokenizer rejects becomes its exception (found by retrying one by one)."""
    try:
        return list(tokenizer.tokenize_batch(texts))
    except Exception:  # noqa: BLE001 - isolate the offending record(s)
        out = []
        for text in texts:
            try:
                text.encode("utf-8")  # JSON can escape lone surrogates that are not valid text
                out.append(list(tokenizer.tokenize(text)))
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out


def _flatten(ids: List[List[int]], dtype: np.dtype, eod: Optional[int]):
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    if eod is not None:
        flat = np.insert(flat, np.cumsum(lengths), eod)
        lengths = lengths + 1
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
        raise PreprocessError(f"token id {int(flat.max())} does not fit the output dtype {dtype}")
    return flat.astype(dtype), lengths


def encode_chunk(chunk: ts.Chunk) -> ChunkResult:
    """Validate and tokenize one chunk (runs in a worker)."""
    tokenizer, keys, dtype = _WORKER["tokenizer"], _WORKER["keys"], _WORKER["dtype"]
    parsed = ts.parse_records(chunk, keys)
    per_key = [_tokenize_texts(tokenizer, column) for column in parsed.texts]
    keep = []
    for i, number in enumerate(parsed.numbers):
        problem = _record_problem([ids[i] for ids in per_key])
        if problem is None:
            keep.append(i)
        else:
            parsed.issues.append((number, *problem))
    parsed.issues.sort()
    eod = tokenizer.eod if _WORKER["append_eod"] else None
    tokens, lengths = [], []
    for ids in per_key:
        flat, lens = _flatten([ids[i] for i in keep], dtype, eod)
        tokens.append(flat)
        lengths.append(lens)
    return ChunkResult(chunk.source, chunk.kind, tokens, lengths, parsed.issues, parsed.blank, chunk.nbytes)


def _record_problem(ids_per_key: list) -> Optional[tuple]:
    """``(reason, detail)`` when any key of a record cannot be used, else None."""
    for ids in ids_per_key:
        if isinstance(ids, UnicodeError):
            return ts.NON_UTF8, "text escapes to invalid Unicode (lone surrogate)"
        if isinstance(ids, Exception):
            return ts.TOKENIZER_ERROR, str(ids)
        if len(ids) == 0:
            return ts.EMPTY_DOCUMENT, ""
    return None


# --- main side -------------------------------------------------------------------------


def _ordered_map(pool, fn, items: Iterable, max_in_flight: int) -> Iterator:
    """``map`` through a pool keeping input order and at most ``max_in_flight`` pending tasks."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def output_prefixes(output_prefix: str, keys: Sequence[str]) -> List[str]:
    """Megatron's naming: ``<prefix>_<key>_document``."""
    return [f"{output_prefix}_{key}_document" for key in keys]


def _check_before_start(opts: PreprocessOptions) -> List[str]:
    if opts.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {opts.workers}")
    if not opts.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    try:
        files = ts.resolve_inputs(opts.input)
    except ts.InputError as e:
        raise PreprocessError(str(e)) from None
    out_dir = os.path.dirname(os.path.abspath(opts.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise PreprocessError(f"--output-prefix {opts.output_prefix}: directory {out_dir} is not writable")
    return files


class _Progress:
    """tqdm bar over input bytes (MB/s) with documents/s and tokens/s.

    Refreshed every ``log_interval`` documents, or every 2 s for inputs of huge documents.
    """

    def __init__(self, files: Sequence[str], enabled: bool, log_interval: int):
        self.bar = None
        self.log_interval = max(1, log_interval)
        self._docs_since, self._bytes_since = 0, 0
        if not enabled:
            return
        from tqdm import tqdm

        total = None if any(f.endswith(".gz") or ts.is_parquet(f) for f in files) else sum(map(os.path.getsize, files))
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            desc="tokenizing",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )
        self.start = self._last = time.perf_counter()

    def update(self, summary: PreprocessSummary, nbytes: int, docs: int) -> None:
        if self.bar is None:
            return
        self._docs_since += docs
        self._bytes_since += nbytes
        now = time.perf_counter()
        if self._docs_since >= self.log_interval or now - self._last > 2.0:
            self._last = now
            elapsed = max(now - self.start, 1e-9)
            self.bar.set_postfix_str(
                f"{summary.documents / elapsed:,.0f} docs/s, "
                f"{summary.tokens / elapsed / 1e6:.2f} M tok/s, skipped {summary.skipped_total}",
                refresh=False,
            )
            self.bar.update(self._bytes_since)
            self._docs_since, self._bytes_since = 0, 0

    def warn(self, message: str) -> None:
        """A warning through megalm's logger; the progress bar (if any) is lifted while it is written."""
        if self.bar is None:
            logger.warning(message)
            return
        with self.bar.external_write_mode(file=sys.stderr):
            logger.warning(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self._bytes_since)
            self.bar.close()


def _handle_issues(
    result: ChunkResult, files: Sequence[str], opts: PreprocessOptions, summary: PreprocessSummary, progress: _Progress
) -> None:
    for number, reason, detail in result.issues:
        where = ts.location(files[result.source], number, result.kind)
        what = f"{reason} ({detail})" if detail else reason
        if opts.strict:
            raise PreprocessError(f"{where}: {what} (--strict stops at the first bad record)")
        summary.skipped[reason] = summary.skipped.get(reason, 0) + 1
        if summary.skipped_total <= MAX_WARNINGS:
            progress.warn(f"skipping {where}: {what}")
            if summary.skipped_total == MAX_WARNINGS:
                progress.warn("further skipped records are only counted (see the summary)")


def _worker_pool(opts: PreprocessOptions, dtype: np.dtype):
    """Worker processes started from a clean single-threaded fork server.

    Forking the caller directly is unsafe when it has threads (torch, DataLoader, a
    trainer): a child can inherit a held lock and hang.  The fork server preloads this
    module once, so later pools start as fast as plain fork.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["megalm.data.preprocess"])
    else:
        ctx = mp.get_context("spawn")
    return ctx.Pool(opts.workers, initializer=_init_worker, initargs=(opts, dtype))


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def preprocess(opts: PreprocessOptions) -> PreprocessSummary:
    """Tokenize ``opts.input`` into ``<output_prefix>_<key>_document.{bin,idx}``."""
    files = _check_before_start(opts)
    tokenizer = opts.make_tokenizer()
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    prefixes = output_prefixes(opts.output_prefix, opts.json_keys)
    summary = PreprocessSummary(dtype=str(dtype), outputs=prefixes)
    start = time.perf_counter()
    pool = _worker_pool(opts, dtype)
    old_term = signal.signal(signal.SIGTERM, _raise_on_sigterm) if _in_main_thread() else None
    progress = _Progress(files, opts.progress, opts.log_interval)
    try:
        with ExitStack() as stack:
            builders = [stack.enter_context(IndexedDatasetBuilder(p, dtype)) for p in prefixes]
            chunks = ts.iter_chunks(files, opts.json_keys, chunk_bytes=opts.chunk_bytes)
            for result in _ordered_map(pool, encode_chunk, chunks, 4 * opts.workers):
                _handle_issues(result, files, opts, summary, progress)
                for builder, tokens, lengths in zip(builders, result.tokens, result.lengths):
                    builder.add_documents(tokens, lengths)
                summary.documents += len(result.lengths[0])
                summary.tokens += sum(int(t.size) for t in result.tokens)
                summary.bytes_read += result.nbytes
                summary.blank_lines += result.blank
                progress.update(summary, result.nbytes, len(result.lengths[0]))
            if summary.documents == 0:
                raise PreprocessError(
                    f"--input {opts.input}: no valid documents "
                    f"({summary.skipped_total} records skipped); nothing written"
                )
            for builder in builders:
                builder.finalize()
    except BaseException:
        for prefix in prefixes:  # a builder interrupted while being built was never registered to abort
            IndexedDatasetBuilder.remove_temporary(prefix)
        raise
    finally:
        progress.close()
        pool.terminate()
        pool.join()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    summary.seconds = time.perf_counter() - start
    return summary


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
