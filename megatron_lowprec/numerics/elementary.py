"""Elementary FP32 functions that every backend computes to the same bits: eager ATen and compiled
Inductor code, on CPUs (C++) and GPUs (Triton).

A fused optimizer step is only bit-identical to its eager reference if every operation in it is
specified to the bit. IEEE 754 fixes the results of +, -, *, / and sqrt (correctly rounded) and of
integer and comparison operations; it fixes nothing for ``pow``, ``log`` or ``exp``, and the backends
differ: ATen's CPU kernels take SLEEF's vectorized functions for whole vectors and the C library's
for the tail, Inductor's C++ code takes its own vectorized ones (which depend on the machine's
instruction set: AVX2 and AVX-512 differ), and Triton takes libdevice. Compilers also change how the
basic operations are done: Triton lowers an FP32 ``/`` to ``div.full.f32`` (an approximation within
2 ulp) unless Inductor is told otherwise, and libdevice's FP32 square root flushes subnormals to zero
under Triton's default FTZ setting.

So this module builds everything from operations that are exact by specification, and does the
two that some compilers approximate in a way no compiler does:

* :func:`div_rn` and :func:`sqrt_rn`: correctly rounded FP32 division and square root. In eager code
  they are ATen's division and the square root through float64 (SLEEF's FP32 square root, and this
  CPU build's eager FP32 ``torch.sqrt``, are not always correctly rounded). In compiled code they are
  the FP32 operations wherever the compiler makes those correctly rounded: Inductor's C++ code (the
  IEEE vector instructions, :data:`NATIVE_FP32_DEVICES`), and Triton code (:data:`IEEE_FP32_DEVICES`:
  ``sqrt`` compiles to ``sqrt.rn.f32``, ``/`` to ``div.rn.f32`` under Inductor's
  ``eager_numerics.division_rounding``, which the code that compiles must announce with
  :func:`ieee_fp32_division`). Otherwise, and for a division by a Python constant on those devices
  (which Inductor turns into a product with its reciprocal; a constant passed as a 0-d host tensor
  is divided by in FP32, as COAT's format maximum is), they are computed in float64 and rounded
  once to FP32, which gives the correctly rounded FP32 result (53 >= 2·24 + 2: double rounding
  through float64 is innocuous for the four operations and sqrt) and cannot be approximated or
  flushed (the FP64 operations of PTX and of libdevice are always correctly rounded, subnormal FP32
  values are normal in FP64). A product with the FP64 reciprocal of a constant is harmless: for
  FP32 x and d the quotient x/d is either an FP32 midpoint or at least 2^-49 (relative) away from
  every one, and the product is within 2^-52 of x/d.
* :func:`log2`, :func:`exp2` and :func:`power`: from those, integer operations on the FP32 bit pattern,
  ``round`` (exact), and fixed polynomials evaluated by Horner's rule with every product and sum
  rounded on its own (Inductor keeps them apart: ``-ffp-contract=off`` in C++, no FP fusion in
  Triton under ``emulate_precision_casts``). Their results are not correctly rounded, but they are
  the same function everywhere; their distance to the exact function is bounded below and checked
  against float64 in the tests (:data:`LOG2_ERROR_BEYOND_HALF_ULP`, :data:`EXP2_MAX_REL_ERROR`,
  :data:`POWER_MAX_REL_ERROR`): far finer than FP8's steps of 2^-4, COAT's use.

Why not a tolerance instead: COAT's dynamic range expansion raises every moment to a per-group
power (``numerics/quant.py``); with backend-dependent ``pow``/``log`` an FP8 code moves by one step
on some elements, the decoded moments differ, and over steps the FP32 masters diverge in their last
bits. One function for every backend keeps the fused step bit-identical to the eager one on every
machine, and a test can say so without a bound.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

NATIVE_FP32_DEVICES = ("cpu",)
"""Device types whose compiled FP32 division and square root are correctly rounded as written."""

IEEE_FP32_DEVICES = ("cuda",)
"""Device types whose compiled FP32 square root is correctly rounded (Triton's ``sqrt_rn``), and whose
FP32 division is too while :func:`ieee_fp32_division` is in force (Triton's ``div_rn``; ``div.full.f32``,
within 2 ulp, otherwise)."""

_ieee_fp32_division = False


@contextlib.contextmanager
def ieee_fp32_division() -> Iterator[None]:
    """Announce, while code is traced, that Inductor compiles it with ``eager_numerics.division_rounding``:
    :func:`div_rn` is then FP32 division on :data:`IEEE_FP32_DEVICES` (Dynamo cannot read Inductor's
    config while tracing, and recompiles when this changes)."""
    global _ieee_fp32_division
    previous, _ieee_fp32_division = _ieee_fp32_division, True
    try:
        yield
    finally:
        _ieee_fp32_division = previous


_FP32_EXPONENT_SHIFT = 23
_FP32_BIAS = 127
_FP32_MANTISSA_MASK = (1 << _FP32_EXPONENT_SHIFT) - 1
_FP32_ONE_BITS = _FP32_BIAS << _FP32_EXPONENT_SHIFT
_FP32_SQRT2_BITS = 0x3FB504F3
"""The FP32 bits of √2 (rounded down): significands above it are halved, so that log2's argument
lies in [√2/2, √2]."""
_FP32_MIN_NORMAL_BITS = 1 << _FP32_EXPONENT_SHIFT
_SUBNORMAL_SCALE_EXPONENT = 24

_LOG2_ATANH_COEFFICIENTS = tuple(2 / ((2 * n + 1) * math.log(2)) for n in range(5))
"""log2(m) = (2 / ln 2) atanh(s) = Σ 2 s^(2n+1) / ((2n+1) ln 2) with s = (m - 1) / (m + 1), |s| <= 0.1716;
the first five terms leave a truncation error below 2e-9 relative."""
_EXP2_TAYLOR_COEFFICIENTS = tuple(math.log(2) ** n / math.factorial(n) for n in range(8))
"""2^f = Σ (f ln 2)^n / n! for |f| <= 1/2; eight terms leave a truncation error below 6e-9 relative."""

EXP2_MIN_EXPONENT = -160.0
"""Exponents below are treated as this one: 2^-160 underflows to zero in FP32."""
EXP2_MAX_EXPONENT = 127.0
"""Exponents above are treated as this one: 2^128 overflows FP32 (callers here stay at or below 0)."""

LOG2_ERROR_BEYOND_HALF_ULP = 2.0**-23
""":func:`log2` is within half an ulp of its result (the rounding of e + log2(m)) plus this of the exact
log2, on every finite positive FP32 value (2^-23.6 measured on 4M random bit patterns)."""
EXP2_MAX_REL_ERROR = 2.0**-23
""":func:`exp2` is within this relative distance of the exact 2^y where the result is normal (2^-23.4 measured)."""
POWER_MAX_REL_ERROR = 2.0**-15.5
""":func:`power` is within this relative distance of the exact x^k for x in (0, 1], every finite k > 0 and a
normal result. It is exp2 of y = k·log2(x), whose rounded product and log2 are each about 2^-24 relative
off, so the error grows with |y| = |log2(x^k)| <= 126, not with k: at most (|y| + 1)·2^-22.57 measured,
2^-17.0 for k <= 16 and 2^-15.85 over k in [2^-10, 2^24] (COAT's exponents reach far beyond 16 for
groups of nearly equal magnitudes)."""


def _fp64_needed(x: torch.Tensor, *, division: bool, constant_denominator: bool = False) -> bool:
    """Whether the code being traced for ``x``'s device must divide (``division``) or take the square
    root in float64 to round correctly (see the module's docstring)."""
    device = x.device.type
    if not torch.compiler.is_compiling():
        return not division
    if device in NATIVE_FP32_DEVICES:
        return False
    if device not in IEEE_FP32_DEVICES:
        return True
    return division and (constant_denominator or not _ieee_fp32_division)


def div_rn(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """The correctly rounded FP32 quotient, on every backend. One operand may be a Python float: it
    is rounded to FP32 first and divides as a tensor on the other's device, since neither
    ``float / tensor`` (torch computes ``reciprocal(tensor) * float``) nor eager CUDA's
    ``tensor / float`` (a product with the FP32 reciprocal) is a correctly rounded division. In
    compiled code, a constant divisor passed as a 0-d FP32 host tensor is divided by in FP32 on GPUs
    too (Inductor passes it by value, while a Python constant becomes a reciprocal product)."""
    like = numerator if torch.is_tensor(numerator) else denominator
    constant_denominator = not torch.is_tensor(denominator)
    numerator, denominator = (
        operand if torch.is_tensor(operand) else like.new_full((), operand) for operand in (numerator, denominator)
    )
    if _fp64_needed(like, division=True, constant_denominator=constant_denominator):
        return (numerator.double() / denominator.double()).float()
    return numerator / denominator


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of an FP32 tensor, subnormals included, on every backend:
    FP32 ``sqrt`` where it compiles to the IEEE instruction, float64 elsewhere."""
    if _fp64_needed(x, division=False):
        return x.double().sqrt().to(x.dtype)
    return torch.sqrt(x)


def _horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """Σ coefficients[n] x^n, each product and sum rounded on its own."""
    result = x * coefficients[-1] + coefficients[-2]
    for coefficient in reversed(coefficients[:-2]):
        result = result * x + coefficient
    return result


def log2(x: torch.Tensor) -> torch.Tensor:
    """log2 of positive finite FP32 values (subnormals included); other inputs give unspecified values.

    x = 2^e · m with m in [√2/2, √2] from the bit pattern (subnormals scaled by 2^24 first, exactly);
    then log2(m) = (2/ln 2) atanh(s), s = (m - 1)/(m + 1) (m - 1 is exact), by its odd series. Exact at
    every power of two (m = 1 gives s = 0)."""
    subnormal = x.view(torch.int32) < _FP32_MIN_NORMAL_BITS
    normal = torch.where(subnormal, x * 2.0**_SUBNORMAL_SCALE_EXPONENT, x)
    bits = normal.view(torch.int32)
    significand_bits = (bits & _FP32_MANTISSA_MASK) | _FP32_ONE_BITS
    above_sqrt2 = significand_bits > _FP32_SQRT2_BITS
    significand = torch.where(above_sqrt2, significand_bits - _FP32_MIN_NORMAL_BITS, significand_bits).view(torch.float32)
    exponent = (bits >> _FP32_EXPONENT_SHIFT) - _FP32_BIAS + above_sqrt2.to(torch.int32)
    exponent = exponent - subnormal.to(torch.int32) * _SUBNORMAL_SCALE_EXPONENT
    s = div_rn(significand - 1.0, significand + 1.0)
    log2_significand = s * _horner(s * s, _LOG2_ATANH_COEFFICIENTS)
    return exponent.to(torch.float32) + log2_significand


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent for int32 exponents in [-126, 127], exactly, from the bit pattern."""
    return ((exponent + _FP32_BIAS) << _FP32_EXPONENT_SHIFT).view(torch.float32)


def exp2(y: torch.Tensor) -> torch.Tensor:
    """2^y of FP32 ``y`` (clamped to [:data:`EXP2_MIN_EXPONENT`, :data:`EXP2_MAX_EXPONENT`]; NaN gives
    unspecified values).

    y = i + f with i = round(y) and |f| <= 1/2 (both exact); 2^f by its Taylor series (exactly 1 at
    f = 0, so 2^i is exact for integer y); then times 2^a and 2^b with a + b = i, a in [-126, 127],
    b in [-34, 0]: the first product is exact, the second rounds once where the result is subnormal."""
    clamped = y.clamp(EXP2_MIN_EXPONENT, EXP2_MAX_EXPONENT)
    whole = torch.round(clamped)
    fraction = clamped - whole
    whole_int = whole.to(torch.int32)
    normal_part = whole_int.clamp(-(_FP32_BIAS - 1), _FP32_BIAS)
    return (_horner(fraction, _EXP2_TAYLOR_COEFFICIENTS) * _power_of_two(normal_part)) * _power_of_two(
        whole_int - normal_part
    )


def power(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x^exponent for FP32 x >= 0 and finite exponent > 0, as exp2(exponent · log2(x)); 0 at x = 0."""
    positive = x > 0
    return torch.where(positive, exp2(exponent * log2(torch.where(positive, x, 1.0))), 0.0)
