"""Layout sources: where the elements an optimizer steps, and their state, live.

By default an optimizer owns its layout: each parameter group's parameters go to buckets whose
state (and, fused, whose parameters) it allocates (:func:`~megatron_lowprec.optim.buckets.build_bucket`).
A :class:`Layout` replaces that with elements that live elsewhere, e.g. the distributed optimizer's
shard of megatron-core's DDP buffers (a range of them, or rows of them where the strategy's groups
do not fit megatron's padding): it builds the buckets, each entry a parameter or a run of its
flattened elements and a bucket possibly spanning parameter groups, and says where each bucket's
gradients lie. The optimizer steps the buckets with its one runner and keeps their per-entry state
views as its per-parameter state, so its state dict has one format whichever layout it steps.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.buckets import Bucket, BufferRows
from megatron_lowprec.optim.strategies import PrecisionStrategy

BucketGrads = tuple[torch.Tensor | BufferRows, list[torch.Tensor]]
"""A bucket's gradients for its fused step (a flat buffer in its layout, or the rows of one it lives
in) and each entry's flat gradient (views of either)."""


class Layout(abc.ABC):
    """The buckets of an optimizer whose elements live outside it, and their gradients."""

    @abc.abstractmethod
    def build(
        self,
        strategy: PrecisionStrategy,
        param_groups: list[dict[str, Any]],
        streams: dict[torch.nn.Parameter, StreamLayout],
    ) -> list[tuple[Bucket, list[dict[str, Any]]]]:
        """Every bucket with each entry's state (a ``step`` and views of the bucket's buffers, flat),
        for ``param_groups`` (each entry's group: :attr:`Bucket.entry_groups`) under ``strategy``;
        a parameter has at most one entry, and one that has none is not stepped here."""

    @abc.abstractmethod
    def bucket_grads(self, bucket: Bucket) -> BucketGrads:
        """``bucket``'s gradients (:data:`BucketGrads`), where they lie."""
