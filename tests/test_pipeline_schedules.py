"""Pipeline schedules on real gloo ranks with a tiny stand-in model (a chain of linear layers).

Checks, against hand-written expectations derived from Megatron's definitions of 1F1B and
interleaved 1F1B: the order of forward/backward steps per stage, the peak number of live
microbatch activations, that sent outputs are freed, when data-parallel grad sync is enabled,
and that losses and every layer's gradient equal a single-process run.
"""

import contextlib

import pytest
import torch
from torch import nn

from tests.distributed_harness import run_distributed

H, S, B = 6, 4, 2  # hidden, sequence, micro batch
NUM_LAYERS = 8
MICROBATCHES_SEED = 3


def _data(num_microbatches, variable=False):
    """Microbatches ``{"x", "y"}`` of shape [s, b, h]; s = S + i for microbatch i when ``variable``."""
    g = torch.Generator().manual_seed(MICROBATCHES_SEED)
    out = []
    for i in range(num_microbatches):
        s = S + i if variable else S
        out.append({"x": torch.randn(s, B, H, generator=g), "y": torch.randn(s, B, H, generator=g)})
    return out


def _layer(index):
    g = torch.Generator().manual_seed(100 + index)
    layer = nn.Linear(H, H)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(H, H, generator=g) / H**0.5)
        layer.bias.copy_(torch.randn(H, generator=g) * 0.1)
    return layer


class Stage(nn.Module):
    """Layers ``layer_numbers`` of the chain; loss (mean squared error) on the last stage.

    ``no_sync()`` and a gradient hook record whether grad sync was enabled at each backward.
    """

    def __init__(self, layer_numbers, pre_process, post_process):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _layer(i) for i in layer_numbers})
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None
        self.sync_enabled = True
        self.sync_log = []
        first = next(iter(self.layers.values()))
        first.weight.register_hook(self._record_sync)

    def _record_sync(self, grad):
        self.sync_log.append(self.sync_enabled)
        return grad

    @contextlib.contextmanager
    def no_sync(self):
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, batch):
        h = batch["x"] if self.pre_process else self.input_tensor
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        if not self.post_process:
            return h
        return ((h - batch["y"]) ** 2).mean()


def _forward_step(data_iterator, model):
    from megalm import parallel_state as ps

    reads = ps.is_pipeline_first_stage(ignore_virtual=True) or ps.is_pipeline_last_stage(ignore_virtual=True)
    batch = next(data_iterator) if reads else None
    out = model(batch)
    return out, lambda loss: (loss, {"loss": loss.detach()})


def _single_process(num_microbatches, variable=False):
    """Reference: mean loss per microbatch and every layer's gradient."""
    model = Stage(range(NUM_LAYERS), True, True)
    losses = []
    for batch in _data(num_microbatches, variable):
        loss = model(batch)
        (loss / num_microbatches).backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _run_case(pp, vpp, m, forward_only=False, variable=False):
    """Run one schedule on this rank; return trace, losses, grads and sync logs."""
    from megalm import parallel_state as ps
    from megalm.pipeline_parallel.p2p_communication import P2PCommunicator
    from megalm.pipeline_parallel.schedules import get_forward_backward_func
    from megalm.pipeline_parallel.steps import ScheduleTrace

    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    try:
        rank, v = ps.get_pipeline_model_parallel_rank(), vpp or 1
        per_chunk = NUM_LAYERS // (pp * v)
        chunks = []
        for c in range(v):
            stage = c * pp + rank
            chunks.append(Stage(range(stage * per_chunk, (stage + 1) * per_chunk), stage == 0, stage == pp * v - 1))
        trace = ScheduleTrace()
        groups = ps.get_process_groups()
        comm = P2PCommunicator((S, B, H), torch.float32, variable_seq_lengths=variable, groups=groups)
        schedule = get_forward_backward_func(groups, vpp)
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with ctx:
            reported = schedule(
                forward_step_func=_forward_step,
                data_iterator=iter(_data(m, variable)),
                model=chunks,
                num_microbatches=m,
                forward_only=forward_only,
                communicator=comm,
                groups=groups,
                trace=trace,
            )
        grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None}
        return {
            "events": trace.events,
            "peak_live": trace.peak_live,
            "live_end": trace.live,
            "peak_held": trace.peak_held_output_numel,
            "losses": [float(r["loss"]) for r in reported],
            "grads": grads,
            "sync": [c.sync_log for c in chunks],
            "schedule": schedule.__name__,
        }
    finally:
        ps.destroy_model_parallel()


def _run_cases(cases):
    return [_run_case(*case) for case in cases]


CASES_2 = [
    (2, None, 4),
    (2, 2, 4),
    (2, 2, 2),
    (2, None, 4, True),
    (2, 2, 4, True),
    (2, None, 3, False, True),
    (2, 2, 6),
]
CASES_4 = [(4, None, 8), (4, 2, 8), (4, None, 2)]


@pytest.fixture(scope="module")
def results():
    two = run_distributed(_run_cases, 2, args=(CASES_2,), timeout=120)
    four = run_distributed(_run_cases, 4, args=(CASES_4,), timeout=120)
    out = {}
    for cases, per_rank in ((CASES_2, two), (CASES_4, four)):
        for i, case in enumerate(cases):
            out[case] = [r[i] for r in per_rank]
    return out


def F(mb, c=0):
    return ("F", mb, c)


def Bw(mb, c=0):
    return ("B", mb, c)


def test_1f1b_order_pp2_m4(results):
    r0, r1 = results[(2, None, 4)]
    assert r0["schedule"] == "forward_backward_pipelining_without_interleaving"
    # Stage 0: warm-up of p - r - 1 = 1 forward, steady 1F1B, cool-down of one backward.
    assert r0["events"] == [F(0), F(1), Bw(0), F(2), Bw(1), F(3), Bw(2), Bw(3)]
    # Last stage: no warm-up.
    assert r1["events"] == [F(0), Bw(0), F(1), Bw(1), F(2), Bw(2), F(3), Bw(3)]
    assert [r0["peak_live"], r1["peak_live"]] == [2, 1]
    assert r0["live_end"] == r1["live_end"] == 0


def test_interleaved_order_pp2_v2_m4(results):
    r0, r1 = results[(2, 2, 4)]
    assert r0["schedule"] == "forward_backward_pipelining_with_interleaving"
    # Rank 0: warm-up (p - r - 1) * 2 + (v - 1) * p = 4 forwards.
    assert r0["events"] == [
        F(0, 0),
        F(1, 0),
        F(0, 1),
        F(1, 1),
        F(2, 0),
        Bw(0, 1),
        F(3, 0),
        Bw(1, 1),
        F(2, 1),
        Bw(0, 0),
        F(3, 1),
        Bw(1, 0),
        Bw(2, 1),
        Bw(3, 1),
        Bw(2, 0),
        Bw(3, 0),
    ]
    # Rank 1: warm-up (v - 1) * p = 2 forwards.
    assert r1["events"] == [
        F(0, 0),
        F(1, 0),
        F(0, 1),
        Bw(0, 1),
        F(1, 1),
        Bw(1, 1),
        F(2, 0),
        Bw(0, 0),
        F(3, 0),
        Bw(1, 0),
        F(2, 1),
        Bw(2, 1),
        F(3, 1),
        Bw(3, 1),
        Bw(2, 0),
        Bw(3, 0),
    ]
    assert [r0["peak_live"], r1["peak_live"]] == [5, 3]


def test_interleaved_all_warmup_when_microbatches_equal_stages(results):
    expected = [F(0, 0), F(1, 0), F(0, 1), F(1, 1), Bw(0, 1), Bw(1, 1), Bw(0, 0), Bw(1, 0)]
    for r in results[(2, 2, 2)]:
        assert r["events"] == expected
        assert r["peak_live"] == 4


def test_peak_live_activations_pp4(results):
    assert [r["peak_live"] for r in results[(4, None, 8)]] == [4, 3, 2, 1]
    assert [r["peak_live"] for r in results[(4, None, 2)]] == [2, 2, 2, 1]
    # Interleaved: warm-up + 1 = (p - r - 1) * 2 + (v - 1) * p + 1.
    assert [r["peak_live"] for r in results[(4, 2, 8)]] == [11, 9, 7, 5]


def test_sent_outputs_are_freed(results):
    for case in [(2, None, 4), (2, 2, 4), (4, None, 8), (4, 2, 8)]:
        for r in results[case]:
            # Every held output is one element (the loss, or a freed activation).
            assert r["peak_held"] <= r["peak_live"], (case, r["peak_held"], r["peak_live"])


def test_forward_only_runs_forwards_in_order(results):
    for r in results[(2, None, 4, True)]:
        assert r["events"] == [F(i) for i in range(4)]
        assert r["peak_live"] == 0 and r["grads"] == {}
    r0, r1 = results[(2, 2, 4, True)]
    order = [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), F(3, 0), F(2, 1), F(3, 1)]
    assert r0["events"] == r1["events"] == order


def test_grad_sync_only_in_each_chunks_last_backward(results):
    for case in [(2, None, 4), (2, 2, 4), (2, 2, 6), (4, 2, 8), (4, None, 8)]:
        m = case[2]
        for r in results[case]:
            for log in r["sync"]:
                assert log == [False] * (m - 1) + [True], (case, r["sync"])


@pytest.mark.parametrize(
    "case",
    [(2, None, 4), (2, 2, 4), (2, 2, 2), (2, None, 3, False, True), (2, 2, 6), (4, None, 8), (4, 2, 8), (4, None, 2)],
)
def test_losses_and_gradients_equal_single_process(results, case):
    m = case[2]
    ref_losses, ref_grads = _single_process(m, variable=len(case) > 4 and case[4])
    per_rank = results[case]
    losses = per_rank[-1]["losses"]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert all(r["losses"] == [] for r in per_rank[:-1])
    grads = {}
    for r in per_rank:
        grads.update(r["grads"])
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7)


def test_forward_only_losses(results):
    ref_losses, _ = _single_process(4)
    for case in [(2, None, 4, True), (2, 2, 4, True)]:
        assert results[case][-1]["losses"] == pytest.approx(ref_losses, rel=1e-6)
