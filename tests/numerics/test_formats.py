"""FloatFormat descriptors and round-to-nearest-even casts, bit-exact against torch, ml_dtypes and fp64."""

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_lowprec.numerics import formats
from megatron_lowprec.numerics.formats import (
    BF16,
    E4M3,
    E5M2,
    FP16,
    FP32,
    FloatFormat,
    cast,
    float_format,
    from_fp8_codes,
    join_bf16_remainder,
    round_to_16bit,
    round_to_16bit_on_device,
    round_to_bfloat16_through_bits,
    round_to_format,
    split_bf16_remainder,
    to_fp8_codes,
)

FLOAT6_E3M2FN = float_format("float6_e3m2fn")
FLOAT6_E2M3FN = float_format("float6_e2m3fn")
FLOAT4_E2M1FN = float_format("float4_e2m1fn")
IEEE_E4M3 = FloatFormat("ieee_e4m3", 4, 3, "ieee")

TORCH_REFERENCES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e5m2": torch.float8_e5m2}
ML_DTYPES_REFERENCES = [
    (E4M3, ml_dtypes.float8_e4m3fn),
    (FLOAT6_E3M2FN, ml_dtypes.float6_e3m2fn),
    (FLOAT6_E2M3FN, ml_dtypes.float6_e2m3fn),
    (FLOAT4_E2M1FN, ml_dtypes.float4_e2m1fn),
    (float_format("E3M4"), ml_dtypes.float8_e3m4),
    (IEEE_E4M3, ml_dtypes.float8_e4m3),
]
GENERIC_SPECS = ["E8M5", "E7M7", "E5M7", "E8M0", "E6M0", "E2M1", "E3M1", "E8M22", "E7M23", "E4M20", "E6M3"]


def format_values(exponent_bits, mantissa_bits, specials):
    """All non-negative finite values of an ExMy format, from its encoding rules, in fp64."""
    bias = 2 ** (exponent_bits - 1) - 1
    field, fraction = np.meshgrid(
        np.arange(2**exponent_bits, dtype=np.float64), np.arange(2**mantissa_bits, dtype=np.float64), indexing="ij"
    )
    subnormal = fraction * 2.0 ** (1 - bias - mantissa_bits)
    normal = (2.0**mantissa_bits + fraction) * np.exp2(field - bias - mantissa_bits)
    values = np.where(field == 0, subnormal, normal)
    top_field = field == 2**exponent_bits - 1
    if specials == "ieee":
        values = values[~top_field]
    elif specials == "fn":
        values = values[~(top_field & (fraction == 2**mantissa_bits - 1))]
    return np.unique(values)


def rounding_probes(values):
    """Values, midpoints of neighbours (exact ties), the float32 numbers either side of each, and the
    midpoint between the largest value and the next binade step (the overflow tie), both signs."""
    top_gap = values[-1] - values[-2]
    midpoints = np.concatenate([(values[:-1] + values[1:]) / 2, [values[-1] + top_gap / 2, values[-1] + top_gap]])
    midpoints = midpoints[midpoints <= np.finfo(np.float32).max]
    midpoints32 = midpoints.astype(np.float32)
    assert np.array_equal(midpoints32.astype(np.float64), midpoints)
    probes = np.concatenate(
        [
            values.astype(np.float32),
            midpoints32,
            np.nextafter(midpoints32, np.float32(np.inf)),
            np.nextafter(midpoints32, np.float32(0)),
        ]
    )
    return np.concatenate([probes, -probes])


@pytest.fixture(scope="module")
def probes():
    """About 1.4M float32 values: every exponent, exact ties of each tested format, subnormals, specials."""
    rng = np.random.default_rng(20240611)
    random_patterns = rng.integers(0, 2**32, size=600_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    fp32_subnormals = rng.integers(0, 2**23, size=20_000, dtype=np.uint32).view(np.float32)
    scaled_normals = (rng.standard_normal(100_000) * np.exp2(rng.integers(-40, 40, size=100_000))).astype(np.float32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.0, -1.0],
        dtype=np.float32,
    )
    tested = [BF16, FP16, E4M3, E5M2, FLOAT6_E3M2FN, FLOAT6_E2M3FN, FLOAT4_E2M1FN, IEEE_E4M3]
    tested += [float_format(spec) for spec in ["E8M5", "E7M7", "E3M4", "E2M1", "E6M0", "E6M3"]]
    per_format = [rounding_probes(format_values(f.exponent_bits, f.mantissa_bits, f.specials)) for f in tested]
    values = np.concatenate([random_patterns, fp32_subnormals, scaled_normals, specials, *per_format])
    assert values.size > 1_000_000
    return values


def assert_same_floats(actual, expected, inputs):
    """Bit-for-bit equality (signed zeros included), any NaN matching any NaN; ``actual`` on any device."""
    actual = actual.cpu().numpy()
    assert actual.dtype == np.float32
    actual_nan, expected_nan = np.isnan(actual), np.isnan(expected)
    mismatch = (actual_nan != expected_nan) | (
        ~actual_nan & ~expected_nan & (actual.view(np.uint32) != expected.view(np.uint32))
    )
    if mismatch.any():
        where = np.flatnonzero(mismatch)[:5]
        details = ", ".join(f"x={inputs[i]!r}: got {actual[i]!r}, expected {expected[i]!r}" for i in where)
        raise AssertionError(f"{mismatch.sum()} mismatches, e.g. {details}")


def reference_ieee_round(values, exponent_bits, mantissa_bits, saturate=False):
    """RNE to an IEEE-like ExMy in exact fp64 arithmetic: scale to the grid step, np.rint (ties to even), rescale."""
    bias = 2 ** (exponent_bits - 1) - 1
    min_exponent, max_exponent = 1 - bias, 2**exponent_bits - 2 - bias
    max_finite = (2.0 - 2.0**-mantissa_bits) * 2.0**max_exponent
    with np.errstate(invalid="ignore"):
        x = values.astype(np.float64)
        _, exponent = np.frexp(np.abs(x))
        step = np.exp2(np.maximum(exponent - 1, min_exponent) - mantissa_bits)
        rounded = np.rint(np.abs(x) / step) * step
        if saturate:
            rounded = np.minimum(rounded, max_finite)
        rounded = np.where(rounded > max_finite, np.inf, rounded)
        rounded = np.where(np.isinf(x), np.inf if not saturate else max_finite, rounded)
    return np.copysign(np.where(np.isnan(x), np.nan, rounded), x).astype(np.float32)


@pytest.mark.parametrize("spec", ["bf16", "fp16", "e5m2", "E8M7", "E5M10", "E5M2"])
def test_round_matches_torch_cast(probes, spec, device):
    fmt = float_format(spec)
    reference_dtype = TORCH_REFERENCES.get(spec, fmt.torch_dtype)
    x = torch.from_numpy(probes)
    expected = x.to(reference_dtype).float().numpy()
    assert_same_floats(round_to_format(x.to(device), spec), expected, probes)


def test_e4m3_matches_torch_cast_where_torch_agrees_across_versions(probes, device):
    """torch >= 2.13 saturates E4M3 overflow, older torch gave NaN: compare where no overflow occurs."""
    in_range = np.isnan(probes) | (np.abs(probes) <= 464)
    x = torch.from_numpy(probes[in_range])
    expected = x.to(torch.float8_e4m3fn).float().numpy()
    assert_same_floats(round_to_format(x.to(device), E4M3), expected, probes[in_range])


@pytest.mark.parametrize(("fmt", "ml_dtype"), ML_DTYPES_REFERENCES, ids=lambda value: getattr(value, "name", None))
def test_round_matches_ml_dtypes(probes, fmt, ml_dtype, device):
    """ml_dtypes maps NaN to a zero in formats without NaN; round_to_format keeps NaN (checked separately)."""
    keep = ~np.isnan(probes) if fmt.specials == "finite" else np.ones(probes.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        expected = probes[keep].astype(ml_dtype).astype(np.float32)
    assert_same_floats(round_to_format(torch.from_numpy(probes[keep]).to(device), fmt), expected, probes[keep])


@pytest.mark.parametrize("spec", GENERIC_SPECS)
def test_generic_format_matches_fp64_reference(probes, spec, device):
    fmt = float_format(spec)
    expected = reference_ieee_round(probes, fmt.exponent_bits, fmt.mantissa_bits)
    assert_same_floats(round_to_format(torch.from_numpy(probes).to(device), fmt), expected, probes)


@pytest.mark.parametrize("spec", ["E8M5", "E3M4", "E5M2", "E8M7"])
def test_saturate_matches_fp64_reference(probes, spec, device):
    fmt = float_format(spec)
    expected = reference_ieee_round(probes, fmt.exponent_bits, fmt.mantissa_bits, saturate=True)
    assert_same_floats(round_to_format(torch.from_numpy(probes).to(device), fmt, saturate=True), expected, probes)


@pytest.mark.parametrize(("fmt", "ml_dtype"), ML_DTYPES_REFERENCES[:4], ids=lambda value: getattr(value, "name", None))
def test_saturate_equals_rounding_the_clamped_input(probes, fmt, ml_dtype, device):
    """saturate=True: every magnitude above max_finite, inf included, becomes max_finite; NaN stays NaN."""
    clamped = np.clip(probes, -fmt.max_finite, fmt.max_finite)
    keep = ~np.isnan(probes)
    expected = clamped[keep].astype(ml_dtype).astype(np.float32)
    result = round_to_format(torch.from_numpy(probes).to(device), fmt, saturate=True).cpu()
    assert_same_floats(result[torch.from_numpy(keep)], expected, probes[keep])
    assert torch.isnan(result[torch.from_numpy(~keep)]).all()


def test_e4m3_saturate_matches_torch_cast_of_clamped_input(probes, device):
    x = torch.from_numpy(probes)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).float().numpy()
    assert_same_floats(round_to_format(x.to(device), E4M3, saturate=True), expected, probes)


FP8_REFERENCES = [(E4M3, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn), (E5M2, torch.float8_e5m2, ml_dtypes.float8_e5m2)]


@pytest.mark.parametrize("fmt,dtype,ml_dtype", FP8_REFERENCES, ids=["e4m3", "e5m2"])
def test_fp8_codes_are_the_saturating_casts_bytes(probes, fmt, dtype, ml_dtype, device):
    """The integer-coded FP8 store (GPUs without FP8 conversions) gives the byte of torch's cast of the
    value clamped to ±max, and of ml_dtypes' for finite values: every tie, subnormal and specials;
    ±inf saturates, NaN is 0x7F with its sign."""
    x = torch.from_numpy(probes)
    codes = to_fp8_codes(x.to(device), fmt).cpu()
    assert codes.dtype == torch.uint8
    assert torch.equal(codes, x.clamp(-fmt.max_finite, fmt.max_finite).to(dtype).view(torch.uint8))
    finite = np.isfinite(probes)
    expected = np.clip(probes[finite], -fmt.max_finite, fmt.max_finite).astype(ml_dtype).view(np.uint8)
    assert np.array_equal(codes.numpy()[finite], expected)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")], device=device)
    max_code = int(torch.tensor(fmt.max_finite).to(dtype).view(torch.uint8))
    assert to_fp8_codes(specials, fmt).tolist() == [max_code, max_code | 0x80, 0x7F, 0xFF]


@pytest.mark.parametrize("fmt,dtype,ml_dtype", FP8_REFERENCES, ids=["e4m3", "e5m2"])
def test_fp8_codes_decode_as_torch_and_ml_dtypes_do(fmt, dtype, ml_dtype, device):
    """Every one of the 256 codes decodes to torch's float32 bits (NaN payloads included) and to
    ml_dtypes' values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = from_fp8_codes(codes.to(device), fmt).cpu()
    assert torch.equal(decoded.view(torch.int32), codes.view(dtype).float().view(torch.int32))
    expected = codes.numpy().view(ml_dtype).astype(np.float32)
    assert np.array_equal(decoded.numpy(), expected, equal_nan=True)


def test_fp8_codes_refuse_other_formats_and_dtypes():
    with pytest.raises(ValueError, match="e4m3 and e5m2; got 'bf16'"):
        to_fp8_codes(torch.ones(2), BF16)
    with pytest.raises(TypeError, match="float32 values, got torch.bfloat16"):
        to_fp8_codes(torch.ones(2, dtype=torch.bfloat16), E4M3)
    with pytest.raises(TypeError, match="uint8 codes, got torch.int32"):
        from_fp8_codes(torch.ones(2, dtype=torch.int32), E4M3)


@pytest.mark.parametrize("fmt", [BF16, E4M3, E5M2, FLOAT6_E3M2FN, FLOAT4_E2M1FN], ids=lambda f: f.name)
def test_specials(fmt, device):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38])
    result = round_to_format(x.to(device), fmt).cpu()
    overflow = {"ieee": float("inf"), "fn": float("nan"), "finite": fmt.max_finite}[fmt.specials]
    expected = torch.tensor([float("nan"), overflow, -overflow, 0.0, -0.0, overflow, -overflow])
    assert torch.equal(torch.isnan(result), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(result[finite], expected[finite])
    assert torch.equal(torch.signbit(result[finite]), torch.signbit(expected[finite]))
    saturated = round_to_format(x.to(device), fmt, saturate=True).cpu()
    assert torch.equal(saturated[1:3], torch.tensor([fmt.max_finite, -fmt.max_finite]))
    assert torch.equal(saturated[5:], torch.tensor([fmt.max_finite, -fmt.max_finite]))
    assert torch.isnan(saturated[0])


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["e4m3", "e5m2", "fp16", "bf16"])
def test_half_precision_inputs(probes, source_dtype, spec, device):
    x = torch.from_numpy(probes).to(source_dtype)
    fmt = float_format(spec)
    reference = x.float().clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype).float().numpy()
    assert_same_floats(round_to_format(x.to(device), fmt, saturate=True), reference, x.float().numpy())


def test_rejects_other_input_dtypes():
    with pytest.raises(TypeError, match="float32"):
        round_to_format(torch.ones(3, dtype=torch.float64), BF16)


@pytest.mark.parametrize("spec", ["bf16", "fp16", "e4m3", "e5m2", "fp32"])
def test_cast_to_native_dtype(probes, spec, device):
    fmt = float_format(spec)
    x = torch.from_numpy(probes)
    stored = cast(x.to(device), fmt, saturate=True)
    assert stored.dtype == fmt.torch_dtype
    expected = x.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype)
    stored = stored.cpu()
    # A NaN's payload is the device's: on an H200 only NaN elements differed from the CPU's cast.
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(stored), nan)
    assert torch.equal(stored[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))


def test_cast_to_emulated_format_stores_float32(probes, device):
    stored = cast(torch.from_numpy(probes).to(device), "E8M5")
    assert stored.dtype == torch.float32
    assert_same_floats(stored, reference_ieee_round(probes, 8, 5), probes)


@pytest.mark.parametrize(
    ("fmt", "finfo"),
    [
        (BF16, ml_dtypes.finfo(ml_dtypes.bfloat16)),
        (FP16, np.finfo(np.float16)),
        (FP32, np.finfo(np.float32)),
        (E4M3, ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)),
        (E5M2, ml_dtypes.finfo(ml_dtypes.float8_e5m2)),
        (FLOAT6_E3M2FN, ml_dtypes.finfo(ml_dtypes.float6_e3m2fn)),
        (FLOAT6_E2M3FN, ml_dtypes.finfo(ml_dtypes.float6_e2m3fn)),
        (FLOAT4_E2M1FN, ml_dtypes.finfo(ml_dtypes.float4_e2m1fn)),
        (float_format("E3M4"), ml_dtypes.finfo(ml_dtypes.float8_e3m4)),
        (IEEE_E4M3, ml_dtypes.finfo(ml_dtypes.float8_e4m3)),
    ],
    ids=lambda value: getattr(value, "name", ""),
)
def test_descriptors_match_finfo(fmt, finfo):
    assert fmt.max_finite == float(finfo.max)
    assert fmt.min_normal == float(finfo.smallest_normal)
    assert fmt.min_subnormal == float(finfo.smallest_subnormal)
    assert fmt.bias == 2 ** (finfo.nexp - 1) - 1
    if fmt.torch_dtype is not None:
        torch_finfo = torch.finfo(fmt.torch_dtype)
        assert (fmt.max_finite, fmt.min_normal) == (torch_finfo.max, torch_finfo.smallest_normal)
        assert fmt.storage_dtype == fmt.torch_dtype
    else:
        assert fmt.storage_dtype == torch.float32


@pytest.mark.parametrize("fmt", [BF16, FP16, E4M3, E5M2, FLOAT6_E2M3FN, float_format("E8M5"), float_format("E3M0")])
def test_ulp_is_the_gap_to_the_next_value(fmt, device):
    values = format_values(fmt.exponent_bits, fmt.mantissa_bits, fmt.specials)
    gaps = np.diff(values)
    _, top_exponent = np.frexp(values[-1])
    gaps = np.append(gaps, np.exp2(top_exponent - 1 - fmt.mantissa_bits))
    midpoints = np.append((values[:-1] + values[1:]) / 2, values[-1])
    for points in (values, -values, midpoints):
        ulps = fmt.ulp(torch.from_numpy(points.astype(np.float32)).to(device)).cpu().numpy()
        assert np.array_equal(ulps, gaps.astype(np.float32))
    assert fmt.ulp(torch.tensor([float("inf"), float("nan")], device=device)).isnan().all()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("bf16", BF16),
        ("BFloat16", BF16),
        ("fp16", FP16),
        ("float16", FP16),
        ("HALF", FP16),
        ("fp32", FP32),
        ("float32", FP32),
        ("e4m3", E4M3),
        ("E4M3FN", E4M3),
        ("float8_e4m3fn", E4M3),
        ("e5m2", E5M2),
        ("float8_e5m2", E5M2),
        ("float6_e3m2fn", FLOAT6_E3M2FN),
        ("float6_e2m3fn", FLOAT6_E2M3FN),
        ("float4_e2m1fn", FLOAT4_E2M1FN),
        ("E8M7", BF16),
        ("e5m10", FP16),
        ("E8M23", FP32),
        (torch.bfloat16, BF16),
        (torch.float16, FP16),
        (torch.float32, FP32),
        (torch.float8_e4m3fn, E4M3),
        (torch.float8_e5m2, E5M2),
        (E4M3, E4M3),
    ],
)
def test_float_format_names(spec, expected):
    fmt = float_format(spec)
    assert fmt == expected
    assert fmt.torch_dtype == expected.torch_dtype


def test_generic_names():
    fmt = float_format("e7m7")
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.specials) == (7, 7, "ieee")
    assert float_format("E8M5") == FloatFormat("anything", 8, 5, "ieee")
    assert float_format("E8M5").torch_dtype is None


@pytest.mark.parametrize("spec", ["fp8", "bf17", "int8", "E4", "float8_e4m3fnuz"])
def test_unknown_name_lists_valid_names(spec):
    with pytest.raises(ValueError, match="bf16.*float4_e2m1fn.*E\\{e\\}M\\{m\\}"):
        float_format(spec)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="bfloat16"):
        float_format(torch.int8)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((9, 3, "ieee"), "exponent_bits must be in 2..8, got 9"),
        ((1, 3, "ieee"), "exponent_bits must be in 2..8, got 1"),
        ((5, 24, "ieee"), "mantissa_bits must be in 0..23, got 24"),
        ((4, 3, "nan"), "specials must be one of ieee, fn, finite"),
        ((8, 3, "fn"), "exponent_bits in 2..7"),
        ((4, 0, "fn"), "mantissa_bits in 1..23"),
    ],
)
def test_invalid_formats(args, message):
    with pytest.raises(ValueError, match=message):
        FloatFormat("bad", *args)


def test_generic_name_out_of_range():
    with pytest.raises(ValueError, match="exponent_bits must be in 2..8, got 9"):
        float_format("E9M3")


def _sixteen_bit_rounding_probes(dropped_bits_at) -> torch.Tensor:
    """Float32 patterns at every rounding boundary of a 16-bit format: for each sign and float32
    exponent field, every pattern of the bits the format keeps there (``dropped_bits_at(field)``
    low bits are dropped) with the dropped bits 0, 1, just under half, exactly half (the tie), just
    over half and all ones; plus float32's own specials."""
    patterns = []
    for field in range(256):
        dropped = dropped_bits_at(field)
        kept = torch.arange(2 ** (23 - dropped), dtype=torch.int64) << dropped
        half = 1 << (dropped - 1)
        low = torch.tensor([0, 1, half - 1, half, half + 1, (1 << dropped) - 1], dtype=torch.int64)
        magnitudes = (field << 23) + (kept.unsqueeze(1) + low.unsqueeze(0)).reshape(-1)
        patterns += [magnitudes, magnitudes | 2**31]
    words = torch.cat(patterns)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.float32)


def _assert_rounds_like(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor) -> None:
    finite_or_inf = ~torch.isnan(x)
    mismatch = (got.view(torch.int32) != expected.view(torch.int32)) & finite_or_inf
    assert not mismatch.any(), f"{int(mismatch.sum())} differ, first input {x[mismatch][:4].tolist()}"


@pytest.mark.parametrize(
    ("dtype", "ml_dtype", "dropped_bits_at"),
    [
        (torch.bfloat16, ml_dtypes.bfloat16, lambda field: 16),
        (torch.float16, np.float16, lambda field: min(max(126 - field, 13), 23)),
    ],
    ids=["bf16", "fp16"],
)
def test_integer_rounding_to_16_bits_equals_the_casts(dtype, ml_dtype, dropped_bits_at):
    """Every tie, both neighbours of every tie and every carry (into the exponent, into the normal
    range from the subnormals, into inf past the largest finite value), over all exponents, against
    torch's cast and ml_dtypes/numpy's; then 2^18 random float32 patterns."""
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(-(2**31), 2**31, (2**18,), dtype=torch.int32, generator=generator).view(torch.float32)
    for x in (_sixteen_bit_rounding_probes(dropped_bits_at), random):
        got = round_to_16bit(x, dtype)
        _assert_rounds_like(got, x.to(dtype).to(torch.float32), x)
        with np.errstate(over="ignore", invalid="ignore"):
            by_numpy = torch.from_numpy(x.numpy().astype(ml_dtype).astype(np.float32))
        _assert_rounds_like(got, by_numpy, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_integer_rounding_keeps_infinities_and_quiet_nans(dtype):
    quiet_nans = torch.tensor([0x7FC00000, 0x7FFFFFFF, 0x7FC00001, -1, -(2**22)], dtype=torch.int32)
    got = round_to_16bit(quiet_nans.view(torch.float32), dtype)
    assert torch.equal(got.view(torch.int32) & 0x7FFFFFFF, torch.full((5,), 0x7FC00000, dtype=torch.int32))
    assert torch.equal(got.view(torch.int32) < 0, quiet_nans < 0)
    infinities = torch.tensor([torch.inf, -torch.inf, 3.4e38, -3.4e38])
    assert torch.equal(round_to_16bit(infinities, dtype), torch.tensor([1, -1, 1, -1]) * torch.inf)


def test_rounding_to_bfloat16_through_bits_equals_the_casts():
    """The GPUs' rounding to bfloat16 (the cast, read back through its bits) against ml_dtypes and the
    integer form on the same probes (every tie, its neighbours and every carry, then 2^18 random
    patterns); infinities and NaNs stay what they are."""
    generator = torch.Generator().manual_seed(1)
    random = torch.randint(-(2**31), 2**31, (2**18,), dtype=torch.int32, generator=generator).view(torch.float32)
    for x in (_sixteen_bit_rounding_probes(lambda field: 16), random):
        got = round_to_bfloat16_through_bits(x)
        with np.errstate(over="ignore", invalid="ignore"):
            _assert_rounds_like(got, torch.from_numpy(x.numpy().astype(ml_dtypes.bfloat16).astype(np.float32)), x)
        _assert_rounds_like(got, round_to_16bit(x, torch.bfloat16), x)
        assert torch.equal(torch.isnan(got), torch.isnan(x))
    infinities = torch.tensor([torch.inf, -torch.inf, 3.4e38, -3.4e38])
    assert torch.equal(round_to_bfloat16_through_bits(infinities), torch.tensor([1, -1, 1, -1]) * torch.inf)
    with pytest.raises(TypeError, match="float32"):
        round_to_bfloat16_through_bits(torch.ones(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_on_a_device_without_cast_rounding_takes_the_form_that_survives_compilation(monkeypatch, dtype):
    """Off :data:`CAST_ROUNDING_DEVICES` (on GPUs) bfloat16 goes through the cast's bits, float16
    through the integer form; the bits are the cast's either way."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e-3
    monkeypatch.setattr("megatron_lowprec.numerics.formats.CAST_ROUNDING_DEVICES", ())
    calls = []
    for name in ("round_to_bfloat16_through_bits", "round_to_16bit"):
        original = getattr(formats, name)
        monkeypatch.setattr(formats, name, lambda *args, _name=name, _original=original: calls.append(_name) or _original(*args))
    got = round_to_16bit_on_device(x, dtype)
    assert calls == ["round_to_bfloat16_through_bits" if dtype == torch.bfloat16 else "round_to_16bit"]
    assert torch.equal(got, x.to(dtype).to(torch.float32))


def test_integer_rounding_rejects_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        round_to_16bit(torch.ones(2, dtype=torch.float64), torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        round_to_16bit(torch.ones(2), torch.float8_e4m3fn)


REMAINDER_LOW_HALVES = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]
"""Low 16 bits at every boundary of the split: none, the smallest, the largest non-negative
remainder, the tie (the first negative one), past it, and all ones (remainder -1)."""


def _remainder_probes() -> torch.Tensor:
    """Every float32 upper half (both signs, every exponent: subnormals, ±0, the largest finite, ±inf
    and NaNs) with each low half of :data:`REMAINDER_LOW_HALVES`, then 2^18 random patterns."""
    words = (torch.arange(2**16, dtype=torch.int64).unsqueeze(1) << 16) + torch.tensor(REMAINDER_LOW_HALVES)
    random = torch.randint(0, 2**32, (2**18,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    words = torch.cat([words.reshape(-1), random])
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.float32)


def _nearest_bf16_ties_away(x: np.ndarray) -> np.ndarray:
    """Finite float32 ``x`` rounded to bfloat16 to nearest, ties away from zero, in float64 (a
    value past the largest bfloat16 by half a step or more is inf): the two bfloat16 neighbours
    of |x| and the exact distances to them."""
    magnitude = np.abs(x).astype(np.float64)
    below = (np.abs(x).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    exponent = np.maximum((np.abs(x).view(np.uint32) >> 23).astype(np.int64), 1) - 127
    above = below + np.exp2(exponent - 7.0)
    rounded = np.where(magnitude - below < above - magnitude, below, above)
    rounded = np.where(rounded >= 2.0**128, np.inf, rounded)
    return np.copysign(rounded, x)


def test_bf16_remainder_split_is_a_bijection_rounding_half_away_from_zero():
    """Every upper half with every boundary of the low half, and random patterns: the pair rebuilds
    the float32 bit pattern; the remainder is the low half as an int16 and the upper half the high
    half plus the carry (integer arithmetic on the patterns, numpy); for finite values the upper
    half is the nearest bfloat16 with ties away from zero (float64); it equals torch's cast and
    ml_dtypes' (ties to even) except exactly at the ties below an even upper half, where it is
    one step further from zero."""
    x = _remainder_probes()
    upper, remainder = split_bf16_remainder(x)
    assert upper.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_bf16_remainder(upper, remainder).view(torch.int32), x.view(torch.int32))

    words = x.view(torch.int32).numpy().view(np.uint32).astype(np.int64)
    low = words & 0xFFFF
    assert np.array_equal(remainder.numpy(), low.astype(np.uint16).view(np.int16))
    expected_upper = ((words + 0x8000) >> 16) & 0xFFFF
    assert np.array_equal(upper.view(torch.int16).numpy().view(np.uint16), expected_upper.astype(np.uint16))

    values = x.numpy()
    finite = np.isfinite(values)
    got = upper[torch.from_numpy(finite)].double().numpy()
    assert np.array_equal(got, _nearest_bf16_ties_away(values[finite]))

    even_ties = finite & (low == 0x8000) & (((words >> 16) & 1) == 0)
    with np.errstate(invalid="ignore", over="ignore"):
        by_ml_dtypes = torch.from_numpy(values.astype(ml_dtypes.bfloat16).view(np.int16))
    for nearest_even in (x.to(torch.bfloat16).view(torch.int16), by_ml_dtypes):
        nearest_even = nearest_even.numpy().view(np.uint16).astype(np.int64)
        differs = finite & (nearest_even != expected_upper)
        assert np.array_equal(differs, even_ties)
        assert np.array_equal(expected_upper[differs], (nearest_even[differs] + 1) & 0xFFFF)
    assert even_ties.sum() >= 2**15 - 128


@pytest.mark.parametrize(
    ("pattern", "upper_pattern", "remainder_value"),
    [
        (0x00000000, 0x0000, 0),
        (0x80000000, 0x8000, 0),
        (0x00000001, 0x0000, 1),
        (0x80008000, 0x8001, -(2**15)),
        (0x007FFFFF, 0x0080, -1),
        (0x3F808000, 0x3F81, -(2**15)),
        (0x3F818000, 0x3F82, -(2**15)),
        (0x3F7FFFFF, 0x3F80, -1),
        (0x7F7F7FFF, 0x7F7F, 0x7FFF),
        (0x7F7FFFFF, 0x7F80, -1),
        (0xFF7FFFFF, 0xFF80, -1),
        (0x7F800000, 0x7F80, 0),
        (0xFF800000, 0xFF80, 0),
        (0x7FC00000, 0x7FC0, 0),
        (0x7FFFFFFF, 0x8000, -1),
        (0xFFFFFFFF, 0x0000, -1),
    ],
    ids=[
        "zero", "negative zero", "smallest subnormal", "negative subnormal tie", "largest subnormal carries into the normals",
        "even tie goes up", "odd tie goes up", "carry into the exponent", "below the largest bfloat16",
        "largest float32 goes to inf", "to -inf", "inf", "-inf", "quiet nan", "all-ones nan wraps", "negative all-ones nan wraps",
    ],
)
def test_bf16_remainder_split_at_the_edges(pattern, upper_pattern, remainder_value):
    signed = pattern - 2**32 if pattern >= 2**31 else pattern
    x = torch.tensor([signed], dtype=torch.int32).view(torch.float32)
    upper, remainder = split_bf16_remainder(x)
    assert upper.view(torch.int16).item() & 0xFFFF == upper_pattern
    assert remainder.item() == remainder_value
    assert join_bf16_remainder(upper, remainder).view(torch.int32).item() == signed


def _split_and_join(patterns: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Split and join ``patterns`` as they are, and ``finite`` values computed just before."""
    results = []
    for x in (patterns, finite * 1.0):
        upper, remainder = split_bf16_remainder(x)
        results += [upper.view(torch.int16), remainder, join_bf16_remainder(upper, remainder).view(torch.int32)]
    return tuple(results)


def test_bf16_remainder_split_compiled_equals_eager(device):
    """Inductor's code (C++ on the CPU, Triton on CUDA) gives eager's bits on every probe, read from
    memory or computed in the same kernel."""
    x = _remainder_probes()
    arguments = (x.to(device), x[torch.isfinite(x)].to(device))
    torch._dynamo.reset()
    compiled = torch.compile(_split_and_join, dynamic=True, fullgraph=True)
    for eager_result, compiled_result in zip(_split_and_join(*arguments), compiled(*arguments)):
        assert torch.equal(eager_result, compiled_result)
    torch._dynamo.reset()


def test_bf16_remainder_takes_float32_and_bf16_with_int16():
    with pytest.raises(TypeError, match="float32"):
        split_bf16_remainder(torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16 upper half and an int16 remainder"):
        join_bf16_remainder(torch.ones(2, dtype=torch.float16), torch.zeros(2, dtype=torch.int16))
