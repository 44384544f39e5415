"""Wrong data fails loudly (issue #18, item 5): token ids beyond the vocabulary, missing,
truncated or garbled .bin/.idx files and missing tokenizer files raise a named
:class:`MegalmError` whose message names the file or prefix and the numbers involved."""

import glob
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from megalm.data.builder import build_train_valid_test_datasets, validate_data
from megalm.data.gpt_dataset import build_gpt_indices
from megalm.data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megalm.data.token_ids import TokenIdError, check_token_ids, token_id_range
from megalm.errors import MegalmError
from megalm.tokenizers import NullTokenizer, create_tokenizer
from megalm.tokenizers.build import TokenizerError, TokenizerFileError
from tests.configs import make_config
from tests.training_runs import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 500  # NullTokenizer(500): ids 0..499 and eod 500, vocab_size 501


def write_corpus(prefix, num_docs=60, bad_id=None, bad_doc=17, dtype=np.uint16):
    """Documents of 20 in-vocabulary tokens and eod; ``bad_id`` (if given) inside document ``bad_doc``."""
    if bad_id is not None and not 0 <= bad_id < 65536:
        dtype = np.int32
    with IndexedDatasetBuilder(str(prefix), dtype) as b:
        for d in range(num_docs):
            tokens = [(d * 7 + i) % VOCAB for i in range(20)]
            if bad_id is not None and d == bad_doc:
                tokens[5] = bad_id
            b.add_item(tokens + [VOCAB])
            b.end_document()
        b.finalize()
    return str(prefix)


# The batch, evaluation and split settings of these tests (not validated: the checks read the config as is);
# the tests add the data paths and a cache directory.
BATCHES = dict(seq_length=8, train_iters=20, global_batch_size=4, micro_batch_size=2, eval_interval=10, eval_iters=1)
BATCHES.update(split="90,5,5")


# --- token ids against the vocabulary --------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "blend", "valid_split"])
def test_token_id_beyond_vocabulary_names_prefix_id_and_vocab(tmp_path, layout):
    good = write_corpus(tmp_path / "good")
    bad = write_corpus(tmp_path / "bad", bad_id=70000)
    data = {
        "single": {"data_path": [bad]},
        "blend": {"data_path": ["0.5", good, "0.5", bad]},
        "valid_split": {"train_data_path": [good], "valid_data_path": [bad]},
    }[layout]
    cfg = make_config(BATCHES, data, data_cache_path=str(tmp_path / "cache"), validate=False)
    with pytest.raises(TokenIdError) as e:
        build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB))
    assert str(e.value) == (
        f"data prefix {bad}: largest token id 70000 >= vocabulary size 501 "
        f"(tokenizer NullTokenizer); was it preprocessed with another tokenizer?"
    )
    assert isinstance(e.value, MegalmError) and isinstance(e.value, DataError)
    with pytest.raises(TokenIdError, match="largest token id 70000"):
        validate_data(cfg, NullTokenizer(VOCAB))  # the up-front check alone, from the cached scan


def test_vocabulary_boundary_and_negative_ids(tmp_path):
    at_eod = IndexedDataset(write_corpus(tmp_path / "a", bad_id=VOCAB))  # eod itself: the largest valid id
    check_token_ids(at_eod, VOCAB + 1)
    with pytest.raises(TokenIdError, match=r"largest token id 500 >= vocabulary size 500 \(tokenizer X\)"):
        check_token_ids(at_eod, VOCAB, "X")
    negative = IndexedDataset(write_corpus(tmp_path / "n", bad_id=-3))
    with pytest.raises(TokenIdError, match=f"data prefix {negative.path_prefix}: smallest token id -3 < 0"):
        check_token_ids(negative, VOCAB + 1)


def test_tokenizer_is_named_by_its_flags(tmp_path):
    bad = write_corpus(tmp_path / "bad", bad_id=600)
    cfg = make_config(
        BATCHES,
        data_path=[bad],
        tokenizer_type="NullTokenizer",
        data_cache_path=str(tmp_path / "cache"),
        validate=False,
    )
    with pytest.raises(TokenIdError, match=r"largest token id 600 >= vocabulary size 501 \(tokenizer NullTokenizer\)"):
        validate_data(cfg, NullTokenizer(VOCAB))
    cfg.data.tokenizer_type, cfg.data.tokenizer_model = "SentencePieceTokenizer", "/models/tok.model"
    with pytest.raises(TokenIdError, match=r"\(tokenizer SentencePieceTokenizer /models/tok.model\)"):
        validate_data(cfg, NullTokenizer(VOCAB))


def test_scan_is_exact_across_chunks(tmp_path):
    ds = IndexedDataset(write_corpus(tmp_path / "c", bad_id=4000, bad_doc=59))  # in the last chunk
    assert ds.token_id_range(chunk_tokens=7) == (0, 4000) == ds.token_id_range()
    assert ds.token_id_range(chunk_tokens=ds.num_tokens - 1) == (0, 4000)


# --- the cached scan ---------------------------------------------------------------------


def _cache_files(cache_dir):
    return sorted(glob.glob(os.path.join(cache_dir, "*-TokenIdRange-*")))


def test_scan_is_cached_and_rescanned_when_the_bin_changes(tmp_path, monkeypatch):
    prefix = write_corpus(tmp_path / "c")
    cache = str(tmp_path / "cache")
    assert token_id_range(IndexedDataset(prefix), cache) == ((0, VOCAB), True)
    assert len(_cache_files(cache)) == 2  # the array and its description (the completion marker)

    def no_scan(self, chunk_tokens=0):
        raise AssertionError("scanned again although the cache is current")

    monkeypatch.setattr(IndexedDataset, "token_id_range", no_scan)
    assert token_id_range(IndexedDataset(prefix), cache) == ((0, VOCAB), False)
    monkeypatch.undo()

    # Same size, new contents (and a new mtime): the cached answer no longer applies.
    st = os.stat(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.seek(10)
        f.write(struct.pack("<H", 9999))
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert os.path.getsize(prefix + ".bin") == st.st_size
    assert token_id_range(IndexedDataset(prefix), cache) == ((0, 9999), True)
    with pytest.raises(TokenIdError, match="largest token id 9999 >= vocabulary size 501"):
        check_token_ids(IndexedDataset(prefix), VOCAB + 1, cache_dir=cache)
    # Rewritten by the builder (new size): rescanned, and good again.
    write_corpus(prefix, num_docs=30)
    assert token_id_range(IndexedDataset(prefix), cache) == ((0, VOCAB), True)
    assert len(_cache_files(cache)) == 6


def test_default_cache_is_beside_the_data(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    token_id_range(IndexedDataset(prefix))
    assert len(_cache_files(str(tmp_path / "cache" / "GPTDataset_indices"))) == 2


def test_good_corpus_builds_the_same_sample_indices(tmp_path):
    a, b = write_corpus(tmp_path / "a"), write_corpus(tmp_path / "b", num_docs=80)
    cfg = make_config(BATCHES, data_path=["0.3", a, "0.7", b], data_cache_path=str(tmp_path / "cache"), validate=False)
    train, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB))
    for gpt in train.datasets:
        ref = build_gpt_indices(gpt.dataset.sequence_lengths, gpt.documents, gpt.num_samples, 8, cfg.training.seed)
        for name, array in ref.items():
            np.testing.assert_array_equal(getattr(gpt, name), array)
    again, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB))
    assert not any(g.built_indices for g in again.datasets)  # the GPT index cache is unchanged
    assert [again[i]["tokens"].tolist() for i in range(20)] == [train[i]["tokens"].tolist() for i in range(20)]
    assert len(_cache_files(cfg.data.data_cache_path)) == 4  # one scan per prefix


# --- missing, truncated and garbled files ----------------------------------------------


def test_missing_files_name_the_file(tmp_path):
    cfg = make_config(
        BATCHES, data_path=[str(tmp_path / "nope")], data_cache_path=str(tmp_path / "cache"), validate=False
    )
    with pytest.raises(IndexedDatasetError) as e:
        build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB))
    assert str(e.value) == f"index file {tmp_path}/nope.idx does not exist"
    assert isinstance(e.value, MegalmError)
    prefix = write_corpus(tmp_path / "c")
    with pytest.raises(IndexedDatasetError, match=re.escape(f"(give the prefix without its extension: {prefix})")):
        IndexedDataset(prefix + ".bin")
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError) as e:
        validate_data(
            make_config(BATCHES, data_path=[prefix], data_cache_path=str(tmp_path / "cache"), validate=False),
            NullTokenizer(VOCAB),
        )
    assert str(e.value) == f"data file {prefix}.bin does not exist (its index {prefix}.idx does)"


def test_truncated_bin_names_expected_and_actual_bytes(tmp_path):
    prefix = write_corpus(tmp_path / "c")  # 60 documents x 21 uint16 tokens = 2520 bytes
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(IndexedDatasetError) as e:
        validate_data(
            make_config(BATCHES, data_path=[prefix], data_cache_path=str(tmp_path / "cache"), validate=False),
            NullTokenizer(VOCAB),
        )
    assert str(e.value) == (
        f"{prefix}.bin: 1000 bytes, but its index {prefix}.idx describes 2520 bytes "
        f"(truncated or mismatched .bin/.idx: truncated .bin)"
    )


def _rewrite_idx(prefix, edit):
    with open(prefix + ".idx", "rb") as f:
        raw = bytearray(f.read())
    with open(prefix + ".idx", "wb") as f:
        f.write(bytes(edit(raw)))


def test_truncated_idx_names_expected_and_actual_bytes(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    expected = 34 + 60 * 12 + 61 * 8  # header, lengths and pointers, document indices
    assert os.path.getsize(prefix + ".idx") == expected
    _rewrite_idx(prefix, lambda raw: raw[:-100])
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix)
    assert str(e.value) == (
        f"{prefix}.idx: {expected - 100} bytes on disk does not match its header, which "
        f"describes 60 sequences and 61 document indices in {expected} bytes "
        f"(truncated or garbled index)"
    )
    _rewrite_idx(prefix, lambda raw: raw[:20])
    with pytest.raises(IndexedDatasetError, match=r"c\.idx: 20 bytes, shorter than the 34-byte header"):
        IndexedDataset(prefix)
    _rewrite_idx(prefix, lambda raw: b"")
    with pytest.raises(IndexedDatasetError, match=r"c\.idx: 0 bytes, shorter than the 34-byte header"):
        IndexedDataset(prefix)


@pytest.mark.parametrize(
    "where, value, message",
    [
        (
            18,
            struct.pack("<Q", 1 << 40),
            (
                f"1099511627776 sequences and 61 document indices in {34 + 12 * 2**40 + 8 * 61} "
                f"bytes (truncated or garbled index)"
            ),
        ),
        (17, bytes([99]), "unknown dtype code 99 (garbled index)"),
        (
            34 + 60 * 4 + 8 * 30,
            struct.pack("<q", 10**9),
            ("sequence 30 spans bytes [1000000000, 1000000042), outside the 2520 bytes of its .bin (garbled index)"),
        ),
        (34 + 10 * 4, struct.pack("<i", -5), "sequence 10 has negative length -5 (garbled index)"),
        (34 + 60 * 12 + 8 * 20, struct.pack("<q", 5), "document indices are not non-decreasing (garbled index)"),
    ],
)
def test_garbled_idx_is_named(tmp_path, where, value, message):
    prefix = write_corpus(tmp_path / "c")

    def edit(raw):
        raw[where : where + len(value)] = value
        return raw

    _rewrite_idx(prefix, edit)
    with pytest.raises(IndexedDatasetError) as e:
        validate_data(
            make_config(BATCHES, data_path=[prefix], data_cache_path=str(tmp_path / "cache"), validate=False),
            NullTokenizer(VOCAB),
        )
    assert str(e.value).startswith(f"{prefix}.idx") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


# --- tokenizer files -------------------------------------------------------------------


def test_missing_tokenizer_files(tmp_path):
    model = str(tmp_path / "nope.model")
    with pytest.raises(TokenizerFileError) as e:
        create_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert (
        str(e.value) == f"--tokenizer-model {model} does not exist (needed by --tokenizer-type SentencePieceTokenizer)"
    )
    assert isinstance(e.value, MegalmError) and isinstance(e.value, FileNotFoundError)
    with pytest.raises(TokenizerFileError, match=f"--tokenizer-model {tmp_path} is a directory, not a file"):
        create_tokenizer("Llama2Tokenizer", tokenizer_model=str(tmp_path))
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    with pytest.raises(TokenizerFileError, match=f"--merge-file {tmp_path}/merges.txt does not exist"):
        create_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(tmp_path / "merges.txt"))
    with pytest.raises(TokenizerFileError, match="--tokenizer-model /no/such/dir does not exist"):
        create_tokenizer("HuggingFaceTokenizer", tokenizer_model="/no/such/dir")


def test_unreadable_tokenizer_model_is_one_line(tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a sentencepiece model\n" * 4)
    with pytest.raises(TokenizerError) as e:
        create_tokenizer("SentencePieceTokenizer", tokenizer_model=str(junk))
    text = str(e.value)
    assert text.startswith(f"--tokenizer-type SentencePieceTokenizer ({junk}): ") and "\n" not in text, text


# --- end to end: pretrain_gpt.py ---------------------------------------------------------

# Real data (no --mock-data), default dropout, seed and log interval.
TINY = tiny_flags(
    num_layers="1",
    hidden_size="32",
    num_attention_heads="2",
    seq_length="16",
    mock_data=None,
    vocab_size=None,
    hidden_dropout=None,
    attention_dropout=None,
    lr="1e-3",
    log_interval=None,
    seed=None,
    micro_batch_size="2",
    global_batch_size="2",
    train_iters="2",
    split="100,0,0",
)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """pretrain_gpt.py on bad data (2 ranks, TP 2: the layout that used to train silently) and with
    a missing tokenizer model (1 rank), run side by side."""
    tmp = tmp_path_factory.mktemp("e2e")
    bad = write_corpus(tmp / "bad", bad_id=700)
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    runs = {
        "bad_ids": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "pretrain_gpt.py",
            *TINY,
            "--tensor-model-parallel-size",
            "2",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            str(VOCAB),
            "--data-path",
            bad,
        ],
        "no_tokenizer": [
            sys.executable,
            "pretrain_gpt.py",
            *TINY,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            str(tmp / "missing.model"),
            "--data-path",
            bad,
        ],
    }
    procs = {}
    for name, argv in runs.items():
        argv = argv + ["--metrics-file", str(tmp / f"{name}.jsonl")]
        procs[name] = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:  # a rank left waiting in a collective
            p.kill()
            stdout, stderr = p.communicate()
            stderr += "\n<timed out>"
        out[name] = (p.returncode, stdout, stderr)
    return {"tmp": tmp, "bad": bad, **out}


def test_pretrain_fails_on_ids_beyond_vocabulary_with_tp2(launches):
    code, _, stderr = launches["bad_ids"]
    assert code != 0 and "<timed out>" not in stderr, stderr[-3000:]  # every rank stops, none hangs
    message = f"data prefix {launches['bad']}: largest token id 700 >= vocabulary size 501 (tokenizer NullTokenizer)"
    assert message in stderr, stderr[-3000:]


def test_pretrain_fails_on_missing_tokenizer_model_without_metrics_file(launches):
    code, _, stderr = launches["no_tokenizer"]
    assert code != 0 and "<timed out>" not in stderr, stderr[-3000:]
    model = launches["tmp"] / "missing.model"
    assert f"--tokenizer-model {model} does not exist (needed by --tokenizer-type SentencePieceTokenizer)" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]  # one line from the entry point, no traceback
    assert not os.path.exists(launches["tmp"] / "no_tokenizer.jsonl")


def test_pretrain_on_bad_data_leaves_no_metrics_file(launches):
    assert launches["bad_ids"][0] != 0
    assert not os.path.exists(launches["tmp"] / "bad_ids.jsonl")
