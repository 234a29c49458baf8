"""Binary floating-point formats (BF16, FP16, FP32, FP8, generic ExMy) and round-to-nearest-even casts.

A format is described by its exponent and mantissa widths and by how it spends the top exponent
code on special values. Rounding works on the float32 bit pattern with integer operations, so a
format that torch lacks (E8M5, E3M2, ...) is emulated exactly and identically on every device:
results are float32 tensors holding exact values of the target format ("ExMy emulation",
to_fp8_and_back.txt section 3.2: removing mantissa bits rounds them away, removing exponent bits
narrows the range at both ends).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_SPECIALS = ("ieee", "fn", "finite")
_FP32_MANTISSA_BITS = 23
_FP32_BIAS = 127
_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000
_FP32_QUIET_NAN_BITS = 0x7FC00000
_FP32_SIGN_BIT = -(2**31)
_FP32_IMPLICIT_BIT = 1 << _FP32_MANTISSA_BITS
_ROUNDABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

RoundingIncrement = Callable[[torch.Tensor, "int | torch.Tensor"], torch.Tensor]
"""``increment(kept_is_odd, shift)``: what to add to a magnitude before its low ``shift`` bits are dropped.

``kept_is_odd`` (0 or 1, in the integer dtype to return) is the parity of the kept integer significand.
"""


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with a sign bit, ``exponent_bits`` and ``mantissa_bits``.

    ``specials`` says how the top exponent code is used:

    - ``"ieee"``: reserved for inf and NaN (BF16, FP16, FP32, E5M2 and every generic ExMy);
    - ``"fn"``: finite values and NaN only; just the all-ones code is NaN (OCP FP8 E4M3, max 448);
    - ``"finite"``: finite values only, no inf and no NaN (OCP MX float6 / float4 element types).

    Two formats are equal when they hold the same values; ``name`` is a label.
    """

    name: str = field(compare=False)
    exponent_bits: int
    mantissa_bits: int
    specials: str = "ieee"

    def __post_init__(self) -> None:
        if not 2 <= self.exponent_bits <= 8:
            raise ValueError(f"exponent_bits must be in 2..8, got {self.exponent_bits}")
        if not 0 <= self.mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits must be in 0..23, got {self.mantissa_bits}")
        if self.specials not in _SPECIALS:
            raise ValueError(f"specials must be one of {', '.join(_SPECIALS)}; got {self.specials!r}")
        if self.specials != "ieee" and self.exponent_bits == 8:
            raise ValueError(
                f"specials {self.specials!r} needs exponent_bits in 2..7 (its range must fit in float32), got 8"
            )
        if self.specials == "fn" and self.mantissa_bits == 0:
            raise ValueError("specials 'fn' needs mantissa_bits in 1..23 (NaN takes the all-ones mantissa), got 0")

    @property
    def bias(self) -> float:
        """Exponent bias, 2^(exponent_bits - 1) - 1."""
        return float(2 ** (self.exponent_bits - 1) - 1)

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal binade, 1 - bias."""
        return 2 - 2 ** (self.exponent_bits - 1)

    @property
    def max_exponent(self) -> int:
        """Exponent of the largest finite binade (the top code is finite unless specials is "ieee")."""
        top_code = 2**self.exponent_bits - (2 if self.specials == "ieee" else 1)
        return top_code - int(self.bias)

    @property
    def max_finite(self) -> float:
        """Largest finite value: 2^max_exponent * (2 - 2^-m), one code lower for "fn" (NaN is all ones)."""
        return float(self._max_significand_field * 2.0 ** (self.max_exponent - self.mantissa_bits))

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2^min_exponent."""
        return 2.0**self.min_exponent

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, 2^(min_exponent - mantissa_bits) (equals min_normal when m = 0)."""
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The native torch dtype holding exactly this format, or None."""
        return _NATIVE_DTYPES.get((self.exponent_bits, self.mantissa_bits, self.specials))

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype that stores values of this format exactly: the native dtype, else float32."""
        return self.torch_dtype or torch.float32

    def ulp(self, x: torch.Tensor) -> torch.Tensor:
        """Spacing of this format at |x|: 2^(clamp(floor(log2|x|), min_exponent, max_exponent) - m).

        ``x`` is float32, bfloat16 or float16. Below min_normal the spacing is min_subnormal (gradual
        underflow); above the range it is the spacing of the top binade. Float32 result; NaN where x
        is inf or NaN.
        """
        magnitude_bits = _float32_bits(x) & _FP32_ABS_MASK
        binade = torch.clamp_min(magnitude_bits >> _FP32_MANTISSA_BITS, 1) - _FP32_BIAS
        spacing_exponent = binade.clamp(self.min_exponent, self.max_exponent) - self.mantissa_bits
        normal_bits = (spacing_exponent + _FP32_BIAS) << _FP32_MANTISSA_BITS
        subnormal_bits = 1 << torch.clamp_min(spacing_exponent + _FP32_BIAS + _FP32_MANTISSA_BITS - 1, 0)
        spacing_bits = torch.where(spacing_exponent >= 1 - _FP32_BIAS, normal_bits, subnormal_bits)
        spacing = spacing_bits.view(torch.float32)
        return torch.where(magnitude_bits < _FP32_INF_BITS, spacing, torch.nan)

    @property
    def _max_significand_field(self) -> int:
        """Largest significand (implicit bit included) of the top binade, as an integer."""
        return 2 ** (self.mantissa_bits + 1) - (2 if self.specials == "fn" else 1)

    @property
    def _max_finite_bits(self) -> int:
        """The float32 bit pattern of max_finite."""
        fraction_field = self._max_significand_field - 2**self.mantissa_bits
        exponent_field = self.max_exponent + _FP32_BIAS
        return (exponent_field << _FP32_MANTISSA_BITS) | (fraction_field << (_FP32_MANTISSA_BITS - self.mantissa_bits))


BF16 = FloatFormat("bf16", 8, 7)
FP16 = FloatFormat("fp16", 5, 10)
FP32 = FloatFormat("fp32", 8, 23)
E4M3 = FloatFormat("e4m3", 4, 3, "fn")
E5M2 = FloatFormat("e5m2", 5, 2)
FLOAT6_E3M2FN = FloatFormat("float6_e3m2fn", 3, 2, "finite")
FLOAT6_E2M3FN = FloatFormat("float6_e2m3fn", 2, 3, "finite")
FLOAT4_E2M1FN = FloatFormat("float4_e2m1fn", 2, 1, "finite")

_NATIVE_DTYPES = {
    (8, 7, "ieee"): torch.bfloat16,
    (5, 10, "ieee"): torch.float16,
    (8, 23, "ieee"): torch.float32,
    (4, 3, "fn"): torch.float8_e4m3fn,
    (5, 2, "ieee"): torch.float8_e5m2,
}

_NAMED_FORMATS = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": FP16,
    "float16": FP16,
    "half": FP16,
    "fp32": FP32,
    "float32": FP32,
    "e4m3": E4M3,
    "e4m3fn": E4M3,
    "float8_e4m3fn": E4M3,
    "e5m2": E5M2,
    "float8_e5m2": E5M2,
    "float6_e3m2fn": FLOAT6_E3M2FN,
    "float6_e2m3fn": FLOAT6_E2M3FN,
    "float4_e2m1fn": FLOAT4_E2M1FN,
}

_EXMY_PATTERN = re.compile(r"e(\d+)m(\d+)")


def float_format(spec: str | FloatFormat | torch.dtype) -> FloatFormat:
    """Resolve a format from a name (case-insensitive), a generic "E{e}M{m}", a torch dtype, or a FloatFormat.

    Names win over the generic pattern: "e4m3" is the OCP FP8 E4M3 (fn, max 448), "e5m2" the OCP E5M2.
    A generic "E{e}M{m}" is IEEE-like (top exponent code for inf/NaN), so "E8M7" is BF16 and "E5M10" FP16.
    """
    if isinstance(spec, FloatFormat):
        return spec
    if not isinstance(spec, (str, torch.dtype)):
        raise TypeError(f"a float format is a name, a torch.dtype or a FloatFormat; got {type(spec).__name__}")
    if isinstance(spec, torch.dtype):
        for fmt in _NAMED_FORMATS.values():
            if fmt.torch_dtype == spec:
                return fmt
        native = ", ".join(str(dtype) for dtype in _NATIVE_DTYPES.values())
        raise ValueError(f"no float format for dtype {spec}; supported dtypes: {native}")
    key = spec.strip().lower()
    if key in _NAMED_FORMATS:
        return _NAMED_FORMATS[key]
    generic = _EXMY_PATTERN.fullmatch(key)
    if generic:
        return FloatFormat(spec.strip().upper(), int(generic.group(1)), int(generic.group(2)))
    raise ValueError(
        f"unknown float format {spec!r}; valid names: {', '.join(_NAMED_FORMATS)}, "
        "or 'E{e}M{m}' with e in 2..8 exponent bits and m in 0..23 mantissa bits (e.g. 'E8M5')"
    )


def round_to_format(x: torch.Tensor, fmt: str | FloatFormat, *, saturate: bool = False) -> torch.Tensor:
    """Round to the nearest value of ``fmt``, ties to even, with gradual underflow; float32 result.

    ``x`` is float32, bfloat16 or float16 (exactly widened to float32). The result holds exact values
    of ``fmt`` and keeps the sign of zeros. Values beyond the range, decided after rounding (e.g.
    464 < |x| < 480 rounds to 480, past the E4M3 max 448):

    - ``saturate=False``: overflow and ±inf become ±inf for "ieee" formats and NaN for "fn" formats
      (the OCP FP8 non-saturating mode, as ml_dtypes casts); "finite" formats have neither, so they
      clamp to ±max_finite, as ml_dtypes does.
    - ``saturate=True``: every magnitude above max_finite, ±inf included, becomes ±max_finite
      (the saturating rule of the ONNX Cast operator; torch 2.13's cast to float8_e4m3fn does the same).

    NaN stays NaN in every format (ml_dtypes turns NaN into a zero for "finite" formats; a NaN is kept
    here so that it stays visible).
    """
    return _round_with_increment(x, float_format(fmt), _nearest_even_increment, saturate=saturate)


def cast(x: torch.Tensor, fmt: str | FloatFormat, *, saturate: bool = False) -> torch.Tensor:
    """``round_to_format`` then store in ``fmt.storage_dtype`` (an exact conversion)."""
    fmt = float_format(fmt)
    return round_to_format(x, fmt, saturate=saturate).to(fmt.storage_dtype)


_FP8_BITS = 8
_FP8_SIGN_BIT = 0x80
_FP8_NAN_CODE = 0x7F


def _fp8_format(fmt: str | FloatFormat | torch.dtype) -> FloatFormat:
    """``fmt`` resolved, if it is a format of one byte with a native torch dtype (E4M3, E5M2)."""
    fmt = float_format(fmt)
    if fmt.torch_dtype is None or 1 + fmt.exponent_bits + fmt.mantissa_bits != _FP8_BITS:
        raise ValueError(f"FP8 codes exist for the formats e4m3 and e5m2; got {fmt.name!r}")
    return fmt


def to_fp8_codes(x: torch.Tensor, fmt: str | FloatFormat | torch.dtype) -> torch.Tensor:
    """The uint8 codes of float32 ``x`` in the FP8 format ``fmt`` (E4M3 or E5M2), saturating:
    ``x.clamp(-max, max).to(fmt.torch_dtype).view(torch.uint8)``, computed with integer operations
    and exact float ones, for devices whose compiler has no FP8 conversion (Triton converts to E4M3
    only from sm_89). Round to nearest even with gradual underflow (:func:`round_to_format`), ±inf to
    ±max, NaN to the code 0x7F with its sign (as torch's cast).

    The code of an exact FP8 value v: in the normal range its float32 exponent and top mantissa bits,
    rebiased (the float32 exponent field less ``127 - bias``, shifted by the mantissa width); below
    it v / min_subnormal, an integer that float32 holds exactly."""
    fmt = _fp8_format(fmt)
    if x.dtype != torch.float32:
        raise TypeError(f"to_fp8_codes takes float32 values, got {x.dtype}")
    rounded = round_to_format(x, fmt, saturate=True)
    bits = rounded.view(torch.int32)
    magnitude = bits & _FP32_ABS_MASK
    dropped = _FP32_MANTISSA_BITS - fmt.mantissa_bits
    rebias = (_FP32_BIAS - int(fmt.bias)) << fmt.mantissa_bits
    normal = (magnitude >> dropped) - rebias
    subnormal = (magnitude.view(torch.float32) * (1 / fmt.min_subnormal)).to(torch.int32)
    min_normal_bits = (fmt.min_exponent + _FP32_BIAS) << _FP32_MANTISSA_BITS
    code = torch.where(magnitude < min_normal_bits, subnormal, normal)
    code = torch.where(magnitude > _FP32_INF_BITS, _FP8_NAN_CODE, code)
    return (code | ((bits >> 31) & _FP8_SIGN_BIT)).to(torch.uint8)


def from_fp8_codes(codes: torch.Tensor, fmt: str | FloatFormat | torch.dtype) -> torch.Tensor:
    """The float32 values of the uint8 ``codes`` of the FP8 format ``fmt`` (E4M3 or E5M2): what
    ``codes.view(fmt.torch_dtype).float()`` gives, NaN bits included, computed with integer
    operations and one exact float product (subnormals: the mantissa times min_subnormal)."""
    fmt = _fp8_format(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"from_fp8_codes takes uint8 codes, got {codes.dtype}")
    code = codes.to(torch.int32)
    mantissa = code & ((1 << fmt.mantissa_bits) - 1)
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    dropped = _FP32_MANTISSA_BITS - fmt.mantissa_bits
    normal = ((exponent + (_FP32_BIAS - int(fmt.bias))) << _FP32_MANTISSA_BITS) | (mantissa << dropped)
    subnormal = (mantissa.to(torch.float32) * fmt.min_subnormal).view(torch.int32)
    magnitude = torch.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << fmt.exponent_bits) - 1
    special = top & (mantissa == (1 << fmt.mantissa_bits) - 1) if fmt.specials == "fn" else top
    infinite_or_nan = _FP32_INF_BITS | (mantissa << dropped)
    quiet_nan = torch.where(mantissa != 0, infinite_or_nan | (_FP32_QUIET_NAN_BITS ^ _FP32_INF_BITS), infinite_or_nan)
    magnitude = torch.where(special, quiet_nan, magnitude)
    return (magnitude | ((code >> 7) * _FP32_SIGN_BIT)).view(torch.float32)


_BF16_DROPPED_BITS = 16
_FP16_DROPPED_BITS = 13
_FP16_MIN_NORMAL_BITS = 0x38800000
"""The float32 pattern of 2^-14, float16's smallest normal value."""
_FP16_MAX_FINITE_BITS = 0x477FE000
"""The float32 pattern of 65504, float16's largest finite value."""
_FP16_MIN_SUBNORMAL = 2.0**-24
_FP16_SUBNORMAL_SHIFT_BASE = 126
"""A float32 of exponent field E below 2^-14 is (its 24-bit significand) >> (126 - E) subnormal steps."""
_FP16_LAST_SUBNORMAL_SHIFT = 25
"""Past this shift a 24-bit significand is under half a step: it rounds to zero."""


CAST_ROUNDING_DEVICES = ("cpu",)
"""Device types whose compiled code keeps float round trips: Inductor's C++ backend compiles
``x.to(bf16).to(fp32)`` into a real rounding (the fused-vs-eager tests check every option bit for
bit), and AVX2 vectorizes that cast far better than the integer form (which made compiled B, C and
kahan 2 to 5 times slower on CPU). Elsewhere (Triton on GPUs) :func:`round_to_bfloat16_through_bits`
rounds to bfloat16 and :func:`round_to_16bit` to float16."""

_BF16_HIGH_HALF = 1 << _BF16_DROPPED_BITS
"""Multiplying a bfloat16 pattern (sign-extended to int32) by this puts it in a float32 pattern's high half."""


def round_to_16bit_on_device(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype).to(torch.float32)`` for float32 ``x``, computed the way that survives compilation
    on ``x``'s device: the cast itself on :data:`CAST_ROUNDING_DEVICES`, else
    :func:`round_to_bfloat16_through_bits` for bfloat16 and :func:`round_to_16bit` for float16. All
    give the same bits for every finite value (tested against torch's casts and ml_dtypes), so the
    choice is how, never what."""
    if x.device.type in CAST_ROUNDING_DEVICES:
        return x.to(dtype).to(torch.float32)
    if dtype == torch.bfloat16:
        return round_to_bfloat16_through_bits(x)
    return round_to_16bit(x, dtype)


def round_to_bfloat16_through_bits(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.bfloat16).to(torch.float32)`` for float32 ``x``, written so that no compiler drops
    the rounding: the cast's 16 bits, read as an integer, become the high half of a float32 pattern
    (sign-extended, times 2^16: no overflow, no shift of a negative number). Inductor's Triton code
    removes the plain round trip between two FP32 operations (see :func:`round_to_16bit`), but keeps a
    cast whose bits are used, and a GPU rounds with one instruction (``cvt.rn.bf16.f32``) where
    :func:`round_to_16bit` takes about eight integer ones (the kernel audit's tests check that every
    rounding survives). The same bits as torch's cast for every value, NaN payloads aside (``cvt``
    makes 0x7FFF, torch 0x7FC0: never in the optimizer, whose gradients are checked first)."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bfloat16_through_bits takes float32 values, got {x.dtype}")
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return (bits * _BF16_HIGH_HALF).view(torch.float32)


def round_to_bfloat16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` rounded to bfloat16 toward zero (truncated), as float32: its low 16 bits cleared,
    so the result is exactly a bfloat16 value and casting it to bfloat16 is exact. One integer
    operation on the bit pattern, which no compiler drops (:func:`round_to_16bit`). Finite values
    and ±inf only: a NaN whose high half is ±inf's pattern would come out as ±inf."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bfloat16_toward_zero takes float32 values, got {x.dtype}")
    return (x.view(torch.int32) & -(1 << _BF16_DROPPED_BITS)).view(torch.float32)


def round_to_16bit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype).to(torch.float32)`` for a float32 ``x`` and ``dtype`` bfloat16 or float16, done
    with integer operations on the bit pattern: round to nearest, ties to even, gradual underflow,
    overflow to ±inf, the sign of zeros kept.

    Compilers keep every integer operation, but not a float round trip: Inductor's Triton code drops
    ``x.to(bf16).to(fp32)`` between two FP32 operations even with ``emulate_precision_casts``
    (measured on an H100; the kernel audit's tests check it), which silently removes roundings that MCF arithmetic
    needs. A rounding written this way is the same on every backend, eager or compiled.

    The magnitude is rounded and the sign put back:

    * bfloat16 (8 exponent bits, like float32): add 0x7FFF plus the last kept bit, clear the low 16
      bits; a carry moves into the exponent (up to inf past the largest bfloat16). Float32
      subnormals are bfloat16 subnormals, so no other case exists.
    * float16: at or above 2^-14, the same on the low 13 bits, then anything above 65504 is inf.
      Below 2^-14 the grid is uniform (steps of 2^-24): the significand, shifted right by the binade
      distance with the same round-half-even increment, counts steps, whose float32 value is exact.

    Non-finite inputs (never in the optimizer, whose gradients are checked first): ±inf stays ±inf;
    every NaN produced by arithmetic (a quiet NaN) becomes the canonical quiet NaN 0x7FC00000 with
    its sign; a signalling NaN (quiet bit clear) may come out as ±inf. The magnitude is clamped to
    0x7FC00000 first, so that no integer addition overflows.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_16bit takes float32 values, got {x.dtype}")
    bits = x.view(torch.int32)
    magnitude = bits & _FP32_ABS_MASK
    sign = bits ^ magnitude
    magnitude = torch.clamp_max(magnitude, _FP32_QUIET_NAN_BITS)
    if dtype == torch.bfloat16:
        rounded = _round_low_bits_to_nearest_even(magnitude, _BF16_DROPPED_BITS)
    elif dtype == torch.float16:
        normal = _round_low_bits_to_nearest_even(magnitude, _FP16_DROPPED_BITS)
        normal = torch.where(normal > _FP16_MAX_FINITE_BITS, torch.clamp_min(normal, _FP32_INF_BITS), normal)
        significand = (magnitude & (_FP32_IMPLICIT_BIT - 1)) | _FP32_IMPLICIT_BIT
        shift = torch.clamp(
            _FP16_SUBNORMAL_SHIFT_BASE - (magnitude >> _FP32_MANTISSA_BITS),
            _FP16_DROPPED_BITS + 1,
            _FP16_LAST_SUBNORMAL_SHIFT,
        )
        steps = (significand + _nearest_even_increment((significand >> shift) & 1, shift)) >> shift
        subnormal = (steps.to(torch.float32) * _FP16_MIN_SUBNORMAL).view(torch.int32)
        rounded = torch.where(magnitude < _FP16_MIN_NORMAL_BITS, subnormal, normal)
    else:
        raise ValueError(f"round_to_16bit rounds to torch.bfloat16 or torch.float16, got {dtype}")
    return (rounded | sign).view(torch.float32)


_LOW_HALF = 0xFFFF
_HALF_SIGN = 0x8000


def split_bf16_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``x`` as a bfloat16 ``upper`` and an int16 ``remainder`` that hold it exactly:
    :func:`join_bf16_remainder` gives back every one of the 2^32 bit patterns (a bijection), so an
    FP32 master weight can be stored as its BF16 parameter plus 2 bytes (Transformer Engine's
    ``FusedAdam(store_param_remainders=True)`` encodes it the same way).

    The remainder is the low 16 bits read as a signed int16; ``upper`` is the high 16 bits, plus
    one when the remainder is negative. So ``upper`` is ``x`` rounded to bfloat16 to nearest with
    ties away from zero (half-up on the magnitude's bit pattern). Round-to-nearest-even cannot
    serve: it sends 65,537 float32 values to each even bfloat16 (the tie from below and the whole
    interval above it), one more than a 16-bit remainder can tell apart.

    ``upper`` equals torch's cast ``x.to(torch.bfloat16)`` (round to nearest, ties to even) for every
    finite ``x`` but the ties whose high half is even (low 16 bits exactly 0x8000, last kept bit 0):
    those go one bfloat16 step away from zero, where the cast stays. That is one pattern in 131,072;
    how often a master hits it in training is counted in the README. Non-finite values (never a
    master, since a step with a non-finite gradient is skipped): ±inf and the NaNs whose high half
    is a bfloat16 NaN stay so; NaNs just above ±inf's pattern get an infinite ``upper``, and NaNs
    whose high half is all ones with the next bit set get a zero one (the carry wraps).

    Integer operations on the bit pattern only, none of which can overflow or depends on how a
    compiler shifts negative numbers: eager and compiled code (Inductor's C++ and Triton) compute
    the same bits, and no compiler can drop a float round trip here.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"split_bf16_remainder takes float32 values, got {x.dtype}")
    bits = x.view(torch.int32)
    carry = (bits & _HALF_SIGN) >> 15
    upper = _signed_low_half((bits >> 16) + carry)
    return upper.to(torch.int16).view(torch.bfloat16), _signed_low_half(bits).to(torch.int16)


def join_bf16_remainder(upper: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 values that :func:`split_bf16_remainder` split into bfloat16 ``upper`` and int16
    ``remainder``: high half ``upper`` minus the carry (one when the remainder is negative), low half
    the remainder's bits. Integer operations only, none of which overflows."""
    if upper.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            f"join_bf16_remainder takes a bfloat16 upper half and an int16 remainder, got {upper.dtype} and {remainder.dtype}"
        )
    low = remainder.to(torch.int32)
    carry = (low >> 15) & 1
    high = (upper.view(torch.int16).to(torch.int32) - carry) & _LOW_HALF
    return ((high << 16) | (low & _LOW_HALF)).view(torch.float32)


_RESIDUAL_SHIFT = 8
"""Bits of the FP32 pattern below an 8-bit residual: the residual is bits 8..15, bits 0..7 are rounded away."""
_RESIDUAL_HALF_STEP = 1 << (_RESIDUAL_SHIFT - 1)
_RESIDUAL_BYTE = 0xFF
_RESIDUAL_SIGN = 0x80
_LARGEST_RESIDUAL_ROUNDED_UP = 0x7F7FFFFF - _RESIDUAL_HALF_STEP
"""Magnitude patterns above this would round up to infinity's; they round down (saturate) instead."""


def round_to_bf16_residual8(x: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` rounded to the 16 significant bits that a BF16 value plus an 8-bit residual hold
    (FP32 with its low 8 mantissa bits zero: 1 sign, 8 exponent and 15 mantissa bits), to nearest with
    ties away from zero, as int32 bit patterns. Subnormals round on the same grid (2^-141); finite
    values within half a step of FP32's largest round down to the largest value of the grid rather
    than to infinity; ±inf stay, NaNs become the quiet NaN. Integer operations on the bit pattern."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16_residual8 takes float32 values, got {x.dtype}")
    bits = x.view(torch.int32)
    sign = bits & _FP32_SIGN_BIT
    magnitude = bits & _FP32_ABS_MASK
    rounded = ((torch.clamp_max(magnitude, _LARGEST_RESIDUAL_ROUNDED_UP) + _RESIDUAL_HALF_STEP) >> _RESIDUAL_SHIFT) << _RESIDUAL_SHIFT
    special = torch.where(magnitude > _FP32_INF_BITS, _FP32_QUIET_NAN_BITS, magnitude)
    return torch.where(magnitude < _FP32_INF_BITS, rounded, special) | sign


def split_bf16_residual8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``x`` as a bfloat16 ``upper`` and an int8 ``residual``: FlashOptim's 8-bit master
    residual (arXiv 2602.23349), the rounding error of the BF16 parameter's magnitude in units of 1/128
    of half its ULP, a power-of-two unit so that the codec is integer operations on the bit pattern.

    ``x`` is first rounded to 16 significant bits (:func:`round_to_bf16_residual8`: nearest, ties away
    from zero), which :func:`join_bf16_residual8` gives back exactly; the error of the round trip is
    at most half the grid's step, 2^-16 of ``x``'s binade (128 FP32 ULPs; under 256 within 128 ULPs of
    FP32's largest, which saturates). That value is split as :func:`split_bf16_remainder` splits a
    whole FP32 value, eight bits higher: the residual is bits 8..15 read as a signed byte, ``upper``
    the high 16 bits plus one when the residual is negative. So ``upper`` is the 16-bit value rounded
    to bfloat16 to nearest with ties away from zero (torch's cast of ``x`` but at ties of the rounded
    value and the values rounded up to one), ``|x - upper|`` is at most half a BF16 ULP plus the
    rounding to the grid, and ``upper`` overflows to infinity exactly where the cast does, for values
    above BF16's largest finite plus half its ULP (which no master reaches).
    """
    bits = round_to_bf16_residual8(x)
    byte = (bits >> _RESIDUAL_SHIFT) & _RESIDUAL_BYTE
    carry = byte >> (_RESIDUAL_SHIFT - 1)
    upper = _signed_low_half((bits >> 16) + carry)
    residual = byte - ((byte & _RESIDUAL_SIGN) << 1)
    return upper.to(torch.int16).view(torch.bfloat16), residual.to(torch.int8)


def join_bf16_residual8(upper: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The float32 values that :func:`split_bf16_residual8` split into bfloat16 ``upper`` and int8
    ``residual``: high half ``upper`` minus the carry (one when the residual is negative), bits 8..15
    the residual's, bits 0..7 zero. Integer operations only."""
    if upper.dtype != torch.bfloat16 or residual.dtype != torch.int8:
        raise TypeError(
            f"join_bf16_residual8 takes a bfloat16 upper half and an int8 residual, got {upper.dtype} and {residual.dtype}"
        )
    low = residual.to(torch.int32)
    carry = (low >> (_RESIDUAL_SHIFT - 1)) & 1
    high = (upper.view(torch.int16).to(torch.int32) - carry) & _LOW_HALF
    return ((high << 16) | ((low & _RESIDUAL_BYTE) << _RESIDUAL_SHIFT)).view(torch.float32)


def _signed_low_half(bits: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of int32 ``bits`` as a signed value in [-2^15, 2^15), still int32 (so that
    the conversion to int16 is exact: no backend saturates or wraps)."""
    low = bits & _LOW_HALF
    return low - ((low & _HALF_SIGN) << 1)


def _round_low_bits_to_nearest_even(magnitude: torch.Tensor, dropped: int) -> torch.Tensor:
    """Float32 magnitude patterns with their low ``dropped`` bits rounded away, ties to even."""
    increment = _nearest_even_increment((magnitude >> dropped) & 1, dropped)
    return (magnitude + increment) & -(1 << dropped)


def _nearest_even_increment(kept_is_odd: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
    """Half a unit of the kept bits, minus one unless the kept significand is odd: ties round to even."""
    return (1 << (shift - 1)) - 1 + kept_is_odd


def _float32_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of ``x`` widened exactly to float32."""
    if x.dtype not in _ROUNDABLE_DTYPES:
        accepted = ", ".join(str(dtype) for dtype in _ROUNDABLE_DTYPES)
        raise TypeError(f"expected a tensor of dtype {accepted}; got {x.dtype}")
    return x.to(torch.float32).view(torch.int32)


def _round_with_increment(
    x: torch.Tensor, fmt: FloatFormat, increment: RoundingIncrement, *, saturate: bool
) -> torch.Tensor:
    """Round |x| to ``fmt`` by adding ``increment(kept_is_odd, dropped_bit_count)`` and dropping bits.

    In the normal range of ``fmt`` the low 23 - m bits of the float32 pattern are dropped (a carry
    moves into the exponent field, as it should). The kept significand's parity is its last mantissa
    bit, or with m = 0 its implicit bit, so 1.5 * 2^k ties up to 2^(k+1), as torch and ml_dtypes
    round float8_e8m0fnu.

    Below min_normal of ``fmt`` the grid is uniform with step min_subnormal, so the 24-bit
    significand is shifted right by 23 - m plus the binade distance, at most 32 bits (beyond that
    the extra low bits are truncated first; they are worth under 2^-8 of the step).

    Shared by round-to-nearest-even and stochastic rounding.
    """
    bits = _float32_bits(x)
    sign = bits & _FP32_SIGN_BIT
    magnitude = bits & _FP32_ABS_MASK
    is_finite = magnitude < _FP32_INF_BITS
    finite_magnitude = torch.where(is_finite, magnitude, 0)

    dropped = _FP32_MANTISSA_BITS - fmt.mantissa_bits
    rounded = finite_magnitude
    if dropped > 0:
        kept_bits = finite_magnitude >> dropped
        kept_is_odd = kept_bits & 1 if fmt.mantissa_bits else torch.clamp_max(kept_bits, 1)
        rounded = ((finite_magnitude + increment(kept_is_odd, dropped)) >> dropped) << dropped

    min_normal_exponent_field = fmt.min_exponent + _FP32_BIAS
    if min_normal_exponent_field > 1:
        rounded = torch.where(
            finite_magnitude < (min_normal_exponent_field << _FP32_MANTISSA_BITS),
            _round_below_min_normal(finite_magnitude, fmt, increment),
            rounded,
        )

    max_bits = fmt._max_finite_bits
    overflow_bits = _FP32_QUIET_NAN_BITS if fmt.specials == "fn" else _FP32_INF_BITS
    if saturate or fmt.specials == "finite":
        overflow_bits = max_bits
    result = torch.where(rounded > max_bits, overflow_bits, rounded)
    result = torch.where(is_finite, result, overflow_bits)
    result = torch.where(magnitude > _FP32_INF_BITS, magnitude, result)
    return (result | sign).view(torch.float32)


def _round_below_min_normal(magnitude: torch.Tensor, fmt: FloatFormat, increment: RoundingIncrement) -> torch.Tensor:
    """Float32 bit patterns of |x| rounded to a multiple of fmt.min_subnormal (valid for |x| < min_normal)."""
    exponent_field = magnitude >> _FP32_MANTISSA_BITS
    significand = (magnitude & (_FP32_IMPLICIT_BIT - 1)) | torch.where(exponent_field > 0, _FP32_IMPLICIT_BIT, 0)
    binade_distance = (fmt.min_exponent + _FP32_BIAS) - torch.clamp_min(exponent_field, 1)
    shift = _FP32_MANTISSA_BITS - fmt.mantissa_bits + torch.clamp_min(binade_distance, 0)
    significand = significand.to(torch.int64) >> torch.clamp(shift - 32, 0, 31)
    shift = torch.clamp(shift, 1, 32).to(torch.int64)
    steps = (significand + increment((significand >> shift) & 1, shift)) >> shift
    return (steps.to(torch.float32) * fmt.min_subnormal).view(torch.int32)
