"""``--grad-compression int8`` across torchft replica groups (:mod:`megalm.resilience.torchft_compression`):
the groups simulated by threads around an in-place all-reduce (what torchft's manager runs)."""

import threading

import torch
import torch.distributed as dist

from megalm.resilience.torchft_compression import CrossGroupInt8


class FakeQuorum:
    """An in-place all-reduce over ``n`` threads (group ``i`` calls ``all_reduce(i, tensor, op)``);
    ``sent``: (dtype, elements) of each collective, as group 0 sent it."""

    def __init__(self, n):
        self.n, self.barrier, self.slots, self.sent = n, threading.Barrier(n, timeout=30), {}, []

    def all_reduce(self, i, tensor, op):
        self.slots[i] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack([self.slots[k] for k in range(self.n)])
        result = stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0, dtype=tensor.dtype)
        self.barrier.wait()  # every group has read the slots
        if i == 0:
            self.sent.append((tensor.dtype, tensor.numel()))
        tensor.copy_(result)
        return self

    def wait(self):
        return True

    def run(self, compressors, grads):
        """Each group's ``average`` of its ``grads`` (a list of tensors, changed in place) in its own thread."""
        errors = []

        def work(i):
            try:
                compressors[i].average(lambda t, op: self.all_reduce(i, t, op), self.n, grads[i])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors


def grads_of(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(50, generator=g) * scale, torch.randn(3, 7, generator=g) * scale]


def test_int8_average_across_two_groups_with_error_feedback():
    quorum = FakeQuorum(2)
    comps = [CrossGroupInt8(chunk=16, max_groups=2) for _ in range(2)]
    exact_total = [torch.zeros(50), torch.zeros(3, 7)]
    sent_total = [torch.zeros(50), torch.zeros(3, 7)]
    for step in range(6):
        grads = [grads_of(10 * step + k, scale=k + 1) for k in range(2)]
        exact = [(a + b) / 2 for a, b in zip(*grads)]
        quorum.run(comps, grads)
        for c in comps:
            c.commit()
        # Both groups hold the same average, close to the exact one: at most half a step of the
        # shared per-chunk scale (max |a| / 63) off per group, before error feedback.
        for a, b, e in zip(grads[0], grads[1], exact):
            assert torch.equal(a, b)
            assert (a - e).abs().max() < 0.1 * e.abs().max(), (a - e).abs().max()
        exact_total = [t + e for t, e in zip(exact_total, exact)]
        sent_total = [t + a for t, a in zip(sent_total, grads[0])]
    # Error feedback: what was averaged plus the groups' residuals (each its share of the average) is the
    # exact sum of the averages.
    flat = torch.cat([t.reshape(-1) for t in sent_total]) + comps[0].residual + comps[1].residual
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in exact_total]), rtol=0, atol=1e-5)
    # Bytes: per step one fp32 maximum per chunk of the 71 elements and the flag, then one int8 code each.
    assert quorum.sent[:2] == [(torch.float32, 5 + 1), (torch.int8, 71)], quorum.sent[:2]
    # The codes never overflow: both groups at the extreme of every chunk add up to 2 x 63.
    ones = [[torch.full((50,), 3.0), torch.full((3, 7), -3.0)] for _ in range(2)]
    fresh = [CrossGroupInt8(chunk=16, max_groups=2) for _ in range(2)]
    quorum.run(fresh, ones)
    assert torch.equal(ones[0][0], torch.full((50,), 3.0)) and torch.equal(ones[1][1], torch.full((3, 7), -3.0))


def test_a_step_not_committed_keeps_the_residual_and_a_rejoined_group_starts_from_zero():
    quorum = FakeQuorum(2)
    comps = [CrossGroupInt8(chunk=16, max_groups=2) for _ in range(2)]
    quorum.run(comps, [grads_of(1), grads_of(2)])
    for c in comps:
        c.commit()
    kept = comps[0].residual.clone()
    assert kept.abs().sum() > 0
    quorum.run(comps, [grads_of(3), grads_of(4)])  # the vote said no: nothing was sent
    assert torch.equal(comps[0].residual, kept)
    comps[0].reset()  # a group that rejoined from a peer
    assert comps[0].residual is None
    state = comps[1].state_dict()
    other = CrossGroupInt8(chunk=16, max_groups=2)
    other.load_state_dict(state)
    assert torch.equal(other.residual, comps[1].residual)
    changed = CrossGroupInt8(chunk=32, max_groups=2)  # other settings: not restored, zero
    changed.load_state_dict(state)
    assert changed.residual is None


def test_a_group_alone_applies_its_residual_exactly():
    quorum, alone = FakeQuorum(2), FakeQuorum(1)
    comps = [CrossGroupInt8(chunk=16, max_groups=2) for _ in range(2)]
    quorum.run(comps, [grads_of(1), grads_of(2)])
    comps[0].commit()
    owed = comps[0].residual.clone()
    grads = [grads_of(3)]
    expected = torch.cat([t.reshape(-1) for t in grads_of(3)]) + owed
    alone.run(comps[:1], grads)  # the other group died: no collective, the exact gradient plus its share owed
    comps[0].commit()
    assert alone.sent == [] and torch.equal(torch.cat([t.reshape(-1) for t in grads[0]]), expected)
    assert not comps[0].residual.any()


def test_a_non_finite_gradient_in_one_group_is_non_finite_in_every_group():
    quorum = FakeQuorum(2)
    comps = [CrossGroupInt8(chunk=16, max_groups=2, seed=5 + k) for k in range(2)]  # stochastic rounding
    grads = [grads_of(1), grads_of(2)]
    grads[1][1][2, 3] = float("inf")
    quorum.run(comps, grads)
    for c in comps:
        c.commit()
        assert c.residual is None  # unchanged (none yet)
    assert all(torch.isnan(t).all() for g in grads for t in g)
