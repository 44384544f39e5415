"""Megatron-LM's own example launch scripts (tests/megatron_scripts/*.args: their flags, with sizes, iteration
counts and data scaled to 4 CPU ranks as each file's header says) parse, are refused only by flags on megalm's
documented unsupported list (``megalm.config.megatron_compat.UNSUPPORTED``), and train on 4 real ranks once those
go, with finite losses that fall.

The data is a corpus the test builds: 16384 copies of one 32-token document (31 seeded random ids, then the
end-of-document id), so that every sample of every split is that document.  Each batch is then the same, and a
falling loss is the model learning it, not batch-to-batch noise; the validation loss at the end is measured on
the same document.  No learning rate, optimizer or model flag is touched: the scripts' small learning rates
(gpt-oss 1e-5, DeepSeek-V3 3.9e-6 with forced random routing) move bf16 weights slowly, so those two run more
iterations and are judged on the mean of their last quarter of losses against their first.
"""

import math
import os
import shlex

import numpy as np
import pytest

from megalm.config import ConfigError, build_parser, config_from_args, validate_config
from megalm.config.megatron_compat import UNSUPPORTED
from megalm.data.indexed_dataset import IndexedDatasetBuilder
from tests.distributed_harness import run_distributed
from tests.training_runs import records
from tests.training_runs import run_trainings as _run_trainings

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_scripts")
VOCAB = 128  # NullTokenizer: ids 0..127, end-of-document 128
# What each script asks for that megalm refuses (every flag is on the documented list).
REFUSED = {
    "gpt3_175b": set(),
    "llama3_8b_fp8": {"--fp8-format", "--fp8-param-gather", "--profile"},
    "mixtral_8x7b": set(),
    "llama3_8b_fsdp": {"--fp8-format", "--fp8-param-gather"},
    "gpt_oss": {"--fp8-format", "--fp8-param-gather"},
    "deepseek_v3": set(),
}
# Accepted by the parser, refused when the ranks start on a machine without CUDA (Transformer Engine, flash-attn).
CUDA_ONLY = {"deepseek_v3": ["--transformer-impl", "--use-flash-attn"]}
# MoE scripts with a learning rate too small for bf16 weights to move much per step: judged on quarters.
NOISY = {"gpt_oss", "deepseek_v3"}


def data_flags(tmp: str) -> str:
    return f"--data-path {os.path.join(tmp, 'corpus')} --tokenizer-type NullTokenizer --vocab-size {VOCAB}"


def build_corpus(tmp: str, documents: int = 16384, length: int = 32) -> None:
    """``documents`` copies of one ``length``-token document (the scripts' --seq-length): every sample of
    ``length + 1`` tokens is that document and the next one's first token."""
    doc = np.append(np.random.default_rng(0).integers(0, VOCAB, size=length - 1), VOCAB)
    with IndexedDatasetBuilder(os.path.join(tmp, "corpus"), np.uint16) as b:
        b.add_documents(np.tile(doc, documents), np.full(documents, length))
        b.finalize()


def unknown_flags(name: str) -> list:
    """Flags of a script megalm's parser does not know yet (such a script is skipped, naming them)."""
    known = {s for a in build_parser()._actions for s in a.option_strings}
    return [a for a in script_argv(name, "/tmp") if a.startswith("--") and a not in known]


def script_argv(name: str, tmp: str) -> list:
    with open(os.path.join(HERE, f"{name}.args")) as f:
        text = " ".join(line for line in f.read().splitlines() if line.strip() and not line.startswith("#"))
    text = text.format(data=data_flags(tmp), save=os.path.join(tmp, f"{name}_ckpt"), tb=os.path.join(tmp, f"{name}_tb"))
    return shlex.split(text)


def strip_flag(argv: list, flag: str) -> list:
    """``argv`` without ``flag`` and the values that follow it."""
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def refusals_stripped(argv: list):
    """Validate as on 4 ranks; strip each refused flag (the first word of the refusal) until the rest
    validates.  Returns (argv that validates, flags stripped)."""
    stripped = set()
    while True:
        try:
            validate_config(config_from_args(build_parser().parse_args(argv)), world_size=4)
            return argv, stripped
        except ConfigError as e:
            flag = str(e).split()[0]
            assert flag in UNSUPPORTED, f"refused by a flag not on the documented list: {e}"
            stripped.add(flag)
            argv = strip_flag(argv, flag)


RUNNABLE = [name for name in REFUSED if not unknown_flags(name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron_scripts"))
    build_corpus(tmp)
    prepared, stripped = [], {}
    for name in RUNNABLE:
        argv, stripped[name] = refusals_stripped(script_argv(name, tmp))
        for flag in CUDA_ONLY.get(name, []):
            argv = strip_flag(argv, flag)
        log = ["--log-interval", "1"] if "--log-interval" not in argv else []  # Mixtral's script logs every 100
        prepared.append(argv + log + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")])
    codes = run_distributed(_run_trainings, 4, args=(prepared,), timeout=600)
    return {"tmp": tmp, "stripped": stripped, "codes": codes, "argv": dict(zip(RUNNABLE, prepared))}


def test_scripts_are_refused_only_by_documented_flags(runs):
    assert runs["stripped"] == {name: REFUSED[name] for name in RUNNABLE}


def falls(values: list, noisy: bool) -> bool:
    """Every step does not rise and the last is below the first; ``noisy``: the mean of the last quarter
    is below the mean of the first quarter."""
    if noisy:
        q = max(1, len(values) // 4)
        return sum(values[-q:]) / q < sum(values[:q]) / q
    return all(b <= a for a, b in zip(values, values[1:])) and values[-1] < values[0]


@pytest.mark.parametrize("name", list(REFUSED))
def test_scripts_train_with_falling_losses_on_four_ranks(runs, name):
    if name not in RUNNABLE:
        pytest.skip(f"{name}: megalm does not parse {unknown_flags(name)} yet")
    index = RUNNABLE.index(name)
    assert all(c[index] == 0 for c in runs["codes"]), runs["codes"]
    argv = runs["argv"][name]
    rows = records(runs["tmp"], name)
    gb = int(argv[argv.index("--global-batch-size") + 1])
    iters = (
        int(argv[argv.index("--train-iters") + 1])
        if "--train-iters" in argv
        else int(argv[argv.index("--train-samples") + 1]) // gb
    )
    assert [r["iteration"] for r in rows] == list(range(1, iters + 1))
    # fp16 (GPT-3) starts at loss scale 2^32: its first steps overflow and are skipped, as in Megatron
    assert all(r["skipped_iterations"] > 0 for r in rows if r["lm_loss"] is None), rows
    trained = [r["lm_loss"] for r in rows if r["lm_loss"] is not None]
    assert len(trained) >= 4 and all(math.isfinite(x) and 3.0 < x < 7.0 for x in trained), rows  # ~ln 128 at init
    assert falls(trained, name in NOISY), trained
    if name == "deepseek_v3":  # one MTP depth, its loss logged on its own
        mtp = [r["mtp_1_loss"] for r in rows]
        assert all(math.isfinite(x) for x in mtp) and falls(mtp, noisy=True), mtp
    if "fsdp_dtensor" in argv:  # saved at the end in Megatron-FSDP's layout (tests/test_fsdp_dtensor_checkpoint.py)
        from megalm.checkpoint.common_json import read_common
        from megalm.checkpoint.resume import find_checkpoint
        from megalm.checkpoint.safe_metadata import load_metadata

        path = find_checkpoint(os.path.join(runs["tmp"], f"{name}_ckpt"))
        assert read_common(path)["ckpt_format"] == "fsdp_dtensor"
        keys = set(load_metadata(path, allow_byte_entries=True).state_dict_metadata)
        assert {"iteration", "checkpoint_version", "args"} <= keys
        assert "model.module.decoder.layers.0.self_attention.linear_proj.weight" in keys
        assert any(k.endswith(".linear_fc1.weight_w.exp_avg") for k in keys), sorted(keys)[:20]
        assert not any(k.startswith(("model.decoder", "optimizer.decoder")) for k in keys)
    evals = records(runs["tmp"], name, "validation")
    if name == "gpt_oss":  # its script asks for --eval-iters 0
        assert evals == []
    else:  # evaluated once, at the end, on the same document: below the first training loss
        assert [e["iteration"] for e in evals] == [iters] and evals[0]["loss"] < trained[0], (evals, trained)
