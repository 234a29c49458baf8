"""A step's statistics, one implementation for every path (the plain optimizers, ``build_optimizer``'s
unsharded and distributed optimizers, the app): the exact gradient norm, clipping by it, and the
update quality (EDQ, Collage Def. 3.3, eq. 3; imprecision, Collage §3) summed over buckets.

The gradient norm is exact (:mod:`megatron_lowprec.numerics.square_sum`: Σ x² as integer digit sums),
so it has the same bits however the gradients are split over tensors, buckets and ranks. A caller
whose gradients or buckets lie on several processes passes ``reduce``, which sums a tensor in place
over them (megatron's adapters: an all-reduce over their process groups,
:class:`~megatron_lowprec.megatron.distributed.ExactGradientStatistics`); integer sums and the
update-quality pieces (sums and counts) add up in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_lowprec.metrics.update_quality import UpdateQuality
from megatron_lowprec.numerics.square_sum import norm_from_bins, square_sum_bins

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the processes that hold the other parts (an all-reduce)."""

CLIP_EPSILON = 1.0e-6
"""Added to the norm in the clipping coefficient ``max_norm / (norm + ε)``, as megatron-core and
``torch.nn.utils.clip_grad_norm_`` add it."""

GRAD_NORM_LABEL = "lowprec.grad_norm"
"""The ``torch.profiler.record_function`` label of the exact gradient norm's computation."""


@torch.no_grad()
def grad_norm(grads: Sequence[torch.Tensor], device: torch.device, reduce: Reduce | None = None) -> float:
    """The L2 norm of ``grads`` (and of the other processes' under ``reduce``): the exact Σ x² rounded
    once to float64, then its square root; ``inf`` if a value is infinite, NaN if one is NaN. The sums
    are made on ``device`` (where ``reduce`` communicates). Labelled :data:`GRAD_NORM_LABEL` for
    torch.profiler."""
    with torch.profiler.record_function(GRAD_NORM_LABEL):
        bins = square_sum_bins(list(grads), device)
        if reduce is not None:
            reduce(bins)
        return norm_from_bins(bins)


@torch.no_grad()
def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scales ``grads`` in place by ``max_norm / (norm + ε)`` where that is below 1 (a NaN norm
    leaves them as they are: the step is skipped on non-finite gradients before)."""
    coefficient = max_norm / (norm + CLIP_EPSILON)
    if coefficient < 1.0:
        torch._foreach_mul_(list(grads), coefficient)


def clip_grad_norm_(
    grads: Sequence[torch.Tensor], max_norm: float, device: torch.device, reduce: Reduce | None = None
) -> float:
    """Clips ``grads`` by their global :func:`grad_norm` (:func:`clip_grads_`) and returns that norm."""
    norm = grad_norm(grads, device, reduce)
    clip_grads_(grads, max_norm, norm)
    return norm


def summed_update_quality(
    pieces: Sequence[torch.Tensor], device: torch.device, reduce: Reduce | None = None
) -> UpdateQuality:
    """The update quality of the buckets' ``pieces`` (each a 4-element FP64 tensor,
    :func:`~megatron_lowprec.metrics.update_quality.update_quality_pieces`) added up on ``device``
    (and over the other processes under ``reduce``)."""
    total = torch.zeros(4, dtype=torch.float64, device=device)
    for bucket_pieces in pieces:
        total += bucket_pieces
    if reduce is not None:
        reduce(total)
    return UpdateQuality.from_tensor(total)


def update_quality_by_group(group_indices: Sequence[int], pieces: Sequence[torch.Tensor], groups: int) -> list[UpdateQuality]:
    """The update quality of each of ``groups`` parameter groups from its buckets' ``pieces``
    (``group_indices``: each bucket's group); a group without buckets has none."""
    by_group: dict[int, list[torch.Tensor]] = {}
    for group_index, bucket_pieces in zip(group_indices, pieces):
        by_group.setdefault(group_index, []).append(bucket_pieces)
    return [
        summed_update_quality(by_group[index], by_group[index][0].device) if index in by_group else UpdateQuality()
        for index in range(groups)
    ]
