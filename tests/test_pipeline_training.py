"""Pipeline-parallel training through pretrain_gpt.py's pieces on real spawned ranks (fp32, tiny GPT).

Loss sequences of PP 2, PP 4, PP 2 x VPP 2, uneven first/last stages, PP 2 x TP 2 (SP) and
PP 2 x TP 2 x DP 2 equal the single-process run within 1e-5 (tied and untied embeddings);
the tied embedding copies on the first and last stage stay identical; evaluation, recompute,
variable-sequence-length exchange and fp16 loss scaling work; a checkpoint saved under PP 2
loads under PP 1, PP 2 and PP 4 and continues the uninterrupted run (with tied embeddings the
last stage's copy, which is not saved, is loaded from the embedding's weights and optimizer state).

Groups are spawned in the order 2, 1, 4, 8 ranks (the PP 2 checkpoint is read by later groups).
"""

import os

import pytest
import torch

from tests.distributed_harness import run_distributed
from tests.training_runs import assert_close as _assert_close
from tests.training_runs import inf_at, metrics_argv, tiny_flags
from tests.training_runs import losses as _losses
from tests.training_runs import records as _records

# The tiny GPT (tests/training_runs.py) with 4 layers (one per stage at PP 4), cosine schedule and clipping.
PIPE = tiny_flags(
    num_layers="4",
    min_lr="1e-4",
    lr_decay_style="cosine",
    lr_warmup_iters="2",
    clip_grad="0.5",
    weight_decay="0.1",
    split="90,5,5",
    micro_batch_size="2",
    global_batch_size="8",
    train_iters="6",
    log_params_norm=True,
)
EVALS = ["--eval-interval", "3", "--eval-iters", "2"]
UNTIED = ["--untie-embeddings-and-output-weights"]
FP16 = ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--loss-scale-window", "3"]
# RoPE with positions restarting in every mock document: the second stage's rotation needs the batch's
# positions (without them it rotated by 0..s-1: grad norm off by 3e-4 relative at iteration 4, 1e-3 at 5).
ROPE_RESET = ["--position-embedding-type", "rope", "--reset-position-ids", "--train-iters", "5"]


def _tied_copies(trainer):
    """(first stage's word embedding, last stage's output-layer copy) on this rank, where held."""
    from megalm import parallel_state as ps

    out = {}
    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
        return out
    first = trainer.model[0].module
    last = trainer.model[-1].module
    if ps.is_pipeline_first_stage(ignore_virtual=True):
        out["embedding"] = first.embedding.word_embeddings.weight.detach().float().clone()
    if ps.is_pipeline_last_stage(ignore_virtual=True) and not first.pre_process:
        out["output"] = last.output_layer.weight.detach().float().clone()
    return out


def _run_trainings(runs):
    """Run each (argv, options) in turn on this rank; return per run the exit code and tied copies."""
    import pretrain_gpt
    from megalm import parallel_state
    from megalm.config import parse_config
    from megalm.errors import MegalmError, TrainingStopped
    from megalm.training.initialize import world_size_from_env
    from megalm.training.training import Trainer

    results = []
    for argv, options in runs:
        forward_step = pretrain_gpt.forward_step
        if options.get("inf_at_call"):
            forward_step = inf_at(forward_step, options["inf_at_call"])
        try:
            cfg = parse_config(argv, world_size=world_size_from_env())
            trainer = Trainer(cfg, pretrain_gpt.model_provider, forward_step)
            trainer.run()
            results.append({"code": 0, "tied": _tied_copies(trainer) if options.get("tied") else {}})
        except TrainingStopped as e:
            results.append({"code": e.exit_code, "tied": {}})
        except (SystemExit, MegalmError) as e:
            code = e.code if isinstance(e, SystemExit) else f"error: {e}"
            results.append({"code": code if isinstance(code, int) else str(code), "tied": {}})
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pipe"))
    ck, ck_untied = os.path.join(tmp, "ckpt_pp2"), os.path.join(tmp, "ckpt_pp2_untied")
    pp2 = ["--pipeline-model-parallel-size", "2"]
    pp4 = ["--pipeline-model-parallel-size", "4"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    load = ["--load", ck, "--ckpt-step", "3"]
    save_at_3 = ["--save-interval", "3"]
    two = [
        (metrics_argv(PIPE, tmp, "pp2", *pp2, *EVALS, "--save", ck, *save_at_3), {"tied": True}),
        (metrics_argv(PIPE, tmp, "pp2_untied", *pp2, *UNTIED, "--save", ck_untied, *save_at_3), {}),
        (
            metrics_argv(PIPE, tmp, "pp2_vpp2", *pp2, "--num-layers-per-virtual-pipeline-stage", "1", *EVALS),
            {"tied": True},
        ),
        (metrics_argv(PIPE, tmp, "pp2_first1", *pp2, "--decoder-first-pipeline-num-layers", "1"), {}),
        (metrics_argv(PIPE, tmp, "pp2_last1", *pp2, "--decoder-last-pipeline-num-layers", "1", *UNTIED), {}),
        (
            metrics_argv(
                PIPE,
                tmp,
                "pp2_recompute",
                *pp2,
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
                "--variable-seq-lengths",
            ),
            {},
        ),
        (metrics_argv(PIPE, tmp, "pp2_fp16", *pp2, *FP16), {"inf_at_call": 6}),
        (metrics_argv(PIPE, tmp, "pp2_rope_reset", *pp2, *ROPE_RESET), {}),
        (
            metrics_argv(PIPE, tmp, "load_pp2", *pp2, *load),
            {"tied": True},
        ),  # last: test_tied_copies_identical_after_resume
    ]
    res2 = run_distributed(_run_trainings, 2, args=(two,), timeout=300)
    one = [
        (metrics_argv(PIPE, tmp, "ref", *EVALS), {}),
        (metrics_argv(PIPE, tmp, "ref_untied", *UNTIED), {}),
        (metrics_argv(PIPE, tmp, "ref_fp16", *FP16), {"inf_at_call": 6}),
        (metrics_argv(PIPE, tmp, "ref_rope_reset", *ROPE_RESET), {}),
        (metrics_argv(PIPE, tmp, "load_pp1", *load), {}),
    ]
    res1 = run_distributed(_run_trainings, 1, args=(one,), timeout=300)
    four = [
        (metrics_argv(PIPE, tmp, "pp4", *pp4), {"tied": True}),
        (metrics_argv(PIPE, tmp, "pp2_tp2", *pp2, *tp2, *EVALS), {"tied": True}),
        (
            metrics_argv(
                PIPE,
                tmp,
                "pp2_vpp2_dp2",
                *pp2,
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--overlap-grad-reduce",
                "--ddp-bucket-size",
                "3000",
            ),
            {},
        ),
        (metrics_argv(PIPE, tmp, "load_pp4", *pp4, *load), {}),
        (metrics_argv(PIPE, tmp, "load_pp4_untied", *pp4, *UNTIED, "--load", ck_untied, "--ckpt-step", "3"), {}),
    ]
    res4 = run_distributed(_run_trainings, 4, args=(four,), timeout=300)
    eight = [(metrics_argv(PIPE, tmp, "pp2_tp2_dp2", *pp2, *tp2), {"tied": True})]
    res8 = run_distributed(_run_trainings, 8, args=(eight,), timeout=300)
    return {"tmp": tmp, "results": {1: res1, 2: res2, 4: res4, 8: res8}, "ckpt": ck}


def test_all_runs_exit_cleanly(runs):
    for world, per_rank in runs["results"].items():
        for rank_results in per_rank:
            assert [r["code"] for r in rank_results] == [0] * len(rank_results), (world, rank_results)


@pytest.mark.parametrize(
    "name", ["pp2", "pp2_vpp2", "pp2_first1", "pp2_recompute", "pp4", "pp2_tp2", "pp2_vpp2_dp2", "pp2_tp2_dp2"]
)
def test_tied_embedding_runs_equal_single_process(runs, name):
    _assert_close(_losses(runs["tmp"], name), _losses(runs["tmp"], "ref"))


@pytest.mark.parametrize("name", ["pp2_untied", "pp2_last1"])
def test_untied_embedding_runs_equal_single_process(runs, name):
    _assert_close(_losses(runs["tmp"], name), _losses(runs["tmp"], "ref_untied"))


def test_reset_position_ids_with_rope_reach_every_stage(runs):
    """--reset-position-ids --position-embedding-type rope: PP2 equals one process (the last stage rotates
    by the batch's positions, not 0..s-1), losses and grad norms."""
    tmp = runs["tmp"]
    _assert_close(_losses(tmp, "pp2_rope_reset"), _losses(tmp, "ref_rope_reset"))
    pairs = list(zip(_records(tmp, "pp2_rope_reset"), _records(tmp, "ref_rope_reset")))
    assert len(pairs) == 5
    for a, b in pairs:
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_clipping_is_active_and_grad_norm_is_global(runs):
    """The grad norm (reduced over TP x PP) equals the single process's; clipping at 0.5 is active."""
    tmp = runs["tmp"]
    ref = _records(tmp, "ref")
    assert max(r["grad_norm"] for r in ref) > 0.5
    for name in ["pp2", "pp4", "pp2_vpp2", "pp2_tp2", "pp2_tp2_dp2"]:
        for a, b in zip(_records(tmp, name), ref):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), name


@pytest.mark.parametrize(
    "name, ref",
    [
        ("pp2", "ref"),
        ("pp4", "ref"),
        ("pp2_vpp2", "ref"),
        ("pp2_tp2", "ref"),
        ("pp2_tp2_dp2", "ref"),
        ("pp2_vpp2_dp2", "ref"),
        ("pp2_untied", "ref_untied"),
        ("pp2_last1", "ref_untied"),
    ],
)
def test_params_norm_counts_each_parameter_once(runs, name, ref):
    """--log-params-norm: the tied embedding's last-stage copy and TP-replicated parameters once."""
    tmp = runs["tmp"]
    _assert_close([r["params_norm"] for r in _records(tmp, name)], [r["params_norm"] for r in _records(tmp, ref)])


def test_evaluation_equals_single_process(runs):
    tmp = runs["tmp"]
    ref = [r["loss"] for r in _records(tmp, "ref", "validation")]
    assert len(ref) == 2  # at iteration 3 and after training
    for name in ["pp2", "pp2_vpp2", "pp2_tp2"]:
        got = [r["loss"] for r in _records(tmp, name, "validation")]
        _assert_close(got, ref)


def test_tied_copies_identical_after_training(runs):
    for world, index in [(2, 0), (2, 2), (4, 0), (4, 1), (8, 0)]:
        per_rank = [rank_results[index]["tied"] for rank_results in runs["results"][world]]
        embeddings = [t["embedding"] for t in per_rank if "embedding" in t]
        outputs = [t["output"] for t in per_rank if "output" in t]
        assert len(embeddings) >= 1 and len(outputs) >= 1, (world, index)
        for e in embeddings:
            for o in outputs:
                assert torch.equal(e, o), (world, index)


def test_fp16_loss_scaling_skip_matches_single_process(runs):
    tmp = runs["tmp"]
    pp, ref = _records(tmp, "pp2_fp16"), _records(tmp, "ref_fp16")
    assert [r["loss_scale"] for r in pp] == [r["loss_scale"] for r in ref]
    assert [r["skipped_iterations"] for r in pp] == [r["skipped_iterations"] for r in ref]
    assert sum(r["skipped_iterations"] for r in pp) == 1
    _assert_close(
        [r["lm_loss"] for r in pp if r["lm_loss"] is not None],
        [r["lm_loss"] for r in ref if r["lm_loss"] is not None],
        rel=1e-3,
    )


@pytest.mark.parametrize(
    "name,ref", [("load_pp1", "ref"), ("load_pp2", "ref"), ("load_pp4", "ref"), ("load_pp4_untied", "ref_untied")]
)
def test_pp2_checkpoint_continues_under_other_pipeline_sizes(runs, name, ref):
    tmp = runs["tmp"]
    assert open(os.path.join(runs["ckpt"], "latest_checkpointed_iteration.txt")).read().strip() == "6"
    loaded = _records(tmp, name)
    reference = _records(tmp, ref)
    assert [r["iteration"] for r in loaded] == [4, 5, 6]
    _assert_close([r["lm_loss"] for r in loaded], [r["lm_loss"] for r in reference[3:]])


def test_tied_copies_identical_after_resume(runs):
    per_rank = [rank_results[-1]["tied"] for rank_results in runs["results"][2]]
    assert torch.equal(per_rank[0]["embedding"], per_rank[1]["output"])
