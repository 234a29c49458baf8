"""Exact sums of squares against Python's exact rationals, and their independence of the split."""

import math
from fractions import Fraction

import pytest
import torch

from megatron_lowprec.numerics import square_sum
from megatron_lowprec.numerics.square_sum import norm_from_bins, square_sum_bins


def exact_norm(values: torch.Tensor) -> float:
    """sqrt(Σ x²) with the sum exact (Fraction), rounded once to float64, as norm_from_bins promises."""
    total = sum(Fraction(value) ** 2 for value in values.double().tolist())
    return math.sqrt(float(total))


def mixed_values(generator: torch.Generator, numel: int) -> torch.Tensor:
    """float32 values over many binades, subnormals and zeros included."""
    values = torch.randn(numel, generator=generator) * torch.exp2(torch.randint(-140, 60, (numel,), generator=generator).float())
    values[::97] = 0.0
    values[1::89] = torch.tensor(3.0e-42)
    return values


def test_bins_give_the_exactly_rounded_norm(device):
    generator = torch.Generator().manual_seed(0)
    values = mixed_values(generator, 4000)
    bins = square_sum_bins([values.to(device)], device)
    assert bins.dtype == torch.int64 and bins.device.type == device.type
    assert norm_from_bins(bins.cpu()) == exact_norm(values)


def test_any_split_order_and_chunking_gives_the_same_bits(device, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    values = (torch.randn(3001, generator=generator) * 1.0e-3).to(device)
    whole = square_sum_bins([values], device)
    pieces = list(values[torch.randperm(3001, generator=generator).to(device)].split([1000, 7, 1994]))
    ranks = [square_sum_bins(pieces[:2], device), square_sum_bins(pieces[2:], device)]
    assert torch.equal(ranks[0] + ranks[1], whole)
    monkeypatch.setattr(square_sum, "CHUNK_ELEMENTS", 64)
    assert torch.equal(square_sum_bins([values], device), whole)
    assert norm_from_bins(whole.cpu()) == exact_norm(values.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_are_exact(device, dtype):
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(500, generator=generator).to(dtype)
    assert norm_from_bins(square_sum_bins([values.to(device)], device).cpu()) == exact_norm(values.float())


def test_float64_summation_would_depend_on_the_split():
    """The reason for integers: summing the same float64 squares in two splits differs in the last bit."""
    generator = torch.Generator().manual_seed(3)
    values = mixed_values(generator, 20000).double() ** 2
    split = values[:7777].sum() + values[7777:].sum()
    assert values.sum() != split or values.flip(0).sum() != values.sum()


def test_non_finite_values():
    assert norm_from_bins(square_sum_bins([torch.tensor([1.0, math.inf])], torch.device("cpu"))) == math.inf
    assert math.isnan(norm_from_bins(square_sum_bins([torch.tensor([math.nan, math.inf])], torch.device("cpu"))))
    assert norm_from_bins(square_sum_bins([], torch.device("cpu"))) == 0.0


def test_deterministic_mode_is_kept_and_allows_the_exact_sums(device):
    values = torch.randn(100, generator=torch.Generator().manual_seed(4)).to(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert norm_from_bins(square_sum_bins([values], device).cpu()) == exact_norm(values.cpu())
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
