"""tools/preprocess_data.py: round trip, determinism across workers, every bad-input case, atomic outputs."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megalm.data.indexed_dataset import IndexedDataset
from megalm.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megalm.tokenizers import SentencePieceTokenizer
from tests.logs import megalm_logs
from tests.test_tokenizers import make_sp_model, sample_texts

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return make_sp_model(tmp_path_factory.mktemp("sp"))


def write_jsonl(path, texts, key="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t, "id": len(t)}) + "\n")
    return str(path)


def run(sp_model, inp, out, **kw):
    opts = PreprocessOptions(
        input=str(inp),
        output_prefix=str(out),
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=sp_model,
        progress=False,
        **kw,
    )
    return preprocess(opts)


def files_of(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_round_trip_text_to_bin_to_text(sp_model, tmp_path):
    texts = sample_texts(50, seed=11)
    summary = run(sp_model, write_jsonl(tmp_path / "in.jsonl", texts), tmp_path / "out", append_eod=True)
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16
    assert len(ds) == 50 and ds.document_indices.tolist() == list(range(51))
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod == 2
        assert ids[:-1] == tok.tokenize(text)
        assert tok.detokenize(ids[:-1]) == text
    assert summary.documents == 50 and summary.tokens == ds.num_tokens and summary.skipped == {}
    # Without --append-eod: just the ids.
    run(sp_model, tmp_path / "in.jsonl", tmp_path / "noeod")
    plain = IndexedDataset(str(tmp_path / "noeod_text_document"))
    assert plain[3].tolist() == tok.tokenize(texts[3])


def test_output_identical_for_any_worker_count(sp_model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", sample_texts(400, seed=12, max_words=200))
    outputs = []
    for workers in (1, 2, 3):
        prefix = tmp_path / f"w{workers}"
        run(sp_model, inp, prefix, append_eod=True, workers=workers, chunk_bytes=3000)
        outputs.append(files_of(str(prefix) + "_text_document"))
    assert outputs[0] == outputs[1] == outputs[2]
    # The command line gives the same bytes too.
    subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            sp_model,
            "--append-eod",
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    assert files_of(str(tmp_path / "cli_text_document")) == outputs[0]


def write_bad_input(path):
    lines = [
        json.dumps({"text": "alpha beta"}).encode(),  # 1 ok
        b'{"text": "gamma delta"',  # 2 malformed JSON
        json.dumps({"body": "no text key"}).encode(),  # 3 missing key
        b'{"text": "caf\xe9 latin-1"}',  # 4 non-UTF-8
        json.dumps({"text": ""}).encode(),  # 5 empty document
        b"",  # 6 blank line (ignored)
        json.dumps({"text": 42}).encode(),  # 7 not a string
        json.dumps({"text": "   "}).encode(),  # 8 tokenizes to nothing: empty
        json.dumps({"text": "tensor model"}).encode(),  # 9 ok
        json.dumps({"text": None}).encode(),  # 10 null: missing
        b"[1, 2, 3]",  # 11 not an object
        b'{"text": "lone \\ud800 surrogate"}',
    ]  # 12 escapes to invalid text
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_bad_records_are_skipped_counted_and_reported(sp_model, tmp_path, capsys):
    inp = write_bad_input(tmp_path / "bad.jsonl")
    with megalm_logs("stderr"):
        summary = run(sp_model, inp, tmp_path / "out", append_eod=True)
    assert summary.documents == 2
    assert summary.blank_lines == 1
    assert summary.skipped == {
        "malformed JSON": 2,
        "missing key 'text'": 2,
        "non-UTF-8 bytes": 2,
        "empty document": 2,
        "value of 'text' is not a string": 1,
    }
    err = capsys.readouterr().err
    assert f"[megalm] WARNING: skipping {inp}:2: malformed JSON" in err and f"{inp}:4: non-UTF-8 bytes" in err
    text = summary.format()
    assert "skipped records: 9" in text and "malformed JSON: 2" in text and "blank lines ignored: 1" in text
    tok = SentencePieceTokenizer(sp_model)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == ["alpha beta", "tensor model"]


def test_strict_fails_on_first_bad_record_with_file_and_line(sp_model, tmp_path):
    inp = write_bad_input(tmp_path / "bad.jsonl")
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:2: malformed JSON"):
        run(sp_model, inp, tmp_path / "out", strict=True, workers=2)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing written, no temporary files
    proc = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "cli"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            sp_model,
            "--strict",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and f"{inp}:2: malformed JSON" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_non_utf8_alone_under_strict(sp_model, tmp_path):
    inp = tmp_path / "x.jsonl"
    inp.write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(PreprocessError, match=r"x\.jsonl:3: non-UTF-8 bytes"):
        run(sp_model, inp, tmp_path / "out", strict=True)


def test_interrupted_run_leaves_no_idx(sp_model, tmp_path, monkeypatch):
    from megalm.data import indexed_dataset

    inp = write_jsonl(tmp_path / "in.jsonl", sample_texts(300, seed=13))
    calls = []

    def add_then_interrupt(self, tokens, lengths, sequences_per_document=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, tokens, lengths, sequences_per_document)

    original = indexed_dataset.IndexedDatasetBuilder.add_documents
    monkeypatch.setattr(indexed_dataset.IndexedDatasetBuilder, "add_documents", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(sp_model, inp, tmp_path / "out", chunk_bytes=2000)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_sigint_to_a_real_run_leaves_no_idx(tmp_path):
    # NullTokenizer parses ids in Python: slow enough to interrupt mid-run.
    rng = np.random.default_rng(0)
    with open(tmp_path / "ids.jsonl", "w") as f:
        for _ in range(3000):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1000, 3000)))}) + "\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            TOOL,
            "--input",
            str(tmp_path / "ids.jsonl"),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1000",
            "--workers",
            "1",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal would deliver it, even when this suite runs as a background job of a
        # non-interactive shell (which starts it with SIGINT ignored, and exec keeps that).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.time() + 60
        while not any(".tmp-" in n for n in os.listdir(tmp_path)) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        # Frozen the moment its output exists, so that the interrupt lands mid-run however fast this machine
        # tokenizes (a fixed sleep before SIGINT let a quick run finish first); SIGINT is handled on SIGCONT.
        proc.send_signal(signal.SIGSTOP)
        assert proc.poll() is None, "the run ended before it could be interrupted: give it more input"
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:  # a failed check leaves no run behind (seen on a loaded host: alive, with its workers, 35 min later)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err
    assert b"no output written" in err
    assert sorted(os.listdir(tmp_path)) == ["ids.jsonl"]


def test_gz_parquet_directory_and_glob_inputs_match_jsonl(sp_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = sample_texts(60, seed=14)
    ref = run(sp_model, write_jsonl(tmp_path / "ref.jsonl", texts), tmp_path / "ref", append_eod=True)
    expected = files_of(str(tmp_path / "ref_text_document"))
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", texts[:20])
    with gzip.open(data / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[20:40])
    pq.write_table(pa.table({"text": texts[40:], "other": list(range(20))}), data / "c.parquet", row_group_size=7)
    (data / "notes.md").write_text("ignored: not an input format")
    run(sp_model, data, tmp_path / "dir", append_eod=True)
    assert files_of(str(tmp_path / "dir_text_document")) == expected
    run(sp_model, str(data / "*"), tmp_path / "glob", append_eod=True)
    assert files_of(str(tmp_path / "glob_text_document")) == expected
    assert ref.documents == 60


def test_parquet_nulls_and_missing_columns(sp_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha", None, "", "beta"]}), tmp_path / "a.parquet")
    summary = run(sp_model, tmp_path / "a.parquet", tmp_path / "out")
    assert summary.documents == 2 and summary.skipped == {"missing key 'text'": 1, "empty document": 1}
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "b.parquet")
    with pytest.raises(PreprocessError, match=r"b\.parquet: row 1: missing key 'text'"):
        run(sp_model, tmp_path / "b.parquet", tmp_path / "out2", strict=True)
    with pytest.raises(PreprocessError, match="no valid documents"):
        run(sp_model, tmp_path / "b.parquet", tmp_path / "out2")
    assert not os.path.exists(tmp_path / "out2_text_document.idx")


def test_multiple_json_keys_stay_aligned(sp_model, tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"q": "alpha", "a": "beta gamma"}, {"q": "delta"}, {"q": "model", "a": "loss"}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run(sp_model, inp, tmp_path / "out", json_keys=["q", "a"])
    assert summary.skipped == {"missing key 'a'": 1}
    tok = SentencePieceTokenizer(sp_model)
    q = IndexedDataset(str(tmp_path / "out_q_document"))
    a = IndexedDataset(str(tmp_path / "out_a_document"))
    assert [tok.detokenize(q[i]) for i in range(2)] == ["alpha", "model"]
    assert [tok.detokenize(a[i]) for i in range(2)] == ["beta gamma", "loss"]


def test_null_tokenizer_ids_dtype_and_tokenizer_errors(tmp_path):
    inp = tmp_path / "ids.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1 2 3", "4 70001", "5 x", "69999"]))
    opts = PreprocessOptions(
        input=str(inp),
        output_prefix=str(tmp_path / "out"),
        tokenizer_type="NullTokenizer",
        vocab_size=70000,
        append_eod=True,
        progress=False,
    )
    summary = preprocess(opts)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.int32  # vocabulary 70001 >= 65500
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 70000], [69999, 70000]]
    assert summary.skipped == {"tokenizer error": 2}


def test_errors_before_work_starts(sp_model, tmp_path):
    with pytest.raises(PreprocessError, match="no such file or directory"):
        run(sp_model, tmp_path / "missing.jsonl", tmp_path / "out")
    with pytest.raises(PreprocessError, match="matches no files"):
        run(sp_model, tmp_path / "*.jsonl", tmp_path / "out")
    with pytest.raises(PreprocessError, match="--workers"):
        run(sp_model, write_jsonl(tmp_path / "in.jsonl", ["alpha"]), tmp_path / "out", workers=0)


@pytest.mark.parametrize(
    "tool,flags",
    [
        (
            "preprocess_data.py",
            [
                "--input",
                "--json-keys",
                "--output-prefix",
                "--tokenizer-type",
                "--append-eod",
                "--workers",
                "--log-interval",
                "--strict",
            ],
        ),
        ("merge_datasets.py", ["--input", "--output-prefix"]),
        (
            "train_tokenizer.py",
            [
                "--input",
                "--json-keys",
                "--vocab-size",
                "--model-type",
                "--byte-fallback",
                "--user-defined-symbols",
                "--character-coverage",
            ],
        ),
    ],
)
def test_tools_help(tool, flags):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", tool), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in flags:
        assert flag in out


def test_huggingface_tokenizer_preprocess(tmp_path):
    from megalm.tokenizers import HuggingFaceTokenizer
    from tests.test_tokenizers import make_hf_tokenizer_json

    path = make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    texts = sample_texts(30, seed=15)
    opts = PreprocessOptions(
        input=write_jsonl(tmp_path / "in.jsonl", texts),
        output_prefix=str(tmp_path / "hf"),
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=path,
        append_eod=True,
        workers=2,
        progress=False,
    )
    preprocess(opts)
    tok = HuggingFaceTokenizer(path)
    ds = IndexedDataset(str(tmp_path / "hf_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in texts]
    assert tok.detokenize(ds[4][:-1]) == texts[4]


def test_gpt2_bpe_preprocess_command_line(tmp_path):
    """Megatron's GPT-2 invocation: --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file."""
    from megalm.tokenizers import GPT2BPETokenizer
    from tests.test_tokenizers import TRICKY_TEXTS, make_gpt2_files

    vocab_file, merge_file = make_gpt2_files(tmp_path)
    texts = sample_texts(40, seed=16) + [t for t in TRICKY_TEXTS if t.strip()]
    inp = write_jsonl(tmp_path / "in.jsonl", texts)
    proc = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "gpt2"),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab_file,
            "--merge-file",
            merge_file,
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    ds = IndexedDataset(str(tmp_path / "gpt2_text_document"))
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in texts]
    missing = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            inp,
            "--output-prefix",
            str(tmp_path / "none"),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab_file,
        ],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "needs --merge-file" in missing.stderr
    assert not os.path.exists(str(tmp_path / "none_text_document.idx"))
