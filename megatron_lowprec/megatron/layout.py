"""megatron-core's layout of its DDP buffers, as the optimizer's buckets read it: where a
parameter may start (:data:`ROW`), and a distributed optimizer's shard of a buffer as a state bucket
(:func:`build_shard_bucket`, laid out in place in the buffer's range where the strategy allows),
its owned range cut on FP8 group boundaries (:func:`owned_bounds`).

The optim package's buckets take an owner's layout as data (:class:`~megatron_lowprec.optim.buckets.InPlace`,
a row width); only this module knows megatron's. It imports no megatron module, so that tools that
build a shard's kernels without megatron-core (the kernel audit) use the same rules.
"""

from __future__ import annotations

import math

import torch

from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.buckets import Bucket, BufferRows, InPlace, build_bucket, in_place_offsets
from megatron_lowprec.optim.strategies import PrecisionStrategy

ROW = 64
"""Elements of a row of the per-row tables (:meth:`~megatron_lowprec.optim.buckets.Bucket.row_table`:
each row's parameter group, its stochastic-rounding entry) of a bucket laid out in place in
megatron's buffers: megatron-core starts every parameter of its DDP buffers at a multiple of 64
elements under the distributed optimizer (``pad_param_start``), so that no such row holds two
parameters. A divisor of :data:`~megatron_lowprec.optim.buckets.ALIGNMENT`, the rows of a bucket in
the aligned layout."""


def build_shard_bucket(
    strategy: PrecisionStrategy,
    params: list[torch.nn.Parameter],
    runs: list[tuple[int, int]],
    starts: list[int],
    entry_groups: list[int],
    streams: list[StreamLayout] | None,
    param_data: torch.Tensor,
    grad_data: torch.Tensor,
    start: int,
    end: int,
) -> tuple[Bucket, torch.Tensor | BufferRows]:
    """The state bucket of a distributed optimizer's shard, elements [start, end) of megatron's flat
    parameter and gradient buffers ``param_data`` and ``grad_data`` (one DDP bucket's, whose element
    0 starts a row of :data:`ROW`): its entries are the runs ``runs`` (first element, elements) of
    ``params``, at ``starts`` of the buffers (ascending), in the parameter groups ``entry_groups``,
    with ``streams`` (:func:`~megatron_lowprec.optim.buckets.build_bucket`'s default where ``None``).
    Laid out in place where :func:`~megatron_lowprec.optim.buckets.in_place_offsets` holds them in
    rows of :data:`ROW`, else packed (see :mod:`megatron_lowprec.optim.buckets`); the bucket and its
    gradients: the range of ``grad_data``, or its :class:`~megatron_lowprec.optim.buckets.BufferRows`."""
    offsets = in_place_offsets(strategy, starts, start, end, ROW)
    in_place = None if offsets is None else InPlace(param_data[start:end], offsets, start % ROW, ROW)
    bucket, _ = build_bucket(
        strategy, entry_groups[0], params, own_params=False, streams=streams, runs=runs,
        master_source=[param_data[first : first + numel] for first, (_, numel) in zip(starts, runs)],
        entry_groups=entry_groups, in_place=in_place,
    )
    if in_place is not None:
        return bucket, grad_data[start:end]
    bucket.place_params_in(param_data, starts)
    return bucket, bucket.rows_in(grad_data, starts)


def owned_bounds(bucket_numel: int, world_size: int, params: list[tuple[int, int]], group_size: int) -> list[int]:
    """Each rank's owned range of a bucket: megatron's equal shards, each boundary that falls
    inside a group of ``group_size`` elements of a parameter (``params``: bucket ranges) moved to
    the group's end. ``ValueError`` if a boundary would move past the next shard.

    The rule that ties a distributed optimizer's FP8 groups to megatron's buffer: a group is
    ``group_size`` elements from a multiple of ``group_size`` after its parameter's first element in
    the bucket (COAT §4's 1 x G groups of the parameter's flattened elements, as an unsharded bucket
    cuts them), so no group straddles two parameters or two ranks, and a shard's groups are the
    unsharded step's. The shard is then laid out in place (:func:`build_shard_bucket`) where each
    entry starts a whole number of groups after the shard's start: with parameters on megatron's
    rows of :data:`ROW` elements, for every shard where G divides the parameters' starts, as it
    does for G = 128 on a model of 128-multiples; otherwise packed."""
    shard = bucket_numel // world_size
    bounds = [0]
    for rank in range(1, world_size):
        boundary = rank * shard
        for start, end in params:
            if start < boundary < end:
                boundary = min(end, start + math.ceil((boundary - start) / group_size) * group_size)
        if boundary > (rank + 1) * shard:
            raise ValueError(
                f"a bucket of {bucket_numel} elements split {world_size} ways has shards of {shard} elements, "
                f"fewer than one FP8 group ({group_size}); use fewer data-parallel ranks or larger buckets"
            )
        bounds.append(boundary)
    bounds.append(bucket_numel)
    return bounds
