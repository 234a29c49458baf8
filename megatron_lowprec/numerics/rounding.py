"""Stochastic rounding by dithering, and the random 32-bit words that drive it.

Stochastic rounding (stochastic_rounding.md, eq. 2) rounds x up to the next value of the format with
probability (x - floor(x)) / ulp and down otherwise, so E[Q_SR(x)] = x. It is implemented by
dithering (ibid., section 3): add a uniform random integer to the bits that the format discards,
then drop them.

Two sources of words: ``generator_random_bits`` draws from a torch.Generator; ``counter_random_bits``
is stateless, a hash of (seed, step, stream, global element index), so that every replica and every
shard of an element draws the same word whatever the sharding (the shared randomness of Algorithm 1,
lines 9-11). A :class:`StreamLayout` says where a tensor's elements sit in their stream: a whole
tensor, or a shard of one split along any dimension (tensor parallelism), so that an element's word
is the same at every parallel layout.

Every rounding here is integer arithmetic on the float32 bit pattern (``formats._round_with_increment``)
and every word is integer arithmetic, with no float round trip through a 16-bit dtype: no compiler
pass can remove or reorder any of it, so compiled code (Inductor's C++ or Triton) draws and rounds
exactly as eager code does.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass

import numpy
import torch

from megatron_lowprec.numerics.formats import FloatFormat, _round_with_increment, float_format

_WORD_MASK = 0xFFFFFFFF
_INT32_MIN = -(2**31)
INT32_GRID_MAX_ROW = 2**31 - 1
"""The longest row whose columns :func:`grid_random_bits` counts in int32."""
_UINT64_MASK = 2**64 - 1
_LOWBIAS32_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_SPLITMIX64_INCREMENT = 0x9E3779B97F4A7C15
_SPLITMIX64_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def stochastic_round(
    x: torch.Tensor, fmt: str | FloatFormat, random_bits: torch.Tensor, *, saturate: bool = False
) -> torch.Tensor:
    """Stochastically round float32 (or bfloat16/float16) values to ``fmt``; float32 result of exact fmt values.

    Let s be the number of low bits of the magnitude that ``fmt`` discards at x: 23 - m in the normal
    range of ``fmt``, more below its min_normal (gradual underflow). The dither is the low s bits of
    the element's word in ``random_bits`` (int32 or int64, x's shape, uniform 32-bit words; bits above
    the 32nd are ignored). It is added to the discarded bits and the carry, if any, rounds up, so
    P(round up) = (|x| - floor|x|) / ulp exactly. When s > 32 (deep underflow) the dither is the whole
    word, added to the 32 most significant discarded bits, the rest being truncated: P(round up) is
    then exact to 2^-32. Zeros, exact values, NaN and overflow behave as in ``round_to_format``.
    """
    if random_bits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"random_bits must be int32 or int64, got {random_bits.dtype}")
    if random_bits.shape != x.shape:
        raise ValueError(f"random_bits has shape {tuple(random_bits.shape)}, x has {tuple(x.shape)}; they must match")

    def dither(kept_is_odd: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        return (random_bits & ((1 << shift) - 1)).to(kept_is_odd.dtype)

    return _round_with_increment(x, float_format(fmt), dither, saturate=saturate)


def generator_random_bits(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Uniform 32-bit words (int32, two's complement) drawn from ``generator``, on its device by default."""
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(-(2**31), 2**31, tuple(shape), generator=generator, dtype=torch.int32, device=device)


def counter_random_bits(seed: int, step: int, index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """The uniform 32-bit word (int32, two's complement) of each global element ``index`` of ``stream``
    at ``step`` under ``seed``.

    Stateless and counter-based: the word depends on (seed, step, stream, index) only. Three round keys
    k0, k1, k2 are derived from (seed, stream, step) by SplitMix64 (Steele, Lea & Flood 2014) in Python integers
    (:func:`counter_round_keys`); each element then takes h = f(f(f(hi ^ k0) ^ lo ^ k1) ^ k2)
    (:func:`keyed_random_bits`), where (hi, lo) are the 32-bit halves of the index and f is Wellons'
    "lowbias32" integer hash (hash-prospector), a bijection of 32-bit words. seed, stream, step and
    index are taken mod 2^64.
    """
    return keyed_random_bits(counter_round_keys(seed, step, stream), index)


def keyed_random_bits(keys: tuple[int | torch.Tensor, int | torch.Tensor, int | torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """The words of :func:`counter_random_bits` from precomputed round keys: Python ints (taken mod
    2^32), or 0-d int32 tensors holding them in two's complement (:func:`signed_word`), so that a
    compiled kernel need not be specialised on the step."""
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    index = index.to(torch.int64)
    return hash_words(keys, (index >> 32).to(torch.int32), (index & _WORD_MASK).to(torch.int32))


def grid_random_bits(keys, offset, row_stride, rows: int, row_length: int, device=None) -> torch.Tensor:
    """``keyed_random_bits(keys, grid_index(offset, row_stride, rows, row_length))`` (shape [rows,
    row_length]) with int32 arithmetic per element (:func:`row_start_words`, :func:`row_random_bits`).
    Vector units without 64-bit lanes (AVX2 multiplies and shifts them one by one) run it several
    times faster than the int64 grid. Rows longer than :data:`INT32_GRID_MAX_ROW` use the int64 grid."""
    if row_length > INT32_GRID_MAX_ROW:
        return keyed_random_bits(keys, grid_index(offset, row_stride, rows, row_length, device))
    return row_random_bits(keys, *row_start_words(offset, row_stride, rows, device), row_length)


def row_start_words(offset, row_stride, rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 64-bit global index ``offset + r * row_stride`` of each row's start (r < rows) as its high
    and low 32-bit words (int32, two's complement; shape [rows, 1]). Computed once per stream layout
    outside compiled code, so that a compiled step sees no 64-bit integer: Triton refused the
    step that computed these in int64 ("Cannot bitcast data-type of size 64 to data-type of size 32")."""
    row_start = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1) * row_stride + offset
    return (row_start >> 32).to(torch.int32), (row_start & _WORD_MASK).to(torch.int32)


def row_random_bits(keys, start_high: torch.Tensor, start_low: torch.Tensor, row_length: int) -> torch.Tensor:
    """The words of the rows whose starts :func:`row_start_words` gave, ``row_length`` columns each
    (shape [rows, row_length]): the column is added to the start's low word with an unsigned carry
    into the high word, all in int32."""
    low = start_low + torch.arange(row_length, dtype=torch.int32, device=start_low.device).unsqueeze(0)
    carry = (low ^ _INT32_MIN) < (start_low ^ _INT32_MIN)
    return hash_words(keys, start_high + carry.to(torch.int32), low)


def hash_words(keys, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The words of the global indices whose high and low 32-bit halves are ``high`` and ``low``
    (int32), under round keys ``keys`` (Python ints, or int32 tensors broadcasting with them):
    h = f(f(f(high ^ k0) ^ low ^ k1) ^ k2) on int32 lanes, which every vector unit multiplies
    natively: products wrap mod 2^32 as lowbias32 wants, and right shifts of the signed words are
    made logical by masking off the copied sign bits."""
    first_key, second_key, third_key = (key if torch.is_tensor(key) else signed_word(key) for key in keys)
    word = _lowbias32(high ^ first_key)
    word = _lowbias32(word ^ low ^ second_key)
    return _lowbias32(word ^ third_key)


def counter_random_bits_range(
    seed: int, step: int, start: int, numel: int, device: torch.device | str | None = None, stream: int = 0
) -> torch.Tensor:
    """``counter_random_bits`` of the contiguous global indices start, ..., start + numel - 1."""
    index = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    return counter_random_bits(seed, step, index, stream)


def grid_index(offset, row_stride, rows: int, row_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The int64 grid offset + r * row_stride + i for r < rows, i < row_length (shape [rows, row_length]).
    ``offset`` and ``row_stride`` may be 0-d int64 tensors, so that a compiled kernel is not
    specialised on them; the grid needs no integer division, which vector units lack."""
    row_starts = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1) * row_stride
    return row_starts + torch.arange(row_length, dtype=torch.int64, device=device).unsqueeze(0) + offset


@dataclass(frozen=True)
class StreamLayout:
    """Where the elements of a tensor sit in the counter stream: the tensor, flattened and cut into rows
    of ``row_length`` elements, has element i of row r at global index ``offset + r * row_stride + i``
    of stream ``stream``. A whole tensor is one row; a shard of a tensor split along a dimension is
    many (:meth:`shard`), and its elements take the indices they have in the whole tensor."""

    stream: int
    """Which stream (any integer, taken mod 2^64): one per logical tensor, e.g. :func:`stream_id` of its name."""
    row_length: int
    """Contiguous elements that keep consecutive global indices."""
    row_stride: int
    """Global index distance between the starts of consecutive rows."""
    offset: int = 0
    """Global index of the first element."""

    @classmethod
    def whole(cls, stream: int, numel: int) -> StreamLayout:
        """A tensor that is not sharded: its flat index is its global index."""
        return cls(stream, max(numel, 1), max(numel, 1))

    @classmethod
    def shard(
        cls, stream: int, shape: tuple[int, ...], dim: int, rank: int, world_size: int, chunks: int = 1
    ) -> StreamLayout:
        """Shard ``rank`` of ``world_size`` (local ``shape``) of a tensor split evenly along ``dim``,
        with the global index of each element in the whole tensor (row-major). ``chunks`` > 1: the
        whole tensor is ``chunks`` blocks along ``dim``, each split across the ranks, and a shard holds
        its part of every block in order (megatron's gated fc1 holds [gate part; up part])."""
        if not 0 <= dim < len(shape):
            raise ValueError(f"dim {dim} is not a dimension of shape {tuple(shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if chunks < 1 or shape[dim] % chunks:
            raise ValueError(f"dimension {dim} of shape {tuple(shape)} does not split into {chunks} chunks")
        row_length = math.prod(shape[dim:]) // chunks
        return cls(stream, max(row_length, 1), max(row_length, 1) * world_size, rank * row_length)

    def rows(self, numel: int) -> int:
        """How many rows a tensor of ``numel`` elements has; ``ValueError`` if it is not whole rows."""
        if numel % self.row_length:
            raise ValueError(f"a tensor of {numel} elements is not whole rows of {self.row_length} elements")
        return numel // self.row_length

    def grids(self, start: int, numel: int) -> list[tuple[int, int, int, int]]:
        """Elements ``[start, start + numel)`` of the flattened tensor as grids of stream rows: (first
        element, rows, row length, global index of the first element). A run that starts or ends
        inside a row gives one-row grids for those parts."""
        length = self.row_length
        grids, position, end = [], start, start + numel
        while position < end:
            row, column = divmod(position, length)
            if column or end - position < length:
                width = min(length - column, end - position)
                grids.append((position, 1, width, self.offset + row * self.row_stride + column))
                position += width
            else:
                rows = (end - position) // length
                grids.append((position, rows, length, self.offset + row * self.row_stride))
                position += rows * length
        return grids

    def index(self, numel: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global indices of a tensor's ``numel`` elements in flat order (int64)."""
        return grid_index(self.offset, self.row_stride, self.rows(numel), self.row_length, device).reshape(-1)


def stream_id(name: str) -> int:
    """A stream for the tensor called ``name``: the first 64 bits of its BLAKE2b digest (the same in
    every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def layout_random_bits(
    seed: int, step: int, layout: StreamLayout, shape: torch.Size | tuple[int, ...], device: torch.device | str | None = None
) -> torch.Tensor:
    """The words of a tensor of ``shape`` laid out in its stream as ``layout`` says, at ``step``."""
    index = layout.index(math.prod(shape), device)
    return counter_random_bits(seed, step, index, layout.stream).view(tuple(shape))


def _lowbias32(word: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 hash of int32 words: xorshifts 16, 15, 16 around two multiplies (mod 2^32)."""
    first_multiplier, second_multiplier = _LOWBIAS32_MULTIPLIERS
    word = word ^ _logical_right_shift(word, 16)
    word = word * signed_word(first_multiplier)
    word = word ^ _logical_right_shift(word, 15)
    word = word * signed_word(second_multiplier)
    return word ^ _logical_right_shift(word, 16)


def _logical_right_shift(word: torch.Tensor, shift: int) -> torch.Tensor:
    return (word >> shift) & ((1 << (32 - shift)) - 1)


def signed_word(value: int) -> int:
    """The representative of ``value`` mod 2^32 in [-2^31, 2^31) (an int32's two's complement)."""
    value = operator.index(value) & _WORD_MASK
    return value - 2**32 if value >= 2**31 else value


def _splitmix64(state: int) -> int:
    """SplitMix64 output for ``state`` (Steele, Lea & Flood 2014), in Python integers."""
    z = (state + _SPLITMIX64_INCREMENT) & _UINT64_MASK
    z = ((z ^ (z >> 30)) * _SPLITMIX64_MULTIPLIERS[0]) & _UINT64_MASK
    z = ((z ^ (z >> 27)) * _SPLITMIX64_MULTIPLIERS[1]) & _UINT64_MASK
    return z ^ (z >> 31)


def counter_round_keys_table(seed: int, steps: range, streams: list[int]) -> torch.Tensor:
    """:func:`counter_round_keys` for every step of ``steps`` and every stream of ``streams`` at once
    (uint64 arithmetic in numpy, which wraps as SplitMix64 wants), as int32 words (two's
    complement) of shape [steps, streams, 3], on the CPU."""
    with numpy.errstate(over="ignore"):
        mask = numpy.uint64(_UINT64_MASK)
        seed_key = _splitmix64_array(numpy.array([operator.index(seed) & _UINT64_MASK], dtype=numpy.uint64))
        stream_words = numpy.array([operator.index(stream) & _UINT64_MASK for stream in streams], dtype=numpy.uint64)
        stream_key = _splitmix64_array(seed_key ^ stream_words)
        step_words = numpy.array([operator.index(step) & _UINT64_MASK for step in steps], dtype=numpy.uint64)
        step_key = _splitmix64_array(stream_key[None, :] ^ step_words[:, None]) & mask
        last_key = _splitmix64_array(step_key)
    words = numpy.stack([step_key, step_key >> numpy.uint64(32), last_key], axis=-1) & numpy.uint64(_WORD_MASK)
    return torch.from_numpy(words.astype(numpy.uint32).view(numpy.int32))


def _splitmix64_array(state: numpy.ndarray) -> numpy.ndarray:
    """:func:`_splitmix64` of every element of a uint64 array."""
    z = state + numpy.uint64(_SPLITMIX64_INCREMENT)
    z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(_SPLITMIX64_MULTIPLIERS[0])
    z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(_SPLITMIX64_MULTIPLIERS[1])
    return z ^ (z >> numpy.uint64(31))


def counter_round_keys(seed: int, step: int, stream: int = 0) -> tuple[int, int, int]:
    """The three 32-bit round keys of the counter stream for (seed, step, stream), each taken mod 2^64."""
    seed_key = _splitmix64(operator.index(seed) & _UINT64_MASK)
    stream_key = _splitmix64(seed_key ^ (operator.index(stream) & _UINT64_MASK))
    step_key = _splitmix64(stream_key ^ (operator.index(step) & _UINT64_MASK))
    last_key = _splitmix64(step_key)
    return step_key & _WORD_MASK, step_key >> 32, last_key & _WORD_MASK
