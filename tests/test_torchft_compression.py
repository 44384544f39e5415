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


# --- --grad-compression powersgd across groups (megalm/resilience/torchft_powersgd.py) ---------------------------
SHAPES = [(7,), (12, 10), (6, 5)]  # a vector (sent as it is) and two matrices PowerSGD compresses at rank 2


def pieces_of(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale for s in SHAPES]


def same_qs(a, b):
    return a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def test_powersgd_across_two_groups_is_megalms_powersgd_over_two_data_parallel_ranks(monkeypatch):
    from megalm.distributed import comm
    from megalm.distributed.compression import GradCompressor, PowerSGD, Segment
    from megalm.resilience.torchft_powersgd import KEY, CrossGroupPowerSGD

    # The reference: megalm's data-parallel PowerSGD (GradCompressor + PowerSGD) on 2 ranks as threads,
    # its SUM all-reduce being the same in-place sum the fake quorum runs.
    ranks, local = FakeQuorum(2), threading.local()
    monkeypatch.setattr(comm, "all_reduce", lambda t, group=None, **kw: ranks.all_reduce(local.i, t, dist.ReduceOp.SUM))
    matrices = [Segment(7, 127, (12, 10)), Segment(127, 157, (6, 5))]
    ddp = [GradCompressor(PowerSGD(2)) for _ in range(2)]

    def reference(grads):
        out = [flat(g) / 2 for g in grads]  # DDP pre-scales by 1/DP: the sum is the mean

        def work(i):
            local.i = i
            ddp[i].all_reduce(KEY, out[i], matrices, None).wait()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    quorum = FakeQuorum(2)
    comps = [CrossGroupPowerSGD(2) for _ in range(2)]
    exact_total, sent_total = torch.zeros(157), torch.zeros(157)
    for step in range(5):
        grads = [pieces_of(10 * step + k, scale=k + 1) for k in range(2)]
        expected = reference(grads)
        exact_total += (flat(grads[0]) + flat(grads[1])) / 2
        quorum.run(comps, grads)
        for c in comps:
            c.commit()
        assert torch.equal(flat(grads[0]), flat(grads[1]))  # every group holds the same average
        # bit for bit: every quantity is twice the data-parallel one (a power of two), P^ the same
        assert torch.equal(flat(grads[0]), expected[0]), (flat(grads[0]) - expected[0]).abs().max()
        for k in range(2):  # the residual (this group's share of the average) is the data-parallel rank's
            assert torch.equal(comps[k].residual, ddp[k].residuals[KEY])
        sent_total += flat(grads[0])
    # the warm start is the same on both groups (twice the data-parallel one: the sum of twice the Q's)
    for name, q in comps[0].qs.items():
        assert torch.equal(q, comps[1].qs[name])
        assert torch.equal(q, 2 * ddp[0].method.qs[name])
    # error feedback: what was averaged plus the groups' residuals is the exact sum of the averages
    torch.testing.assert_close(sent_total + comps[0].residual + comps[1].residual, exact_total, rtol=0, atol=1e-5)
    # it compresses: the summed gradients are not rank 2, so the average differs from the exact one
    assert (flat(grads[0]) - (flat(pieces_of(40)) + flat(pieces_of(41, 2.0))) / 2).abs().max() > 0.1
    # bytes per step: P (the 7 plain elements, 12 x 2 and 6 x 2) then Q (10 x 2 and 5 x 2), fp32, against 157
    assert quorum.sent[:2] == [(torch.float32, 7 + 24 + 12), (torch.float32, 20 + 10)], quorum.sent[:2]


def test_powersgd_quorum_shrink_redo_and_rejoin_keep_the_residuals_meaning():
    from megalm.resilience.torchft_powersgd import CrossGroupPowerSGD

    quorum, alone = FakeQuorum(2), FakeQuorum(1)
    comps = [CrossGroupPowerSGD(2) for _ in range(2)]
    exact_total, sent_total = torch.zeros(157), torch.zeros(157)
    for step in range(3):
        grads = [pieces_of(10 * step + k) for k in range(2)]
        exact_total += (flat(grads[0]) + flat(grads[1])) / 2
        quorum.run(comps, grads)
        for c in comps:
            c.commit()
        sent_total += flat(grads[0])
    committed_q = {k: v.clone() for k, v in comps[0].qs.items()}
    owed = [c.residual.clone() for c in comps]
    assert owed[0].abs().sum() > 0 and owed[1].abs().sum() > 0
    # Group 1 dies in step 4: the vote says no, nothing is committed; the survivor redoes it alone.
    quorum.run(comps, [pieces_of(30), pieces_of(31)])
    assert torch.equal(comps[0].residual, owed[0]) and same_qs(committed_q, comps[0].qs)
    redo = [pieces_of(30)]
    alone.run(comps[:1], redo)
    comps[0].commit()
    # alone it adds its whole share owed (x 1 group), exactly, and owes nothing after; its warm start is unchanged
    assert alone.sent == [] and torch.equal(flat(redo[0]), flat(pieces_of(30)) + owed[0])
    assert not comps[0].residual.any() and same_qs(committed_q, comps[0].qs)
    # Only the dead group's residual is lost: the survivor applied the exact averages minus what group 1 owed.
    exact_total += flat(pieces_of(30))
    sent_total += flat(redo[0])
    torch.testing.assert_close(sent_total + owed[1], exact_total, rtol=0, atol=1e-5)
    # Group 1 rejoins from group 0: its residual is zero, its warm start group 0's (sent with the weights).
    rejoined = CrossGroupPowerSGD(2)
    rejoined.residual = owed[1]  # (whatever it had before it died)
    rejoined.rejoin(comps[0].peer_state())
    assert rejoined.residual is None and same_qs(committed_q, rejoined.qs)
    comps[1] = rejoined
    grads = [pieces_of(50), pieces_of(51)]
    exact_total += (flat(grads[0]) + flat(grads[1])) / 2
    quorum.run(comps, grads)
    for c in comps:
        c.commit()
    sent_total += flat(grads[0])
    assert torch.equal(flat(grads[0]), flat(grads[1]))
    assert same_qs(comps[0].qs, comps[1].qs)
    torch.testing.assert_close(
        sent_total + owed[1] + comps[0].residual + comps[1].residual, exact_total, rtol=0, atol=1e-5
    )
    # the per-rank checkpoint state: residual and warm starts, restored only under the same settings
    other = CrossGroupPowerSGD(2)
    other.load_state_dict(comps[1].state_dict())
    assert torch.equal(other.residual, comps[1].residual) and same_qs(other.qs, comps[1].qs)
    changed = CrossGroupPowerSGD(4)
    changed.load_state_dict(comps[1].state_dict())
    assert changed.residual is None and changed.qs == {}


def test_powersgd_non_finite_gradient_in_one_group_is_non_finite_in_every_group():
    from megalm.resilience.torchft_powersgd import CrossGroupPowerSGD

    quorum = FakeQuorum(2)
    comps = [CrossGroupPowerSGD(2) for _ in range(2)]
    quorum.run(comps, [pieces_of(1), pieces_of(2)])
    for c in comps:
        c.commit()
    kept = [(c.residual.clone(), dict(c.qs)) for c in comps]
    grads = [pieces_of(3), pieces_of(4)]
    grads[1][1][2, 3] = float("nan")
    quorum.run(comps, grads)
    for c, (residual, qs) in zip(comps, kept):
        c.commit()
        assert torch.equal(c.residual, residual) and same_qs(c.qs, qs)
    assert all(torch.isnan(t).all() for g in grads for t in g)


def test_gradient_pieces_cover_the_reduced_gradients_with_their_matrices():
    """What powersgd compresses across groups: the buffer per bucket (the distributed optimizer: this
    rank's shard of each), every matrix segment whole rows of one 2-D parameter."""
    from types import SimpleNamespace

    from megalm.distributed.param_and_grad_buffer import ParamAndGradBuffer
    from megalm.distributed.sharded_grad_buffer import ShardedGradBuffer
    from megalm.resilience.torchft_replicas import _gradient_tensors, gradient_pieces

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 10))
    params = list(model.parameters())
    for layout in ("ddp", "distopt", "zero2"):
        distopt = layout != "ddp"
        if layout == "zero2":  # the sharded gradient buffer: rank 0's shards only, in shard_data
            buf = ShardedGradBuffer(params, torch.float32, 40, None, 2, 0.5, allocate_param_data=True,
                                    use_distributed_optimizer=True)  # fmt: skip
            for bucket in buf.buckets:  # each shard element holds its index in the whole buffer
                lo, hi = bucket.shard_range(0)
                buf.reduced_grad(bucket, lo, hi).copy_(torch.arange(lo, hi, dtype=torch.float32))
            storage = buf.shard_data
        else:
            buf = ParamAndGradBuffer(params, torch.float32, 40, None, 2, 0.5, use_distributed_optimizer=distopt)
            buf.grad_data.copy_(torch.arange(buf.grad_data.numel(), dtype=torch.float32))  # an element's index
            storage = buf.grad_data
        chunk = SimpleNamespace(all_buffers=[buf])
        tensors, matrices = gradient_pieces([chunk])
        assert len(tensors) == len(buf.buckets) > 1
        covered = torch.cat(tensors)
        if distopt:  # rank 0's shard of every bucket, as the int8 path sends
            assert torch.equal(covered, torch.cat(_gradient_tensors([chunk])))
        else:
            assert torch.equal(covered, buf.grad_data)
        for t in tensors:  # views: the average lands in the buffer
            assert t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        rows = 0
        for t, mats in zip(tensors, matrices):
            for s in mats:
                first = int(t[s.start])
                owner = [p for p in params if buf.param_index_map[p][0] <= first < buf.param_index_map[p][1]]
                assert len(owner) == 1 and owner[0].dim() == 2 and owner[0].shape[1] == s.shape[1]
                start = buf.param_index_map[owner[0]][0]
                assert (first - start) % s.shape[1] == 0 and first + s.end - s.start <= buf.param_index_map[owner[0]][1]
                assert torch.equal(
                    t[s.start : s.end], torch.arange(first, first + s.end - s.start, dtype=torch.float32)
                )
                rows += s.shape[0]
        assert rows > 0 and (distopt or rows == 6 + 10)  # the whole buffer: every row of both weights
