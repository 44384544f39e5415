"""Text generation (tools/generate.py, megalm.inference): the KV cache against full re-forwards,
megalm greedy tokens against transformers' greedy tokens on the exported model, sampling, batched
prompts of different lengths against one prompt at a time, and tensor/pipeline-parallel generation
on real gloo ranks (TP 2, PP 2, TP 2 x PP 2) against one process, token for token.

This module does not import transformers (only the test that compares with it does), so spawned
ranks start quickly and the tests run without it.
"""

import copy
import dataclasses
import json
import runpy
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megalm.inference import KVCache, SamplingParams, filter_logits, generate, generate_batch, load_model
from tests.checkpoint_fixtures import LLAMA, save_random_model
from tests.configs import TINY_GPT, make_config

REPO = Path(__file__).resolve().parents[1]
VOCAB = 120  # NullTokenizer ids 0..118, EOD 119
GPT2 = dict(
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    swiglu=False,
    max_position_embeddings=64,
    hidden_size=64,
    init_method_std=0.5,
)  # tied embeddings
ARCHS = {"llama": LLAMA, "gpt2": GPT2}
PROMPT = [5, 17, 42, 99, 3, 64, 7]
PROMPTS = [PROMPT, [1, 2], [9], list(range(30, 42)), [77, 5, 60]]  # lengths 7, 2, 1, 12, 3
NEW = 10
SAMPLE = SamplingParams(temperature=1.5, top_k=20, top_p=0.9)
SEEDS = [11 + i for i in range(len(PROMPTS))]


# The tiny GPT of the generation tests, NullTokenizer ids (the tests add the architecture).
MODEL = dict(TINY_GPT, vocab_size=VOCAB, tokenizer_type="NullTokenizer")


def seeded(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one intra-op thread is faster than two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for arch in ARCHS:
        save_random_model(make_config(MODEL, ARCHS[arch]), root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def models(checkpoints):
    return {arch: load_model(str(path))[0] for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cache_matches_full_forward(arch, models):
    model = models[arch]
    assert not model.training
    cached = generate(model, PROMPT, 20)
    full = generate(model, PROMPT, 20, use_cache=False)
    assert len(cached.generated_ids) == 20 and cached.generated_ids == full.generated_ids
    assert len(set(cached.generated_ids)) > 3  # the random model does not just repeat one token
    # Logits at each step within 1e-5 (in float64, so fp32 rounding of ~10-sized logits does not count).
    model = copy.deepcopy(model).double()
    cached = generate(model, PROMPT, 20, return_logits=True)
    full = generate(model, PROMPT, 20, use_cache=False, return_logits=True)
    assert cached.generated_ids == full.generated_ids and len(cached.step_logits) == 20
    for a, b in zip(cached.step_logits, full.step_logits):
        assert (a - b).abs().max() < 1e-5
    # Step by step: the logits of every position of a prompt fed in chunks equal one forward.
    ids = torch.randint(0, VOCAB, (2, 27), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids)[..., :VOCAB]
        cache = KVCache(ids.shape[1])
        pieces = [model(ids[:, a:b], inference_cache=cache)[..., :VOCAB] for a, b in ((0, 5), (5, 6), (6, 27))]
    assert cache.offset == 27
    assert (torch.cat(pieces, dim=1) - reference).abs().max() < 1e-5


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(arch, checkpoints, models, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megalm.conversion.export_hf import export_to_hf

    export_to_hf(str(checkpoints[arch]), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = generate(models[arch], PROMPT, 16).generated_ids
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    assert ours == theirs and len(set(ours)) > 3


def test_sampling(models):
    model = models["llama"]
    sample = SamplingParams(temperature=1.5, top_k=20, top_p=0.9)

    def run(seed, params=sample):
        return generate(model, PROMPT, 12, params, generator=torch.Generator().manual_seed(seed)).generated_ids

    assert run(1) == run(1)
    assert run(1) != run(2) or run(1) != run(3)
    greedy = generate(model, PROMPT, 12).generated_ids
    assert run(5, SamplingParams(temperature=0.7, top_k=1)) == greedy
    assert run(5, SamplingParams(temperature=1.0, top_p=1e-6)) == greedy

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    # probs ~ [.09, .67, .24, .03]: top-p 0.7 keeps the two most likely
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[True, False, False, True]]


def test_stop_at_eod(models):
    model = models["gpt2"]
    greedy = generate(model, PROMPT, 10).generated_ids
    eod = greedy[3]
    first = greedy.index(eod)
    out = generate(model, PROMPT, 10, eod=eod)
    assert out.stopped_at_eod and out.generated_ids == greedy[: first + 1]


def test_learned_positions_limit(models):
    with pytest.raises(ValueError, match="learned positions"):
        generate(models["gpt2"], PROMPT, 64)


def one_at_a_time(model, eod):
    """Single-process outputs of each prompt alone: greedy, seeded sampling, greedy stopping at ``eod``."""
    return {
        "greedy": [generate(model, p, NEW).generated_ids for p in PROMPTS],
        "sampled": [generate(model, p, NEW, SAMPLE, generator=g).generated_ids for p, g in zip(PROMPTS, seeded(SEEDS))],
        "eod": [generate(model, p, NEW, eod=eod).generated_ids for p in PROMPTS],
    }


def batched(model, eod, prompts=PROMPTS, seeds=SEEDS):
    """The same three runs with all prompts in one batch (works on one process or on model-parallel ranks)."""

    def ids(outs):
        return [o.generated_ids for o in outs]

    return {
        "greedy": ids(generate_batch(model, prompts, NEW)),
        "sampled": ids(generate_batch(model, prompts, NEW, SAMPLE, generators=seeded(seeds))),
        "eod": ids(generate_batch(model, prompts, NEW, eod=eod)),
    }


@pytest.fixture(scope="module")
def references(models):
    """Per architecture: the EOD token used (one that greedy decoding of PROMPT emits before the end
    but some other prompt never does, so rows stop at different steps or not at all) and the
    one-at-a-time outputs."""
    out = {}
    for arch, model in models.items():
        greedy = [generate(model, p, NEW).generated_ids for p in PROMPTS]
        eod = next(t for t in greedy[0][1:-1] if any(t not in ids for ids in greedy[1:]))
        out[arch] = dict(one_at_a_time(model, eod), eod_token=eod)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batch_matches_one_at_a_time(arch, models, references):
    model, ref = models[arch], references[arch]
    eod = ref["eod_token"]
    lengths = [len(p) for p in PROMPTS]
    assert len(set(lengths)) == len(lengths)  # every row starts generating at another step
    for kind, outs in batched(model, eod).items():
        assert outs == ref[kind], kind
    stopped = [eod in ids for ids in ref["eod"]]
    assert (
        ref["eod"][0][-1] == eod and len(ref["eod"][0]) < NEW and not all(stopped)
    )  # rows stop at EOD at different steps; others run to NEW
    assert ref["sampled"] != ref["greedy"]
    # Order and company do not matter: reversed batch, a batch of two, no KV cache.
    rev = batched(model, eod, PROMPTS[::-1], SEEDS[::-1])
    assert {k: v[::-1] for k, v in rev.items()} == {k: ref[k] for k in rev}
    pair = generate_batch(model, PROMPTS[2:4], NEW, SAMPLE, generators=seeded(SEEDS[2:4]))
    assert [o.generated_ids for o in pair] == ref["sampled"][2:4]
    no_cache = generate_batch(model, PROMPTS, NEW, eod=eod, use_cache=False)
    assert [o.generated_ids for o in no_cache] == ref["eod"]
    assert [o.stopped_at_eod for o in no_cache] == stopped
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, [PROMPT, []], 3)
    with pytest.raises(ValueError, match="generators"):
        generate_batch(model, PROMPTS, 3, SAMPLE, generators=seeded([1]))


LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (TP, PP) on 4 ranks: TP 2 and PP 2 run as two data-parallel replicas


def _generate_on_ranks(paths, eods, cli_runs):
    """On each rank: every layout, both architectures, the batched runs and one prompt alone; fp64 logits
    (llama, TP 2 x PP 2) on the sampling rank; then tools/generate.py under two layouts."""
    from megalm import parallel_state
    from megalm.inference import load_model_parallel

    timeout = timedelta(seconds=120)
    out = {}
    for tp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, pp, timeout=timeout)
        for arch, path in paths.items():
            model = load_model_parallel(path, groups=parallel_state.get_process_groups())[0]
            key = f"tp{tp}pp{pp}/{arch}"
            out[key] = batched(model, eods[arch])
            out[key]["alone"] = generate(model, PROMPTS[3], NEW, SAMPLE, generator=seeded(SEEDS[3:4])[0]).generated_ids
            out[key]["no_cache"] = [o.generated_ids for o in generate_batch(model, PROMPTS[:2], NEW, use_cache=False)]
        if (tp, pp) == (2, 2):
            groups = parallel_state.get_process_groups()
            model = load_model_parallel(paths["llama"], dtype=torch.float64, groups=groups)[0]
            logits = [o.step_logits for o in generate_batch(model, PROMPTS, NEW, return_logits=True)]
            out["logits"] = logits if any(logits) else None  # the sampling rank only
        parallel_state.destroy_model_parallel()
    tool = runpy.run_path(str(REPO / "tools" / "generate.py"))
    out["cli"] = [tool["main"](argv + ["--distributed-timeout-minutes", "2"]) for argv in cli_runs]
    return out


def test_model_parallel_generation_matches_one_process(checkpoints, models, references, tmp_path):
    from tests.distributed_harness import run_distributed

    tool = runpy.run_path(str(REPO / "tools" / "generate.py"))
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("".join(" ".join(map(str, p)) + "\n" for p in PROMPTS[1:]))
    common = [
        "--load",
        str(checkpoints["gpt2"]),
        "--prompt",
        " ".join(map(str, PROMPT)),
        "--prompt-file",
        str(prompt_file),
        "--max-new-tokens",
        str(NEW),
        "--temperature",
        "1.2",
        "--top-k",
        "30",
        "--seed",
        "5",
    ]
    layouts = [
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--batch-size", "2"],
        ["--pipeline-model-parallel-size", "2", "--batch-size", "3"],
    ]  # 2 data-parallel replicas
    cli_runs = [common + layout + ["--output-json", str(tmp_path / f"cli{i}.json")] for i, layout in enumerate(layouts)]
    paths = {arch: str(path) for arch, path in checkpoints.items()}
    eods = {arch: ref["eod_token"] for arch, ref in references.items()}
    ranks = run_distributed(_generate_on_ranks, 4, args=(paths, eods, cli_runs), timeout=240)

    for rank, out in enumerate(ranks):
        for tp, pp in LAYOUTS:
            for arch, ref in references.items():
                got = out[f"tp{tp}pp{pp}/{arch}"]
                where = f"rank {rank}, TP {tp} x PP {pp}, {arch}"
                for kind in ("greedy", "sampled", "eod"):
                    assert got[kind] == ref[kind], f"{where}: {kind}"
                assert got["alone"] == ref["sampled"][3], where
                assert got["no_cache"] == ref["greedy"][:2], where
        assert out["cli"] == [0, 0]
    # fp64 logits of every generated position agree with one process to rounding (not just the argmax).
    sampling_ranks = [r for r, out in enumerate(ranks) if out["logits"] is not None]
    assert sampling_ranks == [2]  # last pipeline stage (ranks 2, 3), TP rank 0
    single = [
        generate(copy.deepcopy(models["llama"]).double(), p, NEW, return_logits=True).step_logits for p in PROMPTS
    ]
    for got_row, ref_row in zip(ranks[2]["logits"], single):
        assert len(got_row) == len(ref_row) == NEW
        assert max((a - b).abs().max().item() for a, b in zip(got_row, ref_row)) < 1e-9
    # The tool on 4 ranks writes what one process writes (prompt i samples with --seed + i).
    assert tool["main"](common + ["--output-json", str(tmp_path / "single.json")]) == 0
    single_json = json.loads((tmp_path / "single.json").read_text())
    assert [r["prompt_ids"] for r in single_json] == PROMPTS
    for i in range(len(layouts)):
        assert json.loads((tmp_path / f"cli{i}.json").read_text()) == single_json


def test_cli_output_json(checkpoints, tmp_path, capsys):
    tool = runpy.run_path(str(REPO / "tools" / "generate.py"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n4 5 6 7\n")
    out = tmp_path / "out.json"
    assert (
        tool["main"](
            [
                "--load",
                str(checkpoints["llama"]),
                "--prompt",
                " ".join(map(str, PROMPT)),
                "--prompt-file",
                str(prompts),
                "--max-new-tokens",
                "6",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert [r["prompt"] for r in results] == [" ".join(map(str, PROMPT)), "1 2 3", "4 5 6 7"]
    model = load_model(str(checkpoints["llama"]))[0]
    first = results[0]
    assert first["prompt_ids"] == PROMPT
    expected = generate(model, PROMPT, 6, eod=VOCAB - 1).generated_ids
    assert first["generated_ids"] == expected
    text_ids = expected[:-1] if expected[-1] == VOCAB - 1 else expected
    assert first["text"] == " ".join(map(str, text_ids))

    sampled = [
        tool["main"](
            [
                "--load",
                str(checkpoints["llama"]),
                "--prompt",
                "1 2 3",
                "--max-new-tokens",
                "8",
                "--temperature",
                "1.0",
                "--top-p",
                "0.95",
                "--seed",
                "7",
                "--output-json",
                str(tmp_path / f"s{i}.json"),
            ]
        )
        for i in range(2)
    ]
    assert sampled == [0, 0]
    assert json.loads((tmp_path / "s0.json").read_text()) == json.loads((tmp_path / "s1.json").read_text())
    # Several prompts: prompt i samples with --seed + i, so the batch size does not matter.
    sampling = [
        "--load",
        str(checkpoints["llama"]),
        "--prompt",
        " ".join(map(str, PROMPT)),
        "--prompt-file",
        str(prompts),
        "--max-new-tokens",
        "8",
        "--temperature",
        "1.0",
        "--top-k",
        "40",
        "--seed",
        "7",
    ]
    for size in ("1", "8"):
        assert tool["main"](sampling + ["--batch-size", size, "--output-json", str(tmp_path / f"b{size}.json")]) == 0
    batch_of_one, batch_of_all = (json.loads((tmp_path / f"b{size}.json").read_text()) for size in ("1", "8"))
    assert batch_of_one == batch_of_all
    for i, r in enumerate(batch_of_all):
        alone = generate(
            model,
            r["prompt_ids"],
            8,
            SamplingParams(temperature=1.0, top_k=40),
            eod=VOCAB - 1,
            generator=torch.Generator().manual_seed(7 + i),
        )
        assert r["generated_ids"] == alone.generated_ids
    assert tool["main"](["--load", str(tmp_path / "missing"), "--prompt", "1", "--max-new-tokens", "2"]) == 2
    # One process cannot hold a TP 2 layout: a clear error, before any work.
    assert (
        tool["main"](
            [
                "--load",
                str(checkpoints["llama"]),
                "--prompt",
                "1",
                "--max-new-tokens",
                "2",
                "--tensor-model-parallel-size",
                "2",
            ]
        )
        == 2
    )
    assert "needs 2 processes (or a multiple: data-parallel replicas), this run has 1" in capsys.readouterr().err


def test_gpt2_bpe_text_prompts_and_tokenizer_overrides(tmp_path):
    """A checkpoint trained with GPT2BPETokenizer: text prompts are encoded with its files, and
    --vocab-file / --merge-file replace paths that moved."""
    import shutil

    from megalm.inference.generation import tokenizer_for
    from megalm.tokenizers import GPT2BPETokenizer, NullTokenizer
    from tests.test_tokenizers import make_gpt2_files

    vocab_file, merge_file = make_gpt2_files(tmp_path)
    tok = GPT2BPETokenizer(vocab_file, merge_file)
    cfg = copy.deepcopy(
        make_config(TINY_GPT, LLAMA, vocab_size=tok.vocab_size)
    )  # editable: the validated config is frozen
    cfg.data.tokenizer_type, cfg.data.vocab_file, cfg.data.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    save_random_model(cfg, tmp_path / "ckpt")
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in (vocab_file, merge_file):
        shutil.move(f, moved)
    tool = runpy.run_path(str(REPO / "tools" / "generate.py"))
    args = [
        "--load",
        str(tmp_path / "ckpt"),
        "--prompt",
        "alpha beta gamma",
        "--max-new-tokens",
        "4",
        "--output-json",
        str(tmp_path / "out.json"),
    ]
    assert tool["main"](args) == 2  # the files the config names are gone
    assert (
        tool["main"](args + ["--vocab-file", str(moved / "vocab.json"), "--merge-file", str(moved / "merges.txt")]) == 0
    )
    result = json.loads((tmp_path / "out.json").read_text())[0]
    moved_tok = GPT2BPETokenizer(str(moved / "vocab.json"), str(moved / "merges.txt"))
    assert result["prompt_ids"] == moved_tok.tokenize("alpha beta gamma")
    assert result["text"] == moved_tok.detokenize([i for i in result["generated_ids"] if i != tok.eod])
    assert isinstance(tokenizer_for(cfg, "NullTokenizer", vocab_size=10), NullTokenizer)  # a type override
    small = dataclasses.replace(
        make_config(TINY_GPT, vocab_size=100), data=cfg.data
    )  # a new config: validated ones are frozen
    with pytest.raises(ValueError, match="larger than the model's"):
        tokenizer_for(small, vocab_file=str(moved / "vocab.json"), merge_file=str(moved / "merges.txt"))
