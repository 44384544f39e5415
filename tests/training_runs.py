"""Shared helpers for tests that run whole trainings on spawned ranks and read back --metrics-file:
the tiny GPT's flags (:func:`tiny_flags`), running trainings through ``pretrain_gpt.main`` on a rank,
and reading the metrics back."""

import json
import os
import signal

# The tiny GPT most training tests run (fp32, no dropout, mock data, in-process data loading, a log line
# and a metrics record every iteration, no evaluation).  Values are the flags' text.
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
