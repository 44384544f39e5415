"""Merge several Megatron IndexedDatasets (.bin/.idx pairs) into one.

``--input`` is a directory (every .bin/.idx pair in it, by sorted name, as Megatron-LM's
merge_datasets.py) or one or more dataset prefixes, merged in the order given.  All inputs
must share one token dtype.  The output appears only when the merge completes.
"""

from __future__ import annotations

import argparse
import os

from megalm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, dataset_exists
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
        help="Path to directory containing all document files to merge, or dataset prefixes.",
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix.")
    return parser.parse_args(argv)


def find_prefixes(inputs) -> list:
    """Dataset prefixes to merge, in order; errors name any unpaired or missing file."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        directory = inputs[0]
        stems = {}
        for name in sorted(os.listdir(directory)):
            stem, ext = os.path.splitext(name)
            if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
                stems.setdefault(stem, set()).add(ext)
        unpaired = [s + "".join(sorted(e)) for s, e in stems.items() if len(e) != 2]
        if unpaired:
            raise IndexedDatasetError(f"{directory}: files without their .bin/.idx partner: {unpaired}")
        prefixes = [os.path.join(directory, s) for s in sorted(stems)]
        if not prefixes:
            raise IndexedDatasetError(f"{directory} holds no .bin/.idx datasets")
        return prefixes
    missing = [p for p in inputs if not dataset_exists(p)]
    if missing:
        raise IndexedDatasetError(f"no .bin/.idx pair for prefix(es) {missing}")
    return list(inputs)


def merge(prefixes, output_prefix: str) -> IndexedDataset:
    datasets = [IndexedDataset(p) for p in prefixes]  # validates every input before writing
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) != 1:
        raise IndexedDatasetError(f"inputs have different dtypes {sorted(dtypes)}; cannot merge")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise IndexedDatasetError(f"--output-prefix {output_prefix} is also an input")
    with IndexedDatasetBuilder(output_prefix, datasets[0].dtype) as builder:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize()
    return IndexedDataset(output_prefix)


def main(argv=None) -> int:
    args = get_args(argv)
    setup_logging(stream="stderr")  # warnings and errors; stdout carries the result
    try:
        prefixes = find_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix)
    except IndexedDatasetError as e:
        logger.error("error: %s", e)
        return 1
    docs = len(merged.document_indices) - 1
    print(
        f"merged {len(prefixes)} datasets: {docs:,} documents, {len(merged):,} sequences, "
        f"{merged.num_tokens:,} tokens ({merged.dtype}) -> {args.output_prefix}.bin / .idx"
    )
    return 0
