"""Flat, contiguous buckets of optimizer state: one per (parameter group, device, dtype).

Every buffer is made with ``new_zeros`` of a parameter (or gradient), so it lives where the
parameters live, whatever device that is.

Every state tensor of a bucket is one flat buffer; each parameter's state entries are views into it
at the parameter's offset, so the eager reference (per parameter) and the fused step (per bucket)
read and write the very same memory. Offsets are aligned to :data:`ALIGNMENT` elements (and to the
FP8 group size), so FP8 groups never straddle two parameters and the zero padding between
parameters stays zero under every strategy (zero gradient, zero moments, zero parameter).

With ``own_params=True`` the bucket also owns a flat parameter buffer and re-points each
parameter's ``.data`` at its view, as megatron-core's DistributedDataParallel does with its
contiguous parameter buffer; gradients are gathered into a flat gradient buffer the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lowprec.numerics.quant import quantized_zeros
from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.master import master_key, new_master, reset_master_
from megatron_lowprec.optim.strategies import PrecisionStrategy

ALIGNMENT = 128
"""Elements between parameter starts in a bucket are a multiple of this (and of the FP8 group size)."""

MOMENTS = ("exp_avg", "exp_avg_sq")
FP8_PARTS = ("payload", "scale", "expansion_exponent")
PER_GROUP_PARTS = ("_scale", "_expansion_exponent")
"""Suffixes of the FP8 state parts that hold one value per group, not per element."""
LOW_COMPONENTS = ("param_lo", "exp_avg_sq_lo", "kahan_compensation")


def state_keys(strategy: PrecisionStrategy) -> list[str]:
    """Names of the tensor states ``strategy`` keeps per parameter (``step`` is an int besides these)."""
    if strategy.moments == "fp8":
        parts = FP8_PARTS if strategy.fp8_expand else FP8_PARTS[:2]
        keys = [f"{moment}_{part}" for moment in MOMENTS for part in parts]
    else:
        keys = list(MOMENTS)
    if strategy.master_weights:
        keys.append(master_key(strategy))
    if strategy.keeps_param_low_component:
        keys.append("param_lo")
    if strategy.second_moment_mcf:
        keys.append("exp_avg_sq_lo")
    if strategy.param_update == "kahan":
        keys.append("kahan_compensation")
    return keys


def elements_per_value(key: str, strategy: PrecisionStrategy) -> int:
    """Elements of the parameter per stored value of state ``key``: the FP8 group size for scales, else 1."""
    return strategy.fp8_group_size if key.endswith(PER_GROUP_PARTS) else 1


def bucket_alignment(strategy: PrecisionStrategy) -> int:
    if strategy.moments == "fp8":
        return math.lcm(ALIGNMENT, strategy.fp8_group_size)
    return ALIGNMENT


@dataclass
class Bucket:
    """Flat state of the parameters of one group that share a device and a dtype."""

    group_index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    """Padded number of elements of every flat buffer (FP8 scales: ``numel / group_size``)."""
    streams: list[StreamLayout]
    """Where each parameter's elements sit in the counter-based SR stream (aligned with ``params``)."""
    state: dict[str, torch.Tensor]
    param_buffer: torch.Tensor | None = None
    grad_buffer: torch.Tensor | None = field(default=None, repr=False)
    row_start_words: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Per parameter index, the int32 words of its rows' starts in its SR stream (filled by the fused step)."""
    stream_tables: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    """The per-parameter tables of the whole-bucket SR stream (filled by the fused step on GPUs)."""

    def view(self, buffer: torch.Tensor, index: int, per_group: int = 1) -> torch.Tensor:
        """The flat slice of ``buffer`` that belongs to parameter ``index`` (``per_group`` > 1: FP8 scales)."""
        start = self.offsets[index] // per_group
        return buffer[start : start + math.ceil(self.params[index].numel() / per_group)]


def zero_state(
    strategy: PrecisionStrategy, numel: int, like: torch.Tensor, fp8_groups: int | None = None
) -> dict[str, torch.Tensor]:
    """Every flat state buffer of ``strategy`` but the master, zero (FP8: zero payloads, scale and k of
    an all-zero group), for ``numel`` elements of 16-bit parameters like ``like``, on its device.
    ``fp8_groups`` defaults to ``numel`` cut into consecutive groups."""
    state: dict[str, torch.Tensor] = {}
    for moment in MOMENTS:
        if strategy.moments == "fp8":
            zeros = quantized_zeros(
                numel, strategy.fp8_format, strategy.fp8_group_size, strategy.fp8_expand, like.device, fp8_groups
            )
            for part in FP8_PARTS:
                if getattr(zeros, part) is not None:
                    state[f"{moment}_{part}"] = getattr(zeros, part)
        else:
            state[moment] = like.new_zeros(numel, dtype=like.dtype if strategy.moments == "low" else torch.float32)
    for key in LOW_COMPONENTS:
        if key in state_keys(strategy):
            state[key] = like.new_zeros(numel)
    return state


def _flat_state(strategy: PrecisionStrategy, params: list[torch.nn.Parameter], offsets: list[int], numel: int) -> dict[str, torch.Tensor]:
    state = zero_state(strategy, numel, params[0])
    if strategy.master_weights:
        master = new_master(strategy, numel, params[0])
        for param, offset in zip(params, offsets):
            reset_master_(param.detach().reshape(-1), master[offset : offset + param.numel()])
        state[master_key(strategy)] = master
    return state


def build_bucket(
    strategy: PrecisionStrategy,
    group_index: int,
    params: list[torch.nn.Parameter],
    own_params: bool,
    streams: list[StreamLayout] | None = None,
) -> tuple[Bucket, list[dict[str, Any]]]:
    """A bucket for ``params`` (same device and dtype) and each parameter's state of views into it.
    ``streams`` defaults to a whole stream per parameter, numbered by position."""
    if streams is None:
        streams = [StreamLayout.whole(index, param.numel()) for index, param in enumerate(params)]
    alignment = bucket_alignment(strategy)
    offsets, numel = [], 0
    for param in params:
        offsets.append(numel)
        numel += -(-param.numel() // alignment) * alignment
    bucket = Bucket(group_index, list(params), offsets, numel, list(streams), _flat_state(strategy, params, offsets, numel))
    if own_params:
        bucket.param_buffer = params[0].new_zeros(numel)
        for index, param in enumerate(params):
            view = bucket.view(bucket.param_buffer, index).view(param.shape)
            view.copy_(param.detach())
            param.data = view
    states = []
    for index in range(len(params)):
        entry: dict[str, Any] = {"step": 0}
        for key, buffer in bucket.state.items():
            flat = bucket.view(buffer, index, elements_per_value(key, strategy))
            entry[key] = flat if key.endswith(FP8_PARTS) else flat.view(params[index].shape)
        states.append(entry)
    return bucket, states


def gather_grads(bucket: Bucket) -> torch.Tensor | None:
    """The bucket's gradients as one flat buffer, or ``None`` if some parameter has no gradient or
    the gradients do not share one dtype. Gradients that are not yet views of the buffer are copied
    in once and re-pointed, so that later backward passes accumulate into the buffer directly."""
    grads = [param.grad for param in bucket.params]
    if any(grad is None for grad in grads) or len({grad.dtype for grad in grads}) != 1:
        return None
    dtype = grads[0].dtype
    if bucket.grad_buffer is None or bucket.grad_buffer.dtype != dtype:
        bucket.grad_buffer = grads[0].new_zeros(bucket.numel, dtype=dtype)
    for index, (param, grad) in enumerate(zip(bucket.params, grads)):
        view = bucket.view(bucket.grad_buffer, index).view(param.shape)
        if grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
            view.copy_(grad)
            param.grad = view
    return bucket.grad_buffer
