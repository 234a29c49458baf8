"""Fused AdamW steps: the reference kernel compiled by ``torch.compile``, run once per flat bucket.

A bucket (``buckets.py``) holds the state of its entries, parameters or runs of a parameter's
elements (a distributed optimizer's shard), in one layout. Its parameters and gradients are read
where they live: the bucket's own flat buffers, slices of megatron's DDP buffers (a shard laid out
in place), or rows of them through :class:`~megatron_lowprec.optim.buckets.BufferRows` (a packed
shard: gathered and, for parameters, scattered back inside the compiled call), so the step
allocates no second copy of either. One compiled call (:func:`fused_call_arguments`) updates the
whole bucket:

* flat, or as [groups, group_size] for FP8 moments (coat), so that each group is decoded, updated and
  re-quantized with its new statistics inside one kernel (on GPUs
  :data:`~megatron_lowprec.numerics.inductor.GROUP_STATISTICS_OPTIONS`: without bucket-sized FP32
  temporaries);
  With stochastic rounding too (sr8), on every device: each group finds its entry and its first
  element's index in its stream in tables of one value per group
  (:class:`~megatron_lowprec.optim.kernel.GroupStream`); a parameter whose groups would straddle
  rows of its stream takes the eager step instead (:func:`fused_entries`);
* stochastic rounding on GPUs likewise (:class:`~megatron_lowprec.optim.kernel.BucketStream`: each
  element finds its entry in a table of one value per row of the bucket's ``row_width`` elements,
  and its stream row by an integer division), in windows of at most :data:`MAX_CALL_ELEMENTS`
  (int32 element indices). On CPUs, whose vector units lack
  integer division, one call per entry instead, over its slice viewed as [rows, row_length] of its
  stream layout (each call costs Python and guard overhead);
* a distributed optimizer's shard, whose entries may belong to several parameter groups in any
  order, takes each element's scalars from per-group values by its row's slot
  (:class:`~megatron_lowprec.optim.kernel.GroupScalars`, in a power of two of at least two slots: one
  compilation for shards of one and of two groups).

A call that runs uncompiled (while its background compile is pending, or past Dynamo's recompile
limit) runs in pieces of at most :data:`EAGER_WINDOW_ELEMENTS` elements (:meth:`StepCall.pieces`),
so that the uncompiled kernel's intermediates stay bounded however large the bucket.

Strategies with ``adam_kernel="torch_fused"`` (D) run torch's own fused AdamW kernel instead
(``torch_fused.py``), in the fused and the eager step alike.

Muon's fused step (``muon.py``) is built from the same pieces: its element-wise kernels compiled by
:func:`compile_step_function`, laid out in calls by :func:`fused_call_arguments` and run by
:func:`run_calls`.

The compiled function is :func:`~megatron_lowprec.optim.kernel.bucket_kernel_`, which reads the
sources and calls :func:`~megatron_lowprec.optim.kernel.adamw_kernel_`, the eager reference itself,
so fused and eager steps share one specification. Inductor turns it into C++/OpenMP loops on CPU and
Triton kernels on GPU. What keeps the compiled step bit-identical to the eager one:

* ``emulate_precision_casts``: every explicit cast to a 16-bit dtype is a real rounding. Without it
  Inductor keeps 16-bit intermediates in FP32, which silently drops the MCF error terms. Roundings
  that feed further arithmetic are integer operations on GPUs (Triton drops float round trips).
* No multiply and add are fused: Inductor compiles C++ with ``-ffp-contract=off`` and Triton without
  FP fusion under ``emulate_precision_casts``.
* Divisions, square roots, and COAT's ``log`` and ``pow`` are the package's own correctly rounded or
  fixed-polynomial functions (``numerics/elementary.py``), the same on every backend: FP32 ``div.rn``
  and ``sqrt.rn`` in Triton (``division_rounding``), no FP64 (constant divisors are 0-d host
  tensors); FP32 denormals are kept (``disable_ftz`` where this torch's Inductor has it).
* FP8 payloads are cast to and from FP8 where Triton converts them (sm_89 and later) and on CPUs;
  on older GPUs they are read and written as uint8 codes computed with integer arithmetic
  (:func:`kernel_state`), the same bits as the casts.
* Step-dependent scalars and the SR round keys are 0-d host tensors (passed by value, no
  host-to-device copy), and shapes are dynamic, so one compilation per strategy, dtype and kind of
  source serves every step and bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy
import torch

from megatron_lowprec.numerics import inductor
from megatron_lowprec.numerics.compiled import FP8_CONVERSION_CAPABILITY, compile_exact, inductor_options
from megatron_lowprec.numerics.inductor import EagerFallbackWarning
from megatron_lowprec.numerics.rounding import INT32_GRID_MAX_ROW, StreamLayout, counter_round_keys_table, row_start_words
from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES, BackgroundCompileWarning, CompileRecipe
from megatron_lowprec.optim.buckets import (
    FP8_PARTS, PER_GROUP_PARTS, Bucket, BufferRows, at_least_two, bucket_alignment, elements_per_value,
)
from megatron_lowprec.optim.codecs import FP8GroupMoment
from megatron_lowprec.optim.kernel import (
    BucketStream,
    CounterStream,
    GroupScalars,
    GroupStream,
    RandomSource,
    StepScalars,
    beta2_expansion_for,
    bucket_kernel_,
    kernel_scalar,
)
from megatron_lowprec.optim.master import master_value, split_master, stored_master
from megatron_lowprec.optim.strategies import PrecisionStrategy
from megatron_lowprec.optim.torch_fused import torch_fused_adamw_step_

GROUP_STATISTICS_DEVICES = ("cuda",)
"""Device types whose FP8-moment step takes
:data:`~megatron_lowprec.numerics.inductor.GROUP_STATISTICS_OPTIONS`. On a CPU, where memory is not
what limits the step, recomputing costs more than it saves: the cold compile grows by about half
for a step only a few percent faster."""

BUCKET_STREAM_DEVICES = ("cuda",)
"""Device types on which stochastic rounding runs one compiled call per bucket (:class:`BucketStream`:
a per-row table lookup and an integer division per element, which GPUs have). Elsewhere (CPU vector units
lack integer division) it runs one call per parameter over its [rows, row_length] grid. With FP8
moments it runs one call per bucket on every device (:class:`GroupStream`: lookups per group, no division)."""


def warn_eager_fallback(what: str, reason: str) -> None:
    """Warn with :class:`EagerFallbackWarning` that ``what`` (the parameters) stepped eagerly, and why."""
    warnings.warn(f"{what} took the eager optimizer step instead of the compiled one: {reason}", EagerFallbackWarning, stacklevel=3)


def bucket_entries(bucket: Bucket) -> str:
    """The parameters of a bucket, by group and shape, for messages."""
    shapes = ", ".join(str(tuple(param.shape)) for param in bucket.params)
    return f"the bucket of parameter group {bucket.group_index} (parameters of shapes {shapes})"


TRITON_MIN_CAPABILITY = (7, 0)
"""The least CUDA compute capability Inductor compiles Triton kernels for."""


def _capability_text(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


def fused_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build the fused step on ``device`` (``None``: it can), for every
    option alike. It needs a C++ compiler on CPU; on a GPU Triton and a compute capability of at
    least :data:`TRITON_MIN_CAPABILITY` (FP8 moments compile at every capability:
    :func:`fp8_payloads_as_codes`), and torch (triton on GPUs) within the versions the package's
    compiler internals were written for (:func:`~megatron_lowprec.numerics.inductor.unsupported_reason`)."""
    unsupported = inductor.unsupported_reason(device.type)
    if unsupported is not None:
        return unsupported
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
        capability = torch.cuda.get_device_capability(device)
        if capability < TRITON_MIN_CAPABILITY:
            return (
                f"Inductor compiles Triton kernels from compute capability {_capability_text(TRITON_MIN_CAPABILITY)}; "
                f"{device} has {_capability_text(capability)}"
            )
        return None
    if device.type == "cpu":
        compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")
        return None if any(shutil.which(name) for name in compilers if name) else "no C++ compiler for Inductor"
    return f"no fused step for device type {device.type!r}"


def fp8_payloads_as_codes(device: torch.device) -> bool:
    """Whether the fused step on ``device`` reads and writes FP8 payloads as uint8 codes, converted
    by integer arithmetic (:func:`~megatron_lowprec.numerics.formats.to_fp8_codes`,
    :func:`~megatron_lowprec.numerics.formats.from_fp8_codes`: the same bits as the casts): on GPUs
    below :data:`FP8_CONVERSION_CAPABILITY`, whose Triton has no E4M3 conversion. CPUs (Inductor's C++)
    and newer GPUs cast."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CONVERSION_CAPABILITY


def kernel_state(bucket: Bucket, strategy: PrecisionStrategy) -> dict[str, torch.Tensor]:
    """The bucket's state buffers as the compiled step takes them: FP8 payloads as uint8 views where
    :func:`fp8_payloads_as_codes` (the same memory and bits), every other buffer as it is."""
    if not isinstance(strategy.moment_codec, FP8GroupMoment) or not fp8_payloads_as_codes(bucket.device):
        return bucket.state
    return {key: value.view(torch.uint8) if key.endswith("_payload") else value for key, value in bucket.state.items()}


def fused_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can build the fused step on ``device``; see :func:`fused_unavailable_reason`."""
    return fused_unavailable_reason(device) is None


def resolve_fused(device: torch.device, requested: bool | None) -> bool:
    """Whether the optimizer's buckets on ``device`` take the fused step. ``requested=None``: where
    available, and on a GPU where it is not, the eager step with an :class:`EagerFallbackWarning`
    naming why (outside the supported torch and triton versions, on every device, once per process);
    ``True`` where unavailable: ``ValueError`` naming why."""
    reason = None if requested is False else fused_unavailable_reason(device)
    if requested and reason is not None:
        raise ValueError(f"fused=True cannot compile the step on {device}: {reason}; use fused=False or None")
    if requested is None and reason is not None:
        if reason == inductor.unsupported_reason(device.type):
            inductor.warn_unsupported(reason)
        elif device.type == "cuda":
            warn_eager_fallback(f"every bucket on {device}", reason)
    return reason is None if requested is None else requested


@functools.cache
def compiled_kernel(group_statistics: bool = False) -> Callable:
    """The compiled :func:`~megatron_lowprec.optim.kernel.bucket_kernel_` (built once; Dynamo
    specialises it per strategy, dtype and kind of sources): :func:`compile_step_function`."""
    return compile_step_function(bucket_kernel_, group_statistics)


def compile_step_function(function: Callable, group_statistics: bool = False) -> Callable:
    """``function`` (an element-wise step over a call's tensors) compiled as every fused step is,
    by :func:`~megatron_lowprec.numerics.compiled.compile_exact`, with Inductor's options for FP8
    group statistics (``group_statistics``:
    :func:`~megatron_lowprec.numerics.inductor.group_statistics_options`), each call under
    :func:`~megatron_lowprec.numerics.inductor.step_code_generation` (Inductor's C++ code generator
    as the fused step wants it). Python numbers are constants there: the strategy's FP8 group size
    must be one, or every group index becomes a scalar division by a symbol, and so are the
    polynomial coefficients of ``numerics/elementary.py`` (step-dependent values are 0-d tensors).
    ``automatic_dynamic_shapes`` is off there: without it a compile child
    (:mod:`~megatron_lowprec.optim.background_compile`) could not fill the training process's cache
    entry."""
    options = inductor.group_statistics_options() if group_statistics else {}
    return compile_exact(function, options, around=(inductor.step_code_generation,))


MAX_CALL_ELEMENTS = 1 << 30
"""Elements of one compiled call at most where the call counts its elements in int32 (stochastic
rounding over a whole bucket): a larger bucket is stepped in windows of this size."""

EAGER_WINDOW_ELEMENTS = 1 << 24
"""Elements of a bucket per piece where a call of the fused step runs uncompiled (the first steps
under background compilation, a fallback): the uncompiled kernel allocates every intermediate
(32 to 70 bytes per element of its call, measured on CPU), which over a whole model's bucket would
outgrow a GPU's memory; in pieces of this size they stay near 1 GiB. The pieces give the bits of the
whole call (every value is per element or per FP8 group, and pieces hold whole groups)."""


@dataclasses.dataclass(frozen=True)
class StepCall:
    """The arguments of one call of the fused step, over elements [start, end) of its bucket."""

    param: torch.Tensor | BufferRows
    grad: torch.Tensor | BufferRows
    state: dict[str, Any]
    scalars: StepScalars | GroupScalars
    random_source: RandomSource
    start: int = 0
    end: int = 0
    over: Callable[[int, int], StepCall] | None = None
    """The call of the same kind over other elements [start, end) of the bucket (``None``: one that
    is not cut, such as an entry's grid of stochastic-rounding rows)."""
    unit: int = 1
    """Where the call may be cut: every piece starts at a multiple of this many elements."""

    def pieces(self, elements: int) -> list[StepCall]:
        """The call cut into pieces of at most ``elements`` elements (rounded down to :attr:`unit`)."""
        if self.over is None or self.end - self.start <= elements:
            return [self]
        size = max(elements // self.unit, 1) * self.unit
        return [self.over(start, min(start + size, self.end)) for start in range(self.start, self.end, size)]


@torch.no_grad()
def fused_bucket_step_(
    bucket: Bucket,
    strategy: PrecisionStrategy,
    grad: torch.Tensor | BufferRows,
    entry_grads: list[torch.Tensor],
    hyper: dict[int, dict[str, float]],
    *,
    step: int,
    sr_seed: int | None,
    track_update_quality: bool,
    background_compile: bool = False,
    compile_master_codec: bool = True,
) -> torch.Tensor | None:
    """One AdamW step over a whole bucket (every entry at ``step`` after this call), in the compiled
    calls that :func:`fused_call_arguments` lays out; the update-quality pieces (an FP64 tensor on the bucket's
    device) when ``track_update_quality``. With ``background_compile``, a call whose compiled kernel
    is not built yet runs it uncompiled (the same bits) while a child process compiles it
    (:mod:`~megatron_lowprec.optim.background_compile`; the caller starts that child with
    ``BACKGROUND_COMPILES.start()`` once its step is done).

    ``grad`` holds the bucket's gradients: a flat buffer in the bucket's layout, or a
    :class:`~megatron_lowprec.optim.buckets.BufferRows` over the buffer they live in; ``entry_grads``
    each entry's flat gradient (views of either). ``hyper`` gives lr, beta1, beta2, eps and
    weight_decay of each parameter group that the bucket's entries belong to. Option D (torch's fused
    AdamW) with ``compile_master_codec=False`` compiles nothing: a remainder master is joined and
    split per entry, the same bits (what the distributed optimizer does with ``fused=False``)."""
    if strategy.adam_kernel == "torch_fused":
        return _torch_fused_bucket_step_(bucket, entry_grads, hyper, step, track_update_quality, compile_master_codec)
    betas = {values["beta2"] for values in hyper.values()}
    if len(betas) != 1:
        raise ValueError(f"a bucket's parameter groups must share beta2 (they hold {sorted(betas)})")
    dtype = bucket.state_dtype
    beta2_expansion = tuple(
        None if part is None else kernel_scalar(part, dtype) for part in beta2_expansion_for(strategy, betas.pop(), dtype)
    )
    scalars = {group: StepScalars.for_step(step, **values) for group, values in hyper.items()}
    recipe = CompileRecipe(compiled_kernel, (group_statistics_in_kernel(strategy, bucket.device),))
    pieces = run_calls(
        recipe, bucket_kernel_, bucket, strategy,
        fused_call_arguments(bucket, strategy, grad, entry_grads, scalars, sr_seed, step, track_update_quality),
        lambda call: (
            call.param, call.grad, call.state, strategy, call.scalars, beta2_expansion, call.random_source, track_update_quality
        ),
        sum_of_pieces,
        background_compile,
    )
    return sum_of_pieces(pieces)


def sum_of_pieces(pieces: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The update-quality pieces of several calls added (``None`` where they are not tracked)."""
    return None if pieces[0] is None else sum(pieces)


def run_calls(
    recipe: CompileRecipe, eager: Callable, bucket: Bucket, strategy: PrecisionStrategy, calls: Iterable[StepCall],
    arguments: Callable[[StepCall], tuple[Any, ...]], combine: Callable[[list[Any]], Any], background_compile: bool = False,
) -> list[Any]:
    """The result of the compiled ``eager`` that ``recipe`` builds, on ``arguments(call)``, for each of
    ``calls``: a call of one FP8 group runs ``eager`` (:func:`_one_fp8_group`), the others
    :func:`_compiled_or_eager`. A call that runs uncompiled runs in pieces of at most
    :data:`EAGER_WINDOW_ELEMENTS` elements (:meth:`StepCall.pieces`), whose results ``combine`` joins."""

    def run_in_pieces(call: StepCall) -> Any:
        return combine([eager(*arguments(piece)) for piece in call.pieces(EAGER_WINDOW_ELEMENTS)])

    return [
        eager(*arguments(call)) if _one_fp8_group(strategy, call.state)
        else _compiled_or_eager(recipe, functools.partial(run_in_pieces, call), bucket, background_compile, arguments(call))
        for call in calls
    ]


def _compiled_or_eager(
    recipe: CompileRecipe, uncompiled: Callable[[], Any], bucket: Bucket, background_compile: bool, args: tuple,
) -> Any:
    """One call of the compiled kernel that ``recipe`` builds on ``args`` (in the background:
    :data:`BACKGROUND_COMPILES` runs ``uncompiled()``, the same function uncompiled, until a child
    process has compiled it); ``uncompiled()``, with an :class:`EagerFallbackWarning`, where Dynamo
    refuses to compile it again (its recompile limit: raised before the call runs, so nothing is
    stepped twice)."""

    def warn_failed(error: str) -> None:
        warnings.warn(
            f"{bucket_entries(bucket)}: its background compile failed, the training process compiles it: {error}",
            BackgroundCompileWarning, stacklevel=4,
        )

    try:
        if background_compile:
            return BACKGROUND_COMPILES.call(recipe, lambda *_: uncompiled(), args, warn_failed)
        return recipe.build()(*args)
    except inductor.recompile_limit_error():
        warn_eager_fallback(bucket_entries(bucket), f"torch.compile hit its recompile limit (at least {inductor.RECOMPILE_LIMIT})")
        return uncompiled()


def group_statistics_in_kernel(strategy: PrecisionStrategy, device: torch.device) -> bool:
    """Whether the compiled step of ``strategy`` on ``device`` recomputes its FP8 groups' statistics
    from the payloads (:data:`~megatron_lowprec.numerics.inductor.GROUP_STATISTICS_OPTIONS`) rather than storing them."""
    return strategy.grouped_moments and device.type in GROUP_STATISTICS_DEVICES


def _one_fp8_group(strategy: PrecisionStrategy, state: dict[str, Any]) -> bool:
    """Whether a call holds exactly one FP8 group (a bucket of one group). Such a call runs
    :func:`~megatron_lowprec.optim.kernel.bucket_kernel_` eagerly, the same function uncompiled (so
    the same bits): compiled, a group count of one
    specialises the graph (size 1 broadcasts), and one small call would cost a whole second
    compilation of the FP8 step (minutes on 2 CPU cores)."""
    return strategy.grouped_moments and state[f"{strategy.moment_names[0]}_scale"].numel() == 1


def _join_master_window(param: torch.Tensor | BufferRows, stored: torch.Tensor) -> torch.Tensor:
    """The FP32 masters of a window of a bucket: its 16-bit parameters (a flat window, or rows of
    another buffer) joined with the remainders or residuals ``stored``."""
    values = param.read(stored.shape) if isinstance(param, BufferRows) else param
    return master_value(values, stored)


def _split_master_window_(param: torch.Tensor | BufferRows, stored: torch.Tensor, masters: torch.Tensor) -> None:
    """Store a window's FP32 ``masters`` as its 16-bit parameters and remainders or residuals ``stored``."""
    upper, low = split_master(masters, stored.dtype)
    stored.copy_(low)
    if isinstance(param, BufferRows):
        param.write(upper)
    else:
        param.copy_(upper)


@functools.cache
def compiled_master_codec() -> tuple[Callable, Callable]:
    """:func:`_join_master_window` and :func:`_split_master_window_` compiled (integer operations:
    the same bits as eager on every backend), one pass over a window each. Without duck shapes: a
    window is a slice of the bucket's remainder buffer, and with them a window of the whole buffer
    gives the slice and its base one size symbol, so that Dynamo guards on their equality and compiles
    again for a window of a part (a shard of two parameter groups)."""
    options = inductor_options()
    return tuple(
        inductor.compile_scoped(function, options, duck_shapes=False)
        for function in (_join_master_window, _split_master_window_)
    )


class BucketMasterWindows:
    """:class:`~megatron_lowprec.optim.torch_fused.MasterWindows` of a bucket whose remainder master
    lies below 16-bit parameters in its own flat buffer or in rows of megatron's: one compiled call
    per window to join, one to split (instead of a dozen integer operations per entry)."""

    def __init__(self, bucket: Bucket, stored: torch.Tensor) -> None:
        self.param = bucket.param_buffer if bucket.param_buffer is not None else bucket.param_rows[1]
        self.stored = stored

    def join(self, start: int, end: int) -> torch.Tensor:
        return compiled_master_codec()[0](_window(self.param, start, end), self.stored[start:end])

    def split_(self, start: int, end: int, masters: torch.Tensor) -> None:
        compiled_master_codec()[1](_window(self.param, start, end), self.stored[start:end], masters)


def _master_windows(bucket: Bucket, stored: torch.Tensor, compile_codec: bool) -> BucketMasterWindows | None:
    """The bucket's compiled master windows, where its master is a remainder, its parameters sit in a
    buffer of its layout, compiling is asked for and this device can compile; ``None`` (join and
    split per entry) otherwise."""
    if stored.dtype == torch.float32 or not bucket.laid_out or not compile_codec or not fused_available(bucket.device):
        return None
    return BucketMasterWindows(bucket, stored)


def _torch_fused_bucket_step_(
    bucket: Bucket, entry_grads: list[torch.Tensor], hyper: dict[int, dict[str, float]], step: int, track: bool,
    compile_master_codec: bool,
) -> torch.Tensor | None:
    """Option D: torch's fused AdamW over each parameter group's entries (one multi-tensor call per
    window of the bucket's state; a remainder master joined and split a window at a time); with
    ``track``, the entries whose update does not count in the update quality
    (:attr:`~megatron_lowprec.optim.buckets.Bucket.entry_counted`) in calls of their own."""
    params, state = bucket.entry_params(), bucket.state
    pieces = [torch.zeros(4, dtype=torch.float64, device=bucket.device)]
    stored = stored_master(state)
    master_windows = _master_windows(bucket, stored, compile_master_codec)
    counted = bucket.entry_counted or [True] * len(bucket.offsets)
    calls: dict[tuple[int, bool], list[int]] = {}
    for group, entries in bucket.entries_by_group().items():
        for index in entries:
            calls.setdefault((group, counted[index] or not track), []).append(index)
    for (group, counts), entries in calls.items():
        values = hyper[group]
        piece = torch_fused_adamw_step_(
            [params[index] for index in entries], [entry_grads[index] for index in entries], stored,
            state["exp_avg"], state["exp_avg_sq"], [(bucket.offsets[index], bucket.numels[index]) for index in entries],
            step=step, lr=values["lr"], beta1=values["beta1"], beta2=values["beta2"], eps=values["eps"],
            weight_decay=values["weight_decay"], track_update_quality=track, master_windows=master_windows,
        )
        if counts:
            pieces.append(piece)
    return sum(pieces) if track else None


def _scalars_of(
    bucket: Bucket, scalars: dict[int, StepScalars], start: int, end: int, track_update_quality: bool = False,
    over_groups: bool = False,
) -> StepScalars | GroupScalars:
    """The scalars of a call over elements [start, end) of the bucket, as kernel scalars: one group's
    for a bucket of one group's parameters; for a distributed optimizer's shard
    (:attr:`~megatron_lowprec.optim.buckets.Bucket.per_group_scalars`), whose entries may belong to
    several groups in any order, :class:`GroupScalars` with each row's slot
    (:meth:`~megatron_lowprec.optim.buckets.Bucket.row_table`; per FP8 group for a call
    ``over_groups``), in a power of two of at least two slots (the last group repeated; each slot
    its own tensors, or Dynamo would guard on which are the same object), so that shards of one and
    of two parameter groups take the same compiled step; with ``track_update_quality``, also each
    row's say in the update quality where some entry's update does not count
    (:attr:`~megatron_lowprec.optim.buckets.Bucket.entry_counted`)."""
    entries = bucket.entries_in(start, end)
    groups = sorted({bucket.entry_groups[index] for index in entries})
    counted = bucket.entry_counted if track_update_quality and not all(bucket.entry_counted or [True]) else None
    if len(groups) == 1 and not bucket.per_group_scalars and counted is None:
        return scalars[groups[0]].as_kernel_scalars()
    slots = groups + [groups[-1]] * (max(2, 1 << (len(groups) - 1).bit_length()) - len(groups))
    slot_of = {group: slot for slot, group in enumerate(groups)}
    if over_groups:
        size = bucket.state_group_size
        table, rows, phase = bucket.group_table, slice(start // size, end // size), 0
    else:
        table, rows, phase = bucket.row_table, _row_window(bucket, start, end), (bucket.row_phase + start) % bucket.row_width
    return GroupScalars(
        tuple(scalars[group].as_kernel_scalars() for group in slots),
        _table_rows(table(tuple(slot_of.get(group, 0) for group in bucket.entry_groups), torch.int32), rows),
        kernel_scalar(phase, torch.int32),
        bucket.row_width,
        None if counted is None else _table_rows(table(tuple(counted), torch.bool), rows),
    )


def _row_window(bucket: Bucket, start: int, end: int) -> slice:
    """The rows of :meth:`~megatron_lowprec.optim.buckets.Bucket.row_table` that elements [start, end) of the bucket touch."""
    width = bucket.row_width
    return slice((bucket.row_phase + start) // width, -(-(bucket.row_phase + end) // width))


def _table_rows(table: torch.Tensor, rows: slice) -> torch.Tensor:
    """The ``rows`` of a per-row table for a call: the table itself where they are all of it (a
    whole-bucket call, so that the compiled step is not specialised on a view), its one row repeated
    where there is one (:func:`at_least_two`)."""
    window = table if rows.start == 0 and rows.stop >= table.numel() else table[rows]
    return window.repeat(2) if window.numel() == 1 else window


def fused_call_arguments(
    bucket: Bucket,
    strategy: PrecisionStrategy,
    grad: torch.Tensor | BufferRows,
    entry_grads: list[torch.Tensor],
    scalars: dict[int, StepScalars],
    sr_seed: int | None,
    step: int,
    track_update_quality: bool = False,
) -> Iterator[StepCall]:
    """The compiled calls of the step (``track_update_quality``: :func:`_scalars_of`'s):

    - stochastic rounding where integer division is cheap (:data:`BUCKET_STREAM_DEVICES`): the
      whole bucket, in windows of at most :data:`MAX_CALL_ELEMENTS` (:class:`BucketStream`);
    - stochastic rounding elsewhere: each entry on its own, as grids of whole stream rows;
    - FP8 moments: the whole bucket as [groups, group_size], so that each group's moments are
      decoded, updated and re-quantized in one pass over it (the bucket holds whole groups); with
      stochastic rounding, on every device, each group's words from its entry's stream
      (:class:`GroupStream`, :func:`group_stream_tables`);
    - otherwise the whole bucket, flat.
    """
    param = bucket.param_buffer if bucket.param_buffer is not None else bucket.param_rows[1]
    buffers = kernel_state(bucket, strategy)
    unit = bucket_alignment(strategy)
    if sr_seed is not None and bucket.device.type in BUCKET_STREAM_DEVICES and _whole_bucket_step(strategy):

        def stream_call(start: int, end: int) -> StepCall:
            return StepCall(
                _window(param, start, end), _window(grad, start, end), _state_window(buffers, start, end),
                _scalars_of(bucket, scalars, start, end, track_update_quality), _bucket_stream(bucket, start, end, sr_seed, step),
                start, end, stream_call, unit,
            )

        for start in range(0, bucket.numel, MAX_CALL_ELEMENTS):
            yield stream_call(start, min(start + MAX_CALL_ELEMENTS, bucket.numel))
    elif sr_seed is not None and not strategy.grouped_moments:
        yield from _entry_grid_calls(bucket, strategy, entry_grads, scalars, sr_seed, step)
    elif strategy.grouped_moments:
        group_size = strategy.fp8_group_size
        if sr_seed is not None:
            tables = group_stream_tables(bucket, strategy)

        def grid(source: torch.Tensor | BufferRows, start: int, end: int) -> torch.Tensor | BufferRows:
            window = _window(source, start, end)
            return window.view(-1, group_size) if torch.is_tensor(window) else window

        def group_call(start: int, end: int) -> StepCall:
            state = {
                key: _window(value, start // group_size, end // group_size)
                if key.endswith(PER_GROUP_PARTS) else grid(value, start, end)
                for key, value in buffers.items()
            }
            # The step's keys are fetched per call, not captured: this function refers to itself (the
            # call's ``over``), so what it captures lives until a garbage collection.
            stream = None if sr_seed is None else GroupStream(
                *_round_key_block(bucket, (0, bucket.numel), range(len(bucket.streams)), sr_seed, step),
                *(_window(table, start // group_size, end // group_size) for table in tables), group_size,
            )
            return StepCall(
                grid(param, start, end), grid(grad, start, end), state,
                _scalars_of(bucket, scalars, start, end, track_update_quality, over_groups=True), stream,
                start, end, group_call, unit,
            )

        yield group_call(0, bucket.numel)
    else:

        def flat_call(start: int, end: int) -> StepCall:
            return StepCall(
                _window(param, start, end), _window(grad, start, end), _state_window(buffers, start, end),
                _scalars_of(bucket, scalars, start, end, track_update_quality), None, start, end, flat_call, unit,
            )

        yield flat_call(0, bucket.numel)


def _state_window(buffers: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """Elements [start, end) of each flat state buffer of a bucket."""
    return {key: _window(buffer, start, end) for key, buffer in buffers.items()}


def _window(source: torch.Tensor | BufferRows, start: int, end: int) -> torch.Tensor | BufferRows:
    """Elements [start, end) of a bucket-shaped flat buffer, or of the bucket a :class:`BufferRows` maps:
    the buffer itself where they are all of it (a whole-bucket call passes the bucket's own tensors)."""
    if torch.is_tensor(source):
        return source if start == 0 and end == source.shape[0] else source[start:end]
    return source if start == 0 else source.from_row(start // source.width)


def _whole_bucket_step(strategy: PrecisionStrategy) -> bool:
    """Whether the step is elementwise FP32 and integer arithmetic over flat buffers (no torch kernel,
    no per-group FP8 statistics), so that one call can take the whole bucket under any stream."""
    return strategy.adam_kernel == "reference" and not strategy.grouped_moments


KEY_BLOCK_STEPS = 256
"""Steps whose SR round keys go to the device in one table (:class:`BucketStream`): one copy per this
many steps, none in the others."""


def _bucket_stream(bucket: Bucket, start: int, end: int, sr_seed: int, step: int) -> BucketStream:
    """The :class:`BucketStream` of the bucket's elements [start, end) at ``step``: the per-row and
    per-entry tables of the window, built at its first step, and the round keys of a block of
    :data:`KEY_BLOCK_STEPS` steps from this one, both kept with the bucket."""
    entries = bucket.entries_in(start, end)
    if (start, end) not in bucket.stream_tables:
        bucket.stream_tables[(start, end)] = _stream_tables(bucket, entries, start, end)
    keys, step_row = _round_key_block(bucket, (start, end), entries, sr_seed, step)
    row_entries, *entry_tables = bucket.stream_tables[(start, end)]
    phase = kernel_scalar((bucket.row_phase + start) % bucket.row_width, torch.int32)
    return BucketStream(keys.view(-1), step_row, row_entries, phase, bucket.row_width, *entry_tables)


def _round_key_block(
    bucket: Bucket, window: tuple[int, int], entries: Iterable[int], sr_seed: int, step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The round keys of the streams of the bucket's ``entries`` (those of its elements ``window``)
    for a block of :data:`KEY_BLOCK_STEPS` steps from this one ([steps, entries x 3], at least two
    entries: :func:`~megatron_lowprec.optim.buckets.at_least_two`), kept with the bucket until a step
    leaves the block, and ``step``'s row in it (a kernel scalar)."""
    first_step, seed, keys = bucket.stream_keys.get(window, (None, None, None))
    if seed != sr_seed or not first_step <= step < first_step + KEY_BLOCK_STEPS:
        first_step, seed = step, sr_seed
        streams = at_least_two([bucket.streams[i].stream for i in entries])
        block = counter_round_keys_table(sr_seed, range(step, step + KEY_BLOCK_STEPS), streams)
        keys = block.reshape(KEY_BLOCK_STEPS, -1).to(bucket.device)
        bucket.stream_keys[window] = (first_step, seed, keys)
    return keys, kernel_scalar(step - first_step, torch.int32)


def _stream_tables(bucket: Bucket, entries: list[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
    """:class:`BucketStream`'s tables of the window [start, end) of the bucket whose entries
    ``entries`` (consecutive) overlap it: each row's entry (its place in ``entries``), and each
    entry's column shift (its first column less its offset in the window), row length, first row's
    start and row stride in its stream (each table of at least two values:
    :func:`~megatron_lowprec.optim.buckets.at_least_two`)."""
    shifts, row_lengths, row_starts, row_strides = [], [], [], []
    for index in entries:
        layout = bucket.streams[index]
        skipped = max(start - bucket.offsets[index], 0)
        first_row, column = divmod(bucket.element_starts[index] + skipped, layout.row_length)
        extent = min(bucket.padded_end(index), end) - max(bucket.offsets[index], start)
        if column + extent - 1 > INT32_GRID_MAX_ROW:
            raise ValueError(
                f"entry {index} of the bucket reaches column {column + extent - 1} of its SR stream rows of "
                f"{layout.row_length} elements; the fused step counts columns in int32 (at most {INT32_GRID_MAX_ROW}): "
                "use fused=False"
            )
        shifts.append(column - (bucket.offsets[index] + skipped - start))
        row_lengths.append(layout.row_length)
        row_starts.append(_signed_int64(layout.offset + first_row * layout.row_stride))
        row_strides.append(_signed_int64(layout.row_stride))
    device = bucket.device
    row_entries = _table_rows(bucket.row_table(tuple(index - entries[0] for index in range(len(bucket.offsets))), torch.int32), _row_window(bucket, start, end))
    return (
        row_entries,
        *(torch.tensor(at_least_two(values), dtype=torch.int32, device=device) for values in (shifts, row_lengths)),
        *(torch.tensor(at_least_two(values), dtype=torch.int64, device=device) for values in (row_starts, row_strides)),
    )


def group_stream_tables(bucket: Bucket, strategy: PrecisionStrategy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`GroupStream`'s tables of the bucket (built once, kept with it): each FP8 group's entry
    (as :meth:`~megatron_lowprec.optim.buckets.Bucket.group_table` places them) and the global index
    in its entry's stream of its first element, as int32 high and low words. ``ValueError`` where the
    fused step cannot serve an entry (:func:`check_fused_entries`: its groups straddle rows of its stream)."""
    if bucket.group_stream_tables is not None:
        return bucket.group_stream_tables
    check_fused_entries(strategy, bucket.params, bucket.streams, bucket.element_starts, bucket.numels)
    group_size = strategy.fp8_group_size
    groups = bucket.entry_rows(group_size, 0)

    def per_group(values: Iterable[int], dtype: type = numpy.int64) -> numpy.ndarray:
        return numpy.repeat(numpy.array(values, dtype=dtype), groups)

    entries = per_group(range(len(groups)), numpy.int32)
    element = per_group(bucket.element_starts) + numpy.arange(entries.size, dtype=numpy.int64) * group_size - per_group(bucket.offsets)
    row_lengths = per_group([layout.row_length if layout.row_stride != layout.row_length else 2**62 for layout in bucket.streams])
    row = element // row_lengths
    with numpy.errstate(over="ignore"):
        index = (
            per_group([layout.offset % 2**64 for layout in bucket.streams], numpy.uint64)
            + row.astype(numpy.uint64) * per_group([layout.row_stride % 2**64 for layout in bucket.streams], numpy.uint64)
            + (element - row * row_lengths).astype(numpy.uint64)
        )
    words = ((index >> numpy.uint64(32)).astype(numpy.uint32), (index & numpy.uint64(0xFFFFFFFF)).astype(numpy.uint32))
    bucket.group_stream_tables = tuple(
        torch.from_numpy(table.view(numpy.int32)).to(bucket.device) for table in (entries, *words)
    )
    return bucket.group_stream_tables


def fp8_groups_straddle_rows(strategy: PrecisionStrategy, layout: StreamLayout, element_start: int, numel: int) -> bool:
    """Whether an entry (a parameter's elements [element_start, element_start + numel), in 8-bit moment groups
    of the strategy's size from its first element: a bucket starts every entry on a group) has a group
    whose elements lie in two rows of its stream ``layout`` whose indices are not consecutive (a
    tensor-parallel shard whose row length the group size does not divide; the rows of one rank's
    whole tensor follow each other). The fused step under stochastic rounding draws each group's words
    from one run of its stream (:class:`GroupStream`), so it cannot serve such an entry; the eager step
    draws every element's word from its own row."""
    if strategy.param_update != "stochastic" or not strategy.grouped_moments or layout.row_stride == layout.row_length:
        return False
    group_size, end = strategy.fp8_group_size, element_start + numel
    firsts = numpy.arange(element_start, end, group_size, dtype=numpy.int64)
    lasts = numpy.minimum(firsts + group_size, end) - 1
    return bool((firsts // layout.row_length != lasts // layout.row_length).any())


def _straddling_entries(
    strategy: PrecisionStrategy, streams: list[StreamLayout], element_starts: list[int] | None, numels: list[int],
) -> list[int]:
    starts = element_starts or [0] * len(streams)
    return [
        index for index, (layout, start, numel) in enumerate(zip(streams, starts, numels))
        if fp8_groups_straddle_rows(strategy, layout, start, numel)
    ]


def _straddle_reason(strategy: PrecisionStrategy, param: torch.Tensor, layout: StreamLayout, element_start: int) -> str:
    return (
        f"option {strategy.name!r} steps FP8 groups of {strategy.fp8_group_size} elements with stochastic rounding in one "
        f"compiled call, each group inside one row of its parameter's SR stream; the parameter of shape "
        f"{tuple(param.shape)} has stream rows of {layout.row_length} elements (its elements from {element_start}), "
        "which its groups straddle"
    )


def check_fused_entries(
    strategy: PrecisionStrategy, params: list[torch.Tensor], streams: list[StreamLayout],
    element_starts: list[int] | None = None, numels: list[int] | None = None,
) -> None:
    """``ValueError`` in one line naming the option and the first parameter whose entry the fused step
    cannot serve (:func:`fp8_groups_straddle_rows`), and the way out; entries are whole parameters
    unless ``element_starts`` and ``numels`` say which of their elements."""
    numels = numels or [param.numel() for param in params]
    straddling = _straddling_entries(strategy, streams, element_starts, numels)
    if straddling:
        index = straddling[0]
        start = element_starts[index] if element_starts else 0
        raise ValueError(
            f"{_straddle_reason(strategy, params[index], streams[index], start)}: use fused=False or None "
            "(the eager step, the same bits)"
        )


def fused_entries(
    strategy: PrecisionStrategy, requested: bool | None, params: list[torch.Tensor], streams: list[StreamLayout],
    element_starts: list[int] | None = None, numels: list[int] | None = None,
) -> list[bool]:
    """Which of the entries that a fused bucket would hold (whole parameters, or their elements
    ``element_starts`` and ``numels``) the fused step can serve, decided from their stream layouts
    before any bucket or compiled call is built: all but those whose FP8 groups straddle stream rows
    under stochastic rounding (:func:`fp8_groups_straddle_rows`). With ``requested=True`` such an entry
    is refused (:func:`check_fused_entries`); with ``None`` it takes the eager step (the same bits),
    with one :class:`EagerFallbackWarning` line naming the shapes and why."""
    numels = numels or [param.numel() for param in params]
    straddling = _straddling_entries(strategy, streams, element_starts, numels)
    if not straddling:
        return [True] * len(params)
    if requested:
        check_fused_entries(strategy, params, streams, element_starts, numels)
    shapes = ", ".join(dict.fromkeys(str(tuple(params[index].shape)) for index in straddling))
    rows = ", ".join(dict.fromkeys(str(streams[index].row_length) for index in straddling))
    warn_eager_fallback(
        f"the parameters of shapes {shapes}",
        f"the compiled step of option {strategy.name!r} draws the stochastic-rounding words of each FP8 group of "
        f"{strategy.fp8_group_size} elements from one row of its parameter's SR stream, and their stream rows "
        f"(tensor-parallel shards: rows of {rows} elements) split their groups",
    )
    return [index not in straddling for index in range(len(params))]


def _signed_int64(value: int) -> int:
    """The representative of ``value`` mod 2^64 in [-2^63, 2^63) (an int64's two's complement)."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def _entry_grid_calls(
    bucket: Bucket,
    strategy: PrecisionStrategy,
    entry_grads: list[torch.Tensor],
    scalars: dict[int, StepScalars],
    sr_seed: int,
    step: int,
):
    """Stochastic rounding entry by entry: each entry's slices of the parameters, gradients and state
    as grids of whole rows of its stream layout (:meth:`StreamLayout.grids`: one grid, or a one-row
    grid for a partial first or last row), with the row starts' int32 words (computed at the first
    step and kept with the bucket). FP8 payloads and scales stay flat, as in the eager state."""
    kernel_scalars = {group: values.as_kernel_scalars() for group, values in scalars.items()}
    buffers = kernel_state(bucket, strategy)
    for index, (param, grad) in enumerate(zip(bucket.entry_params(), entry_grads)):
        layout, element_start = bucket.streams[index], bucket.element_starts[index]
        for grid_index, (first, rows, length, offset) in enumerate(layout.grids(element_start, bucket.numels[index])):
            if length > INT32_GRID_MAX_ROW:
                raise ValueError(
                    f"entry {index} of the bucket has SR stream rows of {length} elements; the fused step counts "
                    f"columns in int32 (at most {INT32_GRID_MAX_ROW}): use fused=False"
                )
            key = (index, grid_index)
            if key not in bucket.row_start_words:
                bucket.row_start_words[key] = row_start_words(offset, layout.row_stride, rows, bucket.device)
            local = slice(first - element_start, first - element_start + rows * length)
            state = {
                key_: bucket.view(buffer, index, elements_per_value(key_, strategy))
                if key_.endswith(FP8_PARTS) else bucket.view(buffer, index)[local].view(rows, length)
                for key_, buffer in buffers.items()
            }
            stream = CounterStream.at_step(sr_seed, step, layout.stream, *bucket.row_start_words[key])
            yield StepCall(
                param[local].view(rows, length), grad.reshape(-1)[local].view(rows, length), state,
                kernel_scalars[bucket.entry_groups[index]], stream,
            )
