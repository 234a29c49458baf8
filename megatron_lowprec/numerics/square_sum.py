"""Exact sums of squares, for a gradient norm that does not depend on how the elements are split.

A finite float32 value is ``s · 2^(e - 150)`` with an integer significand ``s < 2^24`` and ``e`` its
biased exponent (1 for subnormals), so ``u = x² · 2^298 = s² · 2^(2e - 2)`` is an integer below
``2^556``, exact in float64. :func:`square_sum_bins` adds the 40-bit digits of ``u`` over all the
elements into int64 sums, one per digit: digit ``d`` of one value is
``floor(u / 2^(40d)) - 2^40 · floor(u / 2^(40(d + 1)))``, exact in float64. Integer sums are exact,
so the digit sums (carried into canonical digits), and the norm,
are the same bits whatever the order of the elements, their grouping into tensors, or the ranks and
shards holding them (the sums of several ranks add up with one integer all-reduce).
:func:`norm_from_bins` turns them into ``sqrt(Σ x²)``: the exact sum rounded once to float64, then
its square root. 16-bit values are converted to float32 exactly first.

On the CPU the digits are computed by a small C kernel (``square_sum.c``), compiled with the system's
C compiler at first use and cached, in one pass over each gradient that visits only the digits its
block of values can reach (with AVX-512 IFMA, a block whose exponents span at most 28 binades, 44 in
BF16, is summed as the low and high 52 bits of each integer significand's square); on CUDA by integer torch operations that Inductor compiles into one
kernel reading each value once, then a few over its rows' sums: one call per run of gradients that
lie back to back in memory, and one for the runs' partial last rows (:func:`_row_partials`). Each
row of 512 values sums into the few digits around its largest value's (:func:`_windowed_digit_sums`),
and only where a value lies far below that, into every digit (:func:`_torch_digit_sums`); on a CPU
without a compiler by float64 torch operations, eagerly. All compute the same integers, so all give
the same bits.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_lowprec.numerics import inductor

DIGITS = 15
"""40-bit digits: ``x² · 2^298`` is below 2^556 for finite float32 ``x``, and the last digit takes
what a sum carries beyond."""

DIGIT_BITS = 40
SCALE_EXPONENT = 298
"""``x² · 2^298`` is an integer for every float32 ``x``."""

NON_FINITE = DIGITS
"""Index of the count of infinite and NaN values in the sums."""

NAN = DIGITS + 1
"""Index of the count of NaNs in the sums."""

ESCAPED = DIGITS + 2
"""Index, in :func:`_windowed_digit_sums`'s sums, of the count of values outside their row's window."""

WINDOW_DIGITS = 3
"""Digits at and below a row's highest that :func:`_windowed_digit_sums` sums into (and one above):
gradients whose values in a row of ``ROW_ELEMENTS`` span less than 2^40 in magnitude stay inside."""

TORCH_CHUNK_ELEMENTS = 1 << 18
"""Elements per call of the eager torch operations (a CPU without a compiler, CUDA without Triton):
bounds their temporaries."""

ROW_ELEMENTS = 512
"""Values per row of the CUDA digit sums: Inductor reduces a row of this many values at once in
registers (a persistent reduction), and a row's digit sums stay below 2^56."""

COMPILED_CHUNK_ELEMENTS = 1 << 31
"""Most values per call of the CUDA digit sums: its rows' carried sums (each below 2^40 + 2^16)
add up below 2^63. At least four rows."""

PARTIALS_PER_CARRY = 1 << 20
"""Calls' results (each digit below 2^41) added up before a carry: their sum stays below 2^63."""

RECOMPILE_LIMIT = 16
"""Dynamo's recompile limit around the compiled digit sums' calls (at least this): :func:`_row_partials`
makes one graph per gradient dtype (FP32, BF16, FP16) and storage offset (Dynamo specializes offsets
0 and 1), at most 9."""

COMPILE_OPTIONS = {"realize_opcount_threshold": 1 << 16}
"""Inductor otherwise stores a value's digit parts to memory after about 30 operations and reads them
back in a second kernel; with this, every digit is computed from the one load of a value."""

PARALLEL_ELEMENTS = 1 << 18
"""A CPU tensor at least this long is split over ``torch.get_num_threads()`` threads."""

KERNEL_SOURCE = Path(__file__).with_name("square_sum.c")
COMPILER_FLAGS = (
    "-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
    *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()),
)
"""``-fno-trapping-math`` lets the compiler vectorize ``floor``. Every floating-point operation of the
kernel is exact (its products included, so contracting one into an FMA changes nothing), and its sums
are integer sums: no flag or vectorization changes its results."""


def square_sum_bins(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ x² over ``tensors`` as an int64 tensor of ``DIGITS + 2`` sums on ``device``: entry ``d <
    DIGITS`` the sum of the 40-bit digits ``d`` of every ``x² · 2^298``, carried so that every entry
    but the last digit is below 2^40 (one value has one such form), then the count of non-finite
    values and of NaNs among them."""
    thread_sums = torch.zeros(torch.get_num_threads(), DIGITS + 2, dtype=torch.int64)
    partials, cuda_runs = [], []
    for flat in _contiguous_runs(tensors):
        if flat.device.type == "cpu" and _cpu_kernel() is not None:
            _add_cpu_digit_sums(flat, thread_sums)
        elif flat.is_cuda:
            cuda_runs.append(flat)
        else:
            chunks = range(0, flat.numel(), TORCH_CHUNK_ELEMENTS)
            partials += [_eager_digit_sums(flat[start : start + TORCH_CHUNK_ELEMENTS]) for start in chunks]
    if cuda_runs:
        partials.append(_cuda_digit_sums(cuda_runs, _compiled_digit_sums()))
    host = torch.tensor(_carried(thread_sums.sum(dim=0).tolist()), dtype=torch.int64)
    if not partials:
        return host.to(device)
    return _carry(_added_partials(partials, device) + host.to(device))


def _added_partials(partials: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The calls' partial sums (each digit below 2^41) added up on ``device``, carried partially every
    ``PARTIALS_PER_CARRY`` of them (:func:`_carry` makes the result canonical)."""
    sums = torch.zeros(len(partials[0]) if partials else DIGITS + 2, dtype=torch.int64, device=device)
    for start in range(0, len(partials), PARTIALS_PER_CARRY):
        sums = _partial_carry(sums + torch.stack(partials[start : start + PARTIALS_PER_CARRY]).to(device).sum(dim=0))
    return sums


def _contiguous_runs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` flattened, in the order of their places in memory, with those that lie back to
    back in one storage (the parameters' gradients in a megatron gradient buffer, which holds them
    in reverse order) joined into one view each: a sum over fewer, longer tensors, the same
    integers."""
    flats = [tensor.detach().reshape(-1) for tensor in tensors if tensor.numel()]
    flats.sort(key=lambda flat: (flat.untyped_storage().data_ptr(), flat.storage_offset()))
    runs: list[torch.Tensor] = []
    end = None
    for flat in flats:
        start = (flat.untyped_storage().data_ptr(), flat.dtype, flat.device, flat.storage_offset())
        if flat.is_contiguous() and end == start:
            runs[-1] = runs[-1].as_strided((runs[-1].numel() + flat.numel(),), (1,))
        else:
            runs.append(flat)
        end = (*start[:3], flat.storage_offset() + flat.numel()) if flat.is_contiguous() else None
    return runs


def _row_partials(
    runs: list[torch.Tensor], digit_sums: Callable[[torch.Tensor], torch.Tensor], max_rows: int
) -> list[torch.Tensor]:
    """``digit_sums`` (:func:`_windowed_digit_sums` or :func:`_torch_digit_sums`, compiled or not) of
    ``runs`` of one device, as rows of ``ROW_ELEMENTS`` values: each run's whole rows as one view, in
    near-equal pieces of at most ``max_rows`` rows (at least 4), then the runs' last, partial rows and
    the runs shorter than two rows together, in float32 (exact), zero-padded to whole rows. Every
    call takes two rows or more of one dtype, so that no size makes a compiled graph of its own
    (:data:`RECOMPILE_LIMIT`)."""
    partials, leftovers = [], []
    for run in runs:
        rows = run.numel() // ROW_ELEMENTS if run.numel() >= 2 * ROW_ELEMENTS else 0
        if rows:
            whole = run[: rows * ROW_ELEMENTS].view(rows, ROW_ELEMENTS)
            partials += [digit_sums(piece.reshape(-1)) for piece in whole.tensor_split(-(-rows // max_rows))]
        if run.numel() > rows * ROW_ELEMENTS:
            leftovers.append(run[rows * ROW_ELEMENTS :].float())
    if leftovers:
        rest = torch.cat(leftovers)
        rows = max(2, -(-rest.numel() // ROW_ELEMENTS))
        rest = torch.nn.functional.pad(rest, (0, rows * ROW_ELEMENTS - rest.numel())).view(rows, ROW_ELEMENTS)
        partials += [digit_sums(piece.reshape(-1)) for piece in rest.tensor_split(-(-rows // max_rows))]
    return partials


def _digit_parts(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per value of ``values`` as rows of ``ROW_ELEMENTS`` (float32 bits): its magnitude bits, whether
    it is finite, its digit ``p // 40`` and the two parts of ``u = s² · 2^p`` (``s`` the significand,
    ``p`` twice the biased exponent less 2; 0 for a non-finite value): ``s²``'s low ``40 - p mod 40``
    bits, shifted, which are digit ``p // 40``, and the rest, ``s² >> (40 - p mod 40)`` (below
    2^47), which adds to digit ``p // 40 + 1``."""
    magnitude = values.float().view(-1, ROW_ELEMENTS).view(torch.int32) & 0x7FFFFFFF
    finite = magnitude < 0x7F800000
    exponent = magnitude >> 23
    significand = torch.where(exponent > 0, (magnitude & 0x7FFFFF) | 0x800000, magnitude).to(torch.int64)
    square = torch.where(finite, significand * significand, 0)
    position = 2 * exponent.clamp(min=1) - 2
    digit = position // DIGIT_BITS
    low_bits = DIGIT_BITS - (position - DIGIT_BITS * digit).to(torch.int64)
    rest = square >> low_bits
    low = (square - (rest << low_bits)) << (DIGIT_BITS - low_bits)
    return magnitude, finite, square, digit, low, rest


def _carried_rows(row_sums: torch.Tensor) -> torch.Tensor:
    """Rows' sums [rows, entries] carried, added up and carried again."""
    return _partial_carry(_partial_carry(row_sums).sum(dim=0))


def _torch_digit_sums(values: torch.Tensor) -> torch.Tensor:
    """The digit sums and counts of whole rows of ``ROW_ELEMENTS`` values (converted to float32; at
    most ``COMPILED_CHUNK_ELEMENTS``), carried so that every digit is below 2^41, in integer torch
    operations that Inductor compiles into one pass over ``values`` (CUDA; the row length a
    constant, so that each row is reduced at once): every digit of every value (:func:`_digit_parts`),
    summed per row in registers, then the rows' sums carried and added up. The digits are canonical
    after the carries."""
    magnitude, finite, _, digit, low, rest = _digit_parts(values)
    row_sums = [
        torch.where(digit == index, low, torch.where(digit == index - 1, rest, 0)).sum(dim=1) for index in range(DIGITS - 1)
    ]
    counts = [torch.zeros_like(row_sums[0]), (~finite).sum(dim=1), (magnitude > 0x7F800000).sum(dim=1)]
    return _carried_rows(torch.stack(row_sums + counts, dim=1))


def _windowed_digit_sums(values: torch.Tensor) -> torch.Tensor:
    """:func:`_torch_digit_sums` in a window of each row's digits, and the count of values outside it
    (index :data:`ESCAPED`; the sums are only those of the whole rows where it is 0). A row takes
    the highest digit of its nonzero finite values, ``top``, and sums only into the digits ``top + 1``
    down to ``top - WINDOW_DIGITS + 1``: ``WINDOW_DIGITS + 1`` accumulators per value instead of
    ``DIGITS - 1``. A value whose digit lies ``WINDOW_DIGITS`` or more below ``top`` (its square
    about 2^80 times smaller than the row's largest, or less) escapes the window. The window's sums
    are then put at their digits once per row."""
    magnitude, finite, square, digit, low, rest = _digit_parts(values)
    counted = square > 0
    top = torch.where(counted, digit, 0).amax(dim=1, keepdim=True)
    below = top - digit
    window = range(-1, WINDOW_DIGITS)
    slots = [torch.where(below == slot, low, torch.where(below == slot + 1, rest, 0)).sum(dim=1) for slot in window]
    index = torch.arange(DIGITS - 1, device=values.device)
    placed = sum(torch.where(index == top - slot, sums.unsqueeze(1), 0) for slot, sums in zip(window, slots))
    escaped = (counted & (below >= WINDOW_DIGITS)).sum(dim=1)
    counts = [torch.zeros_like(escaped), (~finite).sum(dim=1), (magnitude > 0x7F800000).sum(dim=1), escaped]
    return _carried_rows(torch.cat((placed, torch.stack(counts, dim=1)), dim=1))


def _eager_digit_sums(values: torch.Tensor) -> torch.Tensor:
    """The digit sums and counts of at most ``TORCH_CHUNK_ELEMENTS`` values, carried as
    :func:`_torch_digit_sums` carries them, in float64 torch operations run eagerly over the digits
    that ``values`` reach alone (their largest and smallest nonzero finite magnitudes bound them): a
    CPU without a C compiler."""
    values = values.float()
    magnitude = values.view(torch.int32) & 0x7FFFFFFF
    finite = magnitude < 0x7F800000
    counts = torch.stack(((~finite).sum(), (magnitude > 0x7F800000).sum()))
    sums = torch.zeros(DIGITS, dtype=torch.int64, device=values.device)
    nonzero = finite & (magnitude > 0)
    if not bool(nonzero.any()):
        return torch.cat((sums, counts))
    highest = int(torch.where(finite, magnitude, 0).max()) >> 23
    lowest = int(torch.where(nonzero, magnitude, 0x7F7FFFFF).min()) >> 23
    first, last = (2 * max(lowest, 1) - 2) // DIGIT_BITS, (2 * max(highest, 1) + 45) // DIGIT_BITS
    rest = torch.where(finite, values.double().square() * 2.0 ** (SCALE_EXPONENT - DIGIT_BITS * first), 0.0)
    for digit in range(first, last + 1):
        upper = torch.floor(rest * 2.0**-DIGIT_BITS)
        sums[digit] = (rest - upper * 2.0**DIGIT_BITS).to(torch.int64).sum()
        rest = upper
    return _partial_carry(torch.cat((sums, counts)))


@functools.cache
def _compiled_digit_sums() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """:func:`_windowed_digit_sums` and :func:`_torch_digit_sums` compiled (CUDA): each one kernel that
    reads each value once (audited by ``tools/kernel_audit``), for any number of rows, one compilation
    per dtype and storage offset (:data:`RECOMPILE_LIMIT`); run eagerly (on ``TORCH_CHUNK_ELEMENTS``
    values at a time), with a warning, where Triton is not installed or outside the torch and triton
    versions the package's compiler internals were written for."""
    if importlib.util.find_spec("triton") is None:
        warnings.warn("Triton is not installed: the exact gradient norm's digit sums run eagerly on CUDA "
                      "(the same bits, about 100 kernels per 256K values instead of 5 per gradient)", stacklevel=3)
        return _windowed_digit_sums, _torch_digit_sums
    unsupported = inductor.unsupported_reason("cuda")
    if unsupported is not None:
        inductor.warn_unsupported(unsupported)
        return _windowed_digit_sums, _torch_digit_sums
    return tuple(
        inductor.compile_scoped(function, COMPILE_OPTIONS, recompile_limit=RECOMPILE_LIMIT)
        for function in (_windowed_digit_sums, _torch_digit_sums)
    )


def _cuda_digit_sums(
    runs: list[torch.Tensor], digit_sums: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
) -> torch.Tensor:
    """The digit sums and counts of ``runs`` (one device), each digit below 2^41: by the windowed
    digit sums (the first of ``digit_sums``, :func:`_windowed_digit_sums` compiled or not), and, where
    a value escaped its row's window, again by every digit (the second, :func:`_torch_digit_sums`).
    Reading the escape count costs one host synchronisation."""
    windowed, every_digit = digit_sums
    max_rows = (TORCH_CHUNK_ELEMENTS if windowed is _windowed_digit_sums else COMPILED_CHUNK_ELEMENTS) // ROW_ELEMENTS
    sums = _added_partials(_row_partials(runs, windowed, max_rows), runs[0].device)
    if int(sums[ESCAPED]) == 0:
        return sums[:ESCAPED]
    return _added_partials(_row_partials(runs, every_digit, max_rows), runs[0].device)


def _add_cpu_digit_sums(flat: torch.Tensor, thread_sums: torch.Tensor) -> None:
    """Adds the digit sums and counts of one CPU tensor to ``thread_sums`` (one row per thread) with
    the C kernel, which leaves every digit of a row but the last below 2^40."""
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    flat = flat.contiguous()
    kernel = _cpu_kernel()[flat.dtype]
    threads = len(thread_sums) if flat.numel() >= PARALLEL_ELEMENTS else 1
    parts = flat.tensor_split(threads)

    def run(index: int) -> None:
        kernel(parts[index].data_ptr(), parts[index].numel(), thread_sums[index].data_ptr())

    if threads == 1:
        run(0)
    else:
        list(_thread_pool(threads).map(run, range(threads)))


@functools.cache
def _thread_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="square-sum")


def _partial_carry(sums: torch.Tensor) -> torch.Tensor:
    """The same values (along the last dimension) with every digit but the last below 2^40 plus the
    carry of one digit (so that adding another pass's sums cannot overflow), the counts unchanged:
    pointwise, so that Inductor fuses it into the kernels around it."""
    index = torch.arange(sums.shape[-1], device=sums.device)
    carries = index < DIGITS - 1
    low = torch.where(carries, sums & ((1 << DIGIT_BITS) - 1), sums)
    high = torch.where(carries, sums >> DIGIT_BITS, 0)
    return low + torch.nn.functional.pad(high[..., :-1], (1, 0))


def _carried(sums: list[int]) -> list[int]:
    """:func:`_carry` of sums held by the host, in Python integers (on a handful of values, tensor
    operations cost as much as a kernel over a million)."""
    sums = list(sums)
    for digit in range(DIGITS - 1):
        sums[digit + 1] += sums[digit] >> DIGIT_BITS
        sums[digit] &= (1 << DIGIT_BITS) - 1
    return sums


def _carry(sums: torch.Tensor) -> torch.Tensor:
    """The same value with every digit but the last below 2^40 (the counts unchanged), on the
    tensor's device (no host synchronisation)."""
    sums = sums.clone()
    for digit in range(DIGITS - 1):
        sums[digit + 1] += sums[digit] >> DIGIT_BITS
        sums[digit] &= (1 << DIGIT_BITS) - 1
    return sums


@functools.cache
def _cpu_kernel() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    """The C kernel's functions by input dtype, compiled at first use into the user's cache (keyed
    by its source, the compiler, its flags and the CPU's features; the temporary directory where the
    cache is not writable); ``None``, with a warning, where it cannot be compiled (the eager torch
    operations then compute the same sums, much slower)."""
    compiler = os.environ.get("CC", "cc")
    source = KERNEL_SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(COMPILER_FLAGS).encode(),
                                     _cpu_features().encode()])).hexdigest()[:24]
    caches = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron_lowprec",
              Path(tempfile.gettempdir()) / f"megatron_lowprec-{os.getuid() if hasattr(os, 'getuid') else 0}")
    libraries = [cache / f"square_sum-{key}.so" for cache in caches]
    library = next((library for library in libraries if library.exists()), None)
    errors = []
    for candidate in libraries if library is None else ():
        try:
            _compile(compiler, candidate)
            library = candidate
            break
        except (OSError, subprocess.CalledProcessError) as error:
            errors.append(error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error))
    if library is None:
        warnings.warn(f"the exact gradient norm's C kernel did not compile with CC={compiler!r} ({errors[-1]}); "
                      "torch operations compute the same bits instead, much slower", stacklevel=3)
        return None
    functions = ctypes.CDLL(str(library))
    kernels = {}
    for dtype, name in ((torch.float32, "square_sum_float32"), (torch.bfloat16, "square_sum_bfloat16")):
        function = getattr(functions, name)
        function.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
        function.restype = None
        kernels[dtype] = function
    return kernels


def _compile(compiler: str, library: Path) -> None:
    """Compiles the kernel into ``library``, atomically (concurrent processes may race)."""
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as directory:
        built = Path(directory) / library.name
        subprocess.run([compiler, *COMPILER_FLAGS, "-o", str(built), str(KERNEL_SOURCE), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(built, library)


def _cpu_features() -> str:
    """What ``-march=native`` depends on: the CPU's flags on Linux, its name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def norm_from_bins(bins: torch.Tensor) -> float:
    """``sqrt(Σ x²)`` of :func:`square_sum_bins` (summed over ranks where needed): the exact sum
    rounded once to float64, then its square root. ``inf`` if a value was infinite, NaN if one was NaN."""
    sums = bins.tolist()
    if sums[NON_FINITE]:
        return math.nan if sums[NAN] else math.inf
    total = sum(digit << (DIGIT_BITS * index) for index, digit in enumerate(sums[:DIGITS]))
    return math.ldexp(math.sqrt(float(total)), -SCALE_EXPONENT // 2)
