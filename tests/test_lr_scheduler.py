"""OptimizerParamScheduler against closed-form learning-rate formulas."""

import json
import math

import pytest

from megalm.config import ConfigError
from megalm.training.lr_scheduler import OptimizerParamScheduler
from tests.configs import make_config

MAX, MIN, INIT, W, D = 3e-4, 3e-5, 1e-6, 100, 1000


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": -1.0}, {"lr": -1.0, "lr_mult": 0.5}]


def sched(style, warmup=W, decay=D, wsd=None, wsd_style="exponential", init=INIT, **kw):
    return OptimizerParamScheduler(
        FakeOptimizer(),
        init_lr=init,
        max_lr=MAX,
        min_lr=MIN,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=wsd_style,
        **kw,
    )


def lr_at(s, n):
    s.step(n - s.num_steps)
    assert s.optimizer.param_groups[0]["lr"] == s.get_lr()
    assert s.optimizer.param_groups[1]["lr"] == pytest.approx(0.5 * s.get_lr(), rel=1e-15)
    return s.get_lr()


def decay_expected(style, n):
    r = (n - W) / (D - W)
    if style == "linear":
        return MIN + (MAX - MIN) * (1 - r)
    if style == "cosine":
        return MIN + (MAX - MIN) * 0.5 * (1 + math.cos(math.pi * r))
    if style == "inverse-square-root":
        return max(MIN, MAX * math.sqrt(W) / math.sqrt(n))
    if style == "constant":
        return MAX
    raise AssertionError(style)


POINTS = [0, 1, 50, 100, 101, 250, 550, 999, 1000, 1001, 5000]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_decay_styles_match_closed_form(style):
    s = sched(style)
    for n in POINTS:
        if n <= W:
            expected = INIT + (MAX - INIT) * n / W
        elif n > D and style != "constant":
            expected = MIN
        else:
            expected = decay_expected(style, n)
        assert lr_at(s, n) == pytest.approx(expected, rel=1e-12, abs=1e-18), (style, n)


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine"])
def test_wsd_matches_closed_form(wsd_style):
    S = 200  # annealing over the last 200 of 1000 steps
    s = sched("WSD", wsd=S, wsd_style=wsd_style)
    for n in POINTS + [800, 801, 900]:
        if n <= W:
            expected = INIT + (MAX - INIT) * n / W
        elif n > D:
            expected = MIN
        elif n <= D - S:
            expected = MAX  # the stable phase
        else:
            q = (n - (D - S)) / S
            coeff = {"exponential": 2 * 0.5**q - 1, "linear": 1 - q, "cosine": 0.5 * (1 + math.cos(math.pi * q))}[
                wsd_style
            ]
            expected = MIN + coeff * (MAX - MIN)
        assert lr_at(s, n) == pytest.approx(expected, rel=1e-12), (wsd_style, n)
    assert sched("WSD", wsd=S, wsd_style="exponential").get_lr() == INIT


def test_no_warmup():
    s = sched("cosine", warmup=0, init=0.0)
    assert s.get_lr() == MAX and lr_at(s, 500) == pytest.approx(MIN + (MAX - MIN) * 0.5 * (1 + math.cos(math.pi / 2)))
    assert sched("inverse-square-root", warmup=0).get_lr() == MAX  # max(W, 1) / max(n, 1)


@pytest.mark.parametrize(
    "training, message",
    [
        # Checked in samples (x --global-batch-size 8) once the global batch size is known.
        (
            dict(train_samples=8000, lr_warmup_samples=8000),
            r"lr warm-up \(8000 samples\) must be shorter than the decay "
            r"\(8000 samples\)",
        ),
        (dict(train_samples=8000, lr_warmup_iters=1000), r"lr warm-up \(8000 samples\) must be shorter"),
        (dict(train_iters=100, lr_warmup_iters=100), "--lr-warmup-iters 100 must be shorter than the decay"),
        (dict(train_iters=100, lr_decay_style="WSD"), r"WSD needs --lr-wsd-decay-iters \(or --lr-wsd-decay-samples"),
        (dict(train_iters=100, lr_decay_style="WSD", lr_wsd_decay_iters=101), "got 808 of 800 samples"),
        (
            dict(train_iters=100, lr_decay_style="WSD", lr_wsd_decay_style="step"),
            "--lr-wsd-decay-style 'step' is not one",
        ),
        (dict(train_iters=100, lr_decay_style="exp"), "--lr-decay-style 'exp' is not one of"),
        (dict(train_iters=100, min_lr=1e-3), "--min-lr 0.001 is larger than --lr 0.0003"),
        (dict(train_iters=100, min_lr=-1e-5), "--min-lr must be >= 0, got -1e-05"),
        (dict(train_iters=100, lr_warmup_init=1e-3), "--lr-warmup-init 0.001 is larger than --lr 0.0003"),
        (dict(train_iters=100, lr_warmup_fraction=1.0), r"--lr-warmup-fraction 1.0 must be in \[0, 1\)"),
        (dict(train_iters=0, lr_decay_style="constant"), "the learning-rate decay must be positive, got 0 samples"),
        (
            dict(train_iters=100, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
            "give only one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler",
        ),
    ],
)
def test_schedule_is_validated_with_the_config(training, message):
    """The scheduler's checks live in megalm.config.validation (one place), in samples as it runs."""
    with pytest.raises(ConfigError, match=message):
        make_config(SCHEDULE, training)
    assert (
        OptimizerParamScheduler.from_config(
            make_config(SCHEDULE, train_iters=100, validate=False), FakeOptimizer()
        ).lr_decay_steps
        == 800
    )
    make_config(SCHEDULE, train_iters=100, lr_decay_style="WSD", lr_wsd_decay_iters=100)  # the whole decay: allowed


# The schedule settings of the scheduler tests (global batch 8: one iteration is 8 samples).
SCHEDULE = dict(global_batch_size=8, lr=MAX, min_lr=MIN)


def test_from_config_counts_samples_like_megatron():
    s = OptimizerParamScheduler.from_config(
        make_config(SCHEDULE, train_iters=100, lr_warmup_iters=10, validate=False), FakeOptimizer()
    )
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (80, 800)
    s = OptimizerParamScheduler.from_config(
        make_config(SCHEDULE, train_iters=100, lr_decay_iters=50, lr_warmup_fraction=0.1, validate=False),
        FakeOptimizer(),
    )
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (pytest.approx(40.0), 400)
    s = OptimizerParamScheduler.from_config(
        make_config(SCHEDULE, train_iters=100, lr_decay_style="WSD", lr_wsd_decay_iters=20, validate=False),
        FakeOptimizer(),
    )
    assert s.wsd_decay_steps == 160
    s = OptimizerParamScheduler.from_config(
        make_config(SCHEDULE, train_samples=4000, lr_warmup_iters=5, validate=False), FakeOptimizer()
    )
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (40, 4000)
    # one iteration of 8 samples is 8 steps of the schedule
    s = OptimizerParamScheduler.from_config(
        make_config(SCHEDULE, train_iters=100, lr_warmup_iters=10, lr_warmup_init=0.0, validate=False), FakeOptimizer()
    )
    s.step(increment=8)
    assert s.get_lr() == pytest.approx(MAX / 10)


def test_state_dict_round_trip_and_mismatch():
    s = sched("cosine")
    lr_at(s, 321)
    saved = json.loads(json.dumps(s.state_dict()))  # checkpoints keep it in JSON
    t = sched("cosine")
    t.load_state_dict(saved)
    assert t.num_steps == 321 and t.get_lr() == s.get_lr() and t.optimizer.param_groups[0]["lr"] == s.get_lr()
    other = OptimizerParamScheduler(FakeOptimizer(), INIT, MAX, MIN, W, 2 * D, "cosine")
    with pytest.raises(ValueError, match="lr_decay_steps.*--override-opt-param-scheduler"):
        other.load_state_dict(saved)
    override = OptimizerParamScheduler(
        FakeOptimizer(), INIT, MAX, MIN, W, 2 * D, "cosine", override_opt_param_scheduler=True
    )
    override.load_state_dict(saved)
    assert override.lr_decay_steps == 2 * D and override.num_steps == 321
    from_ckpt = OptimizerParamScheduler(
        FakeOptimizer(), INIT, MAX, MIN, W, 2 * D, "cosine", use_checkpoint_opt_param_scheduler=True
    )
    from_ckpt.load_state_dict(saved)
    assert from_ckpt.lr_decay_steps == D and from_ckpt.get_lr() == s.get_lr()


class WeightDecayGroups:
    def __init__(self):
        self.param_groups = [{"lr": -1.0, "weight_decay": -1.0, "wd_mult": 1.0}, {"lr": -1.0, "weight_decay": 0.0}]


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_weight_decay_schedule_follows_megatrons_formula(style):
    start, end, total = (0.01, 0.1, 400) if style != "constant" else (0.05, 0.05, 400)
    s = OptimizerParamScheduler(
        WeightDecayGroups(),
        INIT,
        MAX,
        MIN,
        W,
        D,
        "cosine",
        start_wd=start,
        end_wd=end,
        wd_incr_steps=total,
        wd_incr_style=style,
    )
    for n in (0, 1, 100, 200, 399, 400, 401, 1000):
        s.step(n - s.num_steps)
        r = n / total
        coeff = {"linear": r, "cosine": 0.5 * (math.cos(math.pi * (1 - r)) + 1), "constant": 1.0}[style]
        expected = end if n > total else start + coeff * (end - start)
        assert s.get_wd() == pytest.approx(expected, rel=1e-12), n
        assert s.optimizer.param_groups[0]["weight_decay"] == s.get_wd()
        assert s.optimizer.param_groups[1]["weight_decay"] == 0.0  # no wd_mult: left alone
    state = json.loads(json.dumps(s.state_dict()))
    again = OptimizerParamScheduler(
        WeightDecayGroups(),
        INIT,
        MAX,
        MIN,
        W,
        D,
        "cosine",
        start_wd=start,
        end_wd=end,
        wd_incr_steps=total,
        wd_incr_style=style,
    )
    again.load_state_dict(state)
    assert again.get_wd() == s.get_wd() and again.optimizer.param_groups[0]["weight_decay"] == s.get_wd()


def test_weight_decay_schedule_from_flags():
    wd = dict(weight_decay_incr_style="cosine", start_weight_decay=0.0, end_weight_decay=0.1)
    cfg = make_config(wd, train_iters=50, global_batch_size=8, micro_batch_size=8, world_size=1)
    s = OptimizerParamScheduler.from_config(cfg, WeightDecayGroups())
    assert (s.start_wd, s.end_wd, s.wd_incr_steps, s.wd_incr_style) == (0.0, 0.1, 400, "cosine")
    assert cfg.training.weight_decay == 0.0  # the starting value
    import torch

    from megalm.optimizer.factory import get_param_groups

    groups = get_param_groups(
        [("w", torch.nn.Parameter(torch.ones(2, 2))), ("b", torch.nn.Parameter(torch.ones(2)))], 0.0
    )
    assert [(g["name"], g["wd_mult"]) for g in groups] == [("decay", 1.0), ("no_decay", 0.0)]
    for bad, message in (
        (dict(start_weight_decay=0.1), "need --weight-decay-incr-style linear or cosine"),
        (dict(weight_decay_incr_style="linear", start_weight_decay=0.1), "needs --start-weight-decay and --end"),
    ):
        with pytest.raises(ConfigError, match=message):
            make_config(bad)


@pytest.mark.parametrize("rule, factor", [("linear", lambda r: r), ("sqrt", math.sqrt), ("none", lambda r: 1.0)])
@pytest.mark.parametrize("kind", ["step_schedule", "rampup"])
def test_lr_batch_scaling_follows_the_rule_at_every_step(rule, factor, kind):
    """The lr each update uses (both groups, lr_mult 1 and 0.5) = the closed-form schedule at the samples
    consumed before it x the rule's factor of that iteration's batch / the global batch (16)."""
    from megalm.training.microbatches import MicrobatchCalculator

    if kind == "step_schedule":
        calc = MicrobatchCalculator(16, 2, 1, step_schedule=[(0, 4), (24, 8), (64, 16)])
    else:
        calc = MicrobatchCalculator(16, 2, 1, rampup_batch_size=[4, 4, 96])
    s = sched("cosine", lr_batch_scaling=rule, reference_batch_size=16)
    consumed, batches = 0, []
    while consumed < 1200:
        calc.update(consumed)
        b = calc.current_global_batch_size
        s.set_global_batch_size(b)
        if consumed <= W:
            expected = INIT + (MAX - INIT) * consumed / W
        else:
            expected = decay_expected("cosine", consumed) if consumed <= D else MIN
        expected *= factor(b / 16)
        assert s.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
        assert s.optimizer.param_groups[1]["lr"] == pytest.approx(0.5 * expected, rel=1e-12)
        s.step(b)
        consumed += b
        batches.append(b)
    assert {4, 8, 16} <= set(batches)  # the batch changed, so the rule was exercised


def test_lr_batch_scaling_needs_a_changing_batch():
    scaled = dict(num_layers=2, hidden_size=64, num_attention_heads=4, lr_batch_scaling="sqrt")
    with pytest.raises(ConfigError, match="--lr-batch-scaling sqrt needs --rampup-batch-size or --step-batch-size"):
        make_config(scaled, train_iters=10, world_size=1)
    cfg = make_config(scaled, rampup_batch_size=[1, 1, 8], global_batch_size=4, train_samples=100, world_size=1)
    assert cfg.training.lr_batch_scaling == "sqrt"
