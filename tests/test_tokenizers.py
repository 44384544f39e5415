"""Tokenizers: GPT-2 BPE (files trained here, checked against a reference BPE written below),
sentencepiece / Llama-2 (tiny model trained here), Hugging Face (tokenizer.json built here), Null."""

import json
import pickle
import random

import pytest

from megalm.config import DataConfig, ModelConfig
from megalm.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    create_tokenizer,
)

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "data",
    "model",
    "token",
    "train",
    "layer",
    "norm",
    "loss",
    "grad",
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "mega",
    "tensor",
    "pipe",
    "line",
    "batch",
]


def sample_texts(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list:
    """Deterministic sentences of WORDS separated by single spaces (sentencepiece round-trips them)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def make_sp_model(directory, vocab_size: int = 120, model_type: str = "bpe") -> str:
    """Train a tiny sentencepiece model on generated text; return the .model path."""
    import sentencepiece as spm

    prefix = str(directory / f"tiny_{model_type}_{vocab_size}")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts(2000, seed=1)),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    return prefix + ".model"


def make_hf_tokenizer_json(path, eos: str = "<|endoftext|>") -> str:
    """Train a tiny byte-level BPE with the tokenizers library and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos, "<pad>"] if eos else ["<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(sample_texts(500, seed=2), trainer=trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return make_sp_model(tmp_path_factory.mktemp("sp"))


def test_sentencepiece_ids_eod_and_round_trip(sp_model):
    import sentencepiece as spm

    raw = spm.SentencePieceProcessor(model_file=sp_model)
    tok = SentencePieceTokenizer(sp_model)
    assert tok.vocab_size == 120 == raw.get_piece_size()
    assert tok.eod == raw.eos_id() == 2
    assert tok.pad == -1
    texts = sample_texts(20, seed=5)
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == raw.encode(text) and all(0 <= i < 120 for i in ids)
        assert tok.eod not in ids
        assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(texts[0]) == tok.tokenize(texts[0])


def test_sentencepiece_unigram_and_missing_file(tmp_path):
    model = make_sp_model(tmp_path, vocab_size=45, model_type="unigram")
    tok = SentencePieceTokenizer(model)
    assert tok.vocab_size == 45
    assert tok.detokenize(tok.tokenize("alpha beta gamma")) == "alpha beta gamma"
    with pytest.raises(FileNotFoundError, match="nope.model"):
        SentencePieceTokenizer(str(tmp_path / "nope.model"))


def test_huggingface_tokenizer_from_file_and_directory(tmp_path):
    path = make_hf_tokenizer_json(tmp_path / "tokenizer.json")
    tok = HuggingFaceTokenizer(path)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(path)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == len(raw.get_vocab()) > 256
    assert tok.eod == raw.token_to_id("<|endoftext|>") == 0
    text = "alpha beta gamma tensor"
    ids = tok.tokenize(text)
    assert ids == raw.encode(text).ids and len(ids) > 0
    assert tok.detokenize(ids) == text
    assert tok.tokenize_batch([text, "delta"]) == [ids, tok.tokenize("delta")]
    # A directory whose tokenizer_config.json names the special tokens.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<pad>"}, "pad_token": "<pad>"})
    )
    by_dir = HuggingFaceTokenizer(str(tmp_path))
    assert by_dir.eod == by_dir.pad == raw.token_to_id("<pad>") == 1
    assert pickle.loads(pickle.dumps(by_dir)).tokenize(text) == ids


def test_huggingface_tokenizer_errors(tmp_path):
    path = make_hf_tokenizer_json(tmp_path / "tokenizer.json", eos=None)
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HuggingFaceTokenizer(path)
    with pytest.raises(FileNotFoundError, match="local files only"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))


def test_null_tokenizer_matches_megatron():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 101 and tok.eod == 100 == tok.vocab_size - 1
    assert tok.tokenize("1 2  3\n99") == [1, 2, 3, 99]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("5 101")
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("5 x")


def test_build_tokenizer_from_config(sp_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model), ModelConfig())
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 120
    null = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), ModelConfig(vocab_size=50))
    assert isinstance(null, NullTokenizer) and null.eod == 50
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), ModelConfig())
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        create_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="needs --vocab-file and --merge-file"):
        create_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="is not one of"):
        create_tokenizer("BertWordPieceLowerCase")
    gpt_sp = build_tokenizer(
        DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model), ModelConfig()
    )
    assert type(gpt_sp) is SentencePieceTokenizer
    llama = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model), ModelConfig())
    assert isinstance(llama, Llama2Tokenizer) and llama.vocab_size == 120


def test_train_tokenizer_tool(tmp_path, capsys):
    import importlib.util
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    texts = sample_texts(600, seed=3)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts[:300]) + "{broken\n")
    pq.write_table(pa.table({"content": texts[300:]}), tmp_path / "b.parquet")
    spec = importlib.util.spec_from_file_location(
        "train_tokenizer", os.path.join(os.path.dirname(__file__), "..", "tools", "train_tokenizer.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prefix = tmp_path / "out" / "tok"
    rc = tool.main(
        [
            "--input",
            str(jsonl),
            str(tmp_path / "b.parquet"),
            "--json-keys",
            "content",
            "--model-prefix",
            str(prefix),
            "--vocab-size",
            "300",
            "--model-type",
            "bpe",
            "--byte-fallback",
            "--user-defined-symbols",
            "<|im_start|>",
            "<|im_end|>",
            "--character-coverage",
            "1.0",
            "--num-threads",
            "1",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "600 documents" in out and "malformed JSON: 1" in out and "eos id 2" in out
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    assert sp.get_piece_size() == 300
    assert sp.piece_to_id("<|im_start|>") == 3 and sp.piece_to_id("<|im_end|>") == 4
    assert "<|im_start|>" in sp.encode("x <|im_start|>alpha", out_type=str)
    assert sp.id_to_piece(sp.encode("é")[-1]) == "<0xA9>"  # byte fallback for an unseen character


# --- GPT-2 BPE -------------------------------------------------------------------------------

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TRICKY_TEXTS = [
    "It's 2024: naïve café, 12,345 tokens!!",
    "  leading spaces\n\n\ttab   runs  ",
    "don't we'll I'd",
    "emoji 🙂 and 中文 and Ωmega",
    "literal <|endoftext|> stays text",
    "x" * 300,
    "",
    " ",
    "\n",
]


def make_gpt2_files(directory) -> tuple:
    """A tiny byte-level BPE in OpenAI's GPT-2 file format: (vocab.json, merges.txt)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample_texts(500, seed=2) + ["don't we'll it's 12,345 café"] * 20, trainer=trainer)
    vocab, merges = tok.model.save(str(directory))
    return vocab, merges


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def reference_gpt2_encode(text: str, vocab: dict, merges: list) -> list:
    """OpenAI's GPT-2 encoder algorithm, written out: regex split, bytes to symbols, merges by rank."""
    regex = pytest.importorskip("regex")
    ranks = {tuple(m.split()): r for r, m in enumerate(merges)}
    byte_map = _bytes_to_unicode()
    ids = []
    for piece in regex.findall(GPT2_PATTERN, text):
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pair = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab[symbol] for symbol in word]
    return ids


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return make_gpt2_files(tmp_path_factory.mktemp("gpt2"))


def test_gpt2_bpe_matches_reference_encoder(gpt2_files):
    vocab_file, merge_file = gpt2_files
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    merges = [line for line in open(merge_file, encoding="utf-8").read().split("\n")[1:] if line]
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    assert tok.vocab_size == len(vocab) > 300 and tok.eod == vocab["<|endoftext|>"] == 0 and tok.pad == -1
    texts = sample_texts(30, seed=7) + TRICKY_TEXTS
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == reference_gpt2_encode(text, vocab, merges), text
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize("alpha beta")) < len("alpha beta")  # merges were applied
    assert tok.eod not in tok.tokenize(TRICKY_TEXTS[4])  # no special tokens are recognised in text
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert pickle.loads(pickle.dumps(tok)).tokenize(texts[0]) == tok.tokenize(texts[0])
    assert tok.detokenize([vocab["Ã"]]) == "\ufffd"  # half a UTF-8 character decodes as a replacement


def test_gpt2_bpe_hand_made_files(tmp_path):
    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    vocab.update({"he": 256, "ll": 257, "hell": 258, "Ġw": 259, "<|endoftext|>": 260})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nl l\nhe ll\nĠ w\n")
    tok = create_tokenizer(
        "GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt")
    )
    assert tok.vocab_size == 261 and tok.eod == 260
    # hello -> h e l l o -> he l l o -> he ll o -> hell o;  " world" -> Ġw o r l d
    assert tok.tokenize("hello world") == [258, ord("o"), 259, ord("o"), ord("r"), ord("l"), ord("d")]


def test_gpt2_bpe_bad_files(tmp_path, gpt2_files):
    vocab_file, merge_file = gpt2_files
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        GPT2BPETokenizer(str(tmp_path / "missing.json"), merge_file)
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "missing.txt"))
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a GPT-2 vocab.json"):
        GPT2BPETokenizer(str(bad), merge_file)
    bad.write_text(json.dumps({k: v for k, v in vocab.items() if k != "<|endoftext|>"}))
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> entry"):
        GPT2BPETokenizer(str(bad), merge_file)
    bad.write_text(json.dumps({k: v for k, v in vocab.items() if k != "Ā"}))
    with pytest.raises(ValueError, match="1 of the 256 byte symbols are missing"):
        GPT2BPETokenizer(str(bad), merge_file)
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(ValueError, match="not a GPT-2 merges file"):
        GPT2BPETokenizer(vocab_file, str(merges))


def test_llama2_tokenizer_adds_bos(sp_model, tmp_path):
    plain, llama = SentencePieceTokenizer(sp_model), Llama2Tokenizer(sp_model)
    assert (llama.vocab_size, llama.eod, llama.bos) == (plain.vocab_size, plain.eod, 1)
    texts = sample_texts(5, seed=9)
    for text in texts:
        assert llama.tokenize(text) == [1] + plain.tokenize(text)
        assert llama.detokenize(llama.tokenize(text)) == text
    assert llama.tokenize_batch(texts) == [llama.tokenize(t) for t in texts]
    assert pickle.loads(pickle.dumps(llama)).tokenize(texts[0])[0] == 1
    import sentencepiece as spm

    prefix = str(tmp_path / "nobos")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample_texts(300, seed=1)),
        model_prefix=prefix,
        vocab_size=40,
        bos_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    with pytest.raises(ValueError, match="no beginning-of-sentence piece"):
        Llama2Tokenizer(prefix + ".model")
    assert SentencePieceTokenizer(prefix + ".model").vocab_size == 40
