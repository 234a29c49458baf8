"""The 8-bit master residual (FlashOptim's, ``master_storage="residual8"``) against float64 arithmetic:
the grid of 16 significant bits, the BF16 upper half, the residual's units and the round trip, over
every BF16 pattern (both signs, every exponent, subnormals, zeros, the largest finite, infinities)."""

import numpy as np
import pytest
import torch

from megatron_lowprec.numerics.formats import join_bf16_residual8, round_to_bf16_residual8, split_bf16_residual8

FLOAT32_MAX = float(np.finfo(np.float32).max)
LOW_HALVES = [0x0000, 0x0001, 0x007F, 0x0080, 0x0081, 0x00FF, 0x0100, 0x017F, 0x0180, 0x7F7F, 0x7F80, 0x7FFF,
              0x8000, 0x807F, 0x8080, 0xFF7F, 0xFF80, 0xFFFF]
"""Low 16 bits at the boundaries of both roundings: the 8 dropped bits below and at their tie, and
the residual byte at zero, its largest positive, its sign change and all ones (a carry into the
upper half, into the exponent at the binade's top)."""


def _patterns_as_float32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy()).view(torch.float32)


def _probes() -> torch.Tensor:
    """Every float32 high half (every BF16 pattern) with each low half of :data:`LOW_HALVES`, then
    2^16 random patterns."""
    highs = np.arange(2**16, dtype=np.int64)[:, None] << 16
    words = (highs + np.array(LOW_HALVES, dtype=np.int64)).reshape(-1)
    random = np.random.default_rng(5).integers(0, 2**32, 2**16, dtype=np.int64)
    return _patterns_as_float32(np.concatenate([words, random]))


def _binade(magnitude: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) for normal float64 magnitudes, -126 below FP32's smallest normal and for zero."""
    _, exponent = np.frexp(magnitude)
    return np.where(magnitude >= 2.0**-126, exponent - 1, -126)


def _grid_step(magnitude: np.ndarray) -> np.ndarray:
    """The spacing of 16 significant bits (BF16's 8 and the residual's 8) at ``magnitude``, in float64."""
    return np.exp2(_binade(magnitude) - 15.0)


def _reference_grid_value(x: np.ndarray) -> np.ndarray:
    """Finite ``x`` rounded to 16 significant bits to nearest, ties away from zero, in float64; a
    value that would round up past FP32's largest finite rounds down instead."""
    magnitude = np.abs(x.astype(np.float64))
    step = _grid_step(magnitude)
    rounded = np.floor(magnitude / step + 0.5) * step
    rounded = np.where(rounded > FLOAT32_MAX, np.floor(magnitude / step) * step, rounded)
    return np.copysign(rounded, x)


def _reference_bf16_ties_away(value: np.ndarray) -> np.ndarray:
    """Float64 ``value`` (on the grid) rounded to BF16, to nearest with ties away from zero: infinity
    from BF16's largest finite plus half a BF16 step on."""
    magnitude = np.abs(value)
    ulp = np.exp2(_binade(magnitude) - 7.0)
    below = np.floor(magnitude / ulp) * ulp
    rounded = np.where(magnitude - below >= ulp / 2, below + ulp, below)
    return np.copysign(np.where(rounded >= 2.0**128, np.inf, rounded), value)


def test_split_rounds_to_16_significant_bits_and_join_gives_them_back():
    """Per finite probe: the joined value is the float64 grid rounding (bit for bit, so ±0 keep their
    sign); it lies within half a grid step of ``x`` (a whole step only where it saturated); the upper
    half is that value rounded to BF16 with ties away from zero; and the residual is the rest of the
    magnitude in grid steps, so ``|upper| + residual * step`` is the value's magnitude exactly."""
    x = _probes()
    finite = torch.isfinite(x)
    upper, residual = split_bf16_residual8(x[finite])
    assert upper.dtype == torch.bfloat16 and residual.dtype == torch.int8
    joined = join_bf16_residual8(upper, residual).numpy()
    values = x[finite].numpy()
    reference = _reference_grid_value(values).astype(np.float32)
    assert np.array_equal(joined.view(np.uint32), reference.view(np.uint32))
    assert np.array_equal(round_to_bf16_residual8(x[finite]).numpy().view(np.uint32), reference.view(np.uint32))

    error = np.abs(joined.astype(np.float64) - values.astype(np.float64))
    step = _grid_step(np.abs(values.astype(np.float64)))
    saturated = np.abs(values.astype(np.float64)) > FLOAT32_MAX - step / 2
    assert np.all(error <= np.where(saturated, step, step / 2))
    assert saturated.sum() == 4  # low halves 0xFF80 and 0xFFFF below the largest exponent, both signs

    expected_upper = _reference_bf16_ties_away(joined.astype(np.float64))
    got_upper = upper.double().numpy()
    assert np.array_equal(got_upper, expected_upper)
    bounded = np.isfinite(expected_upper)
    rest = np.abs(joined.astype(np.float64)[bounded]) - np.abs(expected_upper[bounded])
    assert np.array_equal(rest, residual.numpy()[bounded].astype(np.float64) * _grid_step(np.abs(joined[bounded].astype(np.float64))))
    assert np.all(np.abs(rest) <= np.exp2(_binade(np.abs(got_upper[bounded])) - 8.0))


def test_the_upper_half_is_torchs_cast_but_at_ties():
    """BF16 nearest-even (torch's cast) of the grid value agrees with the upper half but where the
    grid value lies exactly halfway between two BF16 values (residual -128)."""
    x = _probes()
    x = x[torch.isfinite(x)]
    upper, residual = split_bf16_residual8(x)
    cast = join_bf16_residual8(upper, residual).to(torch.bfloat16)
    differs = upper.view(torch.int16) != cast.view(torch.int16)
    assert differs.any()
    assert torch.all(residual[differs] == -128)


def test_every_finite_stored_pair_splits_back_to_itself():
    """Every BF16 upper half with every residual byte: where the joined value is finite, splitting it
    gives the pair back, so that storing a master read from a pair changes nothing."""
    uppers = torch.arange(-(2**15), 2**15, 7, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    residuals = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    upper = uppers.repeat_interleave(residuals.numel())
    residual = residuals.repeat(uppers.numel())
    joined = join_bf16_residual8(upper, residual)
    finite = torch.isfinite(joined)
    again_upper, again_residual = split_bf16_residual8(joined[finite])
    assert torch.equal(again_upper.view(torch.int16), upper[finite].view(torch.int16))
    assert torch.equal(again_residual, residual[finite])
    assert torch.equal(join_bf16_residual8(again_upper, again_residual).view(torch.int32), joined[finite].view(torch.int32))


@pytest.mark.parametrize(
    "value, upper_pattern, residual_value",
    [
        (0.0, 0x0000, 0),
        (-0.0, 0x8000, 0),
        (1.0 + 2.0**-15, 0x3F80, 1),
        (1.0 + 2.0**-16, 0x3F80, 1),
        (1.0 - 2.0**-17, 0x3F80, 0),
        (1.0 + 2.0**-8, 0x3F81, -128),
        (-(1.0 + 2.0**-8), 0xBF81, -128),
        (2.0**-149, 0x0000, 0),
        (2.0**-141, 0x0000, 1),
        (FLOAT32_MAX, 0x7F80, -1),
        (float("inf"), 0x7F80, 0),
        (float("-inf"), 0xFF80, 0),
    ],
)
def test_split_at_the_edges(value, upper_pattern, residual_value):
    """Zeros keep their sign; ties of the grid go away from zero; the smallest subnormal rounds to zero
    and 2^-141 is one grid step; FP32's largest saturates to the grid's largest (an infinite upper
    half, as torch's cast, with the master finite); infinities stay."""
    upper, residual = split_bf16_residual8(torch.tensor([value], dtype=torch.float32))
    assert upper.view(torch.int16).item() & 0xFFFF == upper_pattern
    assert residual.item() == residual_value


def test_nan_stays_nan():
    upper, residual = split_bf16_residual8(_patterns_as_float32(np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF])))
    assert torch.isnan(upper.float()).all() and torch.isnan(join_bf16_residual8(upper, residual)).all()


def test_residual8_takes_float32_and_bf16_with_int8():
    with pytest.raises(TypeError, match="float32"):
        split_bf16_residual8(torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16 upper half and an int8 residual"):
        join_bf16_residual8(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))
