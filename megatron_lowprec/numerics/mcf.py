"""Multi-component float (MCF) arithmetic on low-precision tensors (Collage, Sec. 4.1 and Appendix C).

A length-2 expansion ``(hi, lo)`` stands for the unevaluated sum ``hi + lo`` of two floats of the working
precision P. P is the dtype of the tensor arguments: bfloat16, float16 or float32. Python float arguments
(such as the two components of beta2 from :func:`expand_scalar`) must be exactly representable in P.

Every elementary operation is rounded to P exactly as P-precision hardware rounds it (round to nearest,
ties to even). Each one upcasts its P-valued operands to a wider dtype W (float32 for bfloat16 and
float16, float64 for float32), computes ONE operation there and rounds the result to P:

* ``+``, ``-``, ``*``: W has at least 2p + 2 significand bits (float32: 24 >= 2*8 + 2 and 24 >= 2*11 + 2;
  float64: 53 >= 2*24 + 2), so the double rounding exact -> W -> P returns the correctly rounded P result
  (Figueroa, 1995). W's exponent range contains P's (bfloat16 shares float32's), so W never overflows or
  underflows where P would not have.
* the FMA of TwoProdFMA, ``a*b - fl(a*b)``: the product of two p-bit values has at most 2p bits
  (16 and 22 <= 24, 48 <= 53), so it is exact in W; its difference with fl(a*b) is the rounding error of
  the product, exactly representable in P when a*b does not underflow, so the subtraction and the final
  rounding are exact too. Results near P's underflow threshold lose this error-free property, as they do
  on hardware.

Intermediate values are kept in W (holding P values exactly); results come back in P.

For P = bfloat16 and float16 the rounding to P is :func:`~megatron_lowprec.numerics.formats.round_to_16bit_on_device`:
on GPUs, for bfloat16, the cast's bits widened by integer arithmetic
(:func:`~megatron_lowprec.numerics.formats.round_to_bfloat16_through_bits`), for float16 integer
operations on the float32 bit pattern (:func:`~megatron_lowprec.numerics.formats.round_to_16bit`),
never the bare cast round trip ``w.to(P).to(float32)`` (on CPUs, whose compiler keeps the round trip,
the cast, which is faster there and gives the same bits).
Compilers may remove such a round trip between two float32 operations (Inductor's Triton code does,
even with ``emulate_precision_casts``, as measured on an H100 and checked by the kernel audit's tests),
and every error term of Fast2Sum and TwoSum would then be computed from unrounded values; a rounding
whose bits feed integer operations cannot be optimised away, so eager and compiled code, on every
device, round alike. The casts that remain (to P on return, to W on
entry) convert values that are already exact in P, so dropping them changes nothing. For P = float32
(W = float64) the rounding is the cast, which eager code runs exactly; the compiled optimizer step
never uses float32 MCF.
"""

import torch

from megatron_lowprec.numerics.formats import round_to_16bit_on_device

_WIDER_DTYPE = {
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.float32: torch.float64,
}

Operand = torch.Tensor | float


def _working_precision(operands: tuple[Operand, ...]) -> tuple[torch.dtype, torch.device]:
    """The dtype P and device shared by the tensor operands."""
    tensors = [operand for operand in operands if isinstance(operand, torch.Tensor)]
    if not tensors:
        raise TypeError("MCF operations need at least one tensor argument to fix the working precision")
    dtype = tensors[0].dtype
    if dtype not in _WIDER_DTYPE:
        supported = ", ".join(str(supported_dtype) for supported_dtype in _WIDER_DTYPE)
        raise TypeError(f"MCF working precision must be one of {supported}, got {dtype}")
    for tensor in tensors[1:]:
        if tensor.dtype != dtype:
            raise TypeError(f"MCF tensor arguments must share one dtype, got {dtype} and {tensor.dtype}")
    return dtype, tensors[0].device


def _is_representable(value: float, dtype: torch.dtype) -> bool:
    """Whether the Python number ``value`` is a value of ``dtype`` (NaN and infinities included)."""
    as_float = float(value)
    if as_float != as_float:
        return True
    return as_float == value and torch.tensor(as_float, dtype=torch.float64).to(dtype).item() == as_float


def _to_wide(operand: Operand, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``operand`` as a tensor of the wider dtype of ``dtype``, after checking that scalars fit in ``dtype``."""
    wide_dtype = _WIDER_DTYPE[dtype]
    if isinstance(operand, torch.Tensor):
        return operand.to(wide_dtype)
    if not _is_representable(operand, dtype):
        raise ValueError(
            f"scalar {operand!r} is not exactly representable in {dtype}; "
            f"pass its expansion from expand_scalar({operand!r}, {dtype}) instead"
        )
    return torch.full((), float(operand), dtype=wide_dtype, device=device)


def _round(wide_value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a value computed in the wider dtype to P (nearest, ties to even), kept in the wider dtype:
    with integer operations for 16-bit P where a compiler could drop a cast (see the module docstring)."""
    if dtype == torch.float32:
        return wide_value.to(dtype).to(wide_value.dtype)
    return round_to_16bit_on_device(wide_value, dtype)


def _fast2sum_wide(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    total = _round(a + b, dtype)
    b_virtual = _round(total - a, dtype)
    return total, _round(b - b_virtual, dtype)


def _two_sum_wide(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    total = _round(a + b, dtype)
    b_virtual = _round(total - a, dtype)
    a_virtual = _round(total - b_virtual, dtype)
    b_roundoff = _round(b - b_virtual, dtype)
    a_roundoff = _round(a - a_virtual, dtype)
    return total, _round(a_roundoff + b_roundoff, dtype)


def _two_prod_fma_wide(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    exact_product = a * b
    product = _round(exact_product, dtype)
    return product, _round(exact_product - product, dtype)


def fast2sum(a: Operand, b: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's Fast2Sum (Collage Theorem 4.1): ``s = fl(a + b)``, ``e = a + b - s`` exactly.

    Requires ``|a| >= |b|`` (or ``a == 0``); returns ``|e| <= ulp(s) / 2``.
    """
    dtype, device = _working_precision((a, b))
    total, error = _fast2sum_wide(_to_wide(a, dtype, device), _to_wide(b, dtype, device), dtype)
    return total.to(dtype), error.to(dtype)


def two_sum(a: Operand, b: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum (Collage Appendix C, Algorithm 2): like Fast2Sum, with no ordering requirement."""
    dtype, device = _working_precision((a, b))
    total, error = _two_sum_wide(_to_wide(a, dtype, device), _to_wide(b, dtype, device), dtype)
    return total.to(dtype), error.to(dtype)


def two_prod_fma(a: Operand, b: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """TwoProdFMA (Collage Appendix C, Algorithm 5): ``p = fl(a * b)``, ``e = a * b - p`` exactly.

    Exact when ``a * b`` does not underflow.
    """
    dtype, device = _working_precision((a, b))
    product, error = _two_prod_fma_wide(_to_wide(a, dtype, device), _to_wide(b, dtype, device), dtype)
    return product.to(dtype), error.to(dtype)


def grow(x: Operand, y: Operand, a: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """Grow (Collage Algorithm 1): add the float ``a`` to the expansion ``(x, y)``, requiring ``|x| >= |a|``.

    ``(u, v) = Fast2Sum(x, a)``, then ``(u, v) = Fast2Sum(u, fl(y + v))``. For a non-overlapping input
    (``|y| <= ulp(x) / 2``) both Fast2Sums are exact, so the only rounding is that of ``y + v``: the result
    is off by at most ``ulp(fl(y + v)) / 2`` (at most ``3 * 2**(-2p) * |x|``), exact when ``y + v`` fits
    in P, and non-overlapping.
    """
    dtype, device = _working_precision((x, y, a))
    head, tail, addend = (_to_wide(operand, dtype, device) for operand in (x, y, a))
    total, error = _fast2sum_wide(head, addend, dtype)
    total, error = _fast2sum_wide(total, _round(tail + error, dtype), dtype)
    return total.to(dtype), error.to(dtype)


def scaling(a1: Operand, a2: Operand, v: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaling (Collage Appendix C, Algorithm 6): the expansion ``(a1, a2)`` times the float ``v``.

    Line 3, ``e = fl(a2 * v + e)``, is two rounded operations (no fused multiply-add).
    """
    dtype, device = _working_precision((a1, a2, v))
    head, tail, factor = (_to_wide(operand, dtype, device) for operand in (a1, a2, v))
    product, error = _two_prod_fma_wide(head, factor, dtype)
    error = _round(_round(tail * factor, dtype) + error, dtype)
    product, error = _fast2sum_wide(product, error, dtype)
    return product.to(dtype), error.to(dtype)


def mul(a1: Operand, a2: Operand, b1: Operand, b2: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """Mul (Collage Appendix C, Algorithm 7): the expansion ``(a1, a2)`` times the expansion ``(b1, b2)``.

    Line 3, ``e = fl(e + (a1 * b2 + a2 * b1))``, is four rounded operations; ``a2 * b2`` is dropped.
    """
    dtype, device = _working_precision((a1, a2, b1, b2))
    a_head, a_tail, b_head, b_tail = (_to_wide(operand, dtype, device) for operand in (a1, a2, b1, b2))
    product, error = _two_prod_fma_wide(a_head, b_head, dtype)
    cross_terms = _round(_round(a_head * b_tail, dtype) + _round(a_tail * b_head, dtype), dtype)
    error = _round(error + cross_terms, dtype)
    product, error = _fast2sum_wide(product, error, dtype)
    return product.to(dtype), error.to(dtype)


def _round_float64_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 ``values`` to ``dtype`` to nearest, ties to even, with a single rounding.

    torch converts float64 to bfloat16 / float16 through float32, which double-rounds (1 + 2**-8 + 2**-40
    becomes 1.0 in bfloat16 instead of 1 + 2**-7). Rounding to float32 to odd first (the float32 neighbour
    with an odd last bit whenever the conversion is inexact) keeps the sticky information, and a round to
    odd on q >= p + 2 bits followed by a round to nearest on p bits is a correct round to nearest.
    """
    if dtype == torch.float32:
        return values.to(torch.float32)
    nearest = values.to(torch.float32)
    towards_value = torch.where(
        nearest.to(torch.float64) > values,
        torch.full_like(nearest, -torch.inf),
        torch.full_like(nearest, torch.inf),
    )
    other_neighbour = torch.nextafter(nearest, towards_value)
    inexact = nearest.to(torch.float64) != values
    last_bit_even = (nearest.view(torch.int32) & 1) == 0
    rounded_to_odd = torch.where(inexact & last_bit_even, other_neighbour, nearest)
    return rounded_to_odd.to(dtype)


def expand_scalar(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The length-2 expansion ``(hi, lo)`` of the Python float ``value`` in ``dtype`` (Collage Table 1).

    ``hi`` is ``value`` rounded to nearest-even in ``dtype``, ``lo`` is ``value - hi`` (exact in float64)
    rounded the same way. Independent of ``torch.get_default_dtype()``.
    """
    if dtype not in _WIDER_DTYPE:
        supported = ", ".join(str(supported_dtype) for supported_dtype in _WIDER_DTYPE)
        raise TypeError(f"expand_scalar dtype must be one of {supported}, got {dtype}")
    value = float(value)
    hi = _round_float64_to(torch.tensor(value, dtype=torch.float64), dtype).item()
    lo = _round_float64_to(torch.tensor(value - hi, dtype=torch.float64), dtype).item()
    return hi, lo


def expansion_value(hi: Operand, lo: Operand) -> torch.Tensor:
    """``hi + lo`` as a float64 tensor (exact when the two components span at most 53 bits)."""
    return torch.as_tensor(hi, dtype=torch.float64) + torch.as_tensor(lo, dtype=torch.float64)
