"""Flat, contiguous buckets of optimizer state: one per (parameter group, device, dtype).

Every buffer is made with ``new_zeros`` of a parameter (or gradient), so it lives where the
parameters live, whatever device that is.

Every state tensor of a bucket is one flat buffer; each entry's state is a view into it at the
entry's offset, so the eager reference (per entry) and the fused step (per bucket) read and write
the very same memory. An entry is a parameter, or a contiguous run of a parameter's flattened
elements (the distributed optimizer's shard of it). Offsets are aligned to :data:`ALIGNMENT`
elements (and to the FP8 group size), so FP8 groups never straddle two entries and the zero padding
between entries stays zero under every strategy (zero gradient, zero moments, zero parameter).

A bucket whose parameters and gradients live in another owner's flat buffers (a distributed
optimizer's shard of megatron's DDP buffers, whose layout rules live in
:mod:`megatron_lowprec.megatron.layout`) takes one of two layouts. **In place**
(:func:`in_place_offsets`), the usual one: the state mirrors the range of those buffers element for
element (the owner's padding between parameters is the bucket's padding, zero in all three), so the
bucket's parameters and gradients are plain slices of those buffers and the step reads and writes
them as a plain bucket's. **Packed**, where the owner's layout does not fit the strategy's (an FP8
group would straddle two parameters):
the aligned layout above, the parameters and gradients rows of megatron's buffers
(:class:`BufferRows`), and the padding repeating its entry's last elements
(:meth:`Bucket.repeat_into_padding_`).

With ``own_params=True`` the bucket also owns a flat parameter buffer and re-points each
parameter's ``.data`` at its view, as megatron-core's DistributedDataParallel does with its
contiguous parameter buffer. Gradients are read where they are (:func:`gather_grads`): from the
bucket's own gradient buffer, or in place from another flat buffer that holds them all (megatron's
DDP keeps ``main_grad`` in one: :class:`BufferRows`), and only otherwise copied into a buffer of the
bucket's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.codecs import PER_GROUP_PARTS
from megatron_lowprec.optim.master import new_master, reset_master_
from megatron_lowprec.optim.strategies import PrecisionStrategy

ALIGNMENT = 128
"""Elements between parameter starts in a bucket are a multiple of this (and of the FP8 group size)."""

FP8_PARTS = ("payload", "scale", "expansion_exponent")
"""Suffixes (after the moment's name and an underscore) of the 8-bit moments' state parts, which a
bucket keeps flat (:class:`~megatron_lowprec.optim.codecs.FP8GroupMoment`'s; INT8 the first two)."""
SECOND_MOMENT_LOW = "exp_avg_sq_lo"
"""Collage-plus' δv (``second_moment_mcf``), in the parameter's dtype."""


def state_keys(strategy: PrecisionStrategy) -> list[str]:
    """Names of the tensor states ``strategy`` keeps per parameter (``step`` is an int besides these):
    each moment's parts (:attr:`~megatron_lowprec.optim.strategies.PrecisionStrategy.moment_codec`),
    then the parameter codec's tensor, then Collage-plus' δv."""
    keys = [key for moment in strategy.moment_names for key in strategy.moment_codec.keys(moment)]
    if strategy.param_codec.key is not None:
        keys.append(strategy.param_codec.key)
    if strategy.second_moment_mcf:
        keys.append(SECOND_MOMENT_LOW)
    return keys


def elements_per_value(key: str, strategy: PrecisionStrategy) -> int:
    """Elements of the parameter per stored value of state ``key``: the group size for per-group parts, else 1."""
    return strategy.moment_codec.elements_per_value(key)


def bucket_alignment(strategy: PrecisionStrategy) -> int:
    """Elements between entry starts: :data:`ALIGNMENT` and a multiple of the moments' groups."""
    return math.lcm(ALIGNMENT, strategy.moment_codec.group_size)


ROW_TABLE_BYTES = 4 + 8 + 8
"""Bytes a call over :class:`BufferRows` reads per row to place its elements in the other buffer:
the row's entry (int32), and that entry's shift and last element (int64)."""


def repeated_index(index: torch.Tensor, last: torch.Tensor | int, group_size: int) -> torch.Tensor:
    """The bucket element whose values the bucket element ``index`` repeats, in an entry whose last
    element is ``last``: itself, or, in the padding after ``last``, the element of the entry's last
    group of ``group_size`` elements (FP8 state: per-group statistics; 1 otherwise) in the same
    column, or ``last`` where that column lies past it. So a group of padding holds a copy of the
    entry's last group (the same group statistics), and padding within that group copies of ``last``
    (which leave its statistics, a largest and a smallest magnitude, unchanged)."""
    if group_size == 1:
        return torch.clamp(index, max=last)
    group = torch.clamp(index // group_size, max=last // group_size)
    return group * group_size + torch.minimum(index % group_size, last - group * group_size)


class BufferRows(NamedTuple):
    """A bucket's values that live in another flat buffer: entry e's elements [0, numel_e) sit at
    ``source[source_start_e : source_start_e + numel_e]``, and at the bucket's offsets in its own
    layout. The bucket is cut into rows of ``width`` elements (the bucket's alignment, so that each
    row belongs to one entry): an element finds its entry in a table of one value per row, and its
    source index by adding its entry's shift to its bucket index (inside the step's kernels: a few
    words per row, no search and no kernel of its own). Padding elements have no place in the
    source; they read the element they repeat (:func:`repeated_index`). :meth:`read` and
    :meth:`write` gather the bucket-shaped values (padding zero) and store them back;
    :meth:`read_repeating` and :meth:`store_repeating` do so for a call whose padding elements
    compute exactly what the element they repeat computes (a distributed optimizer's shard, whose
    state padding repeats its entries' last elements: :meth:`Bucket.repeat_into_padding_`), so that
    the step's kernel stores them. Indices are int64 (megatron's buffers can exceed 2^31 elements)."""

    source: torch.Tensor
    row_entries: torch.Tensor
    """[rows] int32: the entry of each row of the bucket (at least two values: :meth:`Bucket.rows_in`)."""
    shifts: torch.Tensor
    """[entries] int64: each entry's source index less its bucket index."""
    lasts: torch.Tensor
    """[entries] int64: the bucket index of each entry's last element."""
    width: int
    group_size: int
    """Elements of a group whose padding repeats a whole group (:func:`repeated_index`): the FP8
    group size where it is not a multiple of ``width`` (else padding never fills a group), 1 otherwise."""
    first_row: torch.Tensor
    """0-d int32 host tensor: the bucket row where a call's values start (a window of the bucket)."""

    def from_row(self, row: int) -> BufferRows:
        """The same rows for a call that starts at bucket row ``row``."""
        return self._replace(first_row=torch.tensor(row, dtype=torch.int32))

    def _places(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per element of a call in ``shape``: its bucket index, the bucket index of the element it
        repeats (:func:`repeated_index`), and that element's source index. Its row (whose entry it
        reads, once per row) is its index shifted by log2 of the row width, a power of two; in a call
        over [groups, group_size] (FP8 moments), the row of its group's first element (a group lies
        in one row, or its rows belong to one entry), so that a kernel over groups reads it once per group."""
        shift = self.width.bit_length() - 1
        device = self.source.device
        if len(shape) == 2:
            groups, group_size = shape
            element = torch.arange(groups * group_size, dtype=torch.int64, device=device).view(shape)
            row = (torch.arange(groups, dtype=torch.int64, device=device) * group_size >> shift).view(-1, 1)
        else:
            element = torch.arange(math.prod(shape), dtype=torch.int64, device=device).view(shape)
            row = element >> shift
        entry = self.row_entries[row + self.first_row]
        index = element + self.first_row.to(torch.int64) * self.width
        repeated = repeated_index(index, self.lasts[entry], self.group_size)
        return index, repeated, repeated + self.shifts[entry]

    def repetition(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element of a call in ``shape``: whether it is its entry's own (not padding), and the
        index in the call (int32) of the element whose values it repeats."""
        index, repeated, _ = self._places(shape)
        call_index = repeated - self.first_row.to(torch.int64) * self.width
        return index == repeated, call_index.to(torch.int32)

    def read(self, shape: torch.Size) -> torch.Tensor:
        """The bucket's values in ``shape`` (padding elements zero)."""
        index, repeated, place = self._places(shape)
        return torch.where(index == repeated, self.source[place], 0)

    def read_repeating(self, shape: torch.Size, source: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's values in ``shape``, each padding element the value of the element it repeats;
        of ``source``, another buffer that holds the entries at the same places (megatron's gradients
        beside its parameters: one set of tables for both), where given."""
        return (self.source if source is None else source)[self._places(shape)[2]]

    def write(self, values: torch.Tensor) -> None:
        """Store the bucket-shaped ``values`` back into the source, each padding element's place
        written by it with the value of the element it repeats (so that duplicate indices carry
        equal values): a gather of ``values``, which Inductor computes into a buffer of the call's
        shape first, in a kernel of its own."""
        _, repeated, place = self._places(values.shape)
        self._store(place.reshape(-1), values.reshape(-1)[repeated.reshape(-1) - self.first_row.to(torch.int64) * self.width])

    def store_repeating(self, values: torch.Tensor) -> None:
        """Store the bucket-shaped ``values``, whose padding elements hold the values of the elements
        they repeat (:meth:`read_repeating` of a step that computes each element from its own state),
        back into the source: duplicate indices carry equal values, and Inductor stores them from the
        kernel that computes them, unless they read the source (its ``index_put_`` then realizes
        them, and the reads of the source go to a kernel before it)."""
        self._store(self._places(values.shape)[2].reshape(-1), values.reshape(-1))

    def _store(self, place: torch.Tensor, values: torch.Tensor) -> None:
        """``source[place] = values`` with equal values at equal places: an ``index_put_``, which
        Inductor compiles to stores into the source itself; under ``torch.use_deterministic_algorithms``
        (where Inductor would fall back to ATen's ``index_put_``, which sorts its indices on CUDA) a
        ``scatter_``, which Inductor compiles to plain stores, but into a copy of the whole source,
        copied back (its functional form is not made in place again): two more kernels that move the
        whole buffer."""
        if torch.are_deterministic_algorithms_enabled():
            self.source.scatter_(0, place, values)
        else:
            self.source.index_put_((place,), values)


@dataclass
class Bucket:
    """Flat state of the entries (parameters, or runs of a parameter's elements) of one group that
    share a device and a dtype."""

    group_index: int
    params: list[torch.nn.Parameter]
    """The parameter of each entry."""
    offsets: list[int]
    numel: int
    """Padded number of elements of every flat buffer (FP8 scales: ``numel / group_size``)."""
    streams: list[StreamLayout]
    """Where each entry's parameter sits in the counter-based SR stream (aligned with ``params``)."""
    state: dict[str, torch.Tensor]
    numels: list[int]
    """Elements of each entry: its parameter's, or its run's."""
    element_starts: list[int]
    """Where each entry starts in its parameter's flattened elements (0 for a whole parameter)."""
    entry_groups: list[int]
    """The parameter group of each entry (all ``group_index`` but in a distributed optimizer's shard,
    whose entries of one group are contiguous)."""
    param_buffer: torch.Tensor | None = None
    """The entries' 16-bit parameters when the bucket owns them (``own_params``)."""
    param_rows: tuple[list[int], BufferRows] | None = None
    """Where the entries' 16-bit parameters live when another flat buffer holds them (megatron's
    DDP buffer under the distributed optimizer): their starts in it, and its :class:`BufferRows`."""
    grad_buffer: torch.Tensor | None = field(default=None, repr=False)
    row_start_words: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Per entry, the int32 words of its rows' starts in its SR stream (filled by the fused step)."""
    stream_tables: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)
    """Per call window, the per-entry tables of the whole-window SR stream (filled by the fused step on GPUs)."""
    stream_keys: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Per call window, the first step and seed of its block of SR round keys, and the keys on the device."""
    group_stream_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    """Per FP8 group, its entry and its first element's global SR index as int32 high and low words
    (the fused step's stream over [groups, group_size] under stochastic rounding)."""
    grad_rows: tuple[list[int], BufferRows] | None = field(default=None, repr=False)
    """The gradients' source starts and :class:`BufferRows` when they live in another buffer."""
    per_group_scalars: bool = False
    """Whether its calls take each element's scalars from its entry's parameter group (a distributed
    optimizer's shard, whose entries may belong to several groups) rather than one group's."""
    state_group_size: int = 1
    """Elements per value of the per-group state (the FP8 group size; 1 without FP8 state)."""
    in_place: bool = False
    """Whether its state mirrors a range of megatron's buffers, which hold its parameters
    (:class:`InPlace`; :attr:`param_buffer` is that range)."""
    row_width: int = ALIGNMENT
    """Elements of a row of its per-row tables (a power of two): :data:`ALIGNMENT` in the aligned
    layout, :attr:`InPlace.row_width` in place."""
    row_phase: int = 0
    """Elements of the bucket's first row before its first element: a shard laid out in place begins
    where megatron's shard begins, anywhere in a row of megatron's buffer."""
    entry_counted: list[bool] | None = None
    """Whether each entry's update counts in the update quality (``None``: all do). A shard holds
    tensor-parallel-replicated parameters beside tensor-parallel ones, and a replica counts on one
    tensor-parallel rank only."""
    row_tables: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    """:meth:`row_table`'s tables, on the device, by their values."""

    def view(self, buffer: torch.Tensor, index: int, per_group: int = 1) -> torch.Tensor:
        """The flat slice of ``buffer`` that belongs to entry ``index`` (``per_group`` > 1: FP8 scales)."""
        start = self.offsets[index] // per_group
        return buffer[start : start + math.ceil(self.numels[index] / per_group)]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def laid_out(self) -> bool:
        """Whether its entries' parameters sit in a flat buffer of its layout: its own, or rows of another."""
        return self.param_buffer is not None or self.param_rows is not None

    @property
    def state_dtype(self) -> torch.dtype:
        """The 16-bit dtype of the entries' parameters."""
        return self.params[0].dtype

    def entry_params(self) -> list[torch.Tensor]:
        """Each entry's 16-bit parameter values, flat, where they live."""
        if self.param_rows is not None:
            starts, rows = self.param_rows
            return [rows.source[start : start + numel] for start, numel in zip(starts, self.numels)]
        if self.param_buffer is not None:
            return [self.view(self.param_buffer, index) for index in range(len(self.params))]
        return [param.detach().reshape(-1) for param in self.params]

    def entries_by_group(self) -> dict[int, list[int]]:
        """The entries of each parameter group, in bucket order."""
        groups: dict[int, list[int]] = {}
        for index, group in enumerate(self.entry_groups):
            groups.setdefault(group, []).append(index)
        return groups

    def entry_rows(self, width: int | None = None, phase: int | None = None) -> list[int]:
        """Rows of ``width`` elements (default: :attr:`row_width`) of each entry, the first row
        beginning ``phase`` elements before the bucket's first element (default: :attr:`row_phase`):
        the rows its elements and the padding after them touch (the first entry's also those of any
        padding before it). ``ValueError`` where a row would hold two entries."""
        width = self.row_width if width is None else width
        phase = self.row_phase if phase is None else phase
        rows, covered = [], 0
        for index, offset in enumerate(self.offsets):
            if index and (phase + offset) % width:
                raise ValueError(
                    f"entry {index} of the bucket starts at element {offset}, inside a row of {width} elements "
                    f"(the bucket's first element is element {phase} of its first row)"
                )
            end = -(-(phase + self.padded_end(index)) // width)
            rows.append(end - covered)
            covered = end
        return rows

    def row_table(self, values: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        """Per row of :attr:`row_width` elements of the bucket (its first row begins :attr:`row_phase`
        elements before its first element), ``values[entry]`` of the entry whose elements or padding
        lie in it (:meth:`entry_rows`), as ``dtype`` on the bucket's device, kept with the bucket."""
        return self._table(values, dtype, self.row_width, self.row_phase)

    def group_table(self, values: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        """:meth:`row_table` per FP8 group of the bucket (:attr:`state_group_size` elements from its first)."""
        return self._table(values, dtype, self.state_group_size, 0)

    def _table(self, values: tuple[Any, ...], dtype: torch.dtype, width: int, phase: int) -> torch.Tensor:
        key = (values, dtype, width)
        if key not in self.row_tables:
            rows: list[Any] = []
            for value, count in zip(values, self.entry_rows(width, phase)):
                rows += [value] * count
            self.row_tables[key] = torch.tensor(rows, dtype=dtype, device=self.device)
        return self.row_tables[key]

    def rows_in(self, source: torch.Tensor, source_starts: list[int]) -> BufferRows:
        """A :class:`BufferRows` for this bucket's entries at ``source_starts`` of the flat ``source``
        (rows of :data:`ALIGNMENT`, a divisor of every entry's offset). Every table holds at least two
        values (a bucket of one row or one entry repeats it; no element reaches the copy): a compiled
        step specialises a size of one and would compile again for it."""
        device = source.device
        entries = [
            index for index, offset in enumerate(self.offsets)
            for _ in range((self.padded_end(index) - offset) // ALIGNMENT)
        ]
        shifts = [start - offset for start, offset in zip(source_starts, self.offsets)]
        lasts = [offset + numel - 1 for offset, numel in zip(self.offsets, self.numels)]
        group_size = self.state_group_size if self.state_group_size % ALIGNMENT else 1
        return BufferRows(
            source,
            torch.tensor(at_least_two(entries), dtype=torch.int32, device=device),
            torch.tensor(at_least_two(shifts), dtype=torch.int64, device=device),
            torch.tensor(at_least_two(lasts), dtype=torch.int64, device=device),
            ALIGNMENT,
            group_size,
            torch.tensor(0, dtype=torch.int32),
        )

    def place_params_in(self, source: torch.Tensor, source_starts: list[int]) -> None:
        """Read and write the entries' 16-bit parameters at ``source_starts`` of the flat ``source``
        (megatron's DDP parameter buffer under the distributed optimizer): :attr:`param_rows`, and
        the state's padding made to repeat (:meth:`repeat_into_padding_`)."""
        self.param_rows = (list(source_starts), self.rows_in(source, source_starts))
        self.repeat_into_padding_()

    def padded_end(self, index: int) -> int:
        """The end of entry ``index``'s elements and the padding after them: the next entry's offset."""
        return self.offsets[index + 1] if index + 1 < len(self.offsets) else self.numel

    def entries_in(self, start: int, end: int) -> list[int]:
        """The entries whose elements or padding (the first entry's: from the bucket's start) overlap
        elements [start, end) of the bucket, consecutive."""
        return [
            index for index in range(len(self.offsets))
            if (self.offsets[index] if index else 0) < end and self.padded_end(index) > start
        ]

    @torch.no_grad()
    def repeat_into_padding_(self) -> None:
        """Set every state buffer's padding to the values of the elements it repeats
        (:func:`repeated_index`; FP8 scales and exponents of a group of padding: those of its entry's
        last group). A bucket whose parameters live in another buffer keeps its state so, so that its
        compiled step computes each padding element exactly as the element it repeats and may store
        both into the one place they share (:meth:`BufferRows.store_repeating`); call it whenever the
        state is written other than by such a step (built, loaded). A step entry by entry (stochastic
        rounding on CPUs) leaves the padding as it was: no step there reads it. Any other bucket's
        padding stays zero: nothing changes."""
        if self.param_rows is None:
            return
        group_size = self.state_group_size
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            last, end = offset + numel - 1, self.padded_end(index)
            if end == last + 1:
                continue
            for key, buffer in self.state.items():
                values = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
                if key.endswith(PER_GROUP_PARTS):
                    values[last // group_size + 1 : end // group_size] = values[last // group_size]
                else:
                    padding = torch.arange(last + 1, end, device=buffer.device)
                    values[padding] = values[repeated_index(padding, last, group_size)]


class InPlace(NamedTuple):
    """A bucket's state laid out in place: as the range of another owner's flat buffers it updates
    (megatron's DDP buffers: :mod:`megatron_lowprec.megatron.layout`)."""

    param_range: torch.Tensor
    """The range of the owner's parameter buffer (a flat view): the bucket's parameters."""
    offsets: list[int]
    """Each entry's first element in the range."""
    row_phase: int
    """The range's first element's place in its row of ``row_width`` elements of the owner's buffer."""
    row_width: int
    """Elements of a row of the bucket's per-row tables (:meth:`Bucket.row_table`: each row's parameter
    group, its stochastic-rounding entry): the owner starts every parameter at a multiple of it, so
    that no row holds two parameters. A power of two dividing :data:`ALIGNMENT`."""


def in_place_offsets(
    strategy: PrecisionStrategy, starts: list[int], start: int, end: int, row: int
) -> list[int] | None:
    """The offsets of entries at ``starts`` (ascending) of an owner's buffer in a bucket whose state
    mirrors the buffer's range [start, end) in place, in rows of ``row`` elements; ``None`` where that
    layout cannot hold them: an entry after the first that starts inside a row of the buffer (each
    row's tables name one entry), or, with FP8 moments, an entry or the range's end off the FP8
    groups of the range (groups would straddle two parameters)."""
    if any(first % row for first in starts[1:]):
        return None
    offsets = [first - start for first in starts]
    group = strategy.moment_codec.group_size
    if any(offset % group for offset in offsets) or (end - start) % group:
        return None
    return offsets


def in_place_runs(params: list[torch.Tensor], row: int) -> list[list[int]]:
    """Whole parameters that are contiguous views of one flat buffer (megatron DDP's parameter
    buffer), in runs that a bucket may hold in place (indices into ``params``, each run in the
    buffer's order): within a run, each parameter after the first starts on a row of ``row``
    elements of the buffer after fewer than ``row`` elements of zeros (the owner's padding), so no
    other tensor lies between them. ``ValueError`` where two parameters overlap."""
    order = sorted(range(len(params)), key=lambda index: params[index].storage_offset())
    runs: list[list[int]] = []
    end = None
    for index in order:
        param = params[index]
        start = param.storage_offset()
        if end is not None and start < end:
            raise ValueError(f"parameters of shapes {tuple(params[runs[-1][-1]].shape)} and {tuple(param.shape)} overlap in their buffer")
        padding = None if end is None else param.new_empty(0).set_(param.untyped_storage(), end, (start - end,))
        joins = padding is not None and start % row == 0 and start - end < row and not padding.any()
        if joins:
            runs[-1].append(index)
        else:
            runs.append([index])
        end = start + param.numel()
    return runs


def params_in_place(strategy: PrecisionStrategy, params: list[torch.Tensor], row: int) -> InPlace | None:
    """The :class:`InPlace` layout, in rows of ``row`` elements, of a run of :func:`in_place_runs`
    (whole parameters, in the buffer's order): the buffer's range from the first parameter's start to
    the last one's end; ``None`` where :func:`in_place_offsets` refuses it (FP8 groups that would
    straddle two parameters)."""
    first, last = params[0], params[-1]
    start, end = first.storage_offset(), last.storage_offset() + last.numel()
    offsets = in_place_offsets(strategy, [param.storage_offset() for param in params], start, end, row)
    if offsets is None:
        return None
    return InPlace(first.new_empty(0).set_(first.untyped_storage(), start, (end - start,)), offsets, start % row, row)


def at_least_two(values: list) -> list:
    """A table of a compiled step (:meth:`Bucket.rows_in`; the stochastic-rounding stream's, per group
    or per entry) with its one value repeated when it has only one: a compiled step specialises a
    size of one (it broadcasts) and would compile again for a bucket or window of one entry or row."""
    return values * 2 if len(values) == 1 else values


def zero_state(
    strategy: PrecisionStrategy, numel: int, like: torch.Tensor, fp8_groups: int | None = None
) -> dict[str, torch.Tensor]:
    """Every flat state buffer of ``strategy`` but the master, zero (8-bit moments: zero payloads, and
    the scale, and for FP8 the k, of an all-zero group), for ``numel`` elements of 16-bit parameters like ``like``, on its device.
    ``fp8_groups`` defaults to ``numel`` cut into consecutive groups."""
    state: dict[str, torch.Tensor] = {}
    for moment in strategy.moment_names:
        state.update(strategy.moment_codec.zeros(moment, numel, like, fp8_groups))
    codec = strategy.param_codec
    if codec.key is not None and not strategy.master_weights:
        state[codec.key] = like.new_zeros(numel, dtype=codec.state_dtype(like.dtype))
    if strategy.second_moment_mcf:
        state[SECOND_MOMENT_LOW] = like.new_zeros(numel)
    return state


def state_dtypes(strategy: PrecisionStrategy, param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each state buffer of ``strategy`` for 16-bit parameters of ``param_dtype``, in
    :func:`state_keys` order."""
    dtypes = {key: value.dtype for key, value in zero_state(strategy, 0, torch.empty(0, dtype=param_dtype)).items()}
    if strategy.master_weights:
        dtypes[strategy.param_codec.key] = strategy.param_codec.state_dtype(param_dtype)
    return {key: dtypes[key] for key in state_keys(strategy)}


def build_bucket(
    strategy: PrecisionStrategy,
    group_index: int,
    params: list[torch.nn.Parameter],
    own_params: bool,
    streams: list[StreamLayout] | None = None,
    runs: list[tuple[int, int]] | None = None,
    master_source: list[torch.Tensor] | None = None,
    entry_groups: list[int] | None = None,
    in_place: InPlace | None = None,
) -> tuple[Bucket, list[dict[str, Any]]]:
    """A bucket for ``params`` (same device and dtype) and each entry's state of views into it.
    ``streams`` defaults to a whole stream per parameter, numbered by position. ``runs``: the
    entries are runs (first element, elements) of the parameters' flattened elements rather than
    whole parameters; their masters start from ``master_source`` (the runs' 16-bit values).
    ``entry_groups``: each entry's parameter group (default: ``group_index``); given, the bucket's
    calls take per-group scalars (:attr:`Bucket.per_group_scalars`). ``in_place``: the state mirrors
    a range of another owner's buffers, which hold the parameters (:class:`InPlace`), instead of the
    aligned layout."""
    if streams is None:
        streams = [StreamLayout.whole(index, param.numel()) for index, param in enumerate(params)]
    if runs is None:
        runs = [(0, param.numel()) for param in params]
    if in_place is not None:
        offsets, numel = list(in_place.offsets), in_place.param_range.numel()
    else:
        alignment = bucket_alignment(strategy)
        offsets, numel = [], 0
        for _, run_numel in runs:
            offsets.append(numel)
            numel += -(-run_numel // alignment) * alignment
    bucket = Bucket(
        group_index, list(params), offsets, numel, list(streams), zero_state(strategy, numel, params[0]),
        [run_numel for _, run_numel in runs], [start for start, _ in runs], entry_groups or [group_index] * len(params),
        per_group_scalars=entry_groups is not None,
        state_group_size=strategy.moment_codec.group_size,
        row_width=in_place.row_width if in_place is not None else ALIGNMENT,
        row_phase=in_place.row_phase if in_place is not None else 0,
    )
    if in_place is not None:
        bucket.param_buffer = in_place.param_range
        bucket.in_place = True
    if strategy.master_weights:
        master = new_master(strategy, numel, params[0])
        sources = master_source or [param.detach().reshape(-1) for param in params]
        for index, source in enumerate(sources):
            reset_master_(source, bucket.view(master, index))
        bucket.state[strategy.param_codec.key] = master
    bucket.state = {key: bucket.state[key] for key in state_keys(strategy)}
    if own_params:
        if in_place is not None:
            raise ValueError("a bucket laid out in place in another owner's buffers does not own its parameters")
        bucket.param_buffer = params[0].new_zeros(numel)
        for index, param in enumerate(params):
            view = bucket.view(bucket.param_buffer, index).view(param.shape)
            view.copy_(param.detach())
            param.data = view
    states = []
    whole = all(start == 0 and count == param.numel() for (start, count), param in zip(runs, params))
    for index in range(len(params)):
        entry: dict[str, Any] = {"step": 0}
        for key, buffer in bucket.state.items():
            flat = bucket.view(buffer, index, elements_per_value(key, strategy))
            entry[key] = flat if key.endswith(FP8_PARTS) or not whole else flat.view(params[index].shape)
        states.append(entry)
    return bucket, states


def own_grad_buffer(bucket: Bucket) -> torch.Tensor | None:
    """The bucket's gradient buffer if every parameter's gradient is its contiguous view there (the
    buffer's padding stays zero), else ``None``."""
    buffer = bucket.grad_buffer
    if buffer is None:
        return None
    start, element_size = buffer.data_ptr(), buffer.element_size()
    for offset, param in zip(bucket.offsets, bucket.params):
        grad = param.grad
        if grad is None or grad.dtype != buffer.dtype or not grad.is_contiguous():
            return None
        if grad.data_ptr() != start + offset * element_size:
            return None
    return buffer


def gather_grads(bucket: Bucket) -> torch.Tensor | BufferRows | None:
    """The bucket's gradients for a fused step, or ``None`` if some parameter has no gradient or the
    gradients do not share one dtype. Without a copy where possible: the bucket's own gradient buffer
    when the gradients are its views (after the first step of a plain training loop); for a bucket
    laid out in place, the range of megatron's gradient buffer beside its parameters'
    (:func:`_grads_beside`); otherwise a :class:`BufferRows` when they are contiguous views of one
    other buffer (megatron DDP's ``main_grad``). Otherwise they are copied into the bucket's buffer and re-pointed at it, so that
    later backward passes accumulate there directly."""
    grads = [param.grad for param in bucket.params]
    if any(grad is None for grad in grads) or len({grad.dtype for grad in grads}) != 1:
        return None
    if (own := own_grad_buffer(bucket)) is not None:
        return own
    if bucket.in_place and (beside := _grads_beside(bucket, grads)) is not None:
        return beside
    rows = None
    if not bucket.in_place and (len(grads) > 1 or grads[0].untyped_storage().nbytes() > grads[0].nbytes):
        rows = _rows_of(bucket, grads, bucket.grad_rows)
    if rows is not None:
        bucket.grad_rows = rows
        return rows[1]
    dtype = grads[0].dtype
    if bucket.grad_buffer is None or bucket.grad_buffer.dtype != dtype:
        bucket.grad_buffer = grads[0].new_zeros(bucket.numel, dtype=dtype)
    for index, (param, grad) in enumerate(zip(bucket.params, grads)):
        view = bucket.view(bucket.grad_buffer, index).view(param.shape)
        view.copy_(grad)
        param.grad = view
    return bucket.grad_buffer


def _grads_beside(bucket: Bucket, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The gradients of a bucket laid out in place (whole parameters) as one range of the flat buffer
    that holds them, where they lie there as the parameters lie in theirs (megatron's gradient buffer
    beside its parameter buffer, whose padding is zero too); ``None`` otherwise."""
    storage = grads[0].untyped_storage()
    if not all(grad.is_contiguous() and grad.untyped_storage().data_ptr() == storage.data_ptr() for grad in grads):
        return None
    shifts = {grad.storage_offset() - offset for grad, offset in zip(grads, bucket.offsets)}
    base = shifts.pop()
    if shifts or base < 0 or base + bucket.numel > storage.nbytes() // grads[0].element_size():
        return None
    return grads[0].new_empty(0).set_(storage, base, (bucket.numel,))


def param_rows_in_place(bucket: Bucket) -> tuple[list[int], BufferRows] | None:
    """Where the bucket's parameters (whole, one per entry) are contiguous views of one storage that
    the bucket does not own (megatron DDP's parameter buffer): their starts in it and its
    :class:`BufferRows`, the bucket's own (:attr:`Bucket.param_rows`) while the parameters stay
    there; ``None`` where they are not views of one storage."""
    return _rows_of(bucket, [param.detach() for param in bucket.params], bucket.param_rows)


def _rows_of(
    bucket: Bucket, tensors: list[torch.Tensor], cached: tuple[list[int], BufferRows] | None
) -> tuple[list[int], BufferRows] | None:
    """The starts and :class:`BufferRows` of ``tensors`` (one per entry) where they are contiguous
    views of one storage (``cached`` while the storage, the dtype and the views' places stay the
    same); ``None`` otherwise."""
    storage = tensors[0].untyped_storage()
    if not all(tensor.is_contiguous() and tensor.untyped_storage().data_ptr() == storage.data_ptr() for tensor in tensors):
        return None
    starts = [tensor.storage_offset() for tensor in tensors]
    if cached is not None:
        cached_starts, rows = cached
        if cached_starts == starts and rows.source.dtype == tensors[0].dtype and rows.source.untyped_storage().data_ptr() == storage.data_ptr():
            return cached
    source = tensors[0].new_empty(0).set_(storage, 0, (storage.nbytes() // tensors[0].element_size(),))
    return starts, bucket.rows_in(source, starts)
