"""Stochastic rounding by dithering and the random word streams, against exact fp64 / Python integer references.

Statistical bounds: a count of round-ups over N independent draws with probability p has standard
deviation sqrt(N p (1 - p)); every check allows 5 standard deviations (a false alarm below 6e-7 for a
normal approximation), and the fixed seeds make each run identical.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_lowprec.numerics import rounding
from megatron_lowprec.numerics.formats import BF16, E4M3, E5M2, FP16, float_format
from megatron_lowprec.numerics.rounding import (
    StreamLayout,
    counter_random_bits,
    counter_round_keys,
    counter_random_bits_range,
    generator_random_bits,
    grid_index,
    grid_random_bits,
    keyed_random_bits,
    layout_random_bits,
    stochastic_round,
    stream_id,
)

FORMATS = [BF16, FP16, E4M3, E5M2, float_format("E8M5")]
WORD = 2**32


def reference_floor_and_step(x, fmt):
    """|x| rounded down to fmt and the grid step there, in exact fp64 (|x| below the overflow threshold)."""
    min_exponent = 2 - 2 ** (fmt.exponent_bits - 1)
    magnitude = np.abs(x.astype(np.float64))
    _, exponent = np.frexp(magnitude)
    step = np.exp2(np.maximum(exponent - 1, min_exponent) - fmt.mantissa_bits)
    return np.floor(magnitude / step) * step, step


def exact_round_up_probability(x, fmt):
    """(|x| - floor|x|) / step as an exact fraction."""
    lower, step = reference_floor_and_step(np.array([x], dtype=np.float32), fmt)
    return (abs(Fraction(float(np.float32(x)))) - Fraction(lower[0])) / Fraction(step[0])


def log_uniform_values(fmt, count, seed):
    """Random-sign float32 values, log-uniform from a quarter of min_subnormal up to max_finite."""
    rng = np.random.default_rng(seed)
    low, high = np.log2(fmt.min_subnormal / 4), np.log2(fmt.max_finite)
    magnitude = np.exp2(rng.uniform(low, high, count)).astype(np.float32)
    magnitude = np.minimum(magnitude, np.float32(fmt.max_finite))
    return np.where(rng.random(count) < 0.5, -magnitude, magnitude).astype(np.float32)


def py_lowbias32(word):
    word ^= word >> 16
    word = (word * 0x7FEB352D) % WORD
    word ^= word >> 15
    word = (word * 0x846CA68B) % WORD
    return word ^ (word >> 16)


def py_splitmix64(state):
    z = (state + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def py_counter_word(seed, step, index, stream=0):
    """The documented counter hash in Python integers."""
    seed_key = py_splitmix64(seed % 2**64)
    stream_key = py_splitmix64(seed_key ^ (stream % 2**64))
    step_key = py_splitmix64(stream_key ^ (step % 2**64))
    last_key = py_splitmix64(step_key) % WORD
    index %= 2**64
    word = py_lowbias32((index >> 32) ^ (step_key % WORD))
    word = py_lowbias32(word ^ (index % WORD) ^ (step_key >> 32))
    return py_lowbias32(word ^ last_key)


def unsigned_words(words):
    return words.to(torch.int64) & (WORD - 1)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_result_is_a_neighbour_and_unbiased_on_aggregate(fmt, device):
    x = log_uniform_values(fmt, 200_000, seed=1)
    lower, step = reference_floor_and_step(x, fmt)
    bits = generator_random_bits(x.shape, torch.Generator().manual_seed(2)).to(device)
    result = stochastic_round(torch.from_numpy(x).to(device), fmt, bits).cpu().numpy().astype(np.float64)
    magnitude = np.abs(result)
    rounded_up = magnitude == lower + step
    assert np.all((magnitude == lower) | rounded_up)
    assert np.array_equal(np.signbit(result), np.signbit(x))
    probability = (np.abs(x.astype(np.float64)) - lower) / step
    assert np.all(rounded_up[probability == 0] == 0)
    excess_ups = rounded_up.sum() - probability.sum()
    assert abs(excess_ups) <= 5 * np.sqrt(np.sum(probability * (1 - probability)))
    if fmt.torch_dtype is not None:
        as_float32 = torch.from_numpy(result.astype(np.float32))
        assert torch.equal(as_float32.to(fmt.torch_dtype).float(), as_float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("position", ["normal", "subnormal", "negative"])
def test_mean_of_many_draws_is_x(fmt, position, device):
    """|mean - x| <= 5 * sqrt(p (1 - p) / N) * step: the mean of N Bernoulli(p) steps above floor|x|."""
    draws = 100_000
    anchor = {"normal": 1.7 * fmt.min_normal * 2**3, "subnormal": fmt.min_normal / 3, "negative": -fmt.max_finite / 5.3}
    x = np.float32(anchor[position])
    probability = float(exact_round_up_probability(x, fmt))
    assert 0.05 < probability < 0.95
    _, step = reference_floor_and_step(np.array([x]), fmt)
    bits = generator_random_bits((draws,), torch.Generator().manual_seed(7)).to(device)
    result = stochastic_round(torch.full((draws,), float(x), device=device), fmt, bits)
    mean = result.double().mean().item()
    assert abs(mean - float(x)) <= 5 * np.sqrt(probability * (1 - probability) / draws) * step[0]


@pytest.mark.parametrize(
    ("fmt", "x", "discarded_bits"),
    [
        (FP16, 1.0 + 2**-10 * 0.3, 13),
        (FP16, 2**-16 * 1.37, 15),
        (BF16, -3.1, 16),
        (BF16, 2**-130 * 1.29, 16),
        (float_format("E8M5"), 0.0123, 18),
        (E4M3, 3.3, 20),
        (E4M3, -(2**-7) * 1.6, 21),
    ],
    ids=["fp16", "fp16-subnormal", "bf16", "bf16-subnormal", "e8m5", "e4m3", "e4m3-subnormal"],
)
def test_round_up_count_over_all_dithers_is_exact(fmt, x, discarded_bits, device):
    """Enumerating every dither value in the low bits (high bits random, hence ignored) rounds up exactly
    p * 2^discarded_bits times. The last bit of x is set, so that every dither bit matters."""
    x = (np.array([x], dtype=np.float32).view(np.uint32) | 1).view(np.float32)[0]
    probability = exact_round_up_probability(x, fmt)
    assert 0 < probability < 1
    count = 2**discarded_bits
    high_bits = torch.randint(0, 2 ** (32 - discarded_bits), (count,), generator=torch.Generator().manual_seed(3))
    words = torch.arange(count, dtype=torch.int64) + (high_bits << discarded_bits)
    lower, step = reference_floor_and_step(np.array([x]), fmt)
    for random_bits in (words, torch.where(words >= 2**31, words - WORD, words).to(torch.int32)):
        result = stochastic_round(torch.full((count,), float(x), device=device), fmt, random_bits.to(device)).double()
        ups = int((result.abs() == lower[0] + step[0]).sum())
        assert ups + int((result.abs() == lower[0]).sum()) == count
        assert Fraction(ups, count) == probability


def test_deep_underflow_dithers_the_top_32_discarded_bits(device):
    """x = 2^-40 in E4M3 discards 54 bits; P(up) = 2^-40 / 2^-9 = 2^-31 = 2 / 2^32: exactly two words round up."""
    x = torch.full((4,), 2.0**-40, device=device)
    words = torch.tensor([WORD - 1, WORD - 2, WORD - 3, 0], dtype=torch.int64, device=device)
    result = stochastic_round(x, E4M3, words).cpu()
    assert torch.equal(result, torch.tensor([2.0**-9, 2.0**-9, 0.0, 0.0]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_same_generator_state_gives_same_result(fmt, device):
    x = torch.from_numpy(log_uniform_values(fmt, 10_000, seed=4)).to(device)
    first = stochastic_round(x, fmt, generator_random_bits(x.shape, torch.Generator().manual_seed(11)).to(device))
    again = stochastic_round(x, fmt, generator_random_bits(x.shape, torch.Generator().manual_seed(11)).to(device))
    other = stochastic_round(x, fmt, generator_random_bits(x.shape, torch.Generator().manual_seed(12)).to(device))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_exact_values_and_specials_are_kept(fmt, device):
    values = torch.tensor(
        [0.0, -0.0, fmt.min_subnormal, -fmt.min_normal, 1.0, -fmt.max_finite, float("nan")], device=device
    )
    for word in (0, -1, 2**31 - 1):
        result = stochastic_round(values, fmt, torch.full(values.shape, word, dtype=torch.int32, device=device))
        assert torch.equal(result[:-1], values[:-1])
        assert torch.equal(torch.signbit(result[:-1]), torch.signbit(values[:-1]))
        assert torch.isnan(result[-1])
    infinities = torch.tensor([float("inf"), -float("inf")], device=device)
    result = stochastic_round(infinities, fmt, torch.zeros(2, dtype=torch.int32, device=device))
    if fmt.specials == "ieee":
        assert torch.equal(result, infinities)
    else:
        assert torch.isnan(result).all()
    saturated = stochastic_round(infinities, fmt, torch.zeros(2, dtype=torch.int32, device=device), saturate=True)
    assert torch.equal(saturated, torch.tensor([fmt.max_finite, -fmt.max_finite], device=device))


@pytest.mark.parametrize(
    ("fmt", "x", "overflow"),
    [(BF16, 3.395e38, float("inf")), (E5M2, -60000.0, -float("inf")), (E4M3, 460.0, float("nan"))],
    ids=["bf16", "e5m2", "e4m3"],
)
def test_overflow(fmt, x, overflow, device):
    draws = 20_000
    bits = generator_random_bits((draws,), torch.Generator().manual_seed(5)).to(device)
    top = float(np.copysign(fmt.max_finite, x))
    result = stochastic_round(torch.full((draws,), x, device=device), fmt, bits)
    overflowed = torch.isnan(result) if np.isnan(overflow) else result == overflow
    assert torch.all(overflowed | (result == top))
    assert 0 < int(overflowed.sum()) < draws
    saturated = stochastic_round(torch.full((draws,), x, device=device), fmt, bits, saturate=True)
    assert torch.all(saturated == top)


def test_accepts_half_precision_inputs(device):
    x = torch.linspace(-3, 3, 1001, dtype=torch.bfloat16, device=device)
    bits = generator_random_bits(x.shape, torch.Generator().manual_seed(6)).to(device)
    assert torch.equal(stochastic_round(x, E4M3, bits), stochastic_round(x.float(), E4M3, bits))
    assert torch.equal(stochastic_round(x, BF16, bits), x.float())


def test_rejects_bad_random_bits():
    x = torch.ones(4)
    with pytest.raises(TypeError, match="int32 or int64"):
        stochastic_round(x, BF16, torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        stochastic_round(x, BF16, torch.zeros(5, dtype=torch.int32))


def test_sharded_rounding_with_counter_bits_matches_unsharded(device):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(8)).to(device)
    whole = stochastic_round(x, BF16, counter_random_bits_range(3, 17, 0, x.numel(), device=device))
    bounds = [0, 1, 2500, 6001, 10_000]
    shards = [
        stochastic_round(x[start:end], BF16, counter_random_bits_range(3, 17, start, end - start, device=device))
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    assert torch.equal(torch.cat(shards), whole)


@pytest.mark.parametrize(
    ("seed", "step", "stream"), [(0, 0, 0), (1234, 1, 7), (2**64 - 1, 10**6, 2**64 - 1), (-5, 2**40, stream_id("w"))]
)
def test_counter_stream_matches_python_reference(seed, step, stream, device):
    rng = np.random.default_rng(9)
    indices = [0, 1, 2, 2**31, WORD - 1, WORD, 2**40 + 5, 2**63 - 1, -1]
    indices += [int(i) for i in rng.integers(0, 2**62, size=200)]
    words = counter_random_bits(seed, step, torch.tensor(indices, dtype=torch.int64, device=device), stream)
    assert words.dtype == torch.int32
    assert unsigned_words(words).tolist() == [py_counter_word(seed, step, i, stream) for i in indices]


def _tensor_parallel_shard(tensor, dim, rank, world_size, chunks):
    """Rank's shard of ``tensor`` split along ``dim``: its part of each of ``chunks`` blocks, in order."""
    blocks = tensor.chunk(chunks, dim=dim)
    return torch.cat([block.chunk(world_size, dim=dim)[rank] for block in blocks], dim=dim)


@pytest.mark.parametrize(
    ("shape", "dim", "world_size", "chunks"),
    [((12, 8), 0, 2, 1), ((12, 8), 1, 2, 1), ((12, 8), 1, 4, 1), ((8, 6), 0, 2, 2), ((3, 8, 4), 1, 4, 2), ((40,), 0, 5, 1)],
)
def test_every_shard_draws_the_words_of_its_elements_in_the_whole_tensor(shape, dim, world_size, chunks, device):
    """The stream layout of a tensor-parallel shard (column-parallel: dim 0, row-parallel: dim 1, gated
    fc1: chunks 2) gives each element the word it has when the tensor is whole."""
    whole = layout_random_bits(11, 3, StreamLayout.whole(5, math.prod(shape)), shape, device)
    for rank in range(world_size):
        local_shape = _tensor_parallel_shard(whole, dim, rank, world_size, chunks).shape
        layout = StreamLayout.shard(5, tuple(local_shape), dim, rank, world_size, chunks)
        expected = _tensor_parallel_shard(whole, dim, rank, world_size, chunks)
        assert torch.equal(layout_random_bits(11, 3, layout, local_shape, device), expected)


@pytest.mark.parametrize(
    ("offset", "row_stride", "rows", "row_length"),
    [(0, 0, 1, 1000), (WORD - 300, 0, 1, 1000), (5 * WORD - 7, WORD + 3, 4, 64), (2**62, 2**40, 3, 129), (17, 500, 6, 250)],
)
def test_grid_words_carry_into_the_high_word_like_the_int64_index(
    offset, row_stride, rows, row_length, monkeypatch, device
):
    """The int32 grid (low word plus column, unsigned carry) equals the hash of the int64 index grid,
    also where a row crosses a multiple of 2^32; so does the int64 path of over-long rows."""
    keys = counter_round_keys(3, 9, 4)
    expected = keyed_random_bits(keys, grid_index(offset, row_stride, rows, row_length, device))
    assert torch.equal(grid_random_bits(keys, offset, row_stride, rows, row_length, device), expected)
    monkeypatch.setattr(rounding, "INT32_GRID_MAX_ROW", row_length - 1)
    assert torch.equal(grid_random_bits(keys, offset, row_stride, rows, row_length, device), expected)


def test_stream_layout_indices_and_errors():
    layout = StreamLayout.shard(0, (2, 3), 1, 1, 2)
    assert layout.index(6).tolist() == [3, 4, 5, 9, 10, 11]
    assert StreamLayout.whole(0, 4).index(4).tolist() == [0, 1, 2, 3]
    assert StreamLayout.whole(0, 0).index(0).tolist() == []
    with pytest.raises(ValueError, match="not whole rows of 3"):
        layout.index(7)
    with pytest.raises(ValueError, match="dim 2 is not a dimension of shape"):
        StreamLayout.shard(0, (2, 3), 2, 0, 2)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        StreamLayout.shard(0, (2, 3), 1, 2, 2)
    with pytest.raises(ValueError, match="does not split into 2 chunks"):
        StreamLayout.shard(0, (2, 3), 1, 0, 2, chunks=2)


def test_streams_are_independent_and_named_streams_are_stable(device):
    """A name's stream is its BLAKE2b-64 digest read little-endian (b9937e9f8901bfc1 by ``b2sum -l 64``)."""
    assert stream_id("decoder.layers.0.mlp.linear_fc1.weight") == 0xC1BF01899F7E93B9
    reference = counter_random_bits_range(42, 7, 0, 100_000, device, stream=1)
    assert int((counter_random_bits_range(42, 7, 0, 100_000, device, stream=2) == reference).sum()) <= 2


def test_counter_range_slices_equal_the_whole_range(device):
    whole = counter_random_bits_range(42, 7, 0, 100_000, device)
    for start, numel in [(0, 10), (12_345, 777), (99_000, 1000), (31, 1), (50_000, 0)]:
        assert torch.equal(counter_random_bits_range(42, 7, start, numel, device), whole[start : start + numel])
    across_word = counter_random_bits_range(42, 7, WORD - 50, 100, device)
    halves = [counter_random_bits_range(42, 7, start, 50, device) for start in (WORD - 50, WORD)]
    assert torch.equal(across_word, torch.cat(halves))
    assert torch.equal(across_word, counter_random_bits(42, 7, torch.arange(WORD - 50, WORD + 50, device=device)))


def test_counter_streams_differ_across_steps_and_seeds(device):
    """Two independent uniform words agree with probability 2^-32: about 2e-5 matches in 100k."""
    reference = counter_random_bits_range(42, 7, 0, 100_000, device)
    for seed, step in [(42, 8), (43, 7), (7, 42), (42, 7 + 2**32)]:
        assert int((counter_random_bits_range(seed, step, 0, 100_000, device) == reference).sum()) <= 2


def assert_uniform_bits(words):
    """Each of the 32 bits is 1 with frequency 1/2 +- 5 * sqrt(1/4 / N)."""
    unsigned = unsigned_words(words)
    bit_means = torch.stack([((unsigned >> bit) & 1).double().mean() for bit in range(32)])
    assert torch.all((bit_means - 0.5).abs() <= 5 * np.sqrt(0.25 / words.numel()))


def test_counter_bits_are_uniform_and_independent_of_neighbours(device):
    count = 400_000
    words = counter_random_bits_range(2024, 3, 10**9, count, device)
    assert_uniform_bits(words)
    assert_uniform_bits(words[1:] ^ words[:-1])
    assert_uniform_bits(words ^ counter_random_bits_range(2024, 4, 10**9, count, device))
    assert_uniform_bits(words ^ counter_random_bits_range(2025, 3, 10**9, count, device))


def test_generator_bits(device):
    generator = torch.Generator(device).manual_seed(13)
    state = generator.get_state()
    words = generator_random_bits((400, 1000), generator)
    assert words.dtype == torch.int32 and words.shape == (400, 1000) and words.device.type == device.type
    assert_uniform_bits(words.flatten())
    generator.set_state(state)
    assert torch.equal(generator_random_bits((400, 1000), generator), words)
    assert generator_random_bits((3,), None, device=device).shape == (3,)


@pytest.mark.parametrize("start, numel", [(0, 96), (5, 40), (20, 37), (12, 12), (7, 1)])
def test_grids_of_a_run_give_each_element_its_global_index(start, numel):
    """A run of a tensor-parallel shard's elements (a distributed optimizer's piece), cut into grids
    of whole stream rows, draws from the indices that ``StreamLayout.index`` gives those elements."""
    layout = StreamLayout.shard(7, (8, 12), 1, rank=1, world_size=3)
    grids = layout.grids(start, numel)
    assert sum(rows * length for _, rows, length, _ in grids) == numel
    pieces = [grid_index(offset, layout.row_stride, rows, length).reshape(-1) for _, rows, length, offset in grids]
    assert torch.equal(torch.cat(pieces), layout.index(96)[start : start + numel])

