"""Megatron .bin/.idx format: bytes checked by an independent struct reader, hand-written files load."""

import os
import struct

import numpy as np
import pytest

from megalm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, optimal_dtype

CODES = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 6: ("d", 8), 7: ("f", 4), 8: ("H", 2)}


def read_idx(path):
    """Parse a .idx with struct only (independent of megalm's reader)."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    off = 34
    lengths = list(struct.unpack_from(f"<{n}i", raw, off))
    off += 4 * n
    pointers = list(struct.unpack_from(f"<{n}q", raw, off))
    off += 8 * n
    docs = list(struct.unpack_from(f"<{d}q", raw, off))
    off += 8 * d
    assert off == len(raw), "trailing bytes in .idx"
    return version, code, lengths, pointers, docs


def write_megatron_files(prefix, docs, code=8):
    """Write a dataset by hand with struct, as Megatron-LM would: docs = list of lists of sequences."""
    fmt, size = CODES[code]
    lengths, pointers, doc_idx, pos = [], [], [0], 0
    with open(prefix + ".bin", "wb") as f:
        for doc in docs:
            for seq in doc:
                f.write(struct.pack(f"<{len(seq)}{fmt}", *seq))
                lengths.append(len(seq))
                pointers.append(pos)
                pos += len(seq) * size
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_builder_bytes_match_the_format(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    docs = [[5, 6, 7], [65000 if dtype == np.uint16 else 70000], [1, 2], [9] * 10]
    with IndexedDatasetBuilder(prefix, dtype) as b:
        b.add_item(docs[0])
        b.end_document()
        b.add_documents(np.array(docs[1] + docs[2]), np.array([1, 2]))
        b.add_document(docs[3], [4, 6])  # one document of two sequences
        b.finalize()
    version, got_code, lengths, pointers, doc_idx = read_idx(prefix + ".idx")
    item = np.dtype(dtype).itemsize
    assert (version, got_code) == (1, code)
    assert lengths == [3, 1, 2, 4, 6]
    assert pointers == [0, 3 * item, 4 * item, 6 * item, 10 * item]
    assert doc_idx == [0, 1, 2, 3, 5]
    fmt = CODES[code][0]
    raw = open(prefix + ".bin", "rb").read()
    assert list(struct.unpack(f"<{len(raw) // item}{fmt}", raw)) == [t for d in docs for t in d]
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary files left


def test_megatron_written_files_load(tmp_path):
    prefix = str(tmp_path / "megatron_text_document")
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10]]]
    write_megatron_files(prefix, docs)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 4
    assert ds.sequence_lengths.tolist() == [3, 2, 1, 4]
    assert ds.sequence_pointers.tolist() == [0, 6, 10, 12]
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert ds[1].tolist() == [4, 5] and ds[-1].tolist() == [7, 8, 9, 10]
    assert ds.get(3, offset=1, length=2).tolist() == [8, 9]
    assert ds.get(3, offset=2).tolist() == [9, 10]
    assert [a.tolist() for a in ds[0:2]] == [[1, 2, 3], [4, 5]]
    assert ds.num_tokens == 10
    with pytest.raises(IndexError):
        ds.get(1, offset=1, length=5)


def test_opening_does_not_read_the_bin(tmp_path):
    prefix = str(tmp_path / "ds")
    write_megatron_files(prefix, [[[1, 2, 3]]])
    ds = IndexedDataset(prefix)
    # Swap the .bin after opening: a reader that had opened it would still see the old bytes.
    write_megatron_files(str(tmp_path / "other"), [[[7, 8, 9]]])
    os.replace(str(tmp_path / "other.bin"), prefix + ".bin")
    assert ds[0].tolist() == [7, 8, 9]


def test_bad_files_are_rejected_with_clear_errors(tmp_path):
    prefix = str(tmp_path / "ds")
    write_megatron_files(prefix, [[[1, 2, 3]], [[4]]])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(IndexedDatasetError, match="truncated or mismatched"):
        IndexedDataset(prefix)
    write_megatron_files(prefix, [[[1, 2, 3]], [[4]]])
    raw = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(raw[:-8])
    with pytest.raises(IndexedDatasetError, match="does not match its header"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"TNTIDX\x00\x00" + raw[8:])
    with pytest.raises(IndexedDatasetError, match="not a Megatron IndexedDataset"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="does not exist"):
        IndexedDataset(str(tmp_path / "missing"))


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_builder_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_documents(np.arange(10), np.array([4, 6]))
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_merge_tool(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "merge_datasets", os.path.join(os.path.dirname(__file__), "..", "tools", "merge_datasets.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_megatron_files(str(parts / "a"), [[[1, 2]], [[3], [4, 5]]])
    write_megatron_files(str(parts / "b"), [[[6, 7, 8]]])
    assert tool.main(["--input", str(parts), "--output-prefix", str(tmp_path / "merged")]) == 0
    assert "2 datasets: 3 documents, 4 sequences, 8 tokens" in capsys.readouterr().out
    _, code, lengths, pointers, docs = read_idx(str(tmp_path / "merged.idx"))
    assert (code, lengths, pointers, docs) == (8, [2, 1, 2, 3], [0, 4, 6, 10], [0, 1, 3, 4])
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert [merged[i].tolist() for i in range(4)] == [[1, 2], [3], [4, 5], [6, 7, 8]]
    # Prefixes in the order given.
    assert tool.main(["--input", str(parts / "b"), str(parts / "a"), "--output-prefix", str(tmp_path / "m2")]) == 0
    assert IndexedDataset(str(tmp_path / "m2"))[0].tolist() == [6, 7, 8]
    # Mixed dtypes are refused before anything is written.
    write_megatron_files(str(parts / "c"), [[[1]]], code=4)
    assert tool.main(["--input", str(parts), "--output-prefix", str(tmp_path / "bad")]) == 1
    assert "different dtypes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad.idx")
