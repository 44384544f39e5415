"""--data-parallel-sharding-strategy optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3) end to end
through pretrain_gpt.py on real ranks.

* fp32 loss sequences (and grad norms, parameter norms) over 6 iterations equal plain data
  parallelism's (``no_shard``) within 1e-5 relative, for both strategies at DP 2, DP 4 (several
  buckets reduced during the backward) and TP 2 x DP 2 (sequence parallel: the norm gradients'
  shards are summed over TP), for ZeRO-3 with an untied output layer (its weight is read by the
  fused linear cross entropy in the model's forward) and for ZeRO-2 with
  --calculate-per-token-loss (the shards are scaled by the token count); ZeRO-2 in bf16 follows
  plain DP's trajectory within 5e-4;
* ZeRO-3 prefetch (--overlap-param-gather) is bit-identical to ZeRO-3 without it (DP 2, several
  buckets, untied output layer) and within 1e-5 of plain DP (there and at DP 4, and after loading a
  ZeRO-2 checkpoint at DP 4); ZeRO-3 with full recompute
  (--recompute-granularity full, replayed forwards gather in backward) and prefetch equals plain DP
  within 1e-5; ZeRO-3 in bf16 with selective recompute (--recompute-activations) and prefetch is
  bit-identical to ZeRO-2 in bf16 (same gathered bf16 weights, same reduction), two microbatches
  per step in every run;
* ZeRO-3 evaluation (forward under no_grad, gathered by the same hooks) equals plain DP's within 1e-5;
* resume within the strategy is exact: saved at iteration 5 of 10 and resumed (ZeRO-2 with
  --optimizer-cpu-offload at fraction 0.5, which the save did not use; ZeRO-3), iterations 6-10
  equal the uninterrupted ZeRO-2 run's bit for bit;
* --optimizer-cpu-offload (ZeRO-2, fraction 0.5) gives the same losses and parameter norms bit for
  bit (every strategy and precision: tests/test_optimizer_offload.py), with and without
  --overlap-cpu-optimizer-d2h-h2d, and so does --optimizer-offload-device nvme (state in swap files, the
  log's swap bytes per iteration constant, read = written; a resume with it from a ZeRO-2 checkpoint is
  exact; its own checkpoint, streamed from the swap files, is the in-memory run's byte for byte (metadata
  and data files), resumes without offload exactly and loads at DP 4 into ZeRO-3 with NVMe offload (resharded
  straight into the swap files) within 1e-5; the swap files are gone after the runs);
* --cpu-offloading (activations of the first layer to the host and back) gives the same losses, grad
  norms, parameter norms and validation losses bit for bit at DP 2 and at TP 2 x DP 2 (sequence
  parallel, ZeRO-2, overlapped reduction) (the layer-level checks: tests/test_activation_offload.py);
* --init-model-with-meta-device (the model built on the meta device, parameters filled bucket by bucket by
  DDP's buffers) changes nothing: it is given to five of the runs above, each compared with a run without it
  (ZeRO-3 with prefetch and an untied output layer, ZeRO-3 in bf16, ZeRO-2 with CPU offload, plain DP with
  activation offloading: bit for bit; ZeRO-3 at TP 2 x DP 2: within 1e-5 of plain DP);
* checkpoints load across strategies and DP sizes (saved at DP 2, loaded at DP 4): no_shard ->
  optim_grads, optim_grads -> optim_grads_params, optim_grads_params -> no_shard, each continuing the
  uninterrupted run within 1e-5 (optim's checkpoints are optim_grads': the same optimizer);
* --ckpt-format fsdp_dtensor (Megatron-FSDP's layout): ZeRO-3 saved at iteration 5 and resumed with it continues
  the uninterrupted run bit for bit, in fp32 and in bf16 (the weights on disk are the fp32 main copy); loaded at
  DP 4 (plain DP, --auto-detect-ckpt-format) it gives the losses of the same state's torch_dist checkpoint loaded
  there, bit for bit;
* HSDP (--num-distributed-optimizer-instances 2 at DP 4: ZeRO-2, and ZeRO-3 with prefetch, inside each instance of
  2 ranks) equals plain DP within 1e-5, and a DP 2 ZeRO-2 checkpoint resumed into it continues the uninterrupted run.

Groups are spawned in the order 2, 4 ranks (the DP 4 runs read the DP 2 checkpoints).
"""

import os

import pytest

from tests.distributed_harness import run_distributed
from tests.test_distrib_optimizer_training import BF16, INSTANCES2, OVERLAP, SIX, TEN, TINY, TP2
from tests.training_runs import assert_close, losses, records, run_trainings

ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
BUCKETS = ["--overlap-grad-reduce", "--ddp-bucket-size", "5000"]
PREFETCH = ["--overlap-param-gather"]  # ZeRO-3: the next bucket's all-gather in flight
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
UNTIE = "--untie-embeddings-and-output-weights"
EVAL = ["--eval-iters", "2", "--eval-interval", "3"]  # later flags win over TINY's --eval-iters 0
OFFLOAD = ["--optimizer-cpu-offload"]
OFFLOAD_HALF = [*OFFLOAD, "--optimizer-offload-fraction", "0.5"]
OFFLOAD_OVERLAP = [*OFFLOAD_HALF, "--overlap-cpu-optimizer-d2h-h2d"]
ACT_OFFLOAD = ["--cpu-offloading", "--cpu-offloading-num-layers", "1"]
FSDP_DTENSOR = ["--ckpt-format", "fsdp_dtensor"]
META = "--init-model-with-meta-device"  # built on meta, filled by DDP's buffers: the same values


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero2"))

    def run(name, *extra):
        return TINY + ["--metrics-file", os.path.join(tmp, f"{name}.jsonl")] + list(extra)

    ck = {k: os.path.join(tmp, f"ckpt_{k}") for k in ("z2", "p2", "z3", "fd", "bf_fd", "z2n")}
    save_half = ["--exit-interval", "5", "--save-interval", "100"]
    load_z2 = ["--load", ck["z2"], "--ckpt-step", "5"]
    os.makedirs(os.path.join(tmp, "swap"))
    nvme = ["--optimizer-offload-device", "nvme", "--offload-path", os.path.join(tmp, "swap")]
    two = [
        run("p2", *SIX, *EVAL),
        run("z2", *SIX, *ZERO2),
        # The uninterrupted ZeRO-2 run saves at iteration 5 (and 10); resumes load its iteration 5.
        run("straight_z2", *TEN, *ZERO2, *OVERLAP, "--save-interval", "5", "--save", ck["z2"]),
        run("resume_z2_off", *TEN, *ZERO2, *OVERLAP, *OFFLOAD_HALF, *load_z2),
        run("z2_off", *SIX, *ZERO2, *OFFLOAD_HALF),
        run("z2_off_overlap", *SIX, *ZERO2, *OFFLOAD_OVERLAP, META),
        run("z2_nvme", *SIX, *ZERO2, *nvme, "--optimizer-offload-fraction", "0.5"),
        run("resume_z2_nvme", *TEN, *ZERO2, *OVERLAP, *nvme, *load_z2),
        # saved with NVMe offload (streamed from the swap files) at iteration 5, resumed without it
        run("save_z2_nvme", *TEN, *ZERO2, *OVERLAP, *nvme, *save_half, "--save", ck["z2n"]),
        run("resume_z2n", *TEN, *ZERO2, *OVERLAP, "--load", ck["z2n"]),
        run("p2_act_off", *SIX, *EVAL, *ACT_OFFLOAD, META),
        run("bf_p2", *SIX, *BF16),
        run("bf_z2", *SIX, *BF16, *ZERO2, *OVERLAP),
        run("pt_p2", *SIX, "--calculate-per-token-loss"),
        run("pt_z2", *SIX, "--calculate-per-token-loss", *ZERO2),
        run("save_p2", *TEN, *save_half, "--save", ck["p2"]),
        run("z3", *SIX, *ZERO3, *EVAL),
        run("save_z3", *TEN, *ZERO3, *BUCKETS, *save_half, "--save", ck["z3"]),
        run("resume_z3", *TEN, *ZERO3, *BUCKETS, "--load", ck["z3"]),
        # save_z3 again, in Megatron-FSDP's layout, and resumed from it
        run("save_fd", *TEN, *ZERO3, *BUCKETS, *save_half, "--save", ck["fd"], *FSDP_DTENSOR),
        run("resume_fd", *TEN, *ZERO3, *BUCKETS, "--load", ck["fd"], *FSDP_DTENSOR),
        # bf16: the weights on disk are the fp32 main copy, whose ranges some ranks do not hold
        run("bf_straight_z3", *TEN, *BF16, *ZERO3, *BUCKETS),
        run("bf_save_fd", *TEN, *BF16, *ZERO3, *BUCKETS, *save_half, "--save", ck["bf_fd"], *FSDP_DTENSOR),
        run("bf_resume_fd", *TEN, *BF16, *ZERO3, *BUCKETS, "--load", ck["bf_fd"], *FSDP_DTENSOR),
        # untied: the fused linear cross entropy reads the output weight outside the output layer's forward
        run("p2_untied", *SIX, UNTIE),
        run("z3_untied", *SIX, *ZERO3, *BUCKETS, UNTIE),
        run("z3_prefetch_untied", *SIX, *ZERO3, *BUCKETS, *PREFETCH, UNTIE, META),
        run("z3_recompute", *SIX, *ZERO3, *BUCKETS, *PREFETCH, *FULL_RECOMPUTE),
        run("bf_z3_selective", *SIX, *BF16, *ZERO3, *BUCKETS, *PREFETCH, "--recompute-activations", META),
    ]
    codes2 = run_distributed(run_trainings, 2, args=(two,), timeout=300)
    four = [
        run("p4", *SIX),
        run("z4_ov", *SIX, *ZERO2, *OVERLAP),
        run("tp_p", *SIX, *TP2),
        run("tp_z_act_off", *SIX, *TP2, *ZERO2, *OVERLAP, *ACT_OFFLOAD),
        run("tp_z", *SIX, *TP2, *ZERO2, *OVERLAP),
        run("p2_at_d4_optim_grads", *TEN, *ZERO2, "--load", ck["p2"]),
        run("z4_3", *SIX, *ZERO3, *BUCKETS, *PREFETCH),
        run("tp_z3", *SIX, *TP2, *ZERO3, *BUCKETS, META),
        run("z2_at_d4_optim_grads_params", *TEN, *ZERO3, *BUCKETS, *PREFETCH, *load_z2),
        run("z3_at_d4_no_shard", *TEN, "--load", ck["z3"]),
        run("fd_at_d4_no_shard", *TEN, "--load", ck["fd"], "--auto-detect-ckpt-format"),  # saved as fsdp_dtensor
        run("z2n_at_d4_nvme", *TEN, *ZERO3, *BUCKETS, *nvme, "--load", ck["z2n"]),  # resharded into the files
        # HSDP: --num-distributed-optimizer-instances 2, each ZeRO-2/3 instance of 2 ranks
        run("z4_n2", *SIX, *ZERO2, *OVERLAP, *INSTANCES2),
        run("z4_3_n2", *SIX, *ZERO3, *BUCKETS, *PREFETCH, *INSTANCES2),
        run("z2_at_d4_hsdp", *TEN, *ZERO3, *BUCKETS, *INSTANCES2, *load_z2),
    ]
    codes4 = run_distributed(run_trainings, 4, args=(four,), timeout=400)
    return {"tmp": tmp, "codes": (codes2, codes4)}


def test_all_runs_exit_cleanly(runs):
    codes2, codes4 = runs["codes"]
    assert codes2 == [[0] * 29] * 2, codes2
    assert os.listdir(os.path.join(runs["tmp"], "swap")) == []  # the NVMe runs removed their swap files
    assert codes4 == [[0] * 15] * 4, codes4


@pytest.mark.parametrize(
    "plain, sharded",
    [
        ("p2", "z2"),
        ("p4", "z4_ov"),
        ("tp_p", "tp_z"),
        ("pt_p2", "pt_z2"),
        ("p2", "z3"),
        ("p4", "z4_3"),
        ("tp_p", "tp_z3"),
        ("p2_untied", "z3_untied"),
        ("p2_untied", "z3_prefetch_untied"),
        ("p2", "z3_recompute"),
        ("p4", "z4_n2"),
        ("p4", "z4_3_n2"),
    ],
)
def test_losses_and_grad_norms_equal_plain_dp(runs, plain, sharded):
    ref, got = records(runs["tmp"], plain), records(runs["tmp"], sharded)
    assert len(got) == 6
    assert_close([r["lm_loss"] for r in got], [r["lm_loss"] for r in ref], rel=1e-5)
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rel=1e-5)
    assert_close([r["params_norm"] for r in got], [r["params_norm"] for r in ref], rel=1e-5)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] - 0.1  # it trains


def test_zero3_evaluation_equals_plain_dp(runs):
    ref, got = records(runs["tmp"], "p2", "validation"), records(runs["tmp"], "z3", "validation")
    assert [r["iteration"] for r in got] == [3, 6] and len(ref) == 2
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref], rel=1e-5)


def test_bf16_same_trajectory(runs):
    plain, sharded = losses(runs["tmp"], "bf_p2"), losses(runs["tmp"], "bf_z2")
    assert_close(sharded, plain, rel=5e-4)  # bf16 rounding of the weights, as the distributed optimizer
    assert sharded[-1] < sharded[0] - 0.1


@pytest.mark.parametrize("plain, other", [("z3_untied", "z3_prefetch_untied"), ("bf_z2", "bf_z3_selective")])
def test_zero3_prefetch_and_bf16_bit_identical(runs, plain, other):
    ref, got = records(runs["tmp"], plain), records(runs["tmp"], other)
    for key in ("lm_loss", "grad_norm", "params_norm"):
        assert [r[key] for r in got] == [r[key] for r in ref], key


@pytest.mark.parametrize("resumed", ["resume_z2_off", "resume_z3", "resume_z2_nvme", "resume_fd", "resume_z2n"])
def test_resume_within_strategy_is_exact(runs, resumed):
    # ZeRO-3 computes ZeRO-2's numbers bit for bit (the same gathered weights, the same reduction)
    straight = losses(runs["tmp"], "straight_z2")
    assert [r["iteration"] for r in records(runs["tmp"], resumed)] == list(range(6, 11))
    assert losses(runs["tmp"], resumed) == straight[5:]


@pytest.mark.parametrize("offloaded", ["z2_off", "z2_off_overlap", "z2_nvme"])
def test_optimizer_cpu_offload_changes_nothing(runs, offloaded):
    ref, got = records(runs["tmp"], "z2"), records(runs["tmp"], offloaded)
    assert [r["lm_loss"] for r in got] == [r["lm_loss"] for r in ref]
    assert [r["params_norm"] for r in got] == [r["params_norm"] for r in ref]
    if offloaded == "z2_nvme":  # the log's swap bytes: 12 B per offloaded element each way, every iteration
        read = {r["swap_read_bytes"] for r in got}
        assert len(read) == 1 and read == {r["swap_written_bytes"] for r in got}
        assert read.pop() % 12 == 0 and "swap_read_bytes" not in ref[0]


@pytest.mark.parametrize("plain, offloaded", [("p2", "p2_act_off"), ("tp_z", "tp_z_act_off")])
def test_activation_offloading_changes_nothing(runs, plain, offloaded):
    ref, got = records(runs["tmp"], plain), records(runs["tmp"], offloaded)
    assert len(got) == 6
    for key in ("lm_loss", "grad_norm", "params_norm"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    if plain == "p2":
        validation = [r["loss"] for r in records(runs["tmp"], offloaded, "validation")]
        assert validation == [r["loss"] for r in records(runs["tmp"], plain, "validation")] and len(validation) == 2


def test_bf16_fsdp_dtensor_resume_is_exact(runs):
    straight = losses(runs["tmp"], "bf_straight_z3")
    assert [r["iteration"] for r in records(runs["tmp"], "bf_resume_fd")] == list(range(6, 11))
    assert losses(runs["tmp"], "bf_resume_fd") == straight[5:] and losses(runs["tmp"], "bf_save_fd") == straight[:5]


def test_fsdp_dtensor_checkpoint_loads_at_another_dp_size_as_torch_dist_s(runs):
    """Saved at DP 2 in Megatron-FSDP's layout, loaded at DP 4 with --auto-detect-ckpt-format (the default
    --ckpt-format is torch_dist): the same run as from the torch_dist checkpoint of the same state, bit for bit."""
    assert [r["iteration"] for r in records(runs["tmp"], "fd_at_d4_no_shard")] == list(range(6, 11))
    assert losses(runs["tmp"], "fd_at_d4_no_shard") == losses(runs["tmp"], "z3_at_d4_no_shard")
    assert losses(runs["tmp"], "save_fd") == losses(runs["tmp"], "save_z3")


@pytest.mark.parametrize(
    "resumed",
    ["p2_at_d4_optim_grads", "z2_at_d4_optim_grads_params", "z3_at_d4_no_shard", "z2n_at_d4_nvme", "z2_at_d4_hsdp"],
)
def test_checkpoints_load_across_strategies(runs, resumed):
    straight = losses(runs["tmp"], "straight_z2")
    assert [r["iteration"] for r in records(runs["tmp"], resumed)] == list(range(6, 11))
    assert_close(losses(runs["tmp"], resumed), straight[5:], rel=1e-5)


def test_nvme_checkpoint_is_the_in_memory_ones(runs):
    """Saved at iteration 5 with NVMe offload (the moments read from the swap files as DCP writes them) and
    without (straight_z2): the same metadata and the same bytes in every rank's data file."""
    from megalm.checkpoint.safe_metadata import load_metadata

    paths = [os.path.join(runs["tmp"], f"ckpt_{k}", "iter_0000005") for k in ("z2n", "z2")]
    nvme, plain = (load_metadata(p) for p in paths)
    assert nvme.state_dict_metadata == plain.state_dict_metadata and nvme.storage_data == plain.storage_data
    files = sorted(f for f in os.listdir(paths[1]) if f.endswith(".distcp"))
    assert len(files) == 2 and files == sorted(f for f in os.listdir(paths[0]) if f.endswith(".distcp"))
    for f in files:
        with open(os.path.join(paths[0], f), "rb") as a, open(os.path.join(paths[1], f), "rb") as b:
            assert a.read() == b.read(), f
