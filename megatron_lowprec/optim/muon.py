"""Muon with a precision strategy: the same options as AdamW decide its momentum's storage and how
its update reaches the parameter.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; scaled to LLMs in
"Muon is Scalable for LLM Training", arXiv 2502.16982) updates a 2-D weight θ (m x n) as
``torch.optim.Muon`` does:

    B ← μB + (1-μ)g   (EMA momentum),   M = (1-μ)g + μB with Nesterov, else B,
    O = NS₅(M),   θ ← θ - lr·λ·θ - lr·s(m, n)·O   (decoupled weight decay),

where NS₅ is five quintic Newton-Schulz iterations with coefficients (3.4445, -4.775, 2.0315) on
BF16 matrices, after normalising M by its Frobenius norm (:func:`newton_schulz`), and s(m, n) is the
scale mode (:data:`SCALE_MODES`). torch computes B and M with ``lerp`` and the update with
``add_(alpha=)``, one rounding each (on CPUs a fused multiply-add); here every multiply and add is
rounded to FP32 apart (``kernel.muon_momentum_kernel_``, :func:`orthogonal_step_`,
``kernel.apply_update_``), as in AdamW's reference, so that the eager and the compiled step round
alike (Inductor contracts no multiply-add). The results differ from torch's by those roundings.
The iterations may instead take a triple each, in turn
(megatron-core's default ``muon_coefficient_type="quintic"``, :data:`QUINTIC_COEFFICIENT_SETS`).

Every registered option applies (:func:`muon_strategy`), with the fields read as for AdamW:

* ``moments``: the momentum B is stored in the parameter's 16-bit dtype (A, B, C, kahan, sr), FP32
  (D, D-MW) or FP8 E4M3 per 1x128 group with COAT's range expansion (coat). It is decoded to FP32,
  updated there and rounded once when stored (the strategy's moment codec, ``optim/codecs.py``);
  the Nesterov direction uses the FP32 value before that rounding.
* ``param_update`` and ``master_weights``: the FP32 update Δθ = -lr·λ·θ - lr·s·O reaches the 16-bit
  parameter by nearest rounding, MCF Grow into (θ, δθ), Kahan, or stochastic rounding with the
  counter-based words shared by every replica, or updates an FP32 master stored whole or as a
  remainder or residual below the BF16 parameter: the strategy's parameter codec (``optim/codecs.py``).
* ``weight_decay="multiplicative"`` (D, coat, D-BF16): θ ← θ(1 - lr·λ) - lr·s·O on the FP32
  master, as ``torch.optim.Muon`` (so D is torch's Muon on the master, but for the roundings above).
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

A step has three parts: the element-wise momentum update (:func:`~megatron_lowprec.optim.kernel.muon_momentum_kernel_`),
Newton-Schulz per parameter (:func:`orthogonal_step_`: BF16 matmuls), and the element-wise parameter
update (:func:`~megatron_lowprec.optim.kernel.muon_update_kernel_`). The eager step
(:func:`muon_step_`) runs them one parameter at a time; the fused step
(:func:`fused_muon_bucket_step_`) compiles the element-wise parts as AdamW's fused step is compiled
and runs each once per bucket (the matmuls stay per parameter), with the same bits, over a flat
parameter buffer of its own or, where the parameters must stay in another owner's buffer (megatron
DDP's, in its shard-aligned layer-wise layout), over rows of that buffer, in place.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.adamw import PrecisionOptimizer
from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES, CompileRecipe
from megatron_lowprec.optim.buckets import (
    ALIGNMENT, Bucket, BufferRows, build_bucket, in_place_runs, param_rows_in_place, params_in_place,
)
from megatron_lowprec.optim.fused import (
    bucket_entries,
    compile_step_function,
    fused_call_arguments,
    fused_entries,
    group_statistics_in_kernel,
    resolve_fused,
    run_calls,
    warn_eager_fallback,
)
from megatron_lowprec.optim.kernel import (
    MuonScalars,
    check_param_dtype,
    muon_momentum_kernel_,
    muon_update_kernel_,
)
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
    "shape_scaling": lambda rows, columns: math.sqrt(max(1, rows / columns)),
    "match_rms_adamw": lambda rows, columns: 0.2 * math.sqrt(max(rows, columns)),
    "spectral": lambda rows, columns: math.sqrt(max(rows, columns)),
    "unit_rms_norm": lambda rows, columns: math.sqrt(rows / columns),
}
"""s(m, n) for an m x n weight, by megatron-core's ``muon_scale_mode`` names: ``"shape_scaling"``
(Keller Jordan's √max(1, m/n), torch's ``adjust_lr_fn="original"``), ``"spectral"`` (√max(m, n), its
default) and ``"unit_rms_norm"`` (√(m/n)); and torch's ``"match_rms_adamw"`` (Moonshot's
0.2·√max(m, n), arXiv 2502.16982 §2.2), which megatron-core spells ``"spectral"`` with
``muon_extra_scale_factor=0.2``."""
EARLIER_SCALE_MODES = {"original": "shape_scaling"}
"""Earlier spellings of :data:`SCALE_MODES` names (torch's ``adjust_lr_fn`` name): :class:`Muon` takes
them with a warning, :func:`update_scale` (which a parameter group restored from an earlier
checkpoint reaches) without."""


def muon_strategy(option: str | PrecisionStrategy) -> PrecisionStrategy:
    """``option`` as Muon runs it: one momentum instead of m and v, no second-moment expansion (so C
    is B), the reference update (see the module docstring). The name stays."""
    strategy = resolve_option(option)
    return replace(strategy, moment_names=MUON_MOMENTS, second_moment_mcf=False, adam_kernel="reference")


def update_scale(shape: torch.Size | tuple[int, int], scale_mode: str) -> float:
    """s(m, n) of :data:`SCALE_MODES` for a weight of ``shape`` (m, n)."""
    scale_mode = EARLIER_SCALE_MODES.get(scale_mode, scale_mode)
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


def _momentum_state(state: dict[str, Any]) -> dict[str, Any]:
    """The momentum's part of a parameter's (or a call's) state."""
    return {key: value for key, value in state.items() if key.startswith(MUON_MOMENTS)}


def _update_state(state: dict[str, Any]) -> dict[str, Any]:
    """The parameter's part of a state: master, δθ or Kahan compensation (the rest but the step)."""
    return {key: value for key, value in state.items() if torch.is_tensor(value) and not key.startswith(MUON_MOMENTS)}


def orthogonal_step_(
    out: torch.Tensor,
    direction: torch.Tensor,
    *,
    lr: float,
    ns_coefficients: Coefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
    scale_mode: str = "shape_scaling",
    extra_scale_factor: float = 1.0,
    sharded: ShardedMatrix | None = None,
    split_rows: tuple[int, ...] | None = None,
) -> None:
    """``out`` ← -lr·s(m, n)·extra_scale_factor·O, FP32, each element rounded once, where O is the
    Newton-Schulz orthogonalization of the 2-D BF16 ``direction`` (:func:`newton_schulz`; ``out``
    and ``direction`` of the parameter's shape). ``sharded``: ``direction`` is that block of a
    matrix, which is orthogonalized whole (collective over its group) with s of the whole shape, and
    this block of the result kept. ``split_rows``: the rows are groups of blocks of these heights (a
    fused QKV weight's query, key and value rows per query group): the i-th blocks of all groups,
    stacked, form one matrix, orthogonalized with its own s (megatron-core's ``split_qkv``), and the
    results are put back in place."""

    def orthogonalized(matrix: torch.Tensor) -> tuple[torch.Tensor, float]:
        if sharded is None:
            return newton_schulz(matrix, ns_coefficients, ns_steps, eps), update_scale(matrix.shape, scale_mode)
        whole = newton_schulz(sharded.gather(matrix), ns_coefficients, ns_steps, eps)
        return sharded.block(whole), update_scale(sharded.whole_shape(matrix.shape), scale_mode)

    if split_rows is None:
        pieces = [(out, direction)]
    else:
        rows, columns = direction.shape
        groups = rows // sum(split_rows)
        pieces = zip(
            out.view(groups, -1, columns).split(list(split_rows), dim=1),
            direction.view(groups, -1, columns).split(list(split_rows), dim=1),
        )
    for out_piece, piece in pieces:
        orthogonal, scale = orthogonalized(piece.reshape(-1, piece.shape[-1]))
        out_piece.copy_(orthogonal.float().view(out_piece.shape) * (-lr * scale * extra_scale_factor))


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
    random_source: torch.Tensor | None = None,
    **orthogonalization: Any,
) -> None:
    """One Muon step on the 2-D ``param``, in place, following ``strategy`` (a :func:`muon_strategy`;
    see the module docstring): :func:`~megatron_lowprec.optim.kernel.muon_momentum_kernel_`,
    :func:`orthogonal_step_` (``orthogonalization``: its keywords), then
    :func:`~megatron_lowprec.optim.kernel.muon_update_kernel_`. ``grad`` must be finite.
    ``random_source``: the 32-bit words of ``param``'s shape that stochastic rounding draws."""
    state["step"] += 1
    scalars = MuonScalars.for_step(lr, weight_decay, momentum)
    direction = muon_momentum_kernel_(grad, _momentum_state(state), strategy, scalars, nesterov)
    term = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    orthogonal_step_(term, direction, lr=lr, **orthogonalization)
    muon_update_kernel_(param, term, _update_state(state), strategy, scalars, random_source)


@functools.cache
def compiled_muon_momentum_kernel(group_statistics: bool = False) -> Callable:
    """:func:`~megatron_lowprec.optim.kernel.muon_momentum_kernel_` compiled as AdamW's fused step is
    (:func:`~megatron_lowprec.optim.fused.compile_step_function`; ``group_statistics`` for FP8 momentum)."""
    return compile_step_function(muon_momentum_kernel_, group_statistics)


@functools.cache
def compiled_muon_update_kernel() -> Callable:
    """:func:`~megatron_lowprec.optim.kernel.muon_update_kernel_` compiled (Dynamo specialises it per
    strategy); without group statistics also for FP8 momentum, which it never reads."""
    return compile_step_function(muon_update_kernel_)


@torch.no_grad()
def fused_muon_bucket_step_(
    bucket: Bucket,
    strategy: PrecisionStrategy,
    grad: torch.Tensor | BufferRows,
    entry_grads: list[torch.Tensor],
    orthogonal_steps: Callable[[int, torch.Tensor, torch.Tensor], None],
    *,
    step: int,
    sr_seed: int | None,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    background_compile: bool = False,
) -> None:
    """One Muon step over a whole bucket (every entry at ``step`` after this call): one compiled
    call of the momentum kernel over the bucket (FP8 momentum: as [groups, group_size]), whose BF16
    directions go to ``orthogonal_steps(entry, out, direction)`` entry by entry (the Newton-Schulz
    matmuls: :func:`orthogonal_step_` into ``out``, the entry's view of a bucket-sized FP32
    buffer), then the compiled calls of the update kernel that AdamW's fused step would make
    (:func:`~megatron_lowprec.optim.fused.fused_call_arguments`: one per bucket, or per entry for
    stochastic rounding on CPUs). ``grad`` and ``entry_grads``: as for
    :func:`~megatron_lowprec.optim.fused.fused_bucket_step_`; the parameters are the bucket's own
    flat buffer or rows of another (:attr:`~megatron_lowprec.optim.buckets.Bucket.param_rows`),
    read and written in place."""
    scalars = {bucket.group_index: MuonScalars.for_step(lr, weight_decay, momentum)}
    momentum_recipe = CompileRecipe(compiled_muon_momentum_kernel, (group_statistics_in_kernel(strategy, bucket.device),))
    calls = fused_call_arguments(bucket, strategy, grad, entry_grads, scalars, None, step)
    (direction,) = run_calls(
        momentum_recipe, muon_momentum_kernel_, bucket, strategy, calls,
        lambda call: (call.grad, _momentum_state(call.state), strategy, call.scalars, nesterov, False), _joined, background_compile,
    )
    direction = direction.view(-1)
    terms = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
    entry_terms = [bucket.view(terms, index) for index in range(len(bucket.params))]
    for index, (param, term) in enumerate(zip(bucket.params, entry_terms)):
        orthogonal_steps(index, term.view(param.shape), bucket.view(direction, index).view(param.shape))
    run_calls(
        CompileRecipe(compiled_muon_update_kernel), muon_update_kernel_, bucket, strategy,
        fused_call_arguments(bucket, strategy, terms, entry_terms, scalars, sr_seed, step),
        lambda call: (call.param, call.grad, _update_state(call.state), strategy, call.scalars, call.random_source),
        lambda results: None, background_compile,
    )


def _still_in_place(bucket: Bucket) -> bool:
    """Whether every parameter of a bucket laid out in place is still its view of the bucket's range."""
    return all(
        param.data_ptr() == view.data_ptr() and param.is_contiguous()
        for param, view in zip(bucket.params, bucket.entry_params())
    )


def _joined(directions: list[torch.Tensor]) -> torch.Tensor:
    """The directions of a momentum call run in pieces, as one tensor."""
    return directions[0] if len(directions) == 1 else torch.cat(directions)


ELEMENT_WISE = ("lr", "weight_decay", "momentum", "nesterov")
"""The keys of a parameter group that the element-wise parts of a step take."""
ORTHOGONALIZATION = ("ns_coefficients", "eps", "ns_steps", "scale_mode", "extra_scale_factor")
"""The keys of a parameter group that :func:`orthogonal_step_` takes besides ``lr``."""


def _as_tuples(coefficients: Any) -> Any:
    return tuple(_as_tuples(value) for value in coefficients) if isinstance(coefficients, (tuple, list)) else coefficients


def _current_scale_mode(scale_mode: str) -> str:
    """``scale_mode``, an earlier spelling (:data:`EARLIER_SCALE_MODES`) as the current one with a warning."""
    if scale_mode not in EARLIER_SCALE_MODES:
        return scale_mode
    current = EARLIER_SCALE_MODES[scale_mode]
    warnings.warn(f"scale_mode={scale_mode!r} is deprecated; use scale_mode={current!r} (megatron-core's name)", FutureWarning, stacklevel=3)
    return current


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

    Hyperparameters and defaults are ``torch.optim.Muon``'s; ``scale_mode`` (:data:`SCALE_MODES`) is
    megatron-core's ``muon_scale_mode`` (``"shape_scaling"``, torch's default ``adjust_lr_fn``,
    ``"spectral"``, ``"unit_rms_norm"``) or torch's ``"match_rms_adamw"``, times ``extra_scale_factor``
    (megatron-core's ``muon_extra_scale_factor``).
    ``ns_coefficients`` is torch's one (a, b, c) for every Newton-Schulz iteration or, as
    megatron-core's coefficient types, a sequence of triples taken in turn (:func:`coefficient_schedule`).
    Parameters must be 2-D and bfloat16 or float16 (others: :class:`~megatron_lowprec.optim.AdamW`
    with the same option). ``master_weights``, ``master_storage`` and ``moment_storage`` act as for AdamW. Stochastic
    rounding draws the counter-based words of (``seed``, step, stream, element): every replica of an
    element draws the same; ``stream_layout(param)`` places a parameter in the stream (default: a
    whole stream per parameter, numbered by its position). A step with a non-finite gradient is
    skipped before any state changes (:attr:`skipped_steps`), unless ``check_grads_finite=False``.
    ``state_dict`` and ``load_state_dict`` are AdamW's (every state component restored bit-exactly,
    the master in either storage). ``sharded_matrix(param)``: the :class:`ShardedMatrix` of which
    ``param`` is a block, orthogonalized whole, or None (default: every parameter on its own).
    ``split_rows(param)``: the heights of the row blocks of each group of a fused QKV weight that are
    orthogonalized apart (megatron's ``muon_split_qkv``), or None (default: the matrix as one).
    ``fused`` is AdamW's (default: where available): the element-wise parts of a step, before and
    after Newton-Schulz, are one compiled call each per bucket (:func:`fused_muon_bucket_step_`;
    parameters' ``.data`` and ``.grad`` re-pointed at flat buffers, as AdamW does), the matmuls stay
    per parameter; ``fused=False`` runs :func:`muon_step_` per parameter. Both give the same bits.
    ``params_in_buffer``: the parameters are contiguous views of flat buffers that another owner
    needs them in (megatron DDP's parameter buffer, whose all-gather carries them to the other
    ranks): the fused step leaves them there and reads and writes them there. With ``buffer_row``,
    the owner's row (it starts every parameter at a multiple of that many elements; megatron's:
    :data:`megatron_lowprec.megatron.layout.ROW`), a bucket per run of weights that follow one
    another in the buffer separated by the owner's zero padding alone
    (:func:`~megatron_lowprec.optim.buckets.in_place_runs`), laid out in place as the distributed
    optimizer's shards are; without it, or where that layout does not fit, the bucket reads them as
    rows (:class:`~megatron_lowprec.optim.buckets.BufferRows`). Their gradients, where they lie in
    another buffer as the weights lie in theirs (megatron's ``main_grad``), are read there as a
    slice. Should a parameter later leave its buffer, its bucket steps eagerly (a warning says so).
    ``background_compile`` is AdamW's: the fused calls run uncompiled until a child process has
    compiled them (:mod:`~megatron_lowprec.optim.background_compile`).
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
        scale_mode: str = "shape_scaling",
        extra_scale_factor: float = 1.0,
        *,
        option: str | PrecisionStrategy,
        master_weights: bool | None = None,
        master_storage: str | None = None,
        moment_storage: str | None = None,
        fused: bool | None = None,
        params_in_buffer: bool = False,
        buffer_row: int | None = None,
        background_compile: bool = False,
        seed: int = 0,
        check_grads_finite: bool = True,
        stream_layout: Callable[[torch.nn.Parameter], StreamLayout] | None = None,
        sharded_matrix: Callable[[torch.nn.Parameter], ShardedMatrix | None] | None = None,
        split_rows: Callable[[torch.nn.Parameter], tuple[int, ...] | None] | None = None,
    ) -> None:
        self.strategy = muon_strategy(resolve_option(option, master_weights, master_storage, moment_storage))
        self.sharded_matrix = sharded_matrix or (lambda param: None)
        self.split_rows = split_rows or (lambda param: None)
        self._fused_request = fused
        self.params_in_buffer = params_in_buffer
        if buffer_row is not None and (buffer_row < 1 or buffer_row & (buffer_row - 1) or ALIGNMENT % buffer_row):
            raise ValueError(f"buffer_row={buffer_row}: must be a power of two dividing {ALIGNMENT}, or None")
        self.buffer_row = buffer_row
        self.background_compile = background_compile
        self.seed = seed
        self.check_grads_finite = check_grads_finite
        self.skipped_steps = 0
        self.buckets: list[Bucket] = []
        self._stream_layout = stream_layout
        self._stream_layouts: dict[torch.nn.Parameter, StreamLayout] = {}
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=_as_tuples(ns_coefficients), eps=eps, ns_steps=ns_steps, scale_mode=_current_scale_mode(scale_mode),
            extra_scale_factor=extra_scale_factor,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        group = self.param_groups[group_index]
        group["scale_mode"] = _current_scale_mode(group["scale_mode"])
        _check_hyperparameters(group)
        by_layout: dict[tuple[torch.device, torch.dtype, int | None], list[torch.nn.Parameter]] = {}
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
            buffer = param.untyped_storage().data_ptr() if self.params_in_buffer else None
            by_layout.setdefault((param.device, param.dtype, buffer), []).append(param)
        for (device, _, _), params in by_layout.items():
            fused = resolve_fused(device, self._fused_request)
            if fused:
                served = fused_entries(self.strategy, self._fused_request, params, [self._stream_layouts[param] for param in params])
                eager = [param for param, takes_fused in zip(params, served) if not takes_fused]
                if eager:
                    self._add_bucket(group_index, eager, False, in_buffer=False)
                params = [param for param, takes_fused in zip(params, served) if takes_fused]
                if not params:
                    continue
            if fused and self.params_in_buffer:
                self._check_in_buffer(params, group_index)
                runs = in_place_runs(params, self.buffer_row) if self.buffer_row else [list(range(len(params)))]
                for run in runs:
                    self._add_bucket(group_index, [params[index] for index in run], fused, in_buffer=True)
            else:
                self._add_bucket(group_index, params, fused, in_buffer=False)

    @staticmethod
    def _check_in_buffer(params: list[torch.nn.Parameter], group_index: int) -> None:
        shapes = [tuple(param.shape) for param in params if not param.is_contiguous()]
        if shapes:
            raise ValueError(
                f"params_in_buffer=True, but parameters of shapes {shapes} in group {group_index} are not contiguous "
                "views of a flat buffer; use params_in_buffer=False (the fused step then owns their buffer)"
            )

    def _add_bucket(self, group_index: int, params: list[torch.nn.Parameter], fused: bool, in_buffer: bool) -> None:
        """A bucket of ``params``: owning their buffer (fused), or ``in_buffer``, laid out in place in
        the buffer they live in (:func:`~megatron_lowprec.optim.buckets.params_in_place`) or, where
        its layout does not fit, reading and writing them there as rows."""
        streams = [self._stream_layouts[param] for param in params]
        in_place = params_in_place(self.strategy, params, self.buffer_row) if in_buffer and self.buffer_row else None
        bucket, states = build_bucket(
            self.strategy, group_index, params, fused and not in_buffer, streams, in_place=in_place,
        )
        if in_buffer and in_place is None:
            bucket.param_rows = param_rows_in_place(bucket)
        self.buckets.append(bucket)
        for param, state in zip(params, states):
            self.state[param] = state

    def _orthogonalization(self, param: torch.nn.Parameter, group: dict[str, Any]) -> dict[str, Any]:
        """:func:`orthogonal_step_`'s keywords for ``param`` of ``group`` but ``lr``."""
        return dict(
            sharded=self.sharded_matrix(param), split_rows=self.split_rows(param), **{key: group[key] for key in ORTHOGONALIZATION}
        )

    def _step_bucket(self, bucket: Bucket) -> None:
        group = self.param_groups[bucket.group_index]
        hyper = {key: group[key] for key in ELEMENT_WISE}
        if bucket.param_rows is not None:
            bucket.param_rows = param_rows_in_place(bucket)
            if bucket.param_rows is None:
                warn_eager_fallback(bucket_entries(bucket), "its parameters are no longer contiguous views of one buffer")
        elif bucket.in_place and bucket.param_buffer is not None and not _still_in_place(bucket):
            bucket.param_buffer = None
            warn_eager_fallback(bucket_entries(bucket), "its parameters are no longer contiguous views of one buffer")
        grad, step = self._fused_step_grads(bucket)
        if grad is not None:

            def orthogonal_steps(index: int, out: torch.Tensor, direction: torch.Tensor) -> None:
                orthogonal_step_(out, direction, lr=group["lr"], **self._orthogonalization(bucket.params[index], group))

            fused_muon_bucket_step_(
                bucket, self.strategy, grad, [param.grad.reshape(-1) for param in bucket.params], orthogonal_steps,
                step=step, sr_seed=self._sr_seed, background_compile=self.background_compile, **hyper,
            )
            return
        stochastic = self.strategy.param_update == "stochastic"
        for param in bucket.params:
            if param.grad is None:
                continue
            state = self.state[param]
            words = self.random_bits(param, state["step"] + 1) if stochastic else None
            muon_step_(
                param, param.grad, state, self.strategy, random_source=words, **hyper, **self._orthogonalization(param, group)
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon step for every parameter with a gradient (see the class docstring for skips)."""
        loss, ready = self._begin_step(closure)
        if ready:
            for bucket in self.buckets:
                self._step_bucket(bucket)
        if self.background_compile:
            BACKGROUND_COMPILES.start()
        return loss
