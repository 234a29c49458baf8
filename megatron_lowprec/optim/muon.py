"""Muon with a precision strategy: the same options as AdamW decide its momentum's storage and how
its update reaches the parameter.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; scaled to LLMs in
"Muon is Scalable for LLM Training", arXiv 2502.16982) updates a 2-D weight θ (m x n) as
``torch.optim.Muon`` does:

    B ← μB + (1-μ)g   (EMA momentum, torch's ``lerp``),   M = g + μ(B - g) with Nesterov, else B,
    O = NS₅(M),   θ ← θ - lr·λ·θ - lr·s(m, n)·O   (decoupled weight decay),

where NS₅ is five quintic Newton-Schulz iterations with coefficients (3.4445, -4.775, 2.0315) on
BF16 matrices, after normalising M by its Frobenius norm (:func:`newton_schulz`), and s(m, n) is the
scale mode (:data:`SCALE_MODES`). The iterations may instead take a triple each, in turn
(megatron-core's default ``muon_coefficient_type="quintic"``, :data:`QUINTIC_COEFFICIENT_SETS`).

Every registered option applies (:func:`muon_strategy`), with the fields read as for AdamW:

* ``moments``: the momentum B is stored in the parameter's 16-bit dtype (A, B, C, kahan, sr), FP32
  (D, D-MW) or FP8 E4M3 per 1x128 group with COAT's range expansion (coat). It is decoded to FP32,
  updated there and rounded once when stored (``kernel.decode_moment`` / ``kernel.encode_moment``);
  the Nesterov direction uses the FP32 value before that rounding.
* ``param_update`` and ``master_weights``: the FP32 update Δθ = -lr·λ·θ - lr·s·O reaches the 16-bit
  parameter by nearest rounding, MCF Grow into (θ, δθ), Kahan, or stochastic rounding with the
  counter-based words shared by every replica (``kernel.PARAM_UPDATES``), or updates an FP32 master
  stored whole or as a remainder below the BF16 parameter (``optim/master.py``).
* ``weight_decay="multiplicative"`` (D, coat, D-BF16): θ ← θ(1 - lr·λ), then θ ← θ - lr·s·O on the
  FP32 master, operation for operation as ``torch.optim.Muon`` (so D is torch's Muon on the master).
* ``second_moment_mcf`` (C): Muon keeps no second moment, so C's expansion of v has nothing to act
  on and **C is B for Muon** (MCF parameters (θ, δθ), 16-bit momentum); the name stays C.
* ``adam_kernel`` is AdamW's: Muon always runs the reference below.

A parameter may be one shard of a matrix split across a process group (tensor parallelism,
:class:`ShardedMatrix`): then the step orthogonalizes the whole matrix, gathered from every shard,
and keeps this shard of the result, with s(m, n) of the whole shape, so that each shard gets the
update of the unsplit matrix (megatron-core's ``muon_tp_mode="duplicated"``). Without it every
parameter is orthogonalized on its own (a shard by itself: megatron-core's ``"blockwise"``).
A fused QKV weight may be split (megatron-core's ``muon_split_qkv``): its query, key and value
rows, each kind over all query groups, are orthogonalized and scaled as three matrices.

The step is eager, one parameter at a time; there is no fused (compiled) Muon step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.adamw import PrecisionOptimizer
from megatron_lowprec.optim.buckets import Bucket, build_bucket
from megatron_lowprec.optim.kernel import (
    PARAM_UPDATES,
    check_param_dtype,
    decay_base,
    decode_moment,
    encode_moment,
)
from megatron_lowprec.optim.master import master_key, master_value, store_master_
from megatron_lowprec.optim.strategies import PrecisionStrategy, resolve_option

MUON_MOMENTS = ("momentum",)
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (a, b, c) for every iteration, as torch uses them
(megatron-core's ``muon_coefficient_type="simple"``)."""
QUINTIC_COEFFICIENT_SETS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""A triple (a, b, c) for each of five Newton-Schulz iterations, the i-th for iteration i (cycled
beyond five): emerging-optimizers' ``"quintic"`` set (0.3.0), megatron-core's default
``muon_coefficient_type``; its ``"simple"`` is :data:`NS_COEFFICIENTS` at every iteration."""
NS_STEPS = 5
NS_EPS = 1e-7

SCALE_MODES: dict[str, Callable[[int, int], float]] = {
    "original": lambda rows, columns: math.sqrt(max(1, rows / columns)),
    "match_rms_adamw": lambda rows, columns: 0.2 * math.sqrt(max(rows, columns)),
    "spectral": lambda rows, columns: math.sqrt(max(rows, columns)),
    "unit_rms_norm": lambda rows, columns: math.sqrt(rows / columns),
}
"""s(m, n) for an m x n weight: torch's ``adjust_lr_fn`` choices ``"original"`` (Keller Jordan's
√max(1, m/n), megatron-core's ``"shape_scaling"``) and ``"match_rms_adamw"`` (Moonshot's 0.2·√max(m, n),
arXiv 2502.16982 §2.2), and megatron-core's ``"spectral"`` (√max(m, n), its default) and
``"unit_rms_norm"`` (√(m/n))."""


def muon_strategy(option: str | PrecisionStrategy) -> PrecisionStrategy:
    """``option`` as Muon runs it: one momentum instead of m and v, no second-moment expansion (so C
    is B), the reference update (see the module docstring). The name stays."""
    strategy = resolve_option(option)
    return replace(strategy, moment_names=MUON_MOMENTS, second_moment_mcf=False, adam_kernel="reference")


def update_scale(shape: torch.Size | tuple[int, int], scale_mode: str) -> float:
    """s(m, n) of :data:`SCALE_MODES` for a weight of ``shape`` (m, n)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is not valid; choose one of {', '.join(SCALE_MODES)}")
    rows, columns = shape
    return SCALE_MODES[scale_mode](rows, columns)


Coefficients = tuple[float, float, float] | tuple[tuple[float, float, float], ...]
"""One Newton-Schulz triple (a, b, c) for every iteration, or a sequence of triples taken in turn."""


def coefficient_schedule(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` iterations: one triple repeated, or a sequence of triples
    cycled (emerging-optimizers' ``"cycle"`` mode, which its ``"quintic"`` set uses)."""
    sets = [tuple(coefficients)] if all(isinstance(value, (int, float)) for value in coefficients) else [tuple(t) for t in coefficients]
    return [sets[step % len(sets)] for step in range(steps)]


def _valid_coefficients(coefficients: Any) -> bool:
    def is_triple(values: Any) -> bool:
        return isinstance(values, (tuple, list)) and len(values) == 3 and all(isinstance(v, (int, float)) for v in values)

    return is_triple(coefficients) or (
        isinstance(coefficients, (tuple, list)) and len(coefficients) > 0 and all(is_triple(t) for t in coefficients)
    )


def newton_schulz(
    matrix: torch.Tensor, coefficients: Coefficients = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS
) -> torch.Tensor:
    """The approximate orthogonalization U S' Vᵀ of ``matrix`` = U S Vᵀ, as a BF16 tensor: the matrix
    in BF16, transposed to be wide, divided by max(‖·‖_F, eps) so that its spectral norm is at most 1,
    then ``steps`` quintic iterations X ← aX + (bA + cA²)X with A = XXᵀ, every matmul in BF16
    (``torch.optim.Muon``'s ``_zeropower_via_newtonschulz``, operation for operation), with the
    (a, b, c) of :func:`coefficient_schedule`."""
    tall = matrix.size(0) > matrix.size(1)
    orthogonal = matrix.bfloat16()
    if tall:
        orthogonal = orthogonal.T
    orthogonal.div_(orthogonal.norm().clamp(min=eps))
    for a, b, c in coefficient_schedule(coefficients, steps):
        gram = orthogonal @ orthogonal.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        orthogonal = torch.addmm(orthogonal, polynomial, orthogonal, beta=a)
    return orthogonal.T if tall else orthogonal


@dataclass(frozen=True)
class ShardedMatrix:
    """A parameter that is block ``rank`` of ``world_size`` equal blocks of a matrix cut along ``dim``,
    one block on each rank of ``group`` in rank order (a tensor-parallel shard)."""

    group: Any
    dim: int
    rank: int
    world_size: int

    def whole_shape(self, shape: torch.Size) -> tuple[int, int]:
        """The shape of the whole matrix of which a block has ``shape``."""
        whole = list(shape)
        whole[self.dim] *= self.world_size
        return tuple(whole)

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """The whole matrix: every rank's ``block`` joined along ``dim`` (collective over ``group``)."""
        blocks = [torch.empty_like(block) for _ in range(self.world_size)]
        torch.distributed.all_gather(blocks, block.contiguous(), group=self.group)
        return torch.cat(blocks, dim=self.dim)

    def block(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of ``whole``."""
        return whole.chunk(self.world_size, dim=self.dim)[self.rank].contiguous()


def check_muon_param(param: torch.Tensor, strategy: PrecisionStrategy, where: str = "parameter") -> None:
    """``ValueError`` if ``param`` is not a 2-D weight that ``strategy`` can store."""
    if param.ndim != 2:
        raise ValueError(
            f"Muon orthogonalizes 2-D weights; {where} has shape {tuple(param.shape)} ({param.ndim}-D): "
            "optimize it with AdamW (megatron_lowprec.optim.AdamW, the same option)"
        )
    check_param_dtype(param, strategy, where)


@torch.no_grad()
def muon_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Coefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
    scale_mode: str = "original",
    extra_scale_factor: float = 1.0,
    random_source: torch.Tensor | None = None,
    sharded: ShardedMatrix | None = None,
    split_rows: tuple[int, ...] | None = None,
) -> None:
    """One Muon step on the 2-D ``param``, in place, following ``strategy`` (a :func:`muon_strategy`;
    see the module docstring). ``grad`` must be finite. ``random_source``: the 32-bit words of
    ``param``'s shape that stochastic rounding draws. ``sharded``: ``param`` is that block of a
    matrix, which is orthogonalized whole (collective over its group). ``split_rows``: ``param``'s
    rows are groups of blocks of these heights (a fused QKV weight's query, key and value rows per
    query group), and each kind of block is orthogonalized and scaled on its own
    (:func:`_split_orthogonalized`)."""
    state["step"] += 1
    grad = grad.float()
    buffer = decode_moment(state, "momentum", param, strategy)
    buffer.lerp_(grad, 1 - momentum)
    direction = grad.lerp(buffer, momentum) if nesterov else buffer
    def orthogonalized(matrix: torch.Tensor) -> tuple[torch.Tensor, float]:
        if sharded is None:
            return newton_schulz(matrix, ns_coefficients, ns_steps, eps), update_scale(matrix.shape, scale_mode)
        whole = newton_schulz(sharded.gather(matrix), ns_coefficients, ns_steps, eps)
        return sharded.block(whole), update_scale(sharded.whole_shape(matrix.shape), scale_mode)

    if split_rows is None:
        orthogonal, scale = orthogonalized(direction)
    else:
        orthogonal, scale = _split_orthogonalized(direction, split_rows, orthogonalized), 1.0
    step_size = lr * scale * extra_scale_factor
    if strategy.weight_decay == "multiplicative":
        stored = state[master_key(strategy)]
        master = master_value(param, stored)
        master.mul_(1 - lr * weight_decay)
        store_master_(param, stored, master.add_(orthogonal, alpha=-step_size))
    else:
        update = decay_base(param, state) * (-lr * weight_decay) + orthogonal.float() * -step_size
        PARAM_UPDATES[strategy.param_update](param, state, update, random_source)
    encode_moment(state, "momentum", buffer, param, strategy)


def _split_orthogonalized(
    direction: torch.Tensor, split_rows: tuple[int, ...], orthogonalized: Callable[[torch.Tensor], tuple[torch.Tensor, float]]
) -> torch.Tensor:
    """megatron-core's ``split_qkv``: ``direction``'s rows are G groups of ``sum(split_rows)`` rows,
    each cut into blocks of ``split_rows`` heights; the i-th blocks of all groups, stacked, form one
    matrix, orthogonalized and scaled by its own s(m, n); the FP32 results are put back in place."""
    rows, columns = direction.shape
    group_rows = sum(split_rows)
    groups = rows // group_rows
    pieces = []
    for piece in direction.view(groups, group_rows, columns).split(list(split_rows), dim=1):
        orthogonal, scale = orthogonalized(piece.reshape(-1, columns))
        pieces.append((orthogonal.float() * scale).view(groups, -1, columns))
    return torch.cat(pieces, dim=1).view(rows, columns)


def _as_tuples(coefficients: Any) -> Any:
    return tuple(_as_tuples(value) for value in coefficients) if isinstance(coefficients, (tuple, list)) else coefficients


HYPERPARAMETERS = (
    "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "scale_mode", "extra_scale_factor",
)
"""The keys of a parameter group that :func:`muon_step_` takes."""


def _check_hyperparameters(group: dict[str, Any]) -> None:
    checks = [
        ("lr", group["lr"] >= 0, ">= 0"),
        ("weight_decay", group["weight_decay"] >= 0, ">= 0"),
        ("momentum", 0 <= group["momentum"] < 1, "in [0, 1)"),
        ("eps", group["eps"] > 0, "> 0"),
        ("ns_steps", isinstance(group["ns_steps"], int) and 1 <= group["ns_steps"] < 100, "an int in [1, 100)"),
        ("ns_coefficients", _valid_coefficients(group["ns_coefficients"]), "three floats (a, b, c) or a sequence of such triples"),
        ("scale_mode", group["scale_mode"] in SCALE_MODES, f"one of {', '.join(SCALE_MODES)}"),
    ]
    for name, ok, valid in checks:
        if not ok:
            raise ValueError(f"invalid {name}={group[name]!r}; it must be {valid}")


class Muon(PrecisionOptimizer):
    """Muon for 2-D weights with a precision strategy (``option``: any registered name, see
    :func:`megatron_lowprec.optim.strategies.strategy_names`) that decides the momentum's storage and
    how the update is rounded into the parameter (module docstring; C is B for Muon).

    Hyperparameters and defaults are ``torch.optim.Muon``'s; ``scale_mode`` is torch's
    ``adjust_lr_fn`` (``"original"``, ``"match_rms_adamw"``) or megatron-core's ``"spectral"`` and
    ``"unit_rms_norm"``, times ``extra_scale_factor`` (megatron-core's ``muon_extra_scale_factor``).
    ``ns_coefficients`` is torch's one (a, b, c) for every Newton-Schulz iteration or, as
    megatron-core's coefficient types, a sequence of triples taken in turn (:func:`coefficient_schedule`).
    Parameters must be 2-D and bfloat16 or float16 (others: :class:`~megatron_lowprec.optim.AdamW`
    with the same option). ``master_weights`` and ``master_storage`` act as for AdamW. Stochastic
    rounding draws the counter-based words of (``seed``, step, stream, element): every replica of an
    element draws the same; ``stream_layout(param)`` places a parameter in the stream (default: a
    whole stream per parameter, numbered by its position). A step with a non-finite gradient is
    skipped before any state changes (:attr:`skipped_steps`), unless ``check_grads_finite=False``.
    ``state_dict`` and ``load_state_dict`` are AdamW's (every state component restored bit-exactly,
    the master in either storage). ``sharded_matrix(param)``: the :class:`ShardedMatrix` of which
    ``param`` is a block, orthogonalized whole, or None (default: every parameter on its own).
    ``split_rows(param)``: the heights of the row blocks of each group of a fused QKV weight that are
    orthogonalized apart (megatron's ``muon_split_qkv``), or None (default: the matrix as one).
    Eager only: one parameter at a time, no fused (compiled) step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Coefficients = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        scale_mode: str = "original",
        extra_scale_factor: float = 1.0,
        *,
        option: str | PrecisionStrategy,
        master_weights: bool | None = None,
        master_storage: str | None = None,
        seed: int = 0,
        check_grads_finite: bool = True,
        stream_layout: Callable[[torch.nn.Parameter], StreamLayout] | None = None,
        sharded_matrix: Callable[[torch.nn.Parameter], ShardedMatrix | None] | None = None,
        split_rows: Callable[[torch.nn.Parameter], tuple[int, ...] | None] | None = None,
    ) -> None:
        self.strategy = muon_strategy(resolve_option(option, master_weights, master_storage))
        self.sharded_matrix = sharded_matrix or (lambda param: None)
        self.split_rows = split_rows or (lambda param: None)
        self.seed = seed
        self.check_grads_finite = check_grads_finite
        self.skipped_steps = 0
        self.buckets: list[Bucket] = []
        self._stream_layout = stream_layout
        self._stream_layouts: dict[torch.nn.Parameter, StreamLayout] = {}
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=_as_tuples(ns_coefficients), eps=eps, ns_steps=ns_steps, scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        group = self.param_groups[group_index]
        _check_hyperparameters(group)
        by_layout: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for index, param in enumerate(group["params"]):
            where = f"parameter {index} of group {group_index}"
            check_muon_param(param, self.strategy, where)
            split_rows = self.split_rows(param)
            if split_rows is not None and (not split_rows or min(split_rows) < 1 or param.size(0) % sum(split_rows)):
                raise ValueError(
                    f"split_rows={split_rows} for {where} (shape {tuple(param.shape)}): the row heights must be positive "
                    "and their sum must divide the rows"
                )
            self._stream_layouts[param] = self._checked_stream_layout(param, where)
            by_layout.setdefault((param.device, param.dtype), []).append(param)
        for params in by_layout.values():
            streams = [self._stream_layouts[param] for param in params]
            bucket, states = build_bucket(self.strategy, group_index, params, False, streams)
            self.buckets.append(bucket)
            for param, state in zip(params, states):
                self.state[param] = state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon step for every parameter with a gradient (see the class docstring for skips)."""
        loss, ready = self._begin_step(closure)
        if not ready:
            return loss
        stochastic = self.strategy.param_update == "stochastic"
        for group in self.param_groups:
            hyper = {key: group[key] for key in HYPERPARAMETERS}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                words = self.random_bits(param, state["step"] + 1) if stochastic else None
                muon_step_(
                    param, param.grad, state, self.strategy, random_source=words, sharded=self.sharded_matrix(param),
                    split_rows=self.split_rows(param), **hyper
                )
        return loss
