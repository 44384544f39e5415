"""End-to-end training through pretrain_gpt.py's pieces on real spawned ranks (fp32, tiny GPT).

Each spawned group runs several trainings; losses are read back from --metrics-file.
"""

import json
import os

import pytest
import torch

from tests.distributed_harness import run_distributed
from tests.training_runs import assert_close as _assert_close
from tests.training_runs import losses as _losses
from tests.training_runs import metrics_argv, tiny_flags
from tests.training_runs import records as _records
from tests.training_runs import run_trainings as _run_trainings

TINY = tiny_flags(
    min_lr="1e-4",
    lr_decay_style="cosine",
    lr_warmup_iters="2",
    clip_grad="1.0",
    weight_decay="0.1",
    split="90,5,5",
    log_params_norm=True,
)


def _run_name(argv):
    """The name ``metrics_argv`` gave a run (its metrics file's stem)."""
    return os.path.basename(argv[argv.index("--metrics-file") + 1])[: -len(".jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All trainings of this module, in three spawned groups (1, 2 and 4 ranks)."""
    tmp = str(tmp_path_factory.mktemp("train"))
    it = ["--train-iters", "6"]
    evals = ["--eval-interval", "3", "--eval-iters", "2"]
    single = [
        (metrics_argv(TINY, tmp, "ref", *it, *evals, "--micro-batch-size", "8", "--global-batch-size", "8"), {}),
        (metrics_argv(TINY, tmp, "accum", *it, "--micro-batch-size", "2", "--global-batch-size", "8"), {}),
        (metrics_argv(TINY, tmp, "bf16", "--train-iters", "12", "--micro-batch-size", "8", "--bf16"), {}),
        (
            metrics_argv(
                TINY,
                tmp,
                "fp16",
                "--train-iters",
                "6",
                "--micro-batch-size",
                "8",
                "--fp16",
                "--initial-loss-scale",
                "1024",
                "--hysteresis",
                "1",
                "--loss-scale-window",
                "3",
            ),
            {"inf_at_call": 3},
        ),
    ]
    ck_prec, bad = os.path.join(tmp, "ckpt_prec"), os.path.join(tmp, "bad_ckpt")
    os.makedirs(bad)
    with open(os.path.join(bad, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")  # names an iteration that was never written
    single += [
        (
            metrics_argv(
                TINY,
                tmp,
                "prec_fp32",
                "--train-iters",
                "8",
                "--exit-interval",
                "4",
                "--micro-batch-size",
                "8",
                "--save",
                ck_prec,
            ),
            {},
        ),
        (
            metrics_argv(
                TINY, tmp, "prec_bf16", "--train-iters", "8", "--micro-batch-size", "8", "--load", ck_prec, "--bf16"
            ),
            {},
        ),
        (metrics_argv(TINY, tmp, "bad", "--train-iters", "4", "--micro-batch-size", "8", "--load", bad), {}),
        (
            metrics_argv(
                TINY,
                tmp,
                "duration",
                "--train-iters",
                "4",
                "--micro-batch-size",
                "8",
                "--exit-duration-in-mins",
                "0",
                "--save",
                os.path.join(tmp, "ckpt_duration"),
            ),
            {},
        ),
    ]
    # Megatron's auto-resume: the same --load/--save on every launch; the first finds nothing.
    auto = [
        "--train-iters",
        "4",
        "--micro-batch-size",
        "8",
        "--save",
        os.path.join(tmp, "ckpt_auto"),
        "--load",
        os.path.join(tmp, "ckpt_auto"),
        "--save-interval",
        "100",
    ]
    single += [
        (metrics_argv(TINY, tmp, "auto_first", *auto, "--exit-interval", "2"), {}),
        (metrics_argv(TINY, tmp, "auto_second", *auto), {}),
    ]
    # --no-save-optim --no-save-rng: weights only; a resume must say which --no-load-* it needs.
    lean = ["--train-iters", "4", "--micro-batch-size", "8", "--load", os.path.join(tmp, "ckpt_lean")]
    single += [
        (
            metrics_argv(
                TINY,
                tmp,
                "lean_save",
                *lean[:4],
                "--save",
                lean[-1],
                "--exit-interval",
                "2",
                "--no-save-optim",
                "--no-save-rng",
            ),
            {},
        ),
        (metrics_argv(TINY, tmp, "lean_load_plain", *lean), {}),
        (metrics_argv(TINY, tmp, "lean_load_no_optim", *lean, "--no-load-optim"), {}),
        (metrics_argv(TINY, tmp, "lean_load", *lean, "--no-load-optim", "--no-load-rng"), {}),
    ]
    # Non-persistent checkpoints: a NaN stop at iteration 3 leaves the non-persistent one of iteration 2 (and no
    # persistent one); the relaunch resumes from it and trains as the uninterrupted run.
    npc = ["--train-iters", "5", "--micro-batch-size", "8"]
    np_save = ["--save", os.path.join(tmp, "ckpt_np"), "--load", os.path.join(tmp, "ckpt_np")]
    np_save += ["--save-interval", "100", "--non-persistent-save-interval", "1"]
    single += [
        (metrics_argv(TINY, tmp, "np_straight", *npc), {}),
        (metrics_argv(TINY, tmp, "np_crash", *npc, *np_save), {"inf_at_call": 3}),
        (metrics_argv(TINY, tmp, "np_resume", *npc, *np_save), {}),
        # --tensorboard-log-interval 1 with log lines every 5: TensorBoard gets every iteration's loss.
        (
            metrics_argv(
                TINY,
                tmp,
                "tb",
                *npc,
                "--tensorboard-dir",
                os.path.join(tmp, "tb"),
                "--log-interval",
                "5",
                "--tensorboard-log-interval",
                "1",
            ),
            {},
        ),
    ]
    # --reset-attention-mask: document-masked attention, the dense mask in one process here and packed
    # (--qkv-format thd) under TP2 x DP2 below; positions restart per document in both.
    docmask = ["--train-iters", "4", "--global-batch-size", "8", "--reset-attention-mask", "--reset-position-ids"]
    single += [(metrics_argv(TINY, tmp, "docmask_ref", *docmask, "--micro-batch-size", "8"), {})]
    codes1 = run_distributed(_run_trainings, 1, args=(single,), timeout=300)
    double = [
        (metrics_argv(TINY, tmp, "dp2", *it, "--micro-batch-size", "4", "--global-batch-size", "8"), {}),
        (metrics_argv(TINY, tmp, "dp2_bf16", *it, "--micro-batch-size", "4", "--global-batch-size", "8", "--bf16"), {}),
        (
            metrics_argv(
                TINY,
                tmp,
                "dp2_bf16_reduce",
                *it,
                "--micro-batch-size",
                "4",
                "--global-batch-size",
                "8",
                "--bf16",
                "--grad-reduce-in-bf16",
            ),
            {},
        ),
        (
            metrics_argv(
                TINY,
                tmp,
                "dp2_overlap",
                *it,
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "8",
                "--overlap-grad-reduce",
                "--ddp-bucket-size",
                "5000",
            ),
            {},
        ),
    ]
    codes2 = run_distributed(_run_trainings, 2, args=(double,), timeout=300)
    ck = os.path.join(tmp, "ckpt")
    ck_sig = os.path.join(tmp, "ckpt_sig")
    tp2 = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
    ]
    drop = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    quad = [
        (metrics_argv(TINY, tmp, "tp2dp2", *it, *evals, *tp2), {}),
        # Exact resume with dropout on: 10 straight vs 5 + resume + 5.
        (metrics_argv(TINY, tmp, "straight", "--train-iters", "10", *tp2, *drop), {}),
        (
            metrics_argv(
                TINY,
                tmp,
                "first_half",
                "--train-iters",
                "10",
                "--exit-interval",
                "5",
                "--save",
                ck,
                "--save-interval",
                "100",
                *tp2,
                *drop,
            ),
            {},
        ),
        (metrics_argv(TINY, tmp, "second_half", "--train-iters", "10", "--load", ck, "--save", ck, *tp2, *drop), {}),
        # Layout change: the TP2 x DP2 checkpoint at iteration 5 continued as TP1 x DP4.
        (
            metrics_argv(
                TINY,
                tmp,
                "relayout",
                "--train-iters",
                "10",
                "--load",
                ck,
                "--ckpt-step",
                "5",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "8",
                *drop,
            ),
            {},
        ),
        # SIGTERM during iteration 3 (microbatch call 5 of 2 per iteration): finish, save, exit 0.
        (
            metrics_argv(TINY, tmp, "sigterm", "--train-iters", "10", "--exit-signal-handler", "--save", ck_sig, *tp2),
            {"sigterm_at_call": 5},
        ),
    ]
    quad += [(metrics_argv(TINY, tmp, "docmask_thd_tp2", *docmask, "--qkv-format", "thd", *tp2), {})]
    codes4 = run_distributed(_run_trainings, 4, args=(quad,), timeout=300)
    by_name = {_run_name(argv): code for (argv, _), code in zip(single, codes1[0])}
    return {"tmp": tmp, "codes": (codes1, codes2, codes4), "single": by_name, "ckpt": ck, "ckpt_sig": ck_sig}


def test_all_runs_exit_cleanly(runs):
    codes1, codes2, codes4 = runs["codes"]
    meant_to_fail = {"bad", "lean_load_plain", "lean_load_no_optim", "np_crash"}  # checked by their own tests
    assert {name: code for name, code in runs["single"].items() if name not in meant_to_fail and code != 0} == {}
    assert all(c == [0] * 4 for c in codes2), codes2
    assert all(c == [0] * 7 for c in codes4), codes4


def test_microbatch_accumulation_equals_one_big_batch(runs):
    _assert_close(_losses(runs["tmp"], "accum"), _losses(runs["tmp"], "ref"))


def test_data_parallel_equals_single_process(runs):
    ref = _losses(runs["tmp"], "ref")
    _assert_close(_losses(runs["tmp"], "dp2"), ref)
    _assert_close(_losses(runs["tmp"], "dp2_overlap"), ref)


def test_grad_reduce_in_bf16_trains_like_fp32_reduction(runs):
    """--grad-reduce-in-bf16: bf16 gradient buffers (the sum of the two ranks' gradients rounds to bf16):
    close to the fp32 reduction, not equal to it."""
    fp32_reduce, bf16_reduce = _losses(runs["tmp"], "dp2_bf16"), _losses(runs["tmp"], "dp2_bf16_reduce")
    _assert_close(bf16_reduce, fp32_reduce, rel=2e-2)
    assert bf16_reduce != fp32_reduce and bf16_reduce[-1] < bf16_reduce[0]


def test_tensor_and_data_parallel_equal_single_process(runs):
    _assert_close(_losses(runs["tmp"], "tp2dp2"), _losses(runs["tmp"], "ref"))


def test_reset_attention_mask_tensor_parallel_equals_single_process(runs):
    """--reset-attention-mask: packed documents (--qkv-format thd) under TP2 (sequence parallel) x DP2 train
    as the dense document mask in one process; the mask is active (the first loss, before any update,
    differs from the causal run on the same samples)."""
    docmask = _records(runs["tmp"], "docmask_ref")
    _assert_close(_losses(runs["tmp"], "docmask_thd_tp2"), [r["lm_loss"] for r in docmask])
    for a, b in zip(docmask, _records(runs["tmp"], "docmask_thd_tp2")):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # Same samples and initial weights; layouts agree to ~1e-6 here, the mask moves the loss by ~1e-3.
    assert abs(docmask[0]["lm_loss"] - _losses(runs["tmp"], "ref")[0]) > 2e-4


def test_grad_norm_and_lr_logged_identically(runs):
    ref = _records(runs["tmp"], "ref")
    tp = _records(runs["tmp"], "tp2dp2")
    for a, b in zip(ref, tp):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["params_norm"] == pytest.approx(b["params_norm"], rel=1e-5)
        assert a["consumed_samples"] == b["consumed_samples"]


def test_params_norm_is_the_saved_weights_norm(runs):
    """--log-params-norm at iteration 4 equals the L2 norm of every tensor the checkpoint holds."""
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader

    reader = MegalmCheckpointReader(os.path.join(runs["tmp"], "ckpt_prec"))
    assert reader.iteration == 4
    total = sum(t.double().pow(2).sum().item() for t in reader.load(reader.model_names).values())
    logged = [r["params_norm"] for r in _records(runs["tmp"], "prec_fp32") if r["iteration"] == 4]
    assert logged == [pytest.approx(total**0.5, rel=1e-6)]


def test_exact_resume(runs):
    tmp = runs["tmp"]
    straight = _losses(tmp, "straight")
    resumed = _losses(tmp, "first_half") + _losses(tmp, "second_half")
    assert len(straight) == 10
    assert resumed == straight  # bit-identical, dropout included
    assert [r["iteration"] for r in _records(tmp, "second_half")] == list(range(6, 11))


def test_checkpoint_layout_and_tracker(runs):
    ck = runs["ckpt"]
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "10"
    for it in (5, 10):
        d = os.path.join(ck, f"iter_{it:07d}")
        assert os.path.isfile(os.path.join(d, ".metadata"))
        common = json.load(open(os.path.join(d, "common.json")))
        assert common["iteration"] == it and common["consumed_train_samples"] == it * 8
        assert sorted(os.listdir(os.path.join(d, "rng"))) == [f"rank_{r:05d}.pt" for r in range(4)]


def test_layout_changing_load_continues_training(runs):
    tmp = runs["tmp"]
    straight = _losses(tmp, "straight")
    relayout = _losses(tmp, "relayout")
    # Dropout masks depend on the layout, so compare loosely; the first loss after loading is
    # computed from identical weights and data with the same dropout rate.
    assert len(relayout) == 5
    assert abs(relayout[0] - straight[5]) < 0.05 * straight[5]
    assert relayout[-1] < _losses(tmp, "straight")[0]


def test_sigterm_saves_and_exits_zero(runs):
    ck = runs["ckpt_sig"]
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert [r["iteration"] for r in _records(runs["tmp"], "sigterm")] == [1, 2, 3]


def test_fp16_loss_scaler_skips_inf_and_recovers(runs):
    rec = _records(runs["tmp"], "fp16")
    scales = [r["loss_scale"] for r in rec]
    # The inf appears in iteration 3 (one microbatch per iteration): skipped, scale halved.
    assert scales[:2] == [1024.0, 1024.0]
    assert scales[2] == 512.0
    assert rec[2]["skipped_iterations"] == 1
    assert all(r["skipped_iterations"] == 0 for i, r in enumerate(rec) if i != 2)
    losses = [r["lm_loss"] for i, r in enumerate(rec) if i != 2]
    assert all(torch.isfinite(torch.tensor(losses)))
    # Grows back after --loss-scale-window 3 clean iterations.
    assert scales[5] == 1024.0


def test_exit_duration_saves_and_exits(runs):
    assert runs["single"]["duration"] == 0
    ck = os.path.join(runs["tmp"], "ckpt_duration")
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    assert [r["iteration"] for r in _records(runs["tmp"], "duration")] == [1]


def test_same_load_and_save_starts_from_scratch_then_resumes(runs):
    assert runs["single"]["auto_first"] == runs["single"]["auto_second"] == 0
    first, second = _records(runs["tmp"], "auto_first"), _records(runs["tmp"], "auto_second")
    assert [r["iteration"] for r in first] == [1, 2] and [r["iteration"] for r in second] == [3, 4]
    _assert_close([r["lm_loss"] for r in first], _losses(runs["tmp"], "prec_fp32")[:2])  # same seed and data


def test_half_written_checkpoint_is_not_overwritten(tmp_path, capsys):
    """iter_* directories without a tracker: refused even when --load is --save."""
    import pretrain_gpt

    (tmp_path / "iter_0000002").mkdir()
    argv = tiny_flags(train_iters=4, load=tmp_path, save=tmp_path)
    with pytest.raises(SystemExit) as e:
        pretrain_gpt.main(argv)
    assert "it holds iter_* directories" in str(e.value.code)


def test_unreadable_checkpoint_fails_with_clear_error(runs):
    code = runs["single"]["bad"]
    assert "iter_0000007 is incomplete or unreadable" in str(code), code


def test_resume_fp32_checkpoint_with_bf16(runs):
    fp32 = _losses(runs["tmp"], "prec_fp32")
    bf16 = _records(runs["tmp"], "prec_bf16")
    assert [r["iteration"] for r in bf16] == [5, 6, 7, 8]
    # Same weights, same data: the first bf16 loss is the fp32 run's trajectory within bf16 error.
    assert abs(bf16[0]["lm_loss"] - fp32[-1]) < 0.05 * fp32[-1]
    assert all(r["skipped_iterations"] == 0 for r in bf16)


def test_evaluation_is_layout_independent(runs):
    ref = _records(runs["tmp"], "ref", "validation")
    tp = _records(runs["tmp"], "tp2dp2", "validation")
    assert [r["iteration"] for r in ref] == [3, 6] and len(tp) == 2
    for a, b in zip(ref, tp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-4)
    assert _records(runs["tmp"], "ref", "test")[0]["loss"] > 0


def test_bf16_trains(runs):
    losses = _losses(runs["tmp"], "bf16")
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--micro-batch-size", "3", "--global-batch-size", "8", "--train-iters", "4"],
            "not divisible by --micro-batch-size 3",
        ),
        (["--train-iters", "4"], "no training data"),
        (["--train-iters", "4", "--mock-data", "--lr-warmup-iters", "4"], "--lr-warmup-iters 4 must be shorter"),
        (
            ["--train-iters", "4", "--mock-data", "--load", "/nonexistent/ckpt"],
            "--load /nonexistent/ckpt: no checkpoint (latest_checkpointed_iteration.txt is missing); "
            "starting from scratch "
            "needs --load and --save to name the same directory",
        ),
        (
            [
                "--train-iters",
                "4",
                "--mock-data",
                "--load",
                "/nonexistent/ckpt",
                "--save",
                "/nonexistent/ckpt",
                "--exit-on-missing-checkpoint",
            ],
            "is missing); --exit-on-missing-checkpoint",
        ),
        (
            [
                "--train-iters",
                "4",
                "--mock-data",
                "--load",
                "/nonexistent/ckpt",
                "--save",
                "/nonexistent/ckpt",
                "--ckpt-step",
                "3",
            ],
            "--load directory /nonexistent/ckpt does not exist",
        ),
        (
            ["--train-iters", "4", "--mock-data", "--overlap-param-gather"],
            "--overlap-param-gather needs --use-distributed-optimizer",
        ),
        (
            ["--train-iters", "4", "--mock-data", "--profile"],
            "--profile without --use-pytorch-profiler drives nsys through CUDA and this machine has no GPU",
        ),
    ],
)
def test_bad_flags_fail_before_start(argv, message, capsys):
    import pretrain_gpt

    base = tiny_flags(mock_data=None)  # each case gives its data (or none)
    with pytest.raises(SystemExit) as e:
        pretrain_gpt.main(base + argv)
    text = str(e.value.code) + capsys.readouterr().err
    assert message in text
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_weights_only_checkpoint_needs_the_no_load_flags(runs):
    tmp = runs["tmp"]
    codes = [runs["single"][name] for name in ("lean_save", "lean_load_plain", "lean_load_no_optim", "lean_load")]
    d = os.path.join(tmp, "ckpt_lean", "iter_0000002")
    common = json.load(open(os.path.join(d, "common.json")))
    assert common["scheduler"] is None and common["optimizer_common"] is None and common["rng_saved"] is False
    assert not os.path.exists(os.path.join(d, "rng"))  # --no-save-rng: no RNG file and no (empty) rng/
    from megalm.checkpoint.safe_metadata import load_metadata

    keys = load_metadata(d).state_dict_metadata
    assert keys and not [k for k in keys if not k.startswith("model.")]
    assert codes[0] == 0 and codes[3] == 0
    assert "--no-load-optim" in str(codes[1]) and "--no-load-rng" in str(codes[2]), codes
    assert [r["iteration"] for r in _records(tmp, "lean_load")] == [3, 4]


def test_non_persistent_checkpoint_resumes_after_a_crash(runs):
    tmp = runs["tmp"]
    codes = [runs["single"][name] for name in ("np_straight", "np_crash", "np_resume")]
    assert codes[0] == 0 and codes[1] != 0 and codes[2] == 0, codes
    assert [r["iteration"] for r in _records(tmp, "np_crash")] == [1, 2]
    assert [r["iteration"] for r in _records(tmp, "np_resume")] == [3, 4, 5]
    assert _losses(tmp, "np_resume") == _losses(tmp, "np_straight")[2:]  # bit-identical
    np_dir = os.path.join(tmp, "ckpt_np", "non_persistent")
    assert sorted(os.listdir(np_dir)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]  # only the newest


def test_tensorboard_log_interval_writes_every_iteration(runs):
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert runs["single"]["tb"] == 0
    (events,) = glob.glob(os.path.join(runs["tmp"], "tb", "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("lm loss")]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5]
    straight = _losses(runs["tmp"], "np_straight")  # the same run, logged every iteration
    assert [v for _, v in logged[:4]] == pytest.approx(straight[:4], rel=1e-6)  # this iteration's loss
    assert logged[4][1] == pytest.approx(sum(straight) / 5, rel=1e-6)  # the log line's mean of 5
    assert [e.step for e in acc.Scalars("learning-rate")] == [1, 2, 3, 4, 5]
    assert len(_records(runs["tmp"], "tb")) == 1  # the metrics file keeps one record per log line
