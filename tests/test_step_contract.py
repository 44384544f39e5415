"""The training-step contract on real ranks (gloo): ``--calculate-per-token-loss`` and
``--log-num-zeros-in-grad`` through the whole trainer, against values computed here in one process.

Data: 8 samples of 16 tokens with loss masks of very different lengths, so that the per-token
mean (sum over every unmasked token / their number) differs from the mean of per-microbatch means.
Two data-parallel ranks take 2 microbatches of 2 samples each; SGD with lr 1, no momentum, decay
or clipping, so one step's weight change is minus the gradient.
"""

import os

import pytest
import torch

from tests.distributed_harness import run_distributed
from tests.training_runs import tiny_flags

SEQ, MBS, GBS, VOCAB, USED_TOKENS = 16, 2, 8, 128, 40
MASK_LENGTHS = [16, 1, 3, 16, 2, 9, 16, 5]  # per sample: the first k tokens count
# The tiny GPT at hidden 32, one step of plain SGD (lr 1) on 8 samples, its fusions off.
SGD = dict(optimizer="sgd", sgd_momentum=0, weight_decay=0, clip_grad=0, lr="1.0", lr_decay_style="constant")
FUSIONS_OFF = dict(
    no_bias_gelu_fusion=True, no_bias_dropout_fusion=True, no_masked_softmax_fusion=True, no_norm_fusion=True
)
ARGS = tiny_flags(
    hidden_size=32,
    seq_length=SEQ,
    vocab_size=VOCAB,
    seed=5,
    train_iters=1,
    micro_batch_size=MBS,
    global_batch_size=GBS,
    untie_embeddings_and_output_weights=True,
    log_num_zeros_in_grad=True,
    calculate_per_token_loss=True,
    **SGD,
    **FUSIONS_OFF,
)


def _samples():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, USED_TOKENS, (GBS, SEQ), generator=g)
    labels = torch.randint(0, USED_TOKENS, (GBS, SEQ), generator=g)
    mask = torch.zeros(GBS, SEQ)
    for i, k in enumerate(MASK_LENGTHS):
        mask[i, :k] = 1.0
    positions = torch.arange(SEQ).unsqueeze(0).expand(GBS, -1)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}


def _microbatches(dp_rank, dp_size):
    """This data-parallel rank's microbatches: its contiguous share of the global batch, in order."""
    data, per_rank = _samples(), GBS // dp_size
    for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, MBS):
        yield {k: v[start : start + MBS] for k, v in data.items()}


def _arrays(tensors):
    """Plain numpy copies (tensors would travel back from a finished rank through shared memory)."""
    return {n: t.detach().cpu().numpy().copy() for n, t in tensors}


def _trainer(argv):
    import pretrain_gpt
    from megalm.config import parse_config
    from megalm.training.initialize import world_size_from_env
    from megalm.training.training import Trainer

    trainer = Trainer(
        parse_config(argv, world_size=world_size_from_env()), pretrain_gpt.model_provider, pretrain_gpt.forward_step
    )
    trainer.setup()
    return trainer


def _train_one_step(metrics_file, extra=()):
    """On each rank: one trainer iteration over this rank's microbatches; the weights before and after."""
    from megalm import parallel_state
    from megalm.distributed.finalize_model_grads import unwrap_model

    trainer = _trainer(ARGS + ["--metrics-file", metrics_file, *extra])
    try:
        module = unwrap_model(trainer.model[0])
        trainer.train_iter = _microbatches(
            parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        )
        before = _arrays(module.named_parameters())
        trainer.train()
        trainer.metrics.close()
        after = _arrays(module.named_parameters())
        return {
            "before": before,
            "after": after,
            "iteration": trainer.state.iteration,
            "consumed": trainer.state.consumed_train_samples,
        }
    finally:
        parallel_state.destroy_model_parallel()


def _reference():
    """One process, the same initial weights: the per-token mean over all 8 samples and its
    gradient, and the mean of the 4 microbatch means and its gradient."""
    from megalm import parallel_state
    from megalm.distributed.finalize_model_grads import unwrap_model

    trainer = _trainer(ARGS)
    try:
        module = unwrap_model(trainer.model[0])
        names, params = zip(*module.named_parameters())
        data, mask = _samples(), _samples()["loss_mask"]

        def token_losses():  # a fresh graph per backward (the fused output layer allows one)
            return module(data["tokens"], data["position_ids"], labels=data["labels"], loss_mask=mask).float()

        per_token = (token_losses() * mask).sum() / mask.sum()
        grads = torch.autograd.grad(per_token, params)
        losses = token_losses()
        micro = [(losses[i : i + MBS] * mask[i : i + MBS]).sum() / mask[i : i + MBS].sum() for i in range(0, GBS, MBS)]
        mean_of_means = torch.stack(micro).mean()
        grads_mm = torch.autograd.grad(mean_of_means, params)
        return {
            "loss": per_token.item(),
            "loss_mm": mean_of_means.item(),
            "before": _arrays(zip(names, params)),
            "grads": _arrays(zip(names, grads)),
            "grads_mm": _arrays(zip(names, grads_mm)),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("step"))
    metrics = os.path.join(tmp, "dp2.jsonl")
    dp2 = run_distributed(_train_one_step, 2, args=(metrics,), timeout=300)
    # Pipeline parallel: the token count lives on the last stage and is broadcast to the first.
    pp2 = run_distributed(
        _train_one_step, 2, args=(os.path.join(tmp, "pp2.jsonl"), ["--pipeline-model-parallel-size", "2"]), timeout=300
    )
    (ref,) = run_distributed(_reference, 1, timeout=300)
    from tests.training_runs import records

    tensors = lambda d: {n: torch.from_numpy(a) for n, a in d.items()}  # noqa: E731
    dp2 = [{k: tensors(v) if isinstance(v, dict) else v for k, v in r.items()} for r in dp2]
    pp2 = [{k: tensors(v) if isinstance(v, dict) else v for k, v in r.items()} for r in pp2]
    ref = {k: tensors(v) if isinstance(v, dict) else v for k, v in ref.items()}
    return {"dp2": dp2, "pp2": pp2, "ref": ref, "records": records(tmp, "dp2"), "pp2_records": records(tmp, "pp2")}


def test_the_data_tells_per_token_from_mean_of_means(runs):
    ref = runs["ref"]
    assert abs(ref["loss"] - ref["loss_mm"]) > 1e-3 * abs(ref["loss"])
    diff = max((ref["grads"][n] - ref["grads_mm"][n]).abs().max().item() for n in ref["grads"])
    assert diff > 1e-4


def test_per_token_loss_equals_single_process_per_token_mean(runs):
    (record,) = runs["records"]
    assert record["iteration"] == 1 and record["consumed_samples"] == GBS
    assert record["lm_loss"] == pytest.approx(runs["ref"]["loss"], rel=1e-5)


def test_per_token_gradients_equal_single_process(runs):
    ref = runs["ref"]
    for rank in runs["dp2"]:
        assert rank["iteration"] == 1 and rank["consumed"] == GBS  # train_step advanced the counters
        assert sorted(rank["before"]) == sorted(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rank["before"][name], ref["before"][name], rtol=0, atol=0)
            step = rank["before"][name] - rank["after"][name]  # lr 1: minus the gradient
            torch.testing.assert_close(step, g, rtol=1e-4, atol=2e-6, msg=name)


def test_per_token_loss_and_gradients_under_pipeline_parallelism(runs):
    ref = runs["ref"]
    (record,) = runs["pp2_records"]
    assert record["lm_loss"] == pytest.approx(ref["loss"], rel=1e-5)
    seen = set()
    for stage in runs["pp2"]:  # each stage holds its own layers (global names)
        for name in stage["before"]:
            step = stage["before"][name] - stage["after"][name]
            torch.testing.assert_close(step, ref["grads"][name], rtol=1e-4, atol=2e-6, msg=name)
            seen.add(name)
    assert seen == set(ref["grads"])


def test_num_zeros_logged_equals_zero_gradient_entries(runs):
    (record,) = runs["records"]
    expected = sum(int((g == 0).sum()) for g in runs["ref"]["grads"].values())
    # Embedding rows of the tokens never used have no gradient at all.
    assert expected >= (VOCAB - USED_TOKENS) * 32
    assert record["num_zeros"] == expected
