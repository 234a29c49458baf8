"""Exact sums of squares against Python's exact rationals, and their independence of the split."""

import importlib.util
import math
import platform
from fractions import Fraction

import pytest
import torch

from megatron_lowprec.numerics import square_sum
from megatron_lowprec.numerics.square_sum import norm_from_bins, square_sum_bins


def torch_operations_sums(values: torch.Tensor) -> torch.Tensor:
    """The bins of ``values`` by the torch operations that CUDA compiles, run eagerly, in calls of at
    most four rows of ``ROW_ELEMENTS``."""
    partials = square_sum._row_partials([values], square_sum._torch_digit_sums, 4)
    return square_sum._carry(square_sum._added_partials(partials, values.device))


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
    assert torch.equal(square_sum._carry(ranks[0] + ranks[1]), whole)
    monkeypatch.setattr(square_sum, "TORCH_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(square_sum, "COMPILED_CHUNK_ELEMENTS", 4 * square_sum.ROW_ELEMENTS)
    monkeypatch.setattr(square_sum, "PARALLEL_ELEMENTS", 100)
    assert torch.equal(square_sum_bins([values], device), whole)
    assert norm_from_bins(whole.cpu()) == exact_norm(values.cpu())


def special_values(generator: torch.Generator, numel: int) -> torch.Tensor:
    """mixed_values with infinities and NaNs in a few of its 1024-element blocks."""
    values = mixed_values(generator, numel)
    values[5] = math.inf
    values[2100] = -math.inf
    values[2101] = math.nan
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [mixed_values, special_values])
def test_the_c_kernel_and_the_torch_operations_give_the_same_sums(monkeypatch, dtype, make):
    """The CPU kernel against the torch operations over every digit (what CUDA compiles) and over the
    digits each chunk reaches (a CPU without a compiler), over blocks, threads and splits."""
    assert square_sum._cpu_kernel() is not None
    generator = torch.Generator().manual_seed(5)
    values = make(generator, 5000).to(dtype)
    monkeypatch.setattr(square_sum, "PARALLEL_ELEMENTS", 1000)
    kernel = square_sum_bins([values[:1500], values[1500:]], torch.device("cpu"))
    full_range = torch_operations_sums(values.flip(0))
    monkeypatch.setattr(square_sum, "_cpu_kernel", lambda: None)
    monkeypatch.setattr(square_sum, "TORCH_CHUNK_ELEMENTS", 1024)
    eager = square_sum_bins([values.flip(0)], torch.device("cpu"))
    assert torch.equal(kernel, full_range) and torch.equal(kernel, eager)
    norm = norm_from_bins(kernel)
    if values.isnan().any():
        assert math.isnan(norm)
    else:
        assert norm == (math.inf if values.isinf().any() else exact_norm(values.float()))
    finite = values[values.isfinite()]
    assert norm_from_bins(square_sum_bins([finite], torch.device("cpu"))) == exact_norm(finite.float())


def test_without_a_compiler_the_torch_operations_take_over(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    square_sum._cpu_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="CC='no-such-compiler'"):
            assert square_sum._cpu_kernel() is None
        values = torch.randn(300, generator=torch.Generator().manual_seed(6))
        assert norm_from_bins(square_sum_bins([values], torch.device("cpu"))) == exact_norm(values)
    finally:
        square_sum._cpu_kernel.cache_clear()


def test_without_triton_cuda_runs_the_digit_sums_eagerly(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "triton" else find_spec(name, *args))
    square_sum._compiled_digit_sums.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Triton is not installed"):
            assert square_sum._compiled_digit_sums() == (square_sum._windowed_digit_sums, square_sum._torch_digit_sums)
    finally:
        square_sum._compiled_digit_sums.cache_clear()


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


def test_gradients_back_to_back_in_one_buffer_are_summed_as_one_tensor():
    buffer = torch.arange(40, dtype=torch.float32)
    views = [buffer[0:10].view(2, 5), buffer[10:16], buffer[16:16], buffer[16:30]]
    runs = square_sum._contiguous_runs(views)
    assert len(runs) == 1 and runs[0].data_ptr() == buffer.data_ptr() and torch.equal(runs[0], buffer[:30])
    apart = square_sum._contiguous_runs([buffer[0:10], buffer[12:20], buffer[20:30].bfloat16(), buffer[30:40:2]])
    assert sorted(run.numel() for run in apart) == [5, 8, 10, 10]
    reversed_order = square_sum._contiguous_runs([buffer[20:30], buffer[10:20], buffer[0:10]])
    assert len(reversed_order) == 1 and torch.equal(reversed_order[0], buffer[:30])


def test_the_largest_values_in_every_row_stay_exact():
    """Every value the largest finite float32, or the largest of one digit: the bounds of the row sums
    (below 2^56) and their carries, summed over many rows."""
    largest = torch.full((5 * square_sum.ROW_ELEMENTS + 3,), 3.4028234663852886e38)
    digit_top = torch.full((3 * square_sum.ROW_ELEMENTS,), float.fromhex("0x1.fffffep-130"))
    for values in (largest, digit_top, torch.cat((largest, -digit_top))):
        exact = sum(int(x * x * 2.0**square_sum.SCALE_EXPONENT) for x in values.double().tolist())
        sums = torch_operations_sums(values).tolist()
        assert sum(digit << (square_sum.DIGIT_BITS * index) for index, digit in enumerate(sums[: square_sum.DIGITS])) == exact
        assert norm_from_bins(square_sum_bins([values], torch.device("cpu"))) == exact_norm(values)


def test_many_partial_sums_are_carried_before_they_could_overflow(monkeypatch):
    """Without the C kernel, each chunk's sums are a partial of their own; carried every
    ``PARTIALS_PER_CARRY`` of them, the same bins as the C kernel's."""
    values = mixed_values(torch.Generator().manual_seed(7), 3000)
    kernel = square_sum_bins([values[:1000], values[1000:]], torch.device("cpu"))
    monkeypatch.setattr(square_sum, "_cpu_kernel", lambda: None)
    monkeypatch.setattr(square_sum, "TORCH_CHUNK_ELEMENTS", 100)
    monkeypatch.setattr(square_sum, "PARTIALS_PER_CARRY", 3)
    assert torch.equal(square_sum_bins([values[:1000], values[1000:]], torch.device("cpu")), kernel)



def blocks_of_binades(lowest: int, span: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Two 1024-value blocks of ``dtype`` (signed; zeros among them) whose biased exponents fill
    [lowest, lowest + span], each block holding both ends with an all-ones significand (0 is subnormal;
    bfloat16's values truncated from float32's)."""
    exponents = torch.randint(lowest, lowest + span + 1, (2048,), generator=generator)
    significands = torch.randint(0, 1 << 23, (2048,), generator=generator)
    for end in (0, 1024):
        exponents[end : end + 2] = torch.tensor([lowest, lowest + span])
        significands[end : end + 2] = (1 << 23) - 1
    signs = torch.randint(0, 2, (2048,), generator=generator) << 31
    bits = (signs | (exponents << 23) | significands) & (-1 << (16 if dtype == torch.bfloat16 else 0))
    values = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    values[100:110] = 0.0
    return values.to(dtype)


@pytest.fixture(scope="module")
def kernels_without_ifma():
    """The C kernel built without AVX-512 IFMA on x86 (its two-digit and digit-by-digit paths only)."""
    default = square_sum.COMPILER_FLAGS
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    square_sum.COMPILER_FLAGS = (*default, "-mno-avx512ifma") if x86 else default
    square_sum._cpu_kernel.cache_clear()
    try:
        yield square_sum._cpu_kernel()
    finally:
        square_sum.COMPILER_FLAGS = default
        square_sum._cpu_kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("place", ["subnormal", "normal", "middle", "top"])
@pytest.mark.parametrize("span", [0, 16, 17, 28, 29, 44, 45])
def test_blocks_at_the_edges_of_the_kernels_paths_are_exact(dtype, place, span, kernels_without_ifma):
    """Blocks whose exponents span exactly the C kernel's path bounds (16 binades for two 40-bit
    digits; 28 for float32 and 44 for bfloat16 in the 52-bit products), or one more, at the
    subnormals, the middle and the top of the range: Python's integer sums, in any split or order,
    and from the kernel built without the 52-bit products."""
    lowest = {"subnormal": 0, "normal": 1, "middle": 120, "top": 254 - span}[place]
    values = blocks_of_binades(lowest, span, dtype, torch.Generator().manual_seed(lowest * 100 + span))
    exact = sum(int(Fraction(x) ** 2 * 2**square_sum.SCALE_EXPONENT) for x in values.double().tolist())
    portable = torch.zeros(square_sum.DIGITS + 2, dtype=torch.int64)
    kernels_without_ifma[dtype](values.data_ptr(), values.numel(), portable.data_ptr())
    splits = ([values], [values[:1111], values[1111:]], [values.flip(0)])
    for sums in [portable.tolist()] + [square_sum_bins(split, torch.device("cpu")).tolist() for split in splits]:
        assert sum(digit << (square_sum.DIGIT_BITS * index) for index, digit in enumerate(sums[: square_sum.DIGITS])) == exact


EAGER_CUDA_DIGIT_SUMS = (square_sum._windowed_digit_sums, square_sum._torch_digit_sums)


@pytest.mark.parametrize("binade", [-140, -20, 0, 60, 120])
def test_rows_whose_values_span_less_than_2_to_the_40_stay_in_their_window(binade):
    """Gradient-like rows (normal values over 2^±12, zeros, one row of zeros only) of any binade,
    FP32 and BF16: the windowed digit sums count no escape and are the C kernel's sums."""
    generator = torch.Generator().manual_seed(11)
    values = torch.randn(8 * square_sum.ROW_ELEMENTS + 77, generator=generator)
    values = (values * torch.exp2(torch.randint(-12, 13, values.shape, generator=generator).float() + binade)).float()
    values[::13] = 0.0
    values[square_sum.ROW_ELEMENTS : 2 * square_sum.ROW_ELEMENTS] = 0.0
    for run in (values, values.bfloat16()):
        partials = square_sum._row_partials([run], square_sum._windowed_digit_sums, 4)
        sums = square_sum._carry(square_sum._added_partials(partials, run.device))
        assert int(sums[square_sum.ESCAPED]) == 0
        assert torch.equal(sums[: square_sum.ESCAPED], square_sum_bins([run], torch.device("cpu")))


def test_a_value_far_below_its_rows_largest_escapes_and_every_digit_is_summed_again():
    """One value 2^60 below its row's largest escapes the window: the CUDA path's sums are then
    every digit's (the C kernel's), and the norm is still the exactly rounded one."""
    generator = torch.Generator().manual_seed(12)
    values = torch.randn(4 * square_sum.ROW_ELEMENTS, generator=generator)
    values[700] = float(values[700:1024].abs().max()) * 2.0**-60
    partials = square_sum._row_partials([values], square_sum._windowed_digit_sums, 4)
    assert int(square_sum._added_partials(partials, values.device)[square_sum.ESCAPED]) == 1
    sums = square_sum._carry(square_sum._cuda_digit_sums([values], EAGER_CUDA_DIGIT_SUMS))
    assert torch.equal(sums, square_sum_bins([values], torch.device("cpu")))
    assert norm_from_bins(sums) == exact_norm(values)


@pytest.mark.parametrize("digit_sums_function", EAGER_CUDA_DIGIT_SUMS, ids=["windowed", "every_digit"])
def test_every_call_takes_two_rows_or_more_so_one_graph_per_dtype_serves_every_gradient(digit_sums_function):
    """Gradients of any length (one value, part of a row, whole rows, rows and a part), FP32 and BF16,
    as the compiled calls take them: each call two rows or more, at most ``max_rows``; torch.compile
    traces no graph for a size (row counts 0 and 1 would each be one), only per dtype and storage
    offset (0, as the padded last rows have, or more), and the sums are the C kernel's (for the
    windowed sums, of gradient-like values that stay in their windows)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(digit_sums_function, dynamic=True, fullgraph=True, backend=counter)
    shapes = []

    def digit_sums(values):
        shapes.append((values.numel() // square_sum.ROW_ELEMENTS, values.numel() % square_sum.ROW_ELEMENTS))
        return compiled(values)

    windowed = digit_sums_function is square_sum._windowed_digit_sums
    generator = torch.Generator().manual_seed(8)
    buffer = torch.randn(40000, generator=generator) if windowed else mixed_values(generator, 40000)
    runs = [buffer[:1], buffer[1:3], buffer[3:514], buffer[514:1026], buffer[1026:2050], buffer[2050:3075],
            buffer[3075:9000], buffer[9000:].bfloat16()]
    partials = square_sum._row_partials(runs, digit_sums, max_rows=8)
    assert all(2 <= rows <= 8 and rest == 0 for rows, rest in shapes)
    assert counter.frame_count <= 4
    expected = square_sum_bins(runs, torch.device("cpu"))
    sums = square_sum._carry(square_sum._added_partials(partials, torch.device("cpu")))
    if windowed:
        assert int(sums[square_sum.ESCAPED]) == 0
        sums = sums[: square_sum.ESCAPED]
    assert torch.equal(sums, expected)
