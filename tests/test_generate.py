"""Text generation (tools/generate.py, megalm.inference): the KV cache against full re-forwards,
megalm greedy tokens against transformers' greedy tokens on the exported model, sampling."""

import copy
import json
import runpy
from pathlib import Path

import pytest
import torch

from megalm.inference import KVCache, SamplingParams, filter_logits, generate, load_model
from tests.test_convert import GPT2, LLAMA, VOCAB, make_cfg, save_random_model

REPO = Path(__file__).resolve().parents[1]
ARCHS = {"llama": LLAMA, "gpt2": dict(GPT2, max_position_embeddings=64, hidden_size=64, init_method_std=0.5)}
PROMPT = [5, 17, 42, 99, 3, 64, 7]


def null_cfg(arch):
    cfg = make_cfg(**ARCHS[arch])
    cfg.data.tokenizer_type = "NullTokenizer"  # ids 0..118, EOD 119: vocab 120
    return cfg


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for arch in ARCHS:
        save_random_model(null_cfg(arch), root / arch)
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
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
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
    assert out.stopped_at_eod and out.generated_ids == greedy[:first + 1]


def test_learned_positions_limit(models):
    with pytest.raises(ValueError, match="learned positions"):
        generate(models["gpt2"], PROMPT, 64)


def test_cli_output_json(checkpoints, tmp_path):
    tool = runpy.run_path(str(REPO / "tools" / "generate.py"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n4 5 6 7\n")
    out = tmp_path / "out.json"
    assert tool["main"](["--load", str(checkpoints["llama"]), "--prompt", " ".join(map(str, PROMPT)),
                         "--prompt-file", str(prompts), "--max-new-tokens", "6", "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["prompt"] for r in results] == [" ".join(map(str, PROMPT)), "1 2 3", "4 5 6 7"]
    model = load_model(str(checkpoints["llama"]))[0]
    first = results[0]
    assert first["prompt_ids"] == PROMPT
    expected = generate(model, PROMPT, 6, eod=VOCAB - 1).generated_ids
    assert first["generated_ids"] == expected
    text_ids = expected[:-1] if expected[-1] == VOCAB - 1 else expected
    assert first["text"] == " ".join(map(str, text_ids))

    sampled = [tool["main"](["--load", str(checkpoints["llama"]), "--prompt", "1 2 3", "--max-new-tokens", "8",
                             "--temperature", "1.0", "--top-p", "0.95", "--seed", "7",
                             "--output-json", str(tmp_path / f"s{i}.json")]) for i in range(2)]
    assert sampled == [0, 0]
    assert json.loads((tmp_path / "s0.json").read_text()) == json.loads((tmp_path / "s1.json").read_text())
    assert tool["main"](["--load", str(tmp_path / "missing"), "--prompt", "1", "--max-new-tokens", "2"]) == 2
