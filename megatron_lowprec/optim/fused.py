"""Fused AdamW steps: the reference kernel compiled by ``torch.compile``, run once per flat bucket.

Stochastic rounding on GPUs runs once per bucket (:class:`~megatron_lowprec.optim.kernel.BucketStream`:
each element finds its parameter and row by a binary search and an integer division). On CPU it runs
once per parameter instead, over the parameter's slice of the flat buffers viewed as [rows,
row_length] of its stream layout: each element's SR word then comes from its global index without an
integer division per element (which CPU vector units lack), at the price of one call per parameter
(about 0.1 ms of Python and guard overhead each on CPU). Strategies with FP8
moments (coat) run it over the bucket viewed as [groups, group_size], so that each group is decoded,
updated and re-quantized with its new statistics inside one compiled kernel
(:data:`GROUP_STATISTICS_OPTIONS`), without bucket-sized FP32 temporaries.
Strategies with ``adam_kernel="torch_fused"`` (D) run torch's own fused AdamW kernel instead
(``torch_fused.py``), in the fused and the eager step alike.

The kernel is :func:`megatron_lowprec.optim.kernel.adamw_kernel_` itself, so fused and eager
steps share one specification. Inductor turns it into C++/OpenMP loops on CPU and Triton kernels on
GPU. What keeps the compiled step bit-identical to the eager one:

* ``emulate_precision_casts``: every explicit cast to a 16-bit dtype is a real rounding. Without it
  Inductor keeps 16-bit intermediates in FP32, which silently drops the MCF error terms.
* Inductor compiles C++ with ``-ffp-contract=off`` (its default), so no multiply and add are fused.
* COAT's dynamic range expansion calls ``pow`` and ``log``, which Inductor evaluates with its own
  vectorized functions. Where ATen's eager kernels use other implementations (on CPU: the C
  library's ``pow`` for the elements after the last whole vector, and another vectorized ``log``,
  which differs from Inductor's on about 1% of random inputs), an element's FP8 code may differ by
  one step between the eager and the fused step; the tests bound this. Strategies without
  expansion are bit-identical.
* Step-dependent scalars and the SR round keys are 0-d tensors, and shapes are dynamic, so one
  compilation per strategy and dtype serves every step and bucket.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from megatron_lowprec.numerics.rounding import INT32_GRID_MAX_ROW, counter_round_keys, row_start_words, signed_word
from megatron_lowprec.optim.buckets import FP8_PARTS, PER_GROUP_PARTS, Bucket, elements_per_value
from megatron_lowprec.optim.kernel import (
    BucketStream,
    CounterStream,
    StepScalars,
    adamw_kernel_,
    beta2_expansion_for,
    kernel_scalar,
    to_device_async,
)
from megatron_lowprec.optim.master import master_key
from megatron_lowprec.optim.strategies import PrecisionStrategy
from megatron_lowprec.optim.torch_fused import torch_fused_adamw_step_

INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
"""``emulate_precision_casts``: see above. ``cpp.dynamic_threads``: an OpenMP loop whatever the size
hint; with dynamic shapes Inductor otherwise judges the work too small and runs one thread (2x slower
on 2 cores)."""

GROUP_STATISTICS_OPTIONS = {
    "realize_reads_threshold": 8,
    "realize_acc_reads_threshold": 16,
    "realize_cpu_acc_reads_threshold": 16,
}
"""Inductor options for strategies with FP8 moments (COAT): each group's updated moments feed the
master update, two group reductions (max|x|, smallest non-zero) and the re-quantization, and under
Inductor's defaults (4 reads; 8 or 12 accumulated) they are stored in bucket-sized FP32 buffers
between those loops. With these thresholds they are recomputed from the FP8 payloads instead, so
the step reads the state a few times but allocates only per-group buffers. Options this torch's
Inductor lacks are left out (it then stores them)."""

LOW_PRECISION_TILING_TAG = "|megatron_lowprec.low_precision_tiling.v1"
"""Added to torch.compile's cache key while :func:`_low_precision_tiling` is in force."""

BUCKET_STREAM_DEVICES = ("cuda",)
"""Device types on which stochastic rounding runs one compiled call per bucket (:class:`BucketStream`:
a binary search and an integer division per element, which GPUs have). Elsewhere (CPU vector units
lack integer division) it runs one call per parameter over its [rows, row_length] grid."""

RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit is raised to at least this: each strategy, dtype and rank of the views
(flat buckets; [rows, row_length] grids under SR, with one row or more) is one compilation."""


def fused_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can build the fused step here: a C++ compiler on CPU, Triton on GPU."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device.type == "cpu":
        return any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name)
    return False


@functools.cache
def compiled_kernel(group_statistics: bool = False) -> Callable:
    """The compiled :func:`adamw_kernel_` (built once; Dynamo specialises it per strategy and dtype),
    with :data:`GROUP_STATISTICS_OPTIONS` for strategies with FP8 moments (``group_statistics``).
    Shapes are dynamic, but Python ints are not (``specialize_int``): the strategy's FP8 group size
    must be a constant, or every group index becomes a scalar division by a symbol."""
    from torch._inductor import config as inductor_config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    options = dict(INDUCTOR_OPTIONS)
    if group_statistics:
        options.update({k: v for k, v in GROUP_STATISTICS_OPTIONS.items() if hasattr(inductor_config, k)})
    compiled = torch.compile(adamw_kernel_, dynamic=True, fullgraph=True, options=options)
    compiled = torch._dynamo.config.patch(specialize_int=True)(compiled)

    def call(*args):
        with _low_precision_tiling():
            return compiled(*args)

    return call


@contextlib.contextmanager
def _low_precision_tiling():
    """While compiling, Inductor's C++ loops that touch a 16-bit float are vectorized as many
    elements wide as one vector of that type (16 on AVX2), not as one FP32 vector (8).

    Inductor picks the 16-bit width only when every node of a loop is 16-bit; a loop that mixes BF16
    parameters with FP32 moments or int32 SR words runs 8 wide, and ATen loads and stores 8 BF16
    through a stack buffer (a partial vector), which slows D-MW, D, sr and coat down by up to 2.5x
    on CPU (a BF16/FP32 AdamW-like loop: 19.9 ms at 8 wide, 8.3 ms at 16 wide, 16M elements). Only
    the vector width changes, not the arithmetic (the fused-vs-eager tests check every option bit for
    bit). The choice is part of the compile caches' key (``cache_key_tag``), so that code compiled
    without it is not reused.

    This reaches into Inductor's internals, which change between torch versions. Inductor's own
    choice is kept whenever they differ from what is expected here: a missing piece (checked before
    patching), another signature or return shape of ``select_tiling``, or any exception while the
    width is chosen (see :func:`_low_precision_tiling_select`; logged once)."""
    from torch._inductor.codegen import cpp

    original = getattr(cpp, "TilingSelect", None)
    needed = (
        hasattr(original, "select_tiling"),
        hasattr(cpp, "_get_loop_body"),
        hasattr(cpp, "get_loop_body_lowp_fp"),
        hasattr(getattr(torch.compiler, "config", None), "cache_key_tag"),
    )
    if not all(needed):
        yield
        return
    tag = torch.compiler.config.cache_key_tag + LOW_PRECISION_TILING_TAG
    cpp.TilingSelect = _low_precision_tiling_select(original)
    try:
        with torch.compiler.config.patch(cache_key_tag=tag):
            yield
    finally:
        cpp.TilingSelect = original


@functools.cache
def _warn_tiling_fallback(reason: str) -> None:
    """Log once per reason that Inductor's own tiling is used."""
    logging.getLogger(__name__).warning(
        "16-bit vector tiling is off, Inductor's own tiling is used (this torch's Inductor differs: %s)", reason
    )


def _widened_tiling(selected: Any, fn_list: Any) -> Any:
    """``selected`` = (factors, indices, ...) with FP32-wide factors widened to one 16-bit vector when
    every low-precision node of ``fn_list`` has the same 16-bit dtype; raises on any other shape."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codegen import cpp

    factors, indices, *rest = selected
    isa = cpu_vec_isa.pick_vec_isa()
    low_precision = {cpp.get_loop_body_lowp_fp(body)[0] for body in cpp._get_loop_body(fn_list)} - {None}
    if len(low_precision) == 1 and factors and set(factors) == {isa.nelements(torch.float)}:
        factors = [isa.nelements(low_precision.pop())] * len(factors)
    return (factors, indices, *rest)


@functools.cache
def _low_precision_tiling_select(base: type) -> type:
    class LowPrecisionTilingSelect(base):
        """Inductor's tiling, widened to one 16-bit vector for loops that touch a 16-bit float; Inductor's
        own result, unchanged, when it is not the expected (factors, indices, stats) or widening fails."""

        def select_tiling(self, *args, **kwargs):
            selected = super().select_tiling(*args, **kwargs)
            fn_list = kwargs.get("fn_list", args[0] if args else None)
            if not (isinstance(selected, tuple) and len(selected) == 3 and isinstance(selected[0], list)):
                _warn_tiling_fallback(f"select_tiling returned {type(selected).__name__} of another shape")
                return selected
            try:
                return _widened_tiling(selected, fn_list)
            except Exception as error:
                _warn_tiling_fallback(f"{type(error).__name__}: {error}")
                return selected

    return LowPrecisionTilingSelect


@torch.no_grad()
def fused_bucket_step_(
    bucket: Bucket,
    grad: torch.Tensor,
    strategy: PrecisionStrategy,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    sr_seed: int | None,
    track_update_quality: bool,
) -> torch.Tensor | None:
    """One AdamW step over a whole bucket (its parameters all at ``step`` after this call), in the
    compiled calls that :func:`_segments` lays out; the update-quality pieces (an FP64 tensor on the
    bucket's device) when ``track_update_quality``."""
    param = bucket.param_buffer
    if strategy.adam_kernel == "torch_fused":
        spans = [(offset, bucket_param.numel()) for offset, bucket_param in zip(bucket.offsets, bucket.params)]
        state = bucket.state
        return torch_fused_adamw_step_(
            param, grad, state[master_key(strategy)], state["exp_avg"], state["exp_avg_sq"], spans, step=step, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, track_update_quality=track_update_quality,
        )
    scalars = StepScalars.for_step(step, lr, beta1, beta2, eps, weight_decay).as_kernel_scalars()
    beta2_expansion = tuple(
        None if part is None else kernel_scalar(part, param.dtype) for part in beta2_expansion_for(strategy, beta2, param.dtype)
    )

    kernel = compiled_kernel(strategy.moments == "fp8")
    pieces = [
        kernel(param, grad, state, strategy, scalars, beta2_expansion, random_source, track_update_quality)
        for param, grad, state, random_source in _segments(bucket, grad, strategy, sr_seed, step)
    ]
    return sum(pieces) if track_update_quality else None


def _segments(bucket: Bucket, grad: torch.Tensor, strategy: PrecisionStrategy, sr_seed: int | None, step: int):
    """The (parameter, gradient, state, random source) slices of the bucket that one compiled call
    each updates: each parameter on its own under stochastic rounding; else the whole bucket in one
    call (as [groups, group_size] under FP8 moments)."""
    device = bucket.param_buffer.device
    if sr_seed is not None and device.type in BUCKET_STREAM_DEVICES and _whole_bucket_step(strategy):
        yield bucket.param_buffer, grad, bucket.state, _bucket_stream(bucket, sr_seed, step)
    elif sr_seed is not None:
        for index, layout in enumerate(bucket.streams):
            stream = CounterStream.at_step(sr_seed, step, layout.stream, *_row_starts(bucket, index))
            yield *_parameter_grids(bucket, grad, index, strategy), stream
    elif strategy.moments == "fp8":
        yield _group_grids(bucket, grad, strategy)
    else:
        yield bucket.param_buffer, grad, bucket.state, None


def _group_grids(
    bucket: Bucket, grad: torch.Tensor, strategy: PrecisionStrategy
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], None]:
    """The whole bucket viewed as [groups, group_size] of its FP8 quantization (per-group scales and
    exponents flat, one per row), so that the compiled step loops over groups: each group's moments
    are decoded, updated and re-quantized in one pass over it (the bucket holds whole groups)."""
    group_size = strategy.fp8_group_size

    def grid(buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(-1, group_size)

    state = {key: buffer if key.endswith(PER_GROUP_PARTS) else grid(buffer) for key, buffer in bucket.state.items()}
    return grid(bucket.param_buffer), grid(grad), state, None


def _whole_bucket_step(strategy: PrecisionStrategy) -> bool:
    """Whether the step is elementwise FP32 and integer arithmetic over flat buffers (no torch kernel,
    no per-group FP8 statistics), so that one call can take the whole bucket under any stream."""
    return strategy.adam_kernel == "reference" and strategy.moments != "fp8"


def _bucket_stream(bucket: Bucket, sr_seed: int, step: int) -> BucketStream:
    """The :class:`BucketStream` of ``bucket`` at ``step``: this step's round keys, and the
    per-parameter tables, built at the first step and kept with the bucket."""
    device = bucket.param_buffer.device
    if bucket.stream_tables is None:
        starts = [_row_starts(bucket, index) for index in range(len(bucket.params))]
        rows = [high.shape[0] for high, _ in starts]
        bases = [sum(rows[:index]) for index in range(len(rows))]

        def int32(values):
            return to_device_async(torch.tensor(values, dtype=torch.int32), device)

        bucket.stream_tables = (
            int32(bucket.offsets),
            int32([layout.row_length for layout in bucket.streams]),
            int32([base + count - 1 for base, count in zip(bases, rows)]),
            int32(bases),
            torch.cat([high for high, _ in starts]).reshape(-1),
            torch.cat([low for _, low in starts]).reshape(-1),
        )
    keys = [[signed_word(key) for key in counter_round_keys(sr_seed, step, layout.stream)] for layout in bucket.streams]
    return BucketStream(to_device_async(torch.tensor(keys, dtype=torch.int32), device), *bucket.stream_tables)


def _row_starts(bucket: Bucket, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameter ``index``'s row starts in its stream as int32 words (:func:`row_start_words`),
    computed at its first step and kept with the bucket (a layout never changes)."""
    if index not in bucket.row_start_words:
        layout = bucket.streams[index]
        if layout.row_length > INT32_GRID_MAX_ROW:
            raise ValueError(
                f"parameter {index} of the bucket has SR stream rows of {layout.row_length} elements; "
                f"the fused step counts columns in int32 (at most {INT32_GRID_MAX_ROW}): use fused=False"
            )
        rows = layout.rows(bucket.params[index].numel())
        bucket.row_start_words[index] = row_start_words(layout.offset, layout.row_stride, rows, bucket.param_buffer.device)
    return bucket.row_start_words[index]


def _parameter_grids(
    bucket: Bucket, grad: torch.Tensor, index: int, strategy: PrecisionStrategy
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Parameter ``index``'s slices of the bucket's parameter, gradient and state buffers, viewed as
    [rows, row_length] of its stream layout (FP8 payloads and scales stay flat, as in the eager state)."""
    layout = bucket.streams[index]
    rows = layout.rows(bucket.params[index].numel())

    def grid(buffer: torch.Tensor) -> torch.Tensor:
        return bucket.view(buffer, index).view(rows, layout.row_length)

    state = {
        key: bucket.view(buffer, index, elements_per_value(key, strategy)) if key.endswith(FP8_PARTS) else grid(buffer)
        for key, buffer in bucket.state.items()
    }
    return grid(bucket.param_buffer), grid(grad), state
