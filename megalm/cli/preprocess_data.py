"""Tokenize jsonl / .jsonl.gz / parquet text into Megatron IndexedDataset files.

Writes ``<output-prefix>_<key>_document.bin`` and ``.idx`` for each ``--json-keys`` key, in
Megatron-LM's exact format.  Bad records (malformed JSON, missing key, non-UTF-8 bytes,
empty documents) are skipped with a warning and counted in the summary; ``--strict`` stops
at the first one instead.  Outputs appear only when the run completes.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --output-prefix data/corpus --append-eod --workers 2

    # GPT-2 BPE from OpenAI's files, as in Megatron-LM's examples
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod
"""

from __future__ import annotations

import argparse

from megalm.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megalm.log import get_logger, setup_logging
from megalm.tokenizers.build import TOKENIZER_TYPES

logger = get_logger(__name__)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        type=str,
        required=True,
        help="Input file (jsonl, .jsonl.gz, parquet), directory of them, or glob pattern.",
    )
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys (columns) to extract; one output dataset per key."
    )
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES, help="What type of tokenizer to use."
    )
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="Sentencepiece .model file, or Hugging Face tokenizer.json / directory.",
    )
    group.add_argument("--vocab-size", type=int, default=None, help="Size of vocab for use with NullTokenizer.")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: the vocab.json file.")
    group.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: the BPE merges file.")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document.")
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", type=str, required=True, help="Path prefix of the binary output files (without suffix)."
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="Number of worker processes to launch.")
    group.add_argument(
        "--log-interval", type=int, default=1000, help="Interval between progress updates, in documents."
    )
    group.add_argument(
        "--strict",
        action="store_true",
        help="Fail on the first bad record (reported as file:line) instead of skipping it.",
    )
    group.add_argument("--no-progress", action="store_true", help="Do not show the progress bar.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = get_args(argv)
    setup_logging(stream="stderr")  # warnings and errors; stdout carries the result
    opts = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        json_keys=args.json_keys,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
        strict=args.strict,
        progress=not args.no_progress,
    )
    try:
        summary = preprocess(opts)
    except (PreprocessError, FileNotFoundError, ValueError) as e:
        logger.error("error: %s", e)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted: no output written")
        return 130
    print(summary.format())
    return 0
