"""--step-batch-size-schedule: parsing, the config's checks, and whole trainings on spawned ranks.

Trainings (micro batch 2, --seq-length 32, schedule '0:4 256:8 512:16': thresholds 0, 8, 16 samples,
--train-samples 40): the global batches are 4, 4, 8, 16, 16; the forward steps counted on each rank
equal sum(batch / (micro x DP)) at DP 1 and DP 2 and the losses agree; a DP 2 run saved at
iteration 2 (just before the first change) resumes to the uninterrupted run's batches, consumed
samples and losses.  With --lr-batch-scaling sqrt the logged learning rate of each iteration is
--lr x sqrt(batch / 16) (the schedule's constant 2e-3 at the largest batch).
"""

import os
import re

import pytest

from megalm.config import ConfigError, parse_config, validate_config
from megalm.training.microbatches import MicrobatchCalculator, ScheduleError, parse_step_batch_size_schedule
from tests.configs import make_config
from tests.distributed_harness import run_distributed
from tests.training_runs import assert_close, records, tiny_flags

SCHEDULE = "0:4 256:8 512:16"
BATCHES = [4, 4, 8, 16, 16]


def test_parse_tokens_with_suffixes_into_sample_thresholds():
    assert parse_step_batch_size_schedule("0:16 2.4B:320 1T:640", 2048) == [
        (0, 16),
        (2_400_000_000 // 2048, 320),
        (10**12 // 2048, 640),
    ]
    assert parse_step_batch_size_schedule(SCHEDULE, 32) == [(0, 4), (8, 8), (16, 16)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("16:4 512:8", "the first threshold must be 0"),
        ("0:4 512:8 256:16", "must increase"),
        ("0:4 10:8", "must increase"),  # 10 tokens are 0 samples of 32 tokens
        ("0:4 1X:8", "is not a number"),
        ("0:4 512", "is not <tokens>:<global batch size>"),
        ("0:0", "batch size > 0"),
    ],
)
def test_bad_schedules_are_refused(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        parse_step_batch_size_schedule(text, 32)


def test_calculator_follows_the_schedule_at_dp_1_and_2():
    schedule = parse_step_batch_size_schedule(SCHEDULE, 32)
    for dp in (1, 2):
        calc, consumed, seen = MicrobatchCalculator(16, 2, dp, step_schedule=schedule), 0, []
        while consumed < 40:
            calc.update(consumed)
            seen.append((calc.current_global_batch_size, calc.num_microbatches))
            consumed += calc.current_global_batch_size
        assert seen == [(b, b // (2 * dp)) for b in BATCHES]


# A small model trained for 40 samples by SCHEDULE, micro-batch 2.
SCHEDULED = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2)
SCHEDULED.update(step_batch_size_schedule=SCHEDULE, train_samples=40)


@pytest.mark.parametrize(
    "training, world, message",
    [
        ({"global_batch_size": 8}, 1, "do not give --global-batch-size 8"),
        ({"rampup_batch_size": [4, 4, 16]}, 1, "give only one of --step-batch-size-schedule and --rampup-batch-size"),
        ({"step_batch_size_schedule": "4:4"}, 1, "the first threshold must be 0"),
        ({"step_batch_size_schedule": "0:4 256:6"}, 2, "batch 6 is not divisible by --micro-batch-size 2 x"),
    ],
)
def test_config_checks(training, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(SCHEDULED, training, world_size=world)


def test_schedules_with_train_iters_validate_as_in_megatron():
    """Megatron follows the schedule (or ramp) by consumed samples for --train-iters iterations."""
    cfg = make_config(SCHEDULED, train_samples=None, train_iters=5, world_size=1)
    assert cfg.training.train_iters == 5 and cfg.training.global_batch_size == 16
    ramp = dict(step_batch_size_schedule=None, rampup_batch_size=[4, 4, 16], global_batch_size=8)
    cfg = make_config(SCHEDULED, ramp, train_samples=None, train_iters=5, world_size=1)
    assert cfg.training.rampup_batch_size == [4, 4, 16]


def test_vocab_and_merge_files_default_to_gpt2_bpe_at_parse_time(tmp_path):
    """As Megatron's pretrain_gpt.py: --vocab-file / --merge-file without --tokenizer-type mean GPT2BPETokenizer;
    a missing merge file is then refused before any rank starts."""

    def parse(*argv):
        return parse_config(list(argv), world_size=1)

    assert parse("--vocab-file", "v.json", "--merge-file", "m.txt").data.tokenizer_type == "GPT2BPETokenizer"
    with pytest.raises(ConfigError, match="--tokenizer-type GPT2BPETokenizer needs --merge-file"):
        parse("--vocab-file", "v.json")


def test_the_global_batch_size_is_the_schedules_largest():
    cfg = make_config(SCHEDULED, world_size=2)
    assert cfg.training.global_batch_size == 16
    assert validate_config(cfg, world_size=2).training.global_batch_size == 16  # validating again is fine


TINY = tiny_flags(
    lr_decay_style="constant",
    split="90,5,5",
    no_log_memory=True,
    micro_batch_size="2",
    train_samples="40",
    step_batch_size_schedule=SCHEDULE,
)


def count_forward_steps(runs):
    """Run each argv through ``pretrain_gpt.main`` counting this rank's forward steps; [(exit code, count)]."""
    import pretrain_gpt
    from megalm import parallel_state

    out = []
    for argv in runs:
        calls = {"n": 0}

        def forward_step(data_iterator, model):
            calls["n"] += 1
            return pretrain_gpt.forward_step(data_iterator, model)

        try:
            pretrain_gpt.main(argv, forward_step)
            code = 0
        except SystemExit as e:
            code = e.code
        parallel_state.destroy_model_parallel()
        out.append((code, calls["n"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("batch_schedule"))
    ck = os.path.join(tmp, "ckpt")

    def run(name, *extra):
        return TINY + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")] + list(extra)

    two = [
        run("d2"),
        run("save", "--exit-interval", "2", "--save-interval", "100", "--save", ck),
        run("resume", "--load", ck),
    ]
    out2 = run_distributed(count_forward_steps, 2, args=(two,), timeout=300)
    one = [run("d1"), run("d1_sqrt", "--lr-batch-scaling", "sqrt")]
    out1 = run_distributed(count_forward_steps, 1, args=(one,), timeout=200)
    return {"tmp": tmp, "out2": out2, "out1": out1}


def test_microbatches_per_step_follow_the_schedule_at_dp_1_and_2(runs):
    assert runs["out1"] == [[(0, sum(b // 2 for b in BATCHES))] * 2]
    for rank_out in runs["out2"]:
        assert [code for code, _ in rank_out] == [0, 0, 0]
        assert rank_out[0][1] == sum(b // 4 for b in BATCHES)  # 12 forward steps per rank at DP 2
    for name in ("d1", "d2"):
        recs = records(runs["tmp"], name)
        assert [r["global_batch_size"] for r in recs] == BATCHES
        assert [r["consumed_samples"] for r in recs] == [4, 8, 16, 32, 48]
    assert_close([r["lm_loss"] for r in records(runs["tmp"], "d2")], [r["lm_loss"] for r in records(runs["tmp"], "d1")])


def test_resume_before_a_change_continues_the_schedule_exactly(runs):
    straight, resumed = records(runs["tmp"], "d2"), records(runs["tmp"], "resume")
    assert [r["iteration"] for r in resumed] == [3, 4, 5]
    assert [r["global_batch_size"] for r in resumed] == BATCHES[2:]
    assert [r["consumed_samples"] for r in resumed] == [16, 32, 48]
    assert_close([r["lm_loss"] for r in resumed], [r["lm_loss"] for r in straight[2:]], rel=1e-6)
    assert runs["out2"][0][2][1] == sum(b // 4 for b in BATCHES[2:])  # the resumed run's forward steps


def test_lr_batch_scaling_sqrt_scales_each_iterations_lr(runs):
    scaled, plain = records(runs["tmp"], "d1_sqrt"), records(runs["tmp"], "d1")
    assert [r["global_batch_size"] for r in scaled] == BATCHES
    assert_close([r["lr"] for r in scaled], [2e-3 * (b / 16) ** 0.5 for b in BATCHES], rel=1e-12)
    assert [r["lr"] for r in plain] == [2e-3] * len(BATCHES)
    assert scaled[0]["lm_loss"] == plain[0]["lm_loss"]  # same start; the smaller lr shows from the first update on
    assert abs(scaled[1]["lm_loss"] - plain[1]["lm_loss"]) > 1e-6


def test_megatron_fsdp_gradient_dtypes_set_the_gradient_buffers():
    """--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype choose fp32 or the parameters' dtype for
    the buffers gradients accumulate and reduce in; conflicting or impossible choices are refused."""
    from megalm.config import build_parser, config_from_args

    def parse(*argv):
        return validate_config(config_from_args(build_parser().parse_args(list(argv))), world_size=1).parallel

    assert parse("--bf16").accumulate_allreduce_grads_in_fp32
    assert not parse("--bf16", "--megatron-fsdp-main-grads-dtype", "bf16").accumulate_allreduce_grads_in_fp32
    bf16 = parse("--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "bf16")
    assert not bf16.accumulate_allreduce_grads_in_fp32
    assert parse(
        "--bf16", "--grad-reduce-in-bf16", "--megatron-fsdp-main-grads-dtype", "fp32"
    ).accumulate_allreduce_grads_in_fp32
    with pytest.raises(ConfigError, match="must be the same"):
        parse("--bf16", "--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "bf16")
    with pytest.raises(ConfigError, match="needs --fp16 parameters"):
        parse("--bf16", "--megatron-fsdp-grad-comm-dtype", "fp16")
    with pytest.raises(ConfigError, match="--ckpt-format torch is not supported"):
        parse("--ckpt-format", "torch")  # fsdp_dtensor is accepted: tests/test_fsdp_dtensor_checkpoint.py
