"""Multi-latent attention (with YaRN, latent norms and a DeepSeek-style MoE) trained through
pretrain_gpt.py on real spawned ranks equals the single-process run (fp32, losses and grad norms
within 1e-5 relative over 3 steps), on one group of 4 ranks:

* TP 2 with sequence parallelism x DP 2 (replicated down projections, gathered latents and RoPE key),
  with one multi-token prediction depth (its logged ``mtp_1 loss`` too);
* TP 2 (SP) x CP 2 (p2p ring: v zero-padded to the q/k head dim), with one MTP depth (its shift of the
  tokens taken over the whole sequence across the CP chunks, its loss the micro-batch's);
* PP 2 x EP 2 (alltoall dispatcher) x DP 2 (one MLA layer per stage), with MTP on the last stage (its
  copy of the untied word embedding summed with the first stage's);
* DP 4 with the blocked CPU attention core and selective recompute.
"""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.training_runs import MLA_MOE_FLAGS, assert_close, records, run_trainings, tiny_flags

MLA = tiny_flags(
    **MLA_MOE_FLAGS,
    v_head_dim="6",
    rotary_scaling_factor="4",
    original_max_position_embeddings="8",
    mscale_all_dim="1.0",
    num_experts="4",
)
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MTP = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.5"]
LAYOUTS = {  # name: (flags, single-process reference)
    "tp2_sp_mtp": ([*TP2, *MTP], "one_mtp"),
    "tp2_cp2_mtp": ([*TP2, "--context-parallel-size", "2", *MTP], "one_mtp"),
    "pp2_ep2_mtp": (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", *MTP], "one_mtp"),
    "dp4_blocked": (["--attention-backend", "blocked", "--recompute-granularity", "selective"], "one"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mla"))

    def run(name, *extra):
        return MLA + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")] + list(extra)

    codes = (
        run_distributed(run_trainings, 4, args=([run(n, *a) for n, (a, _) in LAYOUTS.items()],), timeout=400),
        run_distributed(run_trainings, 1, args=([run("one"), run("one_mtp", *MTP)],), timeout=200),
    )
    return {"tmp": tmp, "codes": codes}


def test_all_runs_exit_cleanly(runs):
    assert runs["codes"] == ([[0] * len(LAYOUTS)] * 4, [[0, 0]]), runs["codes"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_equal_one_process(runs, name):
    ref, got = records(runs["tmp"], LAYOUTS[name][1]), records(runs["tmp"], name)
    assert len(got) == len(ref) == 3
    keys = ("lm_loss", "grad_norm") + (("mtp_1_loss",) if name.endswith("mtp") else ())
    for key in keys:
        assert_close([r[key] for r in got], [r[key] for r in ref], rel=1e-5)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]  # it trains


def test_mtp_changes_the_training(runs):
    plain, mtp = records(runs["tmp"], "one"), records(runs["tmp"], "one_mtp")
    assert plain[0]["lm_loss"] == mtp[0]["lm_loss"] and "mtp_1_loss" not in plain[0]
    assert abs(plain[0]["grad_norm"] - mtp[0]["grad_norm"]) > 1e-4 * plain[0]["grad_norm"]
