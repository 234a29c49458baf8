"""The functional core of the precision-aware optimizers: one reference step for every strategy.

:func:`adamw_kernel_` is AdamW's specification. The eager path runs it per parameter; the fused
path (``fused.py``) compiles the very same function and runs it once per flat bucket, and the two
must agree bit for bit. :class:`megatron_lowprec.optim.AdamW` is the thin optimizer class around it.
Muon's element-wise parts are specified the same way (:func:`muon_momentum_kernel_` before
Newton-Schulz, :func:`muon_update_kernel_` after it, run per parameter or compiled per bucket by
``muon.py``), and both optimizers apply their update with one piece (:func:`apply_update_`).

Rounding points of the reference, for every strategy:

* Scalars (bias corrections, step size, ``lr * weight_decay``, ``1 - beta``) are Python floats (fp64)
  and never pass through a low-precision tensor (Collage §4.2, "compute scalars in high precision").
* Each moment is decoded to FP32 by the strategy's moment codec, updated there (m = β1·m + (1-β1)·g, v = β2·v + g·g·(1-β2), every
  operation rounded to FP32 on its own, none fused) and rounded once when stored (nearest for
  16-bit, per-group FP8 quantization for COAT). Collage-plus instead updates (v, δv) with Mul and
  Grow, every elementary operation rounded to the 16-bit format (Collage Alg. 2, line 9).
* Where a value is rounded to the 16-bit parameter dtype and then computed with again (the inputs
  of Grow, Fast2Sum and Mul, and every operation inside them), the rounding is
  :func:`~megatron_lowprec.numerics.formats.round_to_16bit_on_device`: on GPUs the BF16 cast read
  back through its bits (one ``cvt.rn.bf16.f32``; FP16: integer operations on the FP32 bits), never
  the bare cast round trip ``x.to(bf16).to(fp32)``, which Inductor's Triton code removes (measured on
  an H100); on CPUs the cast, which Inductor's C++ code keeps. So the compiled step
  rounds exactly where this specification does, on every backend. Casts to 16 bits that remain either store a result or convert an exact value.
* The update Δθ = -lr (m̂ / (√v̂ + ε) + λθ) is computed in FP32 (Collage App. D) as
  λ'θ + s·m / (√v + ε̂) with s = -lr √(1-β2^t) / (1-β1^t), ε̂ = ε √(1-β2^t) (Adam §2), a correctly
  rounded square root and a correctly rounded division on every backend
  (:mod:`~megatron_lowprec.numerics.elementary`: Triton's own FP32 division is approximate), then
  applied as the strategy's parameter codec says (:mod:`~megatron_lowprec.optim.codecs`): nearest,
  Grow into (θ, δθ), Kahan, stochastic rounding, or into an FP32 master.
* An FP32 master is read and written through its master codec: stored whole (the 16-bit parameter
  is its nearest rounding, a cast) or as the BF16 parameter plus an int16 remainder or an int8
  residual (integer operations on the bit pattern).
* FP8 and companded INT8 moments are decoded and re-quantized by ``numerics/quant.py``, whose
  divisions, square roots, ``log`` and ``pow`` are likewise the same function on every backend.
* ``adam_kernel="torch_fused"`` (option D) does not run this specification: torch's own fused AdamW
  kernel updates the FP32 master (``torch_fused.py``), in the eager and in the fused step alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from megatron_lowprec.metrics.update_quality import update_quality_pieces
from megatron_lowprec.numerics.elementary import div_rn, sqrt_rn
from megatron_lowprec.numerics.mcf import expand_scalar, grow, mul
from megatron_lowprec.numerics.rounding import (
    counter_round_keys,
    hash_words,
    keyed_random_bits,
    row_random_bits,
    signed_word,
)
from megatron_lowprec.optim.buckets import PER_GROUP_PARTS, BufferRows, build_bucket
from megatron_lowprec.optim.codecs import rounded_to
from megatron_lowprec.optim.master import check_master_param_dtype
from megatron_lowprec.optim.strategies import PrecisionStrategy
from megatron_lowprec.optim.torch_fused import torch_fused_adamw_step_

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

SR_ROW_TABLE_BYTES = 4 + 4 + 4 + 8 + 8 + 3 * 4
"""Bytes :class:`BucketStream` reads per row of its table (a bucket's ``row_width`` elements), whose
elements share every lookup: the row's entry (int32); the entry's column shift and row length
(int32), first row start and row stride (int64), and three round keys (int32)."""


def call_rows(like: torch.Tensor, phase: torch.Tensor, width: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Per element of a call of ``like``'s shape, its row of ``width`` elements (a power of two; the
    call's first row holds ``phase`` elements before its first, a 0-d int32 host tensor): the index
    into a per-row table. Counted in ``dtype``: int64 for a call that may exceed 2^31 elements, int32
    for one that may not (stochastic rounding's windows)."""
    element = torch.arange(like.numel(), dtype=dtype, device=like.device).view(like.shape)
    return (element + phase) >> (width.bit_length() - 1)


def kernel_scalar(value: float | int, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-d host tensor for a compiled kernel. Inductor passes 0-d CPU tensors to GPU
    kernels by value, so a step-dependent scalar reaches the kernel without a host-to-device copy
    (``torch.tensor(value, device="cuda")`` blocks the host until the device has caught up) and
    without the kernel being specialised on it."""
    return torch.tensor(value, dtype=dtype)


class CounterStream(NamedTuple):
    """The counter-based SR words of a tensor viewed as [rows, row_length] (see
    :class:`~megatron_lowprec.numerics.rounding.StreamLayout`): round keys of (seed, step, stream)
    (0-d int32 tensors in the compiled step, so that it is not specialised on them) and the global
    index of each row's start as int32 high and low words ([rows, 1],
    :func:`~megatron_lowprec.numerics.rounding.row_start_words`): the compiled step has no 64-bit
    integer."""

    keys: tuple[Any, Any, Any]
    start_high: torch.Tensor
    start_low: torch.Tensor

    @classmethod
    def at_step(cls, seed: int, step: int, stream: int, start_high: torch.Tensor, start_low: torch.Tensor) -> CounterStream:
        """The stream's words at ``step``: round keys as :func:`kernel_scalar` int32 words."""
        keys = tuple(kernel_scalar(signed_word(key), torch.int32) for key in counter_round_keys(seed, step, stream))
        return cls(keys, start_high, start_low)

    def words(self, like: torch.Tensor) -> torch.Tensor:
        return row_random_bits(self.keys, self.start_high, self.start_low, like.shape[1])


class BucketStream(NamedTuple):
    """The counter-based SR words of a whole call over a flat bucket (or a window of one), for
    devices with integer division (GPUs). No row of ``row_width`` elements of the call holds two
    entries (:meth:`~megatron_lowprec.optim.buckets.Bucket.entry_rows`), so each element finds its
    entry with one lookup in a per-row table (no search), and its global
    index in its entry's stream arithmetically: its row and column by one division by the entry's row
    length, and the row's start from the entry's first row start and row stride (int64). The entry's
    round keys at this step come from a block of steps kept on the device
    (:func:`~megatron_lowprec.numerics.rounding.counter_round_keys_table`), so a step passes only its
    row in the block, by value. An entry may start inside a row of its stream (a run of a
    parameter's elements). The words equal :class:`CounterStream`'s (padding elements, zero and
    rounded to zero whatever their word, continue their entry's last row). Every table has at least
    two values (a last entry or row repeated), so that no size is one, which a compiled step would
    specialise on."""

    keys: torch.Tensor
    """[steps x entries x 3] int32 round keys of each entry's stream at each step of a block, flat."""
    step_row: torch.Tensor
    """0-d int32 host tensor: this step's row in the block of keys."""
    row_entries: torch.Tensor
    """[rows] int32: the entry of each row of the call."""
    phase: torch.Tensor
    """0-d int32 host tensor: the elements of the call's first row before its first (:func:`call_rows`)."""
    row_width: int
    """Elements per row of ``row_entries`` (the bucket's)."""
    column_shifts: torch.Tensor
    """[entries] int32: the column of each entry's first element in its first row, less the entry's
    offset in the call (an element's column counted from that row's start is its offset plus this)."""
    row_lengths: torch.Tensor
    """[entries] int32 row length of each entry's stream layout."""
    row_starts: torch.Tensor
    """[entries] int64 global index of the start of each entry's first row (two's complement mod 2^64)."""
    row_strides: torch.Tensor
    """[entries] int64 global index distance between consecutive rows of each entry's stream."""

    def words(self, like: torch.Tensor, repeated: torch.Tensor | None = None) -> torch.Tensor:
        """Per element: one lookup in the per-row table, then seven in the per-entry tables
        (:data:`SR_ROW_TABLE_BYTES`). ``repeated``: the index in the call of the element whose word
        each element takes (a packed shard's padding repeats an element of its own entry,
        :meth:`~megatron_lowprec.optim.buckets.BufferRows.repetition`); itself by default. Element
        indices are int32: a call covers fewer than 2^31 elements
        (:data:`~megatron_lowprec.optim.fused.MAX_CALL_ELEMENTS`)."""
        element = torch.arange(like.numel(), dtype=torch.int32, device=like.device)
        entry = self.row_entries[call_rows(element, self.phase, self.row_width, torch.int32)]
        local = (element if repeated is None else repeated.reshape(-1)) + self.column_shifts[entry]
        row_length = self.row_lengths[entry]
        row = torch.div(local, row_length, rounding_mode="trunc")
        column = local - row * row_length
        index = self.row_starts[entry] + row.to(torch.int64) * self.row_strides[entry] + column.to(torch.int64)
        key_base = (self.step_row * self.column_shifts.shape[0] + entry) * 3
        keys = tuple(self.keys[key_base + part] for part in range(3))
        return keyed_random_bits(keys, index).view(like.shape)


SR_GROUP_TABLE_BYTES = 4 + 4 + 4 + 3 * 4
"""Bytes :class:`GroupStream` reads per FP8 group, whose elements share every lookup: the group's
entry and its first element's global index as two int32 words, and the entry's three round keys (int32)."""

_INT32_SIGN = -(2**31)


class GroupStream(NamedTuple):
    """The counter-based SR words of a call over a bucket as [groups, group_size] (FP8 moments with
    stochastic rounding, SR paper Alg. 1 with COAT §4's groups), on every device: each group lies
    inside one row of its entry's stream layout, so element (g, c) has the global index
    ``start[g] + c`` of its entry's stream (the words of :class:`CounterStream` and
    :class:`BucketStream`: every replica and shard of an element draws the same word). Per group a
    table gives its entry and the global index of its first element as int32 high and low words (as
    :func:`~megatron_lowprec.numerics.rounding.row_start_words`; the column is added with an unsigned
    carry, as :func:`~megatron_lowprec.numerics.rounding.row_random_bits` does), so that a compiled
    call does every lookup once per group, in its outer loop, and needs no integer division. The round
    keys of each entry come from a block of steps kept on the device, as :class:`BucketStream`'s.
    Padding elements after an entry's last continue its last group's indices (zero, and rounded to
    zero whatever their word), or, in a packed shard, take the word of the element they repeat."""

    keys: torch.Tensor
    """[steps, entries x 3] int32 round keys of each entry's stream at each step of a block."""
    step_row: torch.Tensor
    """0-d int32 host tensor: this step's row in the block of keys."""
    group_entries: torch.Tensor
    """[groups] int32: the entry of each group of the call."""
    start_high: torch.Tensor
    """[groups] int32: the high word of the global index of each group's first element."""
    start_low: torch.Tensor
    """[groups] int32: its low word."""
    group_size: int
    """Elements per FP8 group: a constant of the compiled step (the strategy's), so that a call whose
    other tensors leave it a size symbol (Muon's update, which reads no FP8 state) finds each
    element's group with a constant shift."""

    def words(self, like: torch.Tensor, repeated: torch.Tensor | None = None) -> torch.Tensor:
        """The words of a call of ``like``'s shape [groups, group_size]. ``repeated``: the index in the
        call of the element whose word each element takes (a packed shard's padding,
        :meth:`~megatron_lowprec.optim.buckets.BufferRows.repetition`); itself by default."""
        groups, group_size = like.shape[0], self.group_size
        if repeated is None:
            group = torch.arange(groups, device=like.device).view(-1, 1)
            column = torch.arange(group_size, dtype=torch.int32, device=like.device).view(1, -1)
        else:
            group, column = repeated // group_size, repeated % group_size
        entry = self.group_entries[group]
        key_base = self.step_row * self.keys.shape[1] + entry * 3
        flat_keys = self.keys.view(-1)
        keys = tuple(flat_keys[key_base + part] for part in range(3))
        start_low = self.start_low[group]
        low = start_low + column
        carry = (low ^ _INT32_SIGN) < (start_low ^ _INT32_SIGN)
        return hash_words(keys, self.start_high[group] + carry.to(torch.int32), low)


RandomSource = torch.Tensor | CounterStream | BucketStream | GroupStream | None
"""Precomputed 32-bit words (a generator's draw, or a stream's words), a counter stream over a
[rows, row_length] view, a bucket's stream per row or per FP8 group, or nothing (no SR)."""


def check_param_dtype(param: torch.Tensor, strategy: PrecisionStrategy, where: str = "parameter") -> None:
    """Raise ``ValueError`` if ``strategy`` cannot store ``param``."""
    if param.dtype not in SUPPORTED_PARAM_DTYPES:
        valid = ", ".join(str(d) for d in SUPPORTED_PARAM_DTYPES)
        raise ValueError(
            f"option {strategy.name!r} keeps the model's parameters in 16 bits; {where} of shape "
            f"{tuple(param.shape)} has dtype {param.dtype}, valid dtypes: {valid}"
        )
    check_master_param_dtype(param, strategy, where)


def init_state(param: torch.Tensor, strategy: PrecisionStrategy) -> dict[str, Any]:
    """Fresh optimizer state for one ``param``: zero moments and components, an FP32 master if any."""
    return build_bucket(strategy, 0, [param], own_params=False)[1][0]


class KernelScalars:
    """Scalars of one step, computed in Python floats (fp64) before they meet a tensor (a frozen
    dataclass of floats): used as Python floats (eager) or 0-d FP32 tensors (compiled); either way
    each is rounded once to FP32 where it multiplies an FP32 tensor."""

    def as_kernel_scalars(self):
        """The same scalars as 0-d FP32 host tensors (:func:`kernel_scalar`), for a compiled step."""
        return type(self)(*(kernel_scalar(getattr(self, f.name), torch.float32) for f in fields(self)))


@dataclass(frozen=True)
class StepScalars(KernelScalars):
    """The scalars of one AdamW step (see :class:`KernelScalars`)."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    neg_scaled_step_size: float
    """-lr √(1 - beta2^t) / (1 - beta1^t): the step size with both bias corrections (Adam §2)."""
    scaled_eps: float
    """ε √(1 - beta2^t), so that m̂ / (√v̂ + ε) = √(1-β2^t)/(1-β1^t) · m / (√v + ε̂) with one division."""
    neg_lr_weight_decay: float
    """-lr * weight_decay (decay inside the update, Collage App. D)."""
    decay_factor: float
    """1 - lr * weight_decay (multiplicative decay, as torch.optim.AdamW)."""

    @classmethod
    def for_step(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> StepScalars:
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        return cls(
            beta1=beta1,
            one_minus_beta1=1 - beta1,
            beta2=beta2,
            one_minus_beta2=1 - beta2,
            neg_scaled_step_size=-lr * bias_correction2_sqrt / bias_correction1,
            scaled_eps=eps * bias_correction2_sqrt,
            neg_lr_weight_decay=-lr * weight_decay,
            decay_factor=1 - lr * weight_decay,
        )


@dataclass(frozen=True)
class MuonScalars(KernelScalars):
    """The scalars of the element-wise parts of one Muon step (:func:`muon_momentum_kernel_`,
    :func:`muon_update_kernel_`)."""

    momentum: float
    one_minus_momentum: float
    neg_lr_weight_decay: float
    """-lr * weight_decay (decay inside the update, Collage App. D)."""
    decay_factor: float
    """1 - lr * weight_decay (multiplicative decay, as torch.optim.Muon)."""

    @classmethod
    def for_step(cls, lr: float, weight_decay: float, momentum: float) -> MuonScalars:
        return cls(momentum, 1 - momentum, -lr * weight_decay, 1 - lr * weight_decay)


def _collage_second_moment_(
    state: dict[str, Any], grad: torch.Tensor, scalars: StepScalars, beta2_expansion: tuple[Any, Any], dtype: torch.dtype
) -> torch.Tensor:
    """(v, δv) ← Grow(Mul((β̂2, δβ2), (v, δv)), (1 - β2) g²) in 16-bit MCF (Collage Alg. 2, line 9).

    Returns the represented v = v + δv in FP32.
    """
    fresh = rounded_to(grad * grad * scalars.one_minus_beta2, dtype)
    scaled_hi, scaled_lo = mul(*beta2_expansion, state["exp_avg_sq"], state["exp_avg_sq_lo"])
    v_hi, v_lo = grow(scaled_hi, scaled_lo, fresh)
    state["exp_avg_sq"].copy_(v_hi)
    state["exp_avg_sq_lo"].copy_(v_lo)
    return v_hi.float() + v_lo.float()


def represented_value(param: torch.Tensor, state: dict[str, Any], strategy: PrecisionStrategy) -> torch.Tensor:
    """The exact value the optimizer holds for ``param`` in float64 (its parameter codec's): master
    (whole, or the parameter joined with its remainder or residual), θ + δθ, or θ."""
    return strategy.param_codec.represented(param, state)


def _adam_term(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scalars: StepScalars) -> torch.Tensor:
    """-lr m̂ / (√v̂ + ε) with the bias corrections folded into the scalars (Adam §2): one correctly
    rounded division and square root."""
    return div_rn(scalars.neg_scaled_step_size * exp_avg, sqrt_rn(exp_avg_sq) + scalars.scaled_eps)


def apply_update_(
    param: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    term: torch.Tensor,
    scalars: StepScalars | MuonScalars,
    random_source: RandomSource,
    track_update_quality: bool = False,
) -> torch.Tensor | None:
    """The parameter update of every optimizer's step, in place: the FP32 ``term`` (AdamW's
    -lr m̂ / (√v̂ + ε), Muon's -lr·s·O) plus decoupled weight decay, applied as ``strategy`` says.
    ``weight_decay="multiplicative"``: master ← master·(1 - lrλ) + term on the FP32 master (as
    torch's AdamW and Muon decay, with separately rounded operations); otherwise
    Δθ = -lrλ·θ + term (Collage App. D) reaches the parameter as its codec applies it
    (:attr:`~megatron_lowprec.optim.strategies.PrecisionStrategy.param_codec`: nearest, Grow into
    (θ, δθ), Kahan, stochastic rounding, or into the master). Returns Δθ (multiplicative:
    -lrλ·master + term) when ``track_update_quality``, else ``None``."""
    codec = strategy.param_codec
    if strategy.weight_decay == "multiplicative":
        master = codec.value(param, state)
        update = master * scalars.neg_lr_weight_decay + term if track_update_quality else None
        codec.store_(param, state, master * scalars.decay_factor + term)
        return update
    update = codec.value(param, state) * scalars.neg_lr_weight_decay + term
    codec.apply_update_(param, state, update, random_source)
    return update if track_update_quality else None




GROUP_SLOT_TABLE_BYTES = 4
"""Bytes :class:`GroupScalars` reads per row of its table: the row's slot (int32)."""


class GroupScalars(NamedTuple):
    """The step scalars of a call whose elements may belong to several parameter groups (a
    distributed optimizer's shard, whose entries of several groups may alternate): ``per_group[g]``
    (:func:`kernel_scalar` tensors) for the elements of the rows whose slot is ``g`` in ``row_slots``
    (a slot may repeat a group, so that there is a power of two of them). A row is ``row_width``
    elements of a flat call (:func:`call_rows`), or one FP8 group of a call over [groups, group_size]. Scalars are passed by value; each element picks
    its group's values with a chain of selects after one lookup per row."""

    per_group: tuple[StepScalars, ...]
    row_slots: torch.Tensor
    """[rows] int32: the slot of each row of the call."""
    phase: torch.Tensor
    """0-d int32 host tensor: the elements of a flat call's first row before its first (0 over groups)."""
    row_width: int
    """Elements per row of a flat call (the bucket's)."""
    row_counted: torch.Tensor | None = None
    """[rows] bool: whether each row's update counts in the update quality (``None``: every row's)."""

    def rows(self, like: torch.Tensor) -> torch.Tensor:
        """Per element of a call of ``like``'s shape, its row."""
        if like.dim() == 2:
            return torch.arange(like.shape[0], dtype=torch.int64, device=like.device).view(-1, 1)
        return call_rows(like, self.phase, self.row_width)

    def resolve(self, like: torch.Tensor) -> StepScalars:
        """Each element's scalars, as tensors broadcasting to ``like``'s shape, on its device."""
        slot = self.row_slots[self.rows(like)]
        selected = []
        for field in fields(self.per_group[0]):
            value = getattr(self.per_group[0], field.name)
            for index, scalars in enumerate(self.per_group[1:], 1):
                value = torch.where(slot == index, getattr(scalars, field.name), value)
            selected.append(value)
        return type(self.per_group[0])(*selected)

    def counted(self, like: torch.Tensor) -> torch.Tensor | None:
        """Per element of ``like``'s shape, whether its update counts in the update quality (``None``: all)."""
        return None if self.row_counted is None else self.row_counted[self.rows(like)].expand(like.shape)


def _per_element_state(state: dict[str, Any]) -> torch.Tensor:
    """A state buffer of a call that holds one value per element (its shape is the call's)."""
    return next(value for key, value in state.items() if not key.endswith(PER_GROUP_PARTS))


def bucket_kernel_(
    param: torch.Tensor | BufferRows,
    grad: torch.Tensor | BufferRows,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    scalars: StepScalars | GroupScalars,
    beta2_expansion: tuple[Any, Any],
    random_source: RandomSource,
    track_update_quality: bool,
) -> torch.Tensor | None:
    """:func:`adamw_kernel_` over a call whose scalars may differ by parameter group
    (:class:`GroupScalars`, which also says which rows count in the update quality) and whose
    parameters or gradients may live in another flat buffer in rows
    (:class:`~megatron_lowprec.optim.buckets.BufferRows`: a packed shard of megatron's DDP buffers; a
    shard laid out in place passes slices of them, as plain tensors). Where the parameters do (their
    gradients lie at the same places of another buffer: read through the parameters' tables), each
    padding element reads the parameter, the gradient and the random word of the element it
    repeats, whose state its own repeats
    (:meth:`~megatron_lowprec.optim.buckets.Bucket.repeat_into_padding_`): it computes the same
    values, so that the new parameters are stored into megatron's buffer from the step's compiled
    call (:meth:`~megatron_lowprec.optim.buckets.BufferRows.store_repeating`), and it counts for
    nothing in the update quality. The fused step compiles this function (and calls it uncompiled
    where compiling cannot pay); its caller has checked the gradients, so it never synchronises with
    the host to check the moments again."""
    like = _per_element_state(state)
    shape = like.shape
    counted = scalars.counted(like) if isinstance(scalars, GroupScalars) else None
    if isinstance(param, BufferRows):
        own, repeated = param.repetition(shape)
        counted = own if counted is None else own & counted
        values, grad = param.read_repeating(shape), param.read_repeating(shape, grad.source)
        if isinstance(random_source, (BucketStream, GroupStream)):
            random_source = random_source.words(like, repeated)
    else:
        values = param
        if isinstance(grad, BufferRows):
            grad = grad.read(shape)
    if isinstance(scalars, GroupScalars):
        scalars = scalars.resolve(like)
    pieces = adamw_kernel_(
        values, grad, state, strategy, scalars, beta2_expansion, random_source, track_update_quality,
        check_finite=False, counted=counted,
    )
    if isinstance(param, BufferRows):
        param.store_repeating(values)
    return pieces


def adamw_kernel_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    scalars: StepScalars,
    beta2_expansion: tuple[Any, Any],
    random_source: RandomSource,
    track_update_quality: bool,
    check_finite: bool = True,
    counted: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The elementwise body of one step, in place. Every operation is one correctly rounded FP32
    operation (no lerp, addcmul or addcdiv, whose CPU kernels fuse multiply-adds; a correctly rounded
    sqrt), so an eager run and a compiled run round alike.

    With ``track_update_quality``, returns the update-quality pieces of the step
    (:func:`~megatron_lowprec.metrics.update_quality.update_quality_pieces`: the intended FP32 update
    against the change of the represented value), reduced inside the step: compiled, it keeps no
    tensor-sized FP64 temporary. ``check_finite=False`` when the caller has checked the gradients:
    FP8 moments are then stored without the host synchronisation that refuses non-finite values.
    ``counted``: the elements whose update counts in the update quality (default: all).
    """
    codec = strategy.moment_codec
    check_finite = check_finite and not torch.compiler.is_compiling()
    before = represented_value(param, state, strategy) if track_update_quality else None
    grad = grad.float()
    exp_avg = codec.decode(state, "exp_avg", param.shape)
    exp_avg = exp_avg * scalars.beta1 + grad * scalars.one_minus_beta1
    if strategy.second_moment_mcf:
        exp_avg_sq = _collage_second_moment_(state, grad, scalars, beta2_expansion, param.dtype)
    else:
        decoded = codec.decode(state, "exp_avg_sq", param.shape)
        exp_avg_sq = decoded * scalars.beta2 + grad * grad * scalars.one_minus_beta2
    update = apply_update_(
        param, state, strategy, _adam_term(exp_avg, exp_avg_sq, scalars), scalars, random_source, track_update_quality
    )
    codec.encode_(state, "exp_avg", exp_avg, check_finite)
    if not strategy.second_moment_mcf:
        codec.encode_(state, "exp_avg_sq", exp_avg_sq, check_finite)
    if not track_update_quality:
        return None
    after = represented_value(param, state, strategy)
    if counted is not None:
        update, before, after = (torch.where(counted, value, 0) for value in (update, before, after))
    return update_quality_pieces(update, before, after)


def muon_momentum_kernel_(
    grad: torch.Tensor | BufferRows,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    scalars: MuonScalars,
    nesterov: bool,
    check_finite: bool = True,
) -> torch.Tensor:
    """Muon's momentum, in place, and the direction that Newton-Schulz orthogonalizes: the EMA
    B ← μ·B + (1-μ)·g, with Nesterov M = (1-μ)·g + μ·B, else M = B (torch.optim.Muon's two lerps,
    each here a multiply, a multiply and an add rounded to FP32 apart, so that eager and compiled
    runs round alike: no lerp, whose CPU kernel fuses a multiply-add). B is decoded to FP32 and
    rounded once when stored (the strategy's moment codec); M, from the FP32 B, is returned rounded to
    BF16 (Newton-Schulz's input). ``grad``: a tensor, or the rows of another buffer (a fused call
    over a bucket, whose gradients the caller has checked: ``check_finite=False``)."""
    if isinstance(grad, BufferRows):
        grad = grad.read(_per_element_state(state).shape)
    grad = grad.float()
    codec = strategy.moment_codec
    buffer = codec.decode(state, "momentum", grad.shape) * scalars.momentum + grad * scalars.one_minus_momentum
    direction = grad * scalars.one_minus_momentum + buffer * scalars.momentum if nesterov else buffer
    codec.encode_(state, "momentum", buffer, check_finite and not torch.compiler.is_compiling())
    return direction.to(torch.bfloat16)


def muon_update_kernel_(
    param: torch.Tensor | BufferRows,
    term: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    scalars: MuonScalars,
    random_source: RandomSource,
) -> None:
    """Muon's parameter update, in place: the orthogonalized step ``term`` = -lr·s·O (FP32) with
    decoupled weight decay, applied as ``strategy`` says (:func:`apply_update_`). ``param``: a
    tensor of ``term``'s shape, or the rows of another buffer (read and written back)."""
    values = param.read(term.shape) if isinstance(param, BufferRows) else param
    apply_update_(values, state, strategy, term, scalars, random_source)
    if isinstance(param, BufferRows):
        param.write(values)


def beta2_expansion_for(strategy: PrecisionStrategy, beta2: float, dtype: torch.dtype) -> tuple[Any, Any]:
    """The 16-bit expansion of beta2 for Collage-plus (Collage Table 1); ``(None, None)`` otherwise."""
    return expand_scalar(beta2, dtype) if strategy.second_moment_mcf else (None, None)


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    random_source: RandomSource = None,
    track_update_quality: bool = False,
) -> torch.Tensor | None:
    """One AdamW step on one parameter, in place, following ``strategy`` (see the module docstring).

    ``grad`` must be finite (the optimizer checks before calling). ``random_source`` drives
    stochastic rounding: 32-bit words of ``param``'s shape, or a :class:`CounterStream`. Returns the
    update-quality pieces (a 4-element FP64 tensor on ``param``'s device) when
    ``track_update_quality`` is set, else ``None``.
    """
    state["step"] += 1
    if strategy.adam_kernel == "torch_fused":
        return torch_fused_adamw_step_(
            [param.view(-1)], [grad.reshape(-1)], state[strategy.param_codec.key].view(-1), state["exp_avg"].view(-1),
            state["exp_avg_sq"].view(-1), [(0, param.numel())], step=state["step"], lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, track_update_quality=track_update_quality,
        )
    scalars = StepScalars.for_step(state["step"], lr, beta1, beta2, eps, weight_decay)
    return adamw_kernel_(
        param,
        grad,
        state,
        strategy,
        scalars,
        beta2_expansion_for(strategy, beta2, param.dtype),
        random_source,
        track_update_quality,
    )
