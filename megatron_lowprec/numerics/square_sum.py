"""Exact sums of squares, for a gradient norm that does not depend on how the elements are split.

A float32 value is ``s · 2^(e - 150)`` with an integer significand ``s < 2^24`` and ``e`` its biased
exponent (1 for subnormals), so its square is the integer ``s² < 2^48`` times ``2^(2e - 300)``.
:func:`square_sum_bins` adds these integers per exponent, each split into two 24-bit limbs so that
int64 never overflows; :func:`norm_from_bins` turns the binned total into ``sqrt(Σ x²)``. Integer
sums are exact, so the bins, and the norm, are the same bits whatever the order of the elements,
their grouping into tensors, or the ranks and shards holding them (the bins of several ranks add up
with one integer all-reduce). 16-bit values are converted to float32 exactly first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

EXPONENTS = 256
"""Biased float32 exponents; 255 holds inf and NaN."""

LIMB_BITS = 24
CHUNK_ELEMENTS = 1 << 24
"""Elements per pass: bounds the int64 temporaries, and keeps each pass's per-exponent limb sums
below 2^48, which float64 (the weights of ``torch.bincount``) holds exactly."""


def square_sum_bins(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ x² over ``tensors`` as int64 bins of shape (2, 256): row 0 the high and row 1 the low 24
    bits of the squared significands per biased exponent. Exponent 255 counts the non-finite values
    in row 0 and the NaNs among them in row 1."""
    bins = torch.zeros(2, EXPONENTS, dtype=torch.int64, device=device)
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            bits = flat[start : start + CHUNK_ELEMENTS].float().view(torch.int32)
            exponent = (bits >> 23) & 0xFF
            mantissa = bits & 0x7FFFFF
            significand = torch.where(exponent > 0, mantissa | 0x800000, mantissa).to(torch.int64)
            square = significand * significand
            non_finite = exponent == 0xFF
            high = torch.where(non_finite, 1, square >> LIMB_BITS)
            low = torch.where(non_finite, (mantissa != 0).to(torch.int64), square & ((1 << LIMB_BITS) - 1))
            index = exponent.clamp(min=1).to(torch.int64)
            with _exact_sums_allowed():
                for row, limb in enumerate((high, low)):
                    bins[row] += torch.bincount(index, weights=limb.double(), minlength=EXPONENTS).to(torch.int64)
    return bins


@contextlib.contextmanager
def _exact_sums_allowed() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` refuses CUDA's ``bincount`` with weights, whose
    float atomics add in any order; here every partial sum is an integer below 2^53, exact in any
    order, so the check is lifted for these calls and restored after them."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def norm_from_bins(bins: torch.Tensor) -> float:
    """``sqrt(Σ x²)`` of :func:`square_sum_bins` (summed over ranks where needed): the exact sum
    rounded once to float64, then its square root. ``inf`` if a value was infinite, NaN if one was NaN."""
    high, low = bins.tolist()
    if high[EXPONENTS - 1]:
        return math.nan if low[EXPONENTS - 1] else math.inf
    total = sum(((high[e] << LIMB_BITS) + low[e]) << (2 * (e - 1)) for e in range(1, EXPONENTS - 1))
    return math.ldexp(math.sqrt(float(total)), -149)
