"""Shared helpers of the tests: the tiny GPT's flags (:func:`tiny_flags`, :func:`metrics_argv`), running
trainings through ``pretrain_gpt.main`` on spawned ranks and reading their --metrics-file back.  In-process
configs: :mod:`tests.configs` (its ``tiny_config``, ``optimizer_config`` and ``MLA_MOE`` are importable from
here too, where tests imported them before)."""

import json
import os
import signal
import time

from tests.configs import MLA_MOE, optimizer_config, tiny_config  # noqa: F401  (see the docstring)

# The tiny GPT most training tests run (fp32, no dropout, mock data, in-process data loading, a log line
# and a metrics record every iteration, no evaluation, no start-up peak measurement).  Values are the flags' text.
TINY = dict(
    num_layers="2",
    hidden_size="64",
    num_attention_heads="4",
    seq_length="32",
    mock_data=True,
    vocab_size="500",
    num_workers="0",
    hidden_dropout="0",
    attention_dropout="0",
    lr="2e-3",
    log_interval="1",
    eval_iters="0",
    seed="7",
    # A fixed peak for the MFU column: without it every fresh process first times 1024^3 matmuls (~1.5 s of
    # CPU per rank; the measurement itself is tested in tests/test_metrics.py).
    device_peak_flops="1e12",
)


# :func:`tiny_flags` overrides of a DeepSeek-style model trained on spawned ranks (MLA with latent norms,
# RMSNorm, SwiGLU without biases; dense then MoE layer, sigmoid routing with expert bias, a shared expert);
# the tests add the value head size and the number of experts.
MLA_MOE_FLAGS = dict(
    hidden_size="32",
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    qk_layernorm=True,
    vocab_size="200",
    seq_length="16",
    clip_grad="1.0",
    no_log_memory=True,
    micro_batch_size="1",
    global_batch_size="4",
    train_iters="3",
    multi_latent_attention=True,
    q_lora_rank="16",
    kv_lora_rank="12",
    qk_head_dim="8",
    qk_pos_emb_head_dim="4",
    moe_layer_freq="[0,1]",
    moe_router_topk="2",
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_shared_expert_intermediate_size="16",
    moe_ffn_hidden_size="8",
    moe_aux_loss_coeff="1e-2",
    moe_token_dispatcher_type="alltoall",
)


def tiny_flags(**overrides) -> list:
    """``pretrain_gpt`` argv of :data:`TINY` with ``overrides`` (flag names with ``_`` for ``-``):
    a value is the flag's text (``str()`` of it), ``True`` a bare switch, ``None`` leaves the flag
    out (its default applies).  ``--max-position-embeddings`` is ``--seq-length`` unless given."""
    flags = {**TINY, **overrides}
    flags.setdefault("max_position_embeddings", flags.get("seq_length"))
    argv = []
    for name, value in flags.items():
        if value is None:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def metrics_argv(base: list, tmp: str, name: str, *extra: str) -> list:
    """``base`` (an argv) with ``--metrics-file <tmp>/<name>.jsonl`` (read back by :func:`records`) and ``extra``."""
    return [*base, "--metrics-file", os.path.join(tmp, f"{name}.jsonl"), *extra]


def offload_optimizer(model, strategy=None, *, offload=None, fraction=1.0, path=None, overlap=False, optimizer="adam"):
    """``(model, chunk, optimizer)`` for the optimizer-offload tests: ``chunk`` is ``model`` wrapped in DDP with
    ``--data-parallel-sharding-strategy strategy`` (None: ``model`` itself, the plain optimizer), the optimizer
    built with tests/test_ddp.py's settings (``OPTIMIZER``) with ``--optimizer offload``: None (no offload), ``"cpu"``
    (``--optimizer-cpu-offload``, ``overlap``: ``--overlap-cpu-optimizer-d2h-h2d``) or ``"nvme"``
    (``--optimizer-offload-device nvme --offload-path path``), each at ``--optimizer-offload-fraction fraction``."""
    from megalm.config import ParallelConfig
    from megalm.distributed import DistributedDataParallel
    from megalm.optimizer import build_optimizer
    from megalm.parallel_state import get_process_groups
    from tests.test_ddp import OPTIMIZER

    cfg = optimizer_config(OPTIMIZER)
    t = cfg.training
    t.optimizer, t.optimizer_offload_fraction = optimizer, fraction
    t.optimizer_cpu_offload, t.overlap_cpu_optimizer_d2h_h2d = offload == "cpu", overlap
    if offload == "nvme":
        t.optimizer_offload_device, t.offload_path = "nvme", str(path)
    chunk = model
    if strategy is not None:
        cfg.parallel.data_parallel_sharding_strategy = strategy
        chunk = DistributedDataParallel(
            model, ParallelConfig(data_parallel_sharding_strategy=strategy), process_groups=get_process_groups()
        )
    return model, chunk, build_optimizer(cfg, [chunk], report_memory=False, process_groups=get_process_groups())


def run_trainings(runs):
    """On this rank, run each ``(argv, options)`` (or bare argv list) through ``pretrain_gpt.main()``
    (the entry point: errors become ``SystemExit("error: ...")``) in turn.

    Returns the exit codes (0, or SystemExit's code / message).  Options: ``inf_at_call`` (the
    n-th microbatch's output becomes inf, on ``inf_rank`` only if given), ``sigterm_at_call``
    (this process gets SIGTERM during the n-th microbatch), ``model_provider`` (a module-level
    function used in place of ``pretrain_gpt.model_provider``).
    """
    import torch.distributed as dist

    import pretrain_gpt
    from megalm import parallel_state

    codes = []
    for run in runs:
        argv, options = run if isinstance(run, tuple) else (run, {})
        forward_step = pretrain_gpt.forward_step
        if options.get("sigterm_at_call"):
            forward_step = sigterm_after(forward_step, options["sigterm_at_call"])
        if options.get("inf_at_call") and dist.get_rank() == options.get("inf_rank", dist.get_rank()):
            forward_step = inf_at(forward_step, options["inf_at_call"])
        try:
            pretrain_gpt.main(argv, forward_step, options.get("model_provider", pretrain_gpt.model_provider))
            codes.append(0)
        except SystemExit as e:
            codes.append(e.code if isinstance(e.code, int) else str(e.code))
        parallel_state.destroy_model_parallel()
    return codes


def sleep_on_rank(forward_step, variable: str, seconds: float):
    """Test hook of the files run as torchrun scripts: ``forward_step``, or on the global rank named by the
    environment variable ``variable`` (unset: none) one that first sleeps ``seconds`` at every call."""
    chosen = os.environ.get(variable)
    if chosen is None or int(os.environ["RANK"]) != int(chosen):
        return forward_step

    def step(data_iterator, model):
        time.sleep(seconds)
        return forward_step(data_iterator, model)

    return step


def sigterm_after(forward_step, n):
    """Wrap ``forward_step`` so that its n-th call sends SIGTERM to this process."""
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_step(data_iterator, model)

    return step


def inf_at(forward_step, n):
    """Wrap ``forward_step`` so that the output of its n-th call is multiplied by inf."""
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        out, loss_func = forward_step(data_iterator, model)
        return (out * float("inf") if calls["n"] == n else out), loss_func

    return step


def records(tmp, name, kind="train"):
    """Records of ``<tmp>/<name>.jsonl``: training iterations, or evaluations of split ``kind``."""
    with open(os.path.join(tmp, f"{name}.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if kind == "train":
        return [r for r in rows if "lm_loss" in r]
    return [r for r in rows if r.get("split") == kind]


def losses(tmp, name):
    return [r["lm_loss"] for r in records(tmp, name)]


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b) and len(a) > 0, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)
