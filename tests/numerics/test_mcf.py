"""Multi-component float arithmetic (Collage Algorithms 1-7) against exact rational arithmetic.

Every reference is computed with ``fractions.Fraction`` (or float64 where it is provably exact), and the
round-to-nearest-even oracle below is written from the IEEE 754 definition, independently of torch.
Notation: p is the significand width including the implicit bit (bf16 8, fp16 11, fp32 24), u = 2**-p.
"""

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_lowprec.numerics.mcf import (
    expand_scalar,
    expansion_value,
    fast2sum,
    grow,
    mul,
    scaling,
    two_prod_fma,
    two_sum,
)


@dataclass(frozen=True)
class Format:
    dtype: torch.dtype
    precision: int
    min_exponent: int
    max_exponent: int

    @property
    def unit_roundoff(self) -> Fraction:
        return Fraction(1, 2**self.precision)

    @property
    def largest(self) -> Fraction:
        return (2 - Fraction(2) ** (1 - self.precision)) * Fraction(2) ** self.max_exponent


BF16 = Format(torch.bfloat16, 8, -126, 127)
FP16 = Format(torch.float16, 11, -14, 15)
FP32 = Format(torch.float32, 24, -126, 127)
FORMATS = [BF16, FP16, FP32]
FORMAT_IDS = ["bf16", "fp16", "fp32"]
SAMPLES = 1500
MAX_GAP = 40


def exponent_of(magnitude: Fraction) -> int:
    """The e with 2**e <= magnitude < 2**(e + 1), for magnitude > 0."""
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    return exponent


def ulp(value: Fraction, fmt: Format) -> Fraction:
    """Collage Definition 3.1, with ulp(0) the subnormal spacing."""
    exponent = fmt.min_exponent if value == 0 else max(exponent_of(abs(value)), fmt.min_exponent)
    return Fraction(2) ** (exponent - fmt.precision + 1)


def round_nearest_even(value: Fraction, fmt: Format) -> Fraction | float:
    """IEEE 754 round to nearest, ties to even, with subnormals; overflow gives +-inf."""
    if value == 0:
        return Fraction(0)
    quantum = ulp(value, fmt)
    rounded = round(abs(value) / quantum) * quantum
    if rounded > fmt.largest:
        return float("inf") if value > 0 else float("-inf")
    return rounded if value > 0 else -rounded


def fractions_of(tensor: torch.Tensor) -> list[Fraction]:
    return [Fraction(value) for value in tensor.detach().cpu().double().flatten().tolist()]


def to_format(values: np.ndarray, fmt: Format) -> torch.Tensor:
    """float64 values converted to the format (exact for the in-range values the generators build)."""
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(fmt.dtype)


def random_floats(rng: np.random.Generator, fmt: Format, exponents: np.ndarray) -> np.ndarray:
    """Random signed p-bit values with the given binary exponents, exact in float64."""
    significands = rng.integers(2 ** (fmt.precision - 1), 2**fmt.precision, size=exponents.shape)
    signs = rng.choice([-1.0, 1.0], size=exponents.shape)
    return signs * np.ldexp(significands.astype(np.float64), exponents - fmt.precision + 1)


def sum_operands(rng: np.random.Generator, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (a, b) with |a| >= |b|: exponent gaps 0..40, mixed signs, zeros, cancellations, exact ties."""
    a_exponents = rng.integers(fmt.min_exponent + 1, fmt.max_exponent - 1, size=SAMPLES)
    gaps = rng.integers(0, MAX_GAP + 1, size=SAMPLES)
    a_values = random_floats(rng, fmt, a_exponents)
    b_values = random_floats(rng, fmt, a_exponents - gaps)
    half_ulps = np.ldexp(1.0, a_exponents - fmt.precision) * rng.choice([-1.0, 1.0], size=SAMPLES)
    kind = rng.integers(0, 8, size=SAMPLES)
    b_values = np.where(kind == 0, half_ulps, b_values)
    b_values = np.where(kind == 1, -a_values, b_values)
    b_values = np.where(kind == 2, 0.0, b_values)
    a_values = np.where(kind == 3, 0.0, a_values)
    b_values = np.where(kind == 3, 0.0, b_values)
    a, b = to_format(a_values, fmt), to_format(b_values, fmt)
    swap = a.abs() < b.abs()
    return torch.where(swap, b, a), torch.where(swap, a, b)


def check_error_free_sum(a, b, total, error, fmt: Format) -> None:
    """a + b == total + error exactly, total == RN(a + b), |error| <= ulp(total) / 2."""
    assert total.dtype == error.dtype == fmt.dtype
    for a_i, b_i, total_i, error_i in zip(*(fractions_of(t) for t in (a, b, total, error))):
        assert total_i + error_i == a_i + b_i
        assert total_i == round_nearest_even(a_i + b_i, fmt)
        assert abs(error_i) <= ulp(total_i, fmt) / 2
    sum_rounded_by_torch = (a.double() + b.double()).to(fmt.dtype)
    assert torch.equal(total.cpu(), sum_rounded_by_torch.cpu())


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_two_sum_is_error_free_in_either_order(fmt, device):
    a, b = sum_operands(np.random.default_rng(1), fmt)
    a, b = a.to(device), b.to(device)
    check_error_free_sum(a, b, *two_sum(a, b), fmt)
    check_error_free_sum(b, a, *two_sum(b, a), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_fast2sum_is_error_free_when_first_operand_is_larger(fmt, device):
    a, b = sum_operands(np.random.default_rng(2), fmt)
    a, b = a.to(device), b.to(device)
    check_error_free_sum(a, b, *fast2sum(a, b), fmt)


def test_sums_round_ties_to_even(device):
    one, half_ulp = torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16, device=device), 2.0**-8
    total, error = two_sum(one, half_ulp)
    assert total.tolist() == [1.0, 1.015625]
    assert error.tolist() == [half_ulp, -half_ulp]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_two_prod_fma_is_error_free_away_from_underflow(fmt, device):
    rng = np.random.default_rng(3)
    # Products stay in [2**(emin + p), 2**emax): normal, with room for the p bits of the error term.
    product_exponents = rng.integers(fmt.min_exponent + fmt.precision, fmt.max_exponent, size=SAMPLES)
    a_exponents = np.array([
        rng.integers(max(fmt.min_exponent, e - fmt.max_exponent), min(fmt.max_exponent, e - fmt.min_exponent) + 1)
        for e in product_exponents
    ])
    a = to_format(random_floats(rng, fmt, a_exponents), fmt)
    b = to_format(random_floats(rng, fmt, product_exponents - a_exponents), fmt)
    product, error = two_prod_fma(a.to(device), b.to(device))
    assert product.dtype == error.dtype == fmt.dtype
    for a_i, b_i, product_i, error_i in zip(*(fractions_of(t) for t in (a, b, product, error))):
        assert product_i + error_i == a_i * b_i
        assert product_i == round_nearest_even(a_i * b_i, fmt)


def grow_operands(rng: np.random.Generator, fmt: Format):
    """(x, y, a) with (x, y) non-overlapping (|y| <= ulp(x)/2, boundary and zero included) and |a| <= |x|."""
    x_exponents = rng.integers(fmt.min_exponent + 1, fmt.max_exponent - 1, size=SAMPLES)
    x_values = random_floats(rng, fmt, x_exponents)
    y_gaps = rng.integers(1, 30, size=SAMPLES)
    y_values = random_floats(rng, fmt, x_exponents - fmt.precision - y_gaps)
    boundary = np.ldexp(1.0, x_exponents - fmt.precision) * rng.choice([-1.0, 1.0], size=SAMPLES)
    y_kind = rng.integers(0, 4, size=SAMPLES)
    y_values = np.where(y_kind == 0, boundary, np.where(y_kind == 1, 0.0, y_values))
    a_values = random_floats(rng, fmt, x_exponents - rng.integers(0, MAX_GAP + 1, size=SAMPLES))
    a_kind = rng.integers(0, 10, size=SAMPLES)
    a_values = np.where(a_kind == 0, -x_values, np.where(a_kind == 1, 0.0, a_values))
    x, y, a = (to_format(values, fmt) for values in (x_values, y_values, a_values))
    return x, y, torch.where(a.abs() > x.abs(), -x, a)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_grow_error_bound_and_non_overlap(fmt, device):
    """Grow's only inexact step is t = fl(y + v1), with (u1, v1) = Fast2Sum(x, a) exact.

    The second Fast2Sum(u1, t) is exact too: without cancellation |u1| >= |x|/2 >> |t|, and with it
    (|a| >= |x|/2, opposite signs) x + a is exact by Sterbenz, so t = y and |u1| >= ulp(x)/2 >= |y|.
    Hence u + v - (x + y + a) = fl(y + v1) - (y + v1), of size at most
    max(u * |y + v1|, 2**(emin - p)) (the second term covers subnormal t), which is 0 when y + v1 is a
    P value (y == 0 in particular). As |y| <= ulp(x)/2 and |v1| <= ulp(u1)/2 <= ulp(x), this is also at
    most 3 * u**2 * |x| away from underflow.
    """
    x, y, a = grow_operands(np.random.default_rng(4), fmt)
    u, v = grow(x.to(device), y.to(device), a.to(device))
    assert u.dtype == v.dtype == fmt.dtype
    smallest_error = Fraction(2) ** (fmt.min_exponent - fmt.precision)
    exact_cases = 0
    for x_i, y_i, a_i, u_i, v_i in zip(*(fractions_of(t) for t in (x, y, a, u, v))):
        head_error = x_i + a_i - round_nearest_even(x_i + a_i, fmt)
        error = abs(u_i + v_i - (x_i + y_i + a_i))
        assert error <= max(fmt.unit_roundoff * abs(y_i + head_error), smallest_error)
        assert error <= 3 * fmt.unit_roundoff**2 * abs(x_i) + smallest_error
        if round_nearest_even(y_i + head_error, fmt) == y_i + head_error:
            assert error == 0
            exact_cases += 1
        assert abs(v_i) <= ulp(u_i, fmt) / 2
    assert exact_cases > SAMPLES // 4


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_grow_is_exact_for_a_zero_tail(fmt, device):
    x, _, a = grow_operands(np.random.default_rng(5), fmt)
    u, v = grow(x.to(device), 0.0, a.to(device))
    for x_i, a_i, u_i, v_i in zip(*(fractions_of(t) for t in (x, a, u, v))):
        assert u_i + v_i == x_i + a_i


def test_grow_recovers_lost_bf16_additions(device):
    """Collage Sec. 3.1: 200 + 0.1 is a lost addition in bf16 (ulp(200) = 1); Grow keeps the increments.

    0.1 in bf16 is 205 * 2**-11, so 200 + k * 0.1 needs up to 19 significant bits and two 8-bit components
    cannot always hold it: each step rounds t = fl(y + v1), |t| <= 1, by at most 2**-9 (the Grow bound),
    so 100 steps stay within 100 * 2**-9 of the exact sum. With 0.125, whose partial sums fit, Grow is exact.
    """
    increment = torch.tensor(0.1, dtype=torch.float64).to(device, torch.bfloat16)
    plain = torch.tensor(200.0, dtype=torch.bfloat16, device=device)
    hi, lo = plain, torch.zeros_like(plain)
    for _ in range(100):
        plain = (plain.float() + increment.float()).to(torch.bfloat16)
        hi, lo = grow(hi, lo, increment)
    exact = 200 + 100 * Fraction(increment.item())
    assert plain.item() == 200.0
    assert abs(Fraction(hi.item()) + Fraction(lo.item()) - exact) <= 100 * Fraction(1, 2**9)
    assert abs(expansion_value(hi, lo).item() - float(exact)) < abs(plain.item() - float(exact)) / 50

    hi = torch.tensor(200.0, dtype=torch.bfloat16, device=device)
    lo = torch.zeros_like(hi)
    for _ in range(100):
        hi, lo = grow(hi, lo, 0.125)
    assert Fraction(hi.item()) + Fraction(lo.item()) == Fraction(425, 2)


def non_overlapping_expansions(rng: np.random.Generator, fmt: Format, exponents: np.ndarray, max_gap: int):
    """(hi, lo) with |lo| <= ulp(hi)/2: lo at gap 1..max_gap below the half ulp, on it, or zero."""
    hi_values = random_floats(rng, fmt, exponents)
    lo_values = random_floats(rng, fmt, exponents - fmt.precision - rng.integers(1, max_gap + 1, size=exponents.shape))
    boundary = np.ldexp(1.0, exponents - fmt.precision) * rng.choice([-1.0, 1.0], size=exponents.shape)
    kind = rng.integers(0, 6, size=exponents.shape)
    lo_values = np.where(kind == 0, boundary, np.where(kind == 1, 0.0, lo_values))
    return to_format(hi_values, fmt), to_format(lo_values, fmt)


def product_exponent_pairs(rng: np.random.Generator, fmt: Format, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Exponents (e1, e2) whose products and cross products (down to 2**-(p + max_gap + 1)) stay normal."""
    low = fmt.min_exponent + fmt.precision + max_gap + 1
    first, second = [], []
    while len(first) < SAMPLES:
        e1 = int(rng.integers(fmt.min_exponent, fmt.max_exponent + 1))
        e2 = int(rng.integers(fmt.min_exponent, fmt.max_exponent + 1))
        if low <= e1 + e2 <= fmt.max_exponent - 2:
            first.append(e1)
            second.append(e2)
    return np.array(first), np.array(second)


def max_gap_for(fmt: Format) -> int:
    return min(MAX_GAP, fmt.max_exponent - fmt.min_exponent - fmt.precision - 4)


def scaling_bound(fmt: Format) -> Fraction:
    """Relative error of Scaling on non-overlapping input (|a2| <= u |a1|), no underflow.

    x = fl(a1 v) with e1 = a1 v - x exact, |e1| <= u P where P = |a1 v|; fl(a2 v) errs by <= u**2 P;
    |fl(a2 v) + e1| <= u (2 + u) P, whose rounding errs by <= u**2 (2 + u) P; the final Fast2Sum is
    exact. Total <= u**2 (3 + u) P and |(a1 + a2) v| >= (1 - u) P: bound u**2 (3 + u) / (1 - u),
    i.e. below 2**(-2p + 1.6) (c = 1.6).
    """
    u = fmt.unit_roundoff
    return u**2 * (3 + u) / (1 - u)


def mul_bound(fmt: Format) -> Fraction:
    """Relative error of Mul on non-overlapping inputs (|a2| <= u |a1|, |b2| <= u |b1|), no underflow.

    With P = |a1 b1|: e1 = a1 b1 - fl(a1 b1) exact, |e1| <= u P; fl(a1 b2), fl(a2 b1) err by <= u**2 P
    each; their sum (<= 2u (1 + u) P) rounds with error <= 2 u**2 (1 + u) P; e1 + that sum
    (<= u (3 + 4u + 2u**2) P) rounds with error <= u**2 (3 + 4u + 2u**2) P; the dropped a2 b2 is
    <= u**2 P; the final Fast2Sum is exact. Total <= u**2 (8 + 6u + 2u**2) P against an exact product
    >= (1 - u)**2 P: bound u**2 (8 + 6u + 2u**2) / (1 - u)**2, i.e. below 2**(-2p + 3.1) (c = 3.1).
    """
    u = fmt.unit_roundoff
    return u**2 * (8 + 6 * u + 2 * u**2) / (1 - u) ** 2


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_error_bounds_are_of_order_two_to_the_minus_2p(fmt):
    assert scaling_bound(fmt) < Fraction(2) ** (-2 * fmt.precision) * Fraction(303, 100)
    assert mul_bound(fmt) < Fraction(2) ** (-2 * fmt.precision) * Fraction(81, 10)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_scaling_relative_error_and_non_overlap(fmt, device):
    rng = np.random.default_rng(6)
    max_gap = max_gap_for(fmt)
    a_exponents, v_exponents = product_exponent_pairs(rng, fmt, max_gap)
    a1, a2 = non_overlapping_expansions(rng, fmt, a_exponents, max_gap)
    v = to_format(random_floats(rng, fmt, v_exponents), fmt)
    x, e = scaling(a1.to(device), a2.to(device), v.to(device))
    assert x.dtype == e.dtype == fmt.dtype
    bound = scaling_bound(fmt)
    for a1_i, a2_i, v_i, x_i, e_i in zip(*(fractions_of(t) for t in (a1, a2, v, x, e))):
        exact = (a1_i + a2_i) * v_i
        assert abs(x_i + e_i - exact) <= bound * abs(exact)
        assert abs(e_i) <= ulp(x_i, fmt) / 2


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_mul_relative_error_and_non_overlap(fmt, device):
    rng = np.random.default_rng(7)
    max_gap = max_gap_for(fmt)
    a_exponents, b_exponents = product_exponent_pairs(rng, fmt, max_gap)
    a1, a2 = non_overlapping_expansions(rng, fmt, a_exponents, max_gap)
    b1, b2 = non_overlapping_expansions(rng, fmt, b_exponents, max_gap)
    x, e = mul(*(t.to(device) for t in (a1, a2, b1, b2)))
    assert x.dtype == e.dtype == fmt.dtype
    bound = mul_bound(fmt)
    worst = Fraction(0)
    for a1_i, a2_i, b1_i, b2_i, x_i, e_i in zip(*(fractions_of(t) for t in (a1, a2, b1, b2, x, e))):
        exact = (a1_i + a2_i) * (b1_i + b2_i)
        relative_error = abs(x_i + e_i - exact) / abs(exact)
        assert relative_error <= bound
        assert abs(e_i) <= ulp(x_i, fmt) / 2
        worst = max(worst, relative_error)
    assert worst > fmt.unit_roundoff**2 / 4


def test_mul_by_beta2_expansion_decays_where_bf16_does_not(device):
    """Collage Sec. 4.2: 0.999 rounds to 1.0 in bf16, so v * beta2 never decays; Mul by (1, -0.001) does."""
    beta2_hi, beta2_lo = expand_scalar(0.999, torch.bfloat16)
    plain = torch.tensor([1.0, 3.0], dtype=torch.bfloat16, device=device)
    v, dv = plain.clone(), torch.zeros_like(plain)
    exact = [Fraction(value) for value in plain.tolist()]
    beta2 = Fraction(beta2_hi) + Fraction(beta2_lo)
    for _ in range(50):
        plain = (plain.float() * torch.tensor(0.999, dtype=torch.float64).to(torch.bfloat16).float()).to(torch.bfloat16)
        v, dv = mul(beta2_hi, beta2_lo, v, dv)
        exact = [value * beta2 for value in exact]
    assert plain.tolist() == [1.0, 3.0]
    for exact_i, v_i, dv_i in zip(exact, fractions_of(v), fractions_of(dv)):
        assert abs(v_i + dv_i - exact_i) <= 50 * mul_bound(BF16) * exact_i


def test_scalar_operands_match_tensor_operands(device):
    rng = np.random.default_rng(8)
    v = to_format(random_floats(rng, BF16, rng.integers(-10, 10, size=64)), BF16).to(device)
    dv = torch.zeros_like(v)
    hi, lo = expand_scalar(0.95, torch.bfloat16)
    as_tensors = mul(torch.full_like(v, hi), torch.full_like(v, lo), v, dv)
    for scalar_result, tensor_result in zip(mul(hi, lo, v, dv), as_tensors):
        assert torch.equal(scalar_result, tensor_result)
    as_tensors = scaling(torch.full_like(v, hi), torch.full_like(v, lo), v)
    for scalar_result, tensor_result in zip(scaling(hi, lo, v), as_tensors):
        assert torch.equal(scalar_result, tensor_result)


def test_unrepresentable_scalar_is_rejected_with_value_and_dtype():
    ones = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"0\.1.*bfloat16"):
        two_sum(ones, 0.1)
    with pytest.raises(ValueError, match=r"0\.999.*bfloat16"):
        mul(0.999, 0.0, ones, ones)
    with pytest.raises(ValueError, match=r"1e-05.*float16"):
        grow(ones.half(), ones.half(), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        scaling(ones.float(), 0.0, 0.1)
    assert two_sum(ones, 0.5)[0].tolist() == [1.5, 1.5, 1.5]


def test_invalid_tensor_arguments_are_rejected():
    with pytest.raises(TypeError, match="at least one tensor"):
        two_sum(1.0, 2.0)
    with pytest.raises(TypeError, match="share one dtype"):
        two_sum(torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float16))
    with pytest.raises(TypeError, match="float64"):
        two_prod_fma(torch.ones(1, dtype=torch.float64), 2.0)


def test_expand_scalar_matches_collage_table_1():
    """Collage Table 1 prints beta2 = 0.99 as (0.9893, 0.0017); 0.9893 is a typo for 0.9883 = 253/256.

    0.9893 is not within 5e-5 of any bf16 value (the bf16 grid near it is 2**-8), so it cannot be a
    rounded bf16 number, while 0.99 - 253/256 = 0.0017 matches the printed low component.
    """
    hi, lo = expand_scalar(0.999, torch.bfloat16)
    assert hi == 1.0 and round(lo, 3) == -0.001
    hi, lo = expand_scalar(0.95, torch.bfloat16)
    assert (round(hi, 4), round(lo, 4)) == (0.9492, 0.0008)
    hi, lo = expand_scalar(0.99, torch.bfloat16)
    assert (round(hi, 4), round(lo, 4)) == (0.9883, 0.0017)
    assert abs(round(0.9893 * 256) - 0.9893 * 256) > 256 * 5e-5
    assert hi == 253 / 256


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_expand_scalar_rounds_once_to_nearest_even(fmt):
    rng = np.random.default_rng(9)
    values = list(rng.uniform(-2.0, 2.0, size=300)) + [0.999, 0.99, 0.95, 0.9, 0.1, 1e-8, 0.0, -3.0]
    # Halfway points nudged by 2**-40: float64 -> float32 -> dtype rounds them to even, the wrong way.
    values += [1 + 2.0 ** (-fmt.precision) + 2.0**-40, 1 + 2.0 ** (-fmt.precision) - 2.0**-45]
    for value in values:
        hi, lo = expand_scalar(float(value), fmt.dtype)
        exact = Fraction(float(value))
        assert Fraction(hi) == round_nearest_even(exact, fmt)
        assert Fraction(lo) == round_nearest_even(exact - Fraction(hi), fmt)
    assert expand_scalar(1 + 2.0**-8 + 2.0**-40, torch.bfloat16)[0] == 1 + 2.0**-7


@pytest.mark.parametrize("default_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_results_do_not_depend_on_default_dtype(default_dtype):
    probes = [0.999, 0.99, 0.95, 0.1, 1 / 3]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    expansions = [expand_scalar(value, dtype) for value in probes for dtype in dtypes]
    x = torch.tensor([200.0, -3.0], dtype=torch.bfloat16)
    grown = grow(x, 0.0, 0.25)
    previous_default = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        assert [expand_scalar(value, dtype) for value in probes for dtype in dtypes] == expansions
        assert all(torch.equal(now, before) for now, before in zip(grow(x, 0.0, 0.25), grown))
    finally:
        torch.set_default_dtype(previous_default)


def test_expansion_value_is_float64_sum():
    hi = torch.tensor([1.0, 200.0], dtype=torch.bfloat16)
    lo = torch.tensor([2.0**-20, -0.0029296875], dtype=torch.bfloat16)
    value = expansion_value(hi, lo)
    assert value.dtype == torch.float64
    assert value.tolist() == [1.0 + 2.0**-20, 200.0 - 0.0029296875]
