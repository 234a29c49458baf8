"""Flat, contiguous buckets of optimizer state: one per (parameter group, device, dtype).

Every buffer is made with ``new_zeros`` of a parameter (or gradient), so it lives where the
parameters live, whatever device that is.

Every state tensor of a bucket is one flat buffer; each entry's state is a view into it at the
entry's offset, so the eager reference (per entry) and the fused step (per bucket) read and write
the very same memory. An entry is a parameter, or a contiguous run of a parameter's flattened
elements (the distributed optimizer's shard of it). Offsets are aligned to :data:`ALIGNMENT`
elements (and to the FP8 group size), so FP8 groups never straddle two entries and the zero padding
between entries stays zero under every strategy (zero gradient, zero moments, zero parameter).

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

from megatron_lowprec.numerics.quant import quantized_zeros
from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim.master import master_key, new_master, reset_master_
from megatron_lowprec.optim.strategies import PrecisionStrategy

ALIGNMENT = 128
"""Elements between parameter starts in a bucket are a multiple of this (and of the FP8 group size)."""

FP8_PARTS = ("payload", "scale", "expansion_exponent")
PER_GROUP_PARTS = ("_scale", "_expansion_exponent")
"""Suffixes of the FP8 state parts that hold one value per group, not per element."""
LOW_COMPONENTS = ("param_lo", "exp_avg_sq_lo", "kahan_compensation")


def state_keys(strategy: PrecisionStrategy) -> list[str]:
    """Names of the tensor states ``strategy`` keeps per parameter (``step`` is an int besides these)."""
    if strategy.moments == "fp8":
        parts = FP8_PARTS if strategy.fp8_expand else FP8_PARTS[:2]
        keys = [f"{moment}_{part}" for moment in strategy.moment_names for part in parts]
    else:
        keys = list(strategy.moment_names)
    if strategy.master_weights:
        keys.append(master_key(strategy))
    if strategy.keeps_param_low_component:
        keys.append("param_lo")
    if strategy.second_moment_mcf:
        keys.append("exp_avg_sq_lo")
    if strategy.param_update == "kahan":
        keys.append("kahan_compensation")
    return keys


def elements_per_value(key: str, strategy: PrecisionStrategy) -> int:
    """Elements of the parameter per stored value of state ``key``: the FP8 group size for scales, else 1."""
    return strategy.fp8_group_size if key.endswith(PER_GROUP_PARTS) else 1


def bucket_alignment(strategy: PrecisionStrategy) -> int:
    if strategy.moments == "fp8":
        return math.lcm(ALIGNMENT, strategy.fp8_group_size)
    return ALIGNMENT


class BufferRows(NamedTuple):
    """A bucket's values that live in another flat buffer: entry e's elements [0, numel_e) sit at
    ``source[source_starts[e] : source_starts[e] + numel_e]``, and at the bucket's offsets in its own
    layout. Viewed as rows of ``width`` elements (the bucket's alignment, so that each row belongs to
    one entry), each row is a contiguous run of the source: each element finds its entry by a binary
    search of its row in the entries' first rows (inside the step's kernels: a few loads from a
    table of a few words per entry, no per-row table and no kernel of its own), and its source
    index arithmetically. :meth:`read` gathers the bucket-shaped values, :meth:`write` stores them
    back. Both run inside compiled steps; indices are int64 (megatron's buffers can exceed 2^31
    elements)."""

    source: torch.Tensor
    first_rows: torch.Tensor
    """[entries] int32: the first row of each entry in the bucket (at least two entries: :meth:`Bucket.rows_in`)."""
    source_starts: torch.Tensor
    """[entries] int64: where each entry starts in ``source``."""
    numels: torch.Tensor
    """[entries] int64: elements of each entry."""
    width: int
    first_row: torch.Tensor
    """0-d int32 host tensor: the bucket row where a call's values start (a window of the bucket)."""

    def from_row(self, row: int) -> BufferRows:
        """The same rows for a call that starts at bucket row ``row``."""
        return self._replace(first_row=torch.tensor(row, dtype=torch.int32))

    def _elements(self, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per element of a call of ``numel`` elements: its row's source start, its row's last valid
        column, and its column (elements counted in int64, rows in int32). Per element throughout (a
        tensor of one value per row would be stored by a kernel of its own, and would specialise the
        step on a call of one row)."""
        element = torch.arange(numel, dtype=torch.int64, device=self.source.device)
        row = (element // self.width).to(torch.int32) + self.first_row
        owner = torch.searchsorted(self.first_rows, row, right=True, out_int32=True) - 1
        done = (row - self.first_rows[owner]).to(torch.int64) * self.width
        last = torch.clamp(self.numels[owner] - done, max=self.width) - 1
        return self.source_starts[owner] + done, last, element % self.width

    def read(self, shape: torch.Size) -> torch.Tensor:
        """The bucket's values in ``shape`` (padding elements zero)."""
        start, last, column = self._elements(math.prod(shape))
        values = self.source[start + torch.minimum(column, last)]
        return torch.where(column <= last, values, 0).view(shape)

    def write(self, values: torch.Tensor) -> None:
        """Store the bucket-shaped ``values`` back into the source. A padding element is written to
        its row's last valid element with that element's value, so that duplicate indices always
        carry equal values and the result does not depend on the order of the stores. An
        ``index_put_``, which Inductor compiles to stores into the source itself; under
        ``torch.use_deterministic_algorithms`` (where Inductor would fall back to ATen's
        ``index_put_``, which sorts its indices on CUDA) a ``scatter_``, which Inductor compiles to
        plain stores, but into a copy of the whole source, copied back (its functional form is not
        made in place again): two more kernels that move the whole buffer."""
        start, last, column = self._elements(values.numel())
        valid_column = torch.minimum(column, last)
        index = start + valid_column
        element = torch.arange(values.numel(), dtype=torch.int64, device=values.device)
        written = values.reshape(-1)[element - column + valid_column]
        if torch.are_deterministic_algorithms_enabled():
            self.source.scatter_(0, index, written)
        else:
            self.source.index_put_((index,), written)


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
    grad_rows: tuple[list[int], BufferRows] | None = field(default=None, repr=False)
    """The gradients' source starts and :class:`BufferRows` when they live in another buffer."""
    per_group_scalars: bool = False
    """Whether its calls take each element's scalars from its entry's parameter group (a distributed
    optimizer's shard, whose entries may belong to several groups) rather than one group's."""

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

    def group_runs(self) -> list[tuple[int, int, int]]:
        """(group, first entry, end entry) of each run of entries of one parameter group."""
        runs: list[tuple[int, int, int]] = []
        for index, group in enumerate(self.entry_groups):
            if runs and runs[-1][0] == group:
                runs[-1] = (group, runs[-1][1], index + 1)
            else:
                runs.append((group, index, index + 1))
        return runs

    def rows_in(self, source: torch.Tensor, source_starts: list[int]) -> BufferRows:
        """A :class:`BufferRows` for this bucket's entries at ``source_starts`` of the flat ``source``
        (rows of :data:`ALIGNMENT`, a divisor of every entry's offset). The tables of a bucket of one
        entry hold it twice (the search finds the second, equal copy): a compiled step specialises a
        size of one and would compile again for it."""
        device = source.device
        first_rows, numels = [offset // ALIGNMENT for offset in self.offsets], list(self.numels)
        if len(first_rows) == 1:
            first_rows, source_starts, numels = first_rows * 2, list(source_starts) * 2, numels * 2
        return BufferRows(
            source,
            torch.tensor(first_rows, dtype=torch.int32, device=device),
            torch.tensor(source_starts, dtype=torch.int64, device=device),
            torch.tensor(numels, dtype=torch.int64, device=device),
            ALIGNMENT,
            torch.tensor(0, dtype=torch.int32),
        )


def zero_state(
    strategy: PrecisionStrategy, numel: int, like: torch.Tensor, fp8_groups: int | None = None
) -> dict[str, torch.Tensor]:
    """Every flat state buffer of ``strategy`` but the master, zero (FP8: zero payloads, scale and k of
    an all-zero group), for ``numel`` elements of 16-bit parameters like ``like``, on its device.
    ``fp8_groups`` defaults to ``numel`` cut into consecutive groups."""
    state: dict[str, torch.Tensor] = {}
    for moment in strategy.moment_names:
        if strategy.moments == "fp8":
            zeros = quantized_zeros(
                numel, strategy.fp8_format, strategy.fp8_group_size, strategy.fp8_expand, like.device, fp8_groups
            )
            for part in FP8_PARTS:
                if getattr(zeros, part) is not None:
                    state[f"{moment}_{part}"] = getattr(zeros, part)
        else:
            state[moment] = like.new_zeros(numel, dtype=like.dtype if strategy.moments == "low" else torch.float32)
    for key in LOW_COMPONENTS:
        if key in state_keys(strategy):
            state[key] = like.new_zeros(numel)
    return state


def state_dtypes(strategy: PrecisionStrategy, param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each state buffer of ``strategy`` for 16-bit parameters of ``param_dtype``, in
    :func:`state_keys` order."""
    dtypes = {key: value.dtype for key, value in zero_state(strategy, 0, torch.empty(0, dtype=param_dtype)).items()}
    if strategy.master_weights:
        dtypes[master_key(strategy)] = new_master(strategy, 0, torch.empty(0)).dtype
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
) -> tuple[Bucket, list[dict[str, Any]]]:
    """A bucket for ``params`` (same device and dtype) and each entry's state of views into it.
    ``streams`` defaults to a whole stream per parameter, numbered by position. ``runs``: the
    entries are runs (first element, elements) of the parameters' flattened elements rather than
    whole parameters; their masters start from ``master_source`` (the runs' 16-bit values).
    ``entry_groups``: each entry's parameter group (default: ``group_index``); given, the bucket's
    calls take per-group scalars (:attr:`Bucket.per_group_scalars`)."""
    if streams is None:
        streams = [StreamLayout.whole(index, param.numel()) for index, param in enumerate(params)]
    if runs is None:
        runs = [(0, param.numel()) for param in params]
    alignment = bucket_alignment(strategy)
    offsets, numel = [], 0
    for _, run_numel in runs:
        offsets.append(numel)
        numel += -(-run_numel // alignment) * alignment
    bucket = Bucket(
        group_index, list(params), offsets, numel, list(streams), zero_state(strategy, numel, params[0]),
        [run_numel for _, run_numel in runs], [start for start, _ in runs], entry_groups or [group_index] * len(params),
        per_group_scalars=entry_groups is not None,
    )
    if strategy.master_weights:
        master = new_master(strategy, numel, params[0])
        sources = master_source or [param.detach().reshape(-1) for param in params]
        for index, source in enumerate(sources):
            reset_master_(source, bucket.view(master, index))
        bucket.state[master_key(strategy)] = master
    bucket.state = {key: bucket.state[key] for key in state_keys(strategy)}
    if own_params:
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


def gather_grads(bucket: Bucket) -> torch.Tensor | BufferRows | None:
    """The bucket's gradients for a fused step, or ``None`` if some parameter has no gradient or the
    gradients do not share one dtype. Without a copy where possible: the bucket's own gradient buffer
    when the gradients are its views (after the first step of a plain training loop); a
    :class:`BufferRows` when they are contiguous views of one other buffer (megatron DDP's
    ``main_grad``). Otherwise they are copied into the bucket's buffer and re-pointed at it, so that
    later backward passes accumulate there directly."""
    grads = [param.grad for param in bucket.params]
    if any(grad is None for grad in grads) or len({grad.dtype for grad in grads}) != 1:
        return None
    if bucket.grad_buffer is not None and bucket.grad_buffer.dtype == grads[0].dtype and all(
        grad.data_ptr() == bucket.view(bucket.grad_buffer, index).data_ptr() and grad.is_contiguous()
        for index, grad in enumerate(grads)
    ):
        return bucket.grad_buffer
    rows = None
    if len(grads) > 1 or grads[0].untyped_storage().nbytes() > grads[0].nbytes:
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
