"""scripts/: every pretraining script passes its preset's flags, they parse and validate, and its
model has the size its name says; nothing in scripts/ refers to a file outside the repository.

Each ``scripts/pretrain_*.sh`` is run with ``DRY_RUN=1`` (it prints the ``pretrain_gpt.py`` flags
after a marker line and launches nothing); the flags go through megalm's own parser and
``validate_config`` at the script's default world size (GPUS_PER_NODE x NNODES).
"""

import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from megalm.config import MegalmConfig, build_parser, config_from_args, validate_config
from megalm.flops import cpu_has_native_bf16
from megalm.presets import PRESETS, Overrides, get_preset, recipe_flags, resolve
from megalm.presets.flags import null_tokenizer_flags

REPO = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = REPO / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("pretrain_*.sh"))
MARKER = "---- pretrain_gpt.py flags ----"
COMMAND_PREFIX = "[megalm] cd "

# Variables a developer's shell may have set that would change the scripts' defaults.
SCRIPT_ENV = (
    "GPUS_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHRUN",
    "TP",
    "PP",
    "MICRO_BATCH_SIZE",
    "GLOBAL_BATCH_SIZE",
    "TRAIN_ITERS",
    "TRAIN_TOKENS",
    "LR",
    "MIN_LR",
    "LR_DECAY_ITERS",
    "LR_WARMUP_ITERS",
    "DATA_PATH",
    "DATA_CACHE_PATH",
    "SPLIT",
    "NUM_WORKERS",
    "TOKENIZER_MODEL",
    "TOKENIZER_TYPE",
    "VOCAB_SIZE",
    "VOCAB_FILE",
    "MERGE_FILE",
    "RUN_DIR",
    "CHECKPOINT_DIR",
    "LOAD_DIR",
    "TENSORBOARD_DIR",
    "METRICS_FILE",
    "WANDB_PROJECT",
    "WANDB_EXP_NAME",
    "SAVE_INTERVAL",
    "LOG_INTERVAL",
    "EVAL_INTERVAL",
    "EVAL_ITERS",
    "TIMING_LOG_LEVEL",
    "ASYNC_SAVE",
    "PRECISION",
    "SEQUENCE_PARALLEL",
    "RECOMPUTE",
    "RECOMPUTE_NUM_LAYERS",
    "VP_LAYERS",
    "DIST_OPT",
    "EP",
    "DRY_RUN",
    "PYTHON",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "SLURM_SUBMIT_DIR",
    "SLURM_GPUS_ON_NODE",
)


def run_script(script, *extra, env=None, cwd=None):
    """Dry-run ``script``; return (torchrun argv, pretrain_gpt.py argv)."""
    full_env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    # A run directory that does not exist, so checkpoints from real runs in runs/ are not seen.
    full_env["RUN_DIR"] = os.path.join(tempfile.gettempdir(), f"megalm-test-scripts-{os.getpid()}", "no-run")
    full_env.update(env or {})
    full_env["DRY_RUN"] = "1"
    proc = subprocess.run(
        ["bash", str(script), *extra], env=full_env, cwd=cwd or "/", capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert MARKER in lines, f"{script.name}: no '{MARKER}' line in:\n{proc.stdout}"
    command = [line for line in lines if line.startswith(COMMAND_PREFIX)]
    assert len(command) == 1, proc.stdout
    words = shlex.split(command[0][len("[megalm] ") :])
    assert words[:3] == ["cd", str(REPO), "&&"], words[:3]
    flags = lines[lines.index(MARKER) + 1 :]
    launcher = words[3:]
    assert launcher[-len(flags) - 1 :] == ["pretrain_gpt.py", *flags], "printed command and flags disagree"
    return launcher[: -len(flags) - 1], flags


def launcher_options(launcher):
    assert launcher[0] == "torchrun"
    opts = launcher[1:]
    return dict(zip(opts[::2], opts[1::2]))


def parse(flags, world_size):
    cfg = config_from_args(build_parser().parse_args(flags))
    return validate_config(cfg, world_size=world_size)


def count_parameters(cfg: MegalmConfig, active: bool = False) -> int:
    """Parameters of the whole GPT model (all TP/PP/EP shards together); with ``active``, only
    those a token goes through (MoE: the router's top-k experts)."""
    m = cfg.model
    h, d, heads, groups = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_kv_heads
    bias = int(m.add_bias_linear)
    norm = h if m.normalization == "RMSNorm" else 2 * h
    qkv = (heads + 2 * groups) * d
    attention = h * qkv + heads * d * h + bias * (qkv + h)

    def mlp(f):
        fc1 = 2 * f if m.swiglu else f
        return h * fc1 + f * h + bias * (fc1 + h)

    layers = m.num_layers * (attention + 2 * norm + mlp(m.ffn_hidden_size))
    if m.num_experts:
        freq = m.moe_layer_freq
        moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, m.num_layers, freq))
        experts = m.moe_router_topk if active else m.num_experts
        moe = m.num_experts * h + experts * mlp(m.moe_ffn_hidden_size)  # router + experts
        if m.moe_shared_expert_intermediate_size:
            moe += mlp(m.moe_shared_expert_intermediate_size)
        layers += moe_layers * (moe - mlp(m.ffn_hidden_size))
    vocab = m.padded_vocab_size
    embedding = vocab * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    output = vocab * h if m.untie_embeddings_and_output_weights else 0
    return embedding + layers + norm + output


# Mixture-of-experts names give the expert layout, not the size: published totals.
MOE_SIZES = {"8x7b": 46.7e9}


def size_from_name(name):
    """``pretrain_gpt3_1.3b.sh`` -> 1.3e9, ``pretrain_mixtral_8x7b.sh`` -> 46.7e9 (total); None for
    names without a size (the tiny CPU scripts)."""
    moe = re.search(r"_(\d+x\d+(?:\.\d+)?[mb])\.sh$", name)
    if moe:
        return MOE_SIZES[moe.group(1)]
    match = re.search(r"_(\d+(?:\.\d+)?)([mb])\.sh$", name)
    if not match:
        return None
    return float(match.group(1)) * (1e6 if match.group(2) == "m" else 1e9)


def test_scripts_exist():
    names = {s.name for s in SCRIPTS}
    for size in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "175b"):
        assert f"pretrain_gpt3_{size}.sh" in names
    for name in ("llama2_7b", "llama3_8b", "llama2_13b", "llama2_70b", "gpt_tiny_cpu", "mixtral_8x7b", "moe_tiny_cpu"):
        assert f"pretrain_{name}.sh" in names
    for script in SCRIPTS + [SCRIPTS_DIR / "slurm" / "pretrain.sbatch"]:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_script_flags_validate_and_size_matches_name(script):
    launcher, flags = run_script(script)
    opts = launcher_options(launcher)
    world = int(opts["--nproc_per_node"]) * int(opts["--nnodes"])
    assert opts["--node_rank"] == "0" and opts["--master_addr"] == "localhost" and opts["--master_port"] == "6000"
    cfg = parse(flags, world)
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data

    # Self-consistent and complete: data (mock by default), tokenizer, a training length.
    assert d.mock_data and d.tokenizer_type == "NullTokenizer" and m.vocab_size is not None
    assert t.train_iters and t.train_iters >= 1
    assert 0 <= t.lr_warmup_iters < t.lr_decay_iters <= t.train_iters
    assert t.min_lr < t.lr
    assert cfg.checkpoint.save and cfg.checkpoint.load == cfg.checkpoint.save  # Megatron's auto-resume
    assert p.use_distributed_optimizer and p.overlap_grad_reduce and p.overlap_param_gather  # DIST_OPT=1 default
    if "tiny_cpu" in script.name:  # PRECISION=auto: bf16 only where this CPU has native bf16
        assert t.bf16 == (torch.cuda.is_available() or cpu_has_native_bf16())
        assert world == 4 and p.tensor_model_parallel_size == 2 and p.data_parallel_size == 2
        return
    assert t.bf16
    assert world % 8 == 0 and int(opts["--nproc_per_node"]) == 8
    assert p.sequence_parallel == (p.tensor_model_parallel_size > 1)
    if "llama" in script.name or "mixtral" in script.name:
        assert m.position_embedding_type == "rope" and m.normalization == "RMSNorm" and m.swiglu
        assert not m.add_bias_linear and m.untie_embeddings_and_output_weights
    else:
        assert m.position_embedding_type == "learned_absolute" and m.normalization == "LayerNorm"
        assert not m.swiglu and not m.untie_embeddings_and_output_weights and m.seq_length == 2048

    expected = size_from_name(script.name)
    n = count_parameters(cfg)
    assert abs(n - expected) <= 0.1 * expected, f"{script.name}: {n / 1e9:.3f}B parameters"


def test_known_shapes():
    """Spot checks against published parameter counts and shapes."""
    n = {}
    for name in ("gpt3_175b", "llama2_7b", "llama3_8b", "llama2_70b"):
        launcher, flags = run_script(SCRIPTS_DIR / f"pretrain_{name}.sh")
        opts = launcher_options(launcher)
        cfg = parse(flags, int(opts["--nproc_per_node"]) * int(opts["--nnodes"]))
        n[name] = (count_parameters(cfg), cfg)
    assert n["gpt3_175b"][1].parallel.pipeline_model_parallel_size == 16
    assert n["gpt3_175b"][1].parallel.world_size == 128
    # Hugging Face's published sizes use the unpadded vocabulary; padding adds < 0.5%.
    assert abs(n["llama2_7b"][0] - 6_738_415_616) / 6_738_415_616 < 0.005
    assert abs(n["llama3_8b"][0] - 8_030_261_248) / 8_030_261_248 < 0.005
    assert abs(n["llama2_70b"][0] - 68_976_648_192) / 68_976_648_192 < 0.005
    llama3 = n["llama3_8b"][1].model
    assert (llama3.num_query_groups, llama3.rotary_base, llama3.ffn_hidden_size, llama3.seq_length) == (
        8,
        500000,
        14336,
        8192,
    )
    assert n["llama2_70b"][1].model.num_query_groups == 8
    assert n["llama2_7b"][1].model.num_query_groups is None


def test_mixtral_shape_and_expert_layout():
    launcher, flags = run_script(SCRIPTS_DIR / "pretrain_mixtral_8x7b.sh")
    opts = launcher_options(launcher)
    cfg = parse(flags, int(opts["--nproc_per_node"]) * int(opts["--nnodes"]))
    m, p = cfg.model, cfg.parallel
    # Hugging Face's Mixtral-8x7B-v0.1: 46,702,792,704 parameters; 2 of 8 experts active per token.
    assert count_parameters(cfg) == 46_702_792_704
    assert abs(count_parameters(cfg, active=True) - 12.9e9) < 0.01 * 12.9e9
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (8, 2, 14336, 1)
    assert (m.num_query_groups, m.rotary_base, m.seq_length) == (8, 1000000, 4096)
    assert m.moe_token_dispatcher_type == "alltoall" and m.moe_grouped_gemm and m.moe_aux_loss_coeff == 1e-2
    assert (p.expert_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (8, 4, 8)
    assert cfg.model.recompute_granularity == "full"
    tiny = parse(run_script(SCRIPTS_DIR / "pretrain_moe_tiny_cpu.sh")[1], 4)
    assert tiny.parallel.expert_model_parallel_size == 2 and tiny.parallel.sequence_parallel
    assert tiny.model.num_experts == 8


def test_environment_overrides_and_extra_flags(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("100")
    env = {
        "TP": "2",
        "PP": "1",
        "MICRO_BATCH_SIZE": "1",
        "GLOBAL_BATCH_SIZE": "8",
        "TRAIN_ITERS": "50",
        "GPUS_PER_NODE": "4",
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "29500",
        "DATA_PATH": "0.7 /data/a_text_document 0.3 /data/b_text_document",
        "TOKENIZER_MODEL": "/models/llama-2/tokenizer.model",
        "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TENSORBOARD_DIR": str(tmp_path / "tb"),
        "WANDB_PROJECT": "proj",
        "DIST_OPT": "1",
        "RECOMPUTE": "full",
        "TIMING_LOG_LEVEL": "2",
        "ASYNC_SAVE": "1",
    }
    launcher, flags = run_script(
        SCRIPTS_DIR / "pretrain_llama2_70b.sh", "--lr", "1e-5", "--min-lr", "1e-6", "--log-interval", "1", env=env
    )
    opts = launcher_options(launcher)
    assert opts == {
        "--nproc_per_node": "4",
        "--nnodes": "2",
        "--node_rank": "1",
        "--master_addr": "node-a",
        "--master_port": "29500",
    }
    assert flags[-6:] == ["--lr", "1e-5", "--min-lr", "1e-6", "--log-interval", "1"]
    cfg = parse(flags, 8)
    p, t, d = cfg.parallel, cfg.training, cfg.data
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (2, 1, 4)
    assert p.sequence_parallel and p.use_distributed_optimizer and p.overlap_grad_reduce
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.lr_decay_iters) == (1, 8, 50, 50)
    assert t.lr_warmup_iters < 50  # the 2000-iteration warm-up is cut to fit a shrunk run
    assert t.lr == 1e-5 and cfg.logging.log_interval == 1
    assert d.data_path == ["0.7", "/data/a_text_document", "0.3", "/data/b_text_document"] and not d.mock_data
    assert d.tokenizer_type == "Llama2Tokenizer" and d.tokenizer_model == "/models/llama-2/tokenizer.model"
    assert cfg.checkpoint.save == cfg.checkpoint.load == str(tmp_path / "ckpt")  # resumes: a checkpoint exists
    assert cfg.logging.tensorboard_dir == str(tmp_path / "tb") and cfg.logging.wandb_project == "proj"
    assert cfg.model.recompute_granularity == "full" and cfg.model.recompute_method == "uniform"
    assert cfg.logging.timing_log_level == 2 and cfg.logging.log_timers_to_tensorboard
    assert cfg.checkpoint.async_save


def test_tiny_cpu_with_real_data_and_tokenizer():
    env = {"DATA_PATH": "data/corpus_text_document", "TOKENIZER_MODEL": "data/tok.model", "TRAIN_ITERS": "3"}
    launcher, flags = run_script(SCRIPTS_DIR / "pretrain_gpt_tiny_cpu.sh", env=env)
    cfg = parse(flags, 4)
    assert cfg.data.data_path == ["data/corpus_text_document"] and not cfg.data.mock_data
    assert cfg.data.tokenizer_type == "SentencePieceTokenizer" and cfg.data.tokenizer_model == "data/tok.model"
    assert cfg.training.train_iters == 3 and cfg.training.lr_warmup_iters < cfg.training.lr_decay_iters
    assert cfg.logging.timing_log_level == 0 and not cfg.logging.log_timers_to_tensorboard
    assert not cfg.checkpoint.async_save


def test_gpt2_bpe_files_from_the_environment():
    env = {
        "DATA_PATH": "/data/pile_text_document",
        "VOCAB_FILE": "/data/gpt2-vocab.json",
        "MERGE_FILE": "/data/gpt2-merges.txt",
    }
    cfg = parse(run_script(SCRIPTS_DIR / "pretrain_gpt3_125m.sh", env=env)[1], 8)
    d = cfg.data
    assert (d.tokenizer_type, d.vocab_file, d.merge_file) == (
        "GPT2BPETokenizer",
        "/data/gpt2-vocab.json",
        "/data/gpt2-merges.txt",
    )
    assert d.tokenizer_model is None and cfg.model.vocab_size is None  # the vocab file sets it at start
    for bad, message in (
        ({"VOCAB_FILE": "/v.json"}, "needs both VOCAB_FILE and MERGE_FILE"),
        ({**env, "TOKENIZER_MODEL": "/models/gpt2"}, "not both"),
    ):
        full_env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
        proc = subprocess.run(
            ["bash", str(SCRIPTS_DIR / "pretrain_gpt3_125m.sh")],
            env={**full_env, **bad, "DRY_RUN": "1"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2 and message in proc.stderr


def test_slurm_wrapper_sets_rendezvous(tmp_path):
    """Run the sbatch file with stand-ins for scontrol and srun (srun runs the task as node 3)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\nprintf "gpu-node-07\\ngpu-node-08\\n"\n'
    )
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nSLURM_NODEID=3 exec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    env.update(
        {
            "PATH": f"{bin_dir}:{env['PATH']}",
            "DRY_RUN": "1",
            "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
            "SLURM_NNODES": "16",
            "SLURM_NODEID": "0",
            "SLURM_SUBMIT_DIR": str(REPO),
        }
    )
    proc = subprocess.run(
        [
            "bash",
            str(SCRIPTS_DIR / "slurm" / "pretrain.sbatch"),
            "scripts/pretrain_gpt3_175b.sh",
            "--log-interval",
            "1",
        ],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    command = next(line for line in proc.stdout.splitlines() if line.startswith(COMMAND_PREFIX))
    words = shlex.split(command[len("[megalm] ") :])
    opts = launcher_options(words[3 : words.index("pretrain_gpt.py")])
    assert opts == {
        "--nproc_per_node": "8",
        "--nnodes": "16",
        "--node_rank": "3",
        "--master_addr": "gpu-node-07",
        "--master_port": "6000",
    }
    assert words[-2:] == ["--log-interval", "1"]

    missing = subprocess.run(
        ["bash", str(SCRIPTS_DIR / "slurm" / "pretrain.sbatch")], env=env, capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 2 and "usage" in missing.stderr


def preset_of(script):
    """``pretrain_gpt3_1.3b.sh`` -> ``gpt3_1.3b``."""
    return script.name[len("pretrain_") : -len(".sh")]


def test_every_preset_has_a_script_that_only_launches_it():
    assert sorted(preset_of(s) for s in SCRIPTS) == sorted(PRESETS)
    for script in SCRIPTS:
        code = [line for line in script.read_text().splitlines() if line.strip() and not line.startswith("#")]
        assert code == [
            "set -euo pipefail",
            'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"',
            f'megalm_launch {preset_of(script)} "$@"',
        ], script.name


# Overrides every script honours; each changes the recipe flags (EP only for the MoE presets).
OVERRIDES = {
    "TP": "2",
    "PP": "2",
    "EP": "1",
    "MICRO_BATCH_SIZE": "2",
    "GLOBAL_BATCH_SIZE": "64",
    "TRAIN_TOKENS": "1000000000",
    "LR": "1e-3",
    "MIN_LR": "1e-4",
    "DIST_OPT": "0",
    "RECOMPUTE": "selective",
    "VP_LAYERS": "1",
    "PRECISION": "fp16",
    "VOCAB_SIZE": "1000",
    "GPUS_PER_NODE": "2",
    "NNODES": "3",
}


# The only flags scripts/common.sh adds to a preset's: data, tokenizer files, outputs, logging.
LAUNCHER_FLAGS = {
    "--mock-data",
    "--data-path",
    "--split",
    "--data-cache-path",
    "--num-workers",
    "--tokenizer-type",
    "--vocab-size",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-model",
    "--save",
    "--save-interval",
    "--load",
    "--async-save",
    "--log-interval",
    "--eval-interval",
    "--eval-iters",
    "--tensorboard-dir",
    "--metrics-file",
    "--timing-log-level",
    "--log-timers-to-tensorboard",
    "--wandb-project",
    "--wandb-exp-name",
    "--wandb-save-dir",
}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_script_passes_its_presets_flags(script):
    """The flags a script passes are its preset's (megalm.presets), by default and with overrides,
    then only the launcher's own."""
    preset = get_preset(preset_of(script))
    for env in ({}, OVERRIDES):
        launch = resolve(preset, Overrides.from_env(env))
        launcher, flags = run_script(script, env=env)
        recipe = recipe_flags(launch)
        assert flags[: len(recipe)] == recipe, (script.name, env)
        assert {f for f in flags[len(recipe) :] if f.startswith("--")} <= LAUNCHER_FLAGS
        i = flags.index("--tokenizer-type")
        assert flags[i : i + 4] == null_tokenizer_flags(launch)
        opts = launcher_options(launcher)
        assert (int(opts["--nproc_per_node"]), int(opts["--nnodes"])) == (
            launch.layout.gpus_per_node,
            launch.layout.nnodes,
        )
    # The overrides reached the flags.
    cfg = config_from_args(build_parser().parse_args(flags))
    p, t = cfg.parallel, cfg.training
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.global_batch_size) == (2, 2, 64)
    assert t.fp16 and not t.bf16 and not p.use_distributed_optimizer and cfg.model.recompute_granularity == "selective"
    assert t.train_iters == 1_000_000_000 // (64 * cfg.model.seq_length) or preset.schedule.train_tokens is None
    assert (t.lr, t.min_lr, cfg.model.vocab_size) == (1e-3, 1e-4, 999)
    assert p.expert_model_parallel_size == 1
    assert opts["--nproc_per_node"] == "2" and opts["--nnodes"] == "3"


# What the scripts passed before they read presets (their dry-run flags up to the data flags),
# numbers as they spelled them: the presets must keep these values.
OLD_SCRIPT_FLAGS = {
    "gpt3_125m": "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 "
    "--max-position-embeddings 2048 --position-embedding-type learned_absolute --normalization LayerNorm "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --init-method-std 0.02 --tensor-model-parallel-size 1 "
    "--pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --micro-batch-size 8 --global-batch-size 256 --train-iters 572204 --bf16 "
    "--optimizer adam --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine --lr-warmup-iters 715 "
    "--lr-decay-iters 495910 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 "
    "--clip-grad 1.0 --exit-signal-handler",
    "mixtral_8x7b": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768 "
    "--position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-5 "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 "
    "--attention-dropout 0.0 --init-method-std 0.01 --num-experts 8 --moe-ffn-hidden-size 14336 "
    "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
    "--expert-model-parallel-size 8 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --recompute-granularity "
    "full --recompute-method uniform --recompute-num-layers 1 --micro-batch-size 1 "
    "--global-batch-size 256 --train-iters 500000 --bf16 --optimizer adam --lr 1.0e-4 --min-lr 1.0e-5 "
    "--lr-decay-style cosine --lr-warmup-iters 500 --lr-decay-iters 320000 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --exit-signal-handler",
}


@pytest.mark.parametrize("name", sorted(OLD_SCRIPT_FLAGS))
def test_presets_keep_the_old_scripts_flags(name):
    old = OLD_SCRIPT_FLAGS[name].split()
    new = recipe_flags(resolve(get_preset(name)))
    assert len(new) == len(old)
    for a, b in zip(old, new):
        assert a == b or float(a) == float(b), (a, b)


def outside_references(text):
    """(line number, text) of each path that leaves the repository: absolute paths, ``../``, ``~/``
    and ``$HOME``.  A ``#!`` first line is allowed; ``a/b`` inside a word (``12/8``, ``s/TP``) is not a path."""
    pattern = re.compile(r"""(?:^|[\s=:"'(`])(/[\w.~-][^\s"'`)]*)|(\.\./)|(?:^|[\s=:"'(`])(~/)|(\$\{?HOME\b)""")
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if number == 1 and line.startswith("#!"):
            continue
        found += [(number, m.group(0).strip()) for m in pattern.finditer(line)]
    return found


def test_outside_reference_scanner():
    for bad in (
        "DATA_PATH=/data/pile_text_document",
        'TOKENIZER_MODEL="/models/tok.model"',
        "source ../../x.sh",
        "CHECKPOINT_DIR=~/ckpt",
        'cd "$HOME/megalm"',
        "see `/lustre/ckpt`",
        "  blend 0.7 /data/a",
    ):
        assert outside_references(bad), bad
    for good in (
        "#!/usr/bin/env bash",
        "6 + 12/8 B; s*b*V/TP; 260/300; 8 / 256",
        "data/pile_text_document",
        'cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd',
        "$RUN_DIR/checkpoints",
        "https://example.org/x",
    ):
        assert not outside_references(good), good


def test_scripts_refer_to_no_file_outside_the_repository():
    files = sorted(f for f in SCRIPTS_DIR.rglob("*") if f.is_file())
    assert SCRIPTS_DIR / "README.md" in files and SCRIPTS_DIR / "common.sh" in files
    for f in files:
        assert not outside_references(f.read_text()), (f.relative_to(REPO), outside_references(f.read_text()))
