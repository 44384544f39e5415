"""Train a sentencepiece BPE or unigram tokenizer on jsonl / .jsonl.gz / parquet / text files.

Documents are read from ``--json-keys`` of jsonl or parquet inputs (plain ``.txt`` files
are read line by line) and split into lines, each line one training sentence.  Writes
``<model-prefix>.model`` and ``.vocab`` and prints a summary.  The end-of-sentence piece
(``--eos-id``) is what megalm and Megatron-LM append as end-of-document.

Example::

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 8192 \\
        --model-type bpe --byte-fallback --user-defined-symbols "<|im_start|>" "<|im_end|>"
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from typing import Iterator, List

from megalm.data import text_sources as ts
from megalm.log import get_logger, setup_logging

logger = get_logger(__name__)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        type=str,
        nargs="+",
        required=True,
        help="Input files (jsonl, .jsonl.gz, parquet, .txt), directories or glob patterns.",
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys (columns) holding the text.")
    group.add_argument(
        "--input-sentence-size",
        type=int,
        default=2_000_000,
        help="Sample at most this many sentences for training (0: all).",
    )
    group.add_argument(
        "--max-sentence-length",
        type=int,
        default=16384,
        help="Longest sentence in bytes; longer lines are cut into pieces of this size.",
    )
    group = parser.add_argument_group(title="model")
    group.add_argument("--model-prefix", type=str, required=True, help="Output prefix: writes <prefix>.model/.vocab.")
    group.add_argument("--vocab-size", type=int, default=32000, help="Vocabulary size, special pieces included.")
    group.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe", help="Sentencepiece algorithm.")
    group.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="Fraction of characters covered by the vocabulary (1.0 for small alphabets).",
    )
    group.add_argument(
        "--byte-fallback",
        action="store_true",
        help="Encode characters outside the vocabulary as UTF-8 byte pieces (no <unk>).",
    )
    group.add_argument(
        "--user-defined-symbols", nargs="*", default=[], help="Special tokens always kept whole (e.g. '<|im_start|>')."
    )
    group.add_argument("--split-digits", action="store_true", help="Split numbers into single digits.")
    group.add_argument("--unk-id", type=int, default=0)
    group.add_argument("--bos-id", type=int, default=1)
    group.add_argument("--eos-id", type=int, default=2, help="End-of-sentence id, used as end-of-document.")
    group.add_argument("--pad-id", type=int, default=-1, help="Padding id (-1: none).")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="Training threads.")
    group.add_argument("--seed", type=int, default=1234, help="Sentence sampling seed.")
    return parser.parse_args(argv)


def resolve(specs: List[str]) -> List[str]:
    files = []
    for spec in specs:
        if os.path.isfile(spec):
            files.append(spec)
        elif os.path.isdir(spec):
            found = sorted(
                os.path.join(d, f)
                for d, _, names in os.walk(spec)
                for f in names
                if f.endswith(ts.SUPPORTED_SUFFIXES + (".txt",))
            )
            if not found:
                raise ts.InputError(f"--input {spec}: directory holds no jsonl, parquet or .txt files")
            files += found
        else:
            matched = sorted(glob.glob(spec, recursive=True))
            if not matched:
                raise ts.InputError(f"--input {spec}: no such file, directory or matching pattern")
            files += matched
    return files


def iter_sentences(files: List[str], keys: List[str], max_bytes: int, stats: dict) -> Iterator[str]:
    """Non-empty lines of every document (plain-text files: every line), cut to ``max_bytes``."""

    def lines_of(text: str):
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            stats["sentences"] += 1
            stats["chars"] += len(line)
            if len(line.encode("utf-8", "surrogatepass")) <= max_bytes:
                yield line
            else:  # keep long lines instead of letting sentencepiece drop them
                step = max(1, max_bytes // 4)  # a character is at most 4 bytes
                for i in range(0, len(line), step):
                    yield line[i : i + step]

    for path in files:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                for raw in f:
                    yield from lines_of(raw)
            stats["documents"] += 1
            continue
        for texts in ts.iter_texts([path], keys, stats["skipped"]):
            stats["documents"] += 1
            for text in texts:
                yield from lines_of(text)


def train(args) -> dict:
    import sentencepiece as spm

    files = resolve(args.input)
    stats = {"documents": 0, "sentences": 0, "chars": 0, "skipped": {}}
    if os.path.dirname(args.model_prefix):
        os.makedirs(os.path.dirname(args.model_prefix), exist_ok=True)
    t0 = time.perf_counter()
    spm.set_random_generator_seed(args.seed)  # sentence sampling is reproducible
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_sentences(files, args.json_keys, args.max_sentence_length, stats),
        model_prefix=args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
        user_defined_symbols=args.user_defined_symbols,
        split_digits=args.split_digits,
        unk_id=args.unk_id,
        bos_id=args.bos_id,
        eos_id=args.eos_id,
        pad_id=args.pad_id,
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=args.max_sentence_length,
        num_threads=args.num_threads,
        minloglevel=2,
    )
    stats["seconds"] = time.perf_counter() - t0
    stats["files"] = len(files)
    return stats


def summarize(args, stats: dict) -> str:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=args.model_prefix + ".model")
    special = {name: getattr(sp, f"{name}_id")() for name in ("unk", "bos", "eos", "pad")}
    lines = [
        f"trained {args.model_type} model {args.model_prefix}.model in {stats['seconds']:.1f} s",
        f"  input: {stats['files']} files, {stats['documents']:,} documents, {stats['sentences']:,} lines, "
        f"{stats['chars']:,} characters",
        f"  vocabulary: {sp.get_piece_size():,} pieces; special ids "
        + ", ".join(f"{k}={v}" + (f" ({sp.id_to_piece(v)})" if v >= 0 else "") for k, v in special.items()),
        f"  byte fallback: {'on' if args.byte_fallback else 'off'}; character coverage: {args.character_coverage}",
    ]
    if args.user_defined_symbols:
        ids = {s: sp.piece_to_id(s) for s in args.user_defined_symbols}
        lines.append("  user-defined symbols: " + ", ".join(f"{s}={i}" for s, i in ids.items()))
    if stats["skipped"]:
        lines.append("  skipped records: " + ", ".join(f"{k}: {v}" for k, v in sorted(stats["skipped"].items())))
    sample = "The quick brown fox jumps over the lazy dog."
    pieces = sp.encode(sample, out_type=str)
    lines.append(f"  example: {sample!r} -> {len(pieces)} tokens {pieces}")
    lines.append("  eod for preprocessing / training: eos id " + str(special["eos"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = get_args(argv)
    setup_logging(stream="stderr")  # warnings and errors; stdout carries the result
    try:
        stats = train(args)
    except (ts.InputError, RuntimeError, OSError) as e:
        logger.error("error: %s", e)
        return 1
    print(summarize(args, stats))
    return 0
