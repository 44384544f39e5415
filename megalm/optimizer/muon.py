"""Muon (Jordan et al. 2024; Megatron-LM's ``--optimizer muon``): orthogonalized momentum for 2-D weights.

For each matrix parameter ``W`` (``out x in``; groups with ``muon`` True: the linear layers'
weights, not the embeddings nor the output layer) with gradient ``G``::

    M = mu M + (1 - mu) G                                   (--muon-momentum mu)
    D = (1 - mu) G + mu M  with --muon-use-nesterov, else M
    O = NS_k(D) * scale(out, in) * extra                    (--muon-num-ns-steps k,
                                                             --muon-scale-mode, --muon-extra-scale-factor)
    W = W (1 - lr wd) - lr O                                (decoupled weight decay)

``NS_k`` (:func:`newton_schulz`) is the quintic Newton-Schulz iteration that maps ``D = U S V^T``
to about ``U V^T``: ``X = D / ||D||_F`` (fp32, transposed when out > in), then for each of the ``k``
iterations ``A = X X^T;  X = a X + (b A + c A A) X`` with that iteration's ``(a, b, c)`` from
``--muon-coefficient-type`` (Megatron's sets, :data:`NS_COEFFICIENT_SETS`: ``quintic``, its default,
five sets in turn; ``simple`` Jordan et al.'s ``(3.4445, -4.7750, 2.0315)`` every time).
``--muon-fp32-matmul-prec`` (Megatron's semantics): ``torch.set_float32_matmul_precision(value)`` for
the orthogonalization pass, restored after it; under ``medium`` (Megatron's default) ``X`` is cast to
bf16 for the iterations and back to fp32 after them (as emerging_optimizers' ``newton_schulz``);
``high``: fp32 tensors, TF32 matmuls where the device has them; ``highest``: IEEE fp32.  ``scale``:
``spectral`` ``sqrt(max(out, in))``, ``unit_rms_norm`` ``sqrt(out / in)``, ``shape_scaling``
``sqrt(max(1, out / in))`` (Megatron's).

Fused QKV (Megatron's default ``muon_split_qkv``; ``--muon-no-split-qkv`` turns it off): the
``linear_qkv`` weight (rows grouped per query group ``g``: ``[q heads of g; k_g; v_g]``, its
:class:`~megalm.tensor_parallel.param_info.ParamInfo` ``qkv_split_shapes``) is orthogonalized as
three matrices, as Megatron-LM's ``TensorParallelMuon``: ``Q`` (every group's query rows, in group
order: ``heads * head_dim`` rows), ``K`` and ``V`` (``groups * head_dim`` rows each), each with
``NS_k`` and its own ``scale(rows, in)``, and the results put back in the grouped rows.  Without
the split the fused ``D`` is one matrix.

Every other parameter (groups with ``muon`` False: biases, norms, embeddings, output layer; Megatron's
``--muon-scalar-optimizer adam``) takes an AdamW step (``--adam-beta1/2``, ``--adam-eps``).

Tensor parallelism (``--muon-tp-mode``, Megatron's choices):

* ``duplicated``: the TP-split ``D`` is all-gathered over ``tp_group`` (one all-gather of the
  matrix per parameter per step; a split QKV weight: one per part, Q, K, V), orthogonalized whole on
  every TP rank, and each rank keeps its shard: the update equals the single-process one; ``scale``
  uses the full shape.  A TP rank holds whole query groups, so the gathered ``Q``/``K``/``V`` of
  its rank's parts are the single process's.
* ``blockwise``: each TP rank orthogonalizes its own shard (its own groups' Q, K, V under the
  split; no communication): the update of a split matrix differs from the single-process one (the
  blocks are orthogonal, the whole is not), ``scale`` uses the shard's shape.
* ``distributed`` (Newton-Schulz with the Gram matrix all-reduced each iteration): not built,
  refused by the config check.

The distributed optimizer (main params are flat ranges of the TP-local matrices): the momentum is
kept per range; the ranges' directions are assembled into whole TP-local matrices with one
all-reduce over data parallelism (:mod:`megalm.optimizer.matrix_shards`), every rank then
orthogonalizes every matrix of its stage (as above) and keeps its range: the update equals the
plain optimizer's, at the cost of that all-reduce and of Newton-Schulz on every data-parallel rank.

State per parameter: ``momentum_buffer`` (matrices) or ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from megalm.device import get_device
from megalm.errors import MegalmError
from megalm.optimizer.lamb import adam_direction, init_adam_state
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.param_info import REPLICATED, param_info
from megalm.tensor_parallel.utils import gather_shards, shard_of_full

# --muon-coefficient-type: Megatron-LM's (emerging_optimizers') (a, b, c) sets, applied in order.
NS_COEFFICIENT_SETS = {
    "simple": ((3.4445, -4.7750, 2.0315),),  # Jordan et al.'s
    "quintic": (  # modded-nanogpt's, per iteration
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (  # Amsel et al. 2025
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "aol": (  # flash-newton-schulz's
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated")
MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values


class MuonError(MegalmError, ValueError):
    """A Muon setting or matrix it cannot take."""


def ns_coefficients(kind: str, steps: int) -> list:
    """The ``(a, b, c)`` of each of ``steps`` iterations for ``--muon-coefficient-type kind`` (Megatron's
    rule: simple repeats its set; polar_express needs 8 steps or more and repeats its last set; the others
    need a multiple of their sets' count and repeat them)."""
    if kind not in NS_COEFFICIENT_SETS:
        raise MuonError(f"unknown --muon-coefficient-type {kind!r} (choose {', '.join(NS_COEFFICIENT_SETS)})")
    sets = list(NS_COEFFICIENT_SETS[kind])
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise MuonError(f"--muon-coefficient-type polar_express needs --muon-num-ns-steps >= 8, got {steps}")
        return sets + sets[-1:] * (steps - len(sets))
    if steps % len(sets):
        raise MuonError(
            f"--muon-coefficient-type {kind} needs --muon-num-ns-steps a multiple of {len(sets)}, got {steps}"
        )
    return sets * (steps // len(sets))


def newton_schulz(
    d: torch.Tensor, steps: int, eps: float = 1e-7, coefficient_type: str = "simple", dtype=torch.float32
) -> torch.Tensor:
    """About ``U V^T`` of ``d = U S V^T`` (2-D) by ``steps`` quintic Newton-Schulz iterations with the
    ``coefficient_type`` sets; normalized in fp32, iterated in ``dtype`` (bf16 under Megatron's ``medium``
    precision), returned in fp32."""
    x = d.float()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.t()
    x = (x / (x.norm() + eps)).to(dtype)
    for a, b, c in ns_coefficients(coefficient_type, steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.float()
    return x.t() if transpose else x


def scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """Megatron's ``get_muon_scale_factor``."""
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    raise MuonError(f"unknown Muon scale mode {mode!r} (choose {', '.join(SCALE_MODES)})")


@contextmanager
def fp32_matmul_precision(precision: str):
    """``torch.set_float32_matmul_precision(precision)`` inside, the previous value restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def split_qkv_rows(d: torch.Tensor, shapes) -> list:
    """A fused QKV matrix (rows grouped per query group: ``shapes`` = query, key, value rows per group)
    -> ``[Q, K, V]``, each the parts of every group stacked in group order (Megatron's split)."""
    per_group = sum(shapes)
    if d.shape[0] % per_group:
        raise MuonError(
            f"a fused QKV matrix of {d.shape[0]} rows is not whole groups of {per_group} rows "
            f"(query, key, value rows per group {tuple(shapes)})"
        )
    grouped = d.reshape(d.shape[0] // per_group, per_group, d.shape[1])
    return [part.reshape(-1, d.shape[1]) for part in torch.split(grouped, list(shapes), dim=1)]


def merge_qkv_rows(parts: list, shapes) -> torch.Tensor:
    """Inverse of :func:`split_qkv_rows`."""
    groups, cols = parts[0].shape[0] // shapes[0], parts[0].shape[1]
    return torch.cat([p.reshape(groups, rows, cols) for p, rows in zip(parts, shapes)], dim=1).view(-1, cols)


class Muon(torch.optim.Optimizer):
    """Muon for groups with ``muon`` True, AdamW for the others; see the module docstring.

    ``tp_group``, ``param_infos`` (``id(main param) -> ParamInfo`` of its model parameter) and, under
    the distributed optimizer, ``shards`` (:class:`megalm.optimizer.matrix_shards.MatrixShards`) are
    set by the megalm wrapper; unset, every matrix is whole (one process).  ``split_qkv``: a parameter
    whose record has ``qkv_split_shapes`` is orthogonalized as its Q, K and V parts; ``fp32_matmul_prec``:
    the float32 matmul precision of the orthogonalization pass.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.95,
        nesterov=False,
        num_ns_steps=5,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        tp_mode="blockwise",
        split_qkv=True,
        fp32_matmul_prec="medium",
        coefficient_type="quintic",
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
    ):
        defaults = dict(lr=lr, momentum=momentum, betas=tuple(betas), eps=eps, weight_decay=weight_decay, muon=True)
        super().__init__(params, defaults)
        if tp_mode not in TP_MODES:
            raise MuonError(f"unsupported --muon-tp-mode {tp_mode!r} (choose {', '.join(TP_MODES)})")
        if fp32_matmul_prec not in MATMUL_PRECISIONS:
            raise MuonError(
                f"unsupported --muon-fp32-matmul-prec {fp32_matmul_prec!r} (choose {', '.join(MATMUL_PRECISIONS)})"
            )
        scale_factor(1, 1, scale_mode)  # checks the mode
        ns_coefficients(coefficient_type, int(num_ns_steps))  # checks the type and the steps
        self.coefficient_type = coefficient_type
        self.nesterov, self.num_ns_steps, self.tp_mode = bool(nesterov), int(num_ns_steps), tp_mode
        self.split_qkv, self.fp32_matmul_prec = bool(split_qkv), fp32_matmul_prec
        self.scale_mode, self.extra_scale_factor = scale_mode, float(extra_scale_factor)
        self.tp_group = None
        self.param_infos = {}
        self.shards = None  # MatrixShards under the distributed optimizer (main params are flat ranges)

    def init_param_state(self, p: torch.Tensor, group: dict) -> None:
        if group["muon"]:
            self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:
            init_adam_state(self.state[p], p)

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW for the other groups; momentum, then one orthogonalization pass for the matrices."""
        self.apply_step(self.prepare_step())
        return None

    @torch.no_grad()
    def prepare_step(self) -> list:
        """Everything but the weight update, for every parameter with a gradient: AdamW directions,
        momentum and the orthogonalized matrices (all of Muon's communication); returns
        ``[(p, group, update)]`` for :meth:`apply_step` (the two halves let the CPU offload apply the
        update bucket by bucket after one orthogonalization pass over all of them).  A direction on
        the host (an offloaded copy's momentum) is moved to :func:`~megalm.device.get_device` first:
        matrices are assembled, gathered and orthogonalized on the device, where the communication
        runs; :meth:`apply_step` brings each update back to its parameter's device."""
        updates, matrices = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.init_param_state(p, group)
                if group["muon"]:
                    matrices.append((p, group, self._direction(p, group["momentum"]).to(get_device())))
                    continue
                updates.append((p, group, adam_direction(self.state[p], p.grad, *group["betas"], group["eps"])))
        done = self._orthogonalize_all(matrices)
        return updates + [(p, group, done[id(p)]) for p, group, _ in matrices]

    @torch.no_grad()
    def apply_step(self, entries: list) -> None:
        """``p = p (1 - lr wd) - lr update`` for the entries given (no communication)."""
        for p, group, update in entries:
            self._apply(p, group, update.to(p.device))

    @staticmethod
    def _apply(p: torch.Tensor, group: dict, update: torch.Tensor) -> None:
        """``p = p (1 - lr wd) - lr update`` (decoupled weight decay)."""
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            p.mul_(1 - lr * wd)
        p.add_(update, alpha=-lr)

    def _direction(self, p: torch.Tensor, mu: float) -> torch.Tensor:
        """Advance the momentum; the direction to orthogonalize (Nesterov's or the momentum)."""
        buf = self.state[p]["momentum_buffer"]
        buf.lerp_(p.grad, 1 - mu)
        return p.grad.lerp(buf, mu) if self.nesterov else buf

    def _orthogonalize_all(self, matrices) -> dict:
        """``{id(p): update shaped like p}``.  Whole local matrices: each on its own.  Flat ranges
        (``shards``): the matrices are assembled over data parallelism first (one all-reduce), every
        Muon matrix of the stage is orthogonalized on every rank (the TP all-gathers in the same
        order everywhere), and each range is cut back out."""
        if self.shards is None:
            with fp32_matmul_precision(self.fp32_matmul_prec):
                return {id(p): self._orthogonalized(d, self.param_infos.get(id(p), REPLICATED)) for p, _, d in matrices}
        whole = self.shards.assemble({id(p): d for p, _, d in matrices})
        with fp32_matmul_precision(self.fp32_matmul_prec):
            done = {i: self._orthogonalized(whole[i], param_info(model)) for i, model in self.shards.matrices}
        return {id(p): self.shards.range_of(id(p), done[self.shards.owned[id(p)][0]]) for p, _, _ in matrices}

    def _orthogonalized(self, d: torch.Tensor, info) -> torch.Tensor:
        """This rank's part of the scaled, orthogonalized ``d`` (a whole TP-local matrix); a fused QKV
        weight under ``split_qkv``: its Q, K and V parts each on their own (:func:`split_qkv_rows`)."""
        if d.dim() != 2:
            raise MuonError(f"Muon updates 2-D matrices, got a parameter of shape {tuple(d.shape)}")
        shapes = info.qkv_split_shapes
        if not self.split_qkv or shapes is None:
            return self._orthogonalized_matrix(d, info)
        return merge_qkv_rows([self._orthogonalized_matrix(part, info) for part in split_qkv_rows(d, shapes)], shapes)

    def _orthogonalized_matrix(self, d: torch.Tensor, info) -> torch.Tensor:
        """This rank's part of the scaled, orthogonalized matrix ``d`` (TP-local; gathered over TP first
        under ``duplicated``)."""
        size = group_size(self.tp_group)
        if self.tp_mode == "blockwise" or not info.tensor_parallel or size == 1:
            return self._newton_schulz(d).to(d.dtype) * self._scale(d)
        full = gather_shards(d, info, self.tp_group)
        o = self._newton_schulz(full) * self._scale(full)
        rank, dim, stride = group_rank(self.tp_group), info.partition_dim, info.partition_stride
        return shard_of_full(o, dim, rank, size, stride).to(d.dtype)

    def _newton_schulz(self, m: torch.Tensor) -> torch.Tensor:
        """:func:`newton_schulz` with this optimizer's steps and coefficients, iterated in bf16 under
        ``medium`` (Megatron's: torch has no fp32-in bf16-compute matmul, so X is cast), else in fp32."""
        dtype = torch.bfloat16 if self.fp32_matmul_prec == "medium" else torch.float32
        return newton_schulz(m, self.num_ns_steps, coefficient_type=self.coefficient_type, dtype=dtype)

    def _scale(self, m: torch.Tensor) -> float:
        return scale_factor(m.shape[0], m.shape[1], self.scale_mode) * self.extra_scale_factor
