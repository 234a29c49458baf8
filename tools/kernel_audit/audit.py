"""Audit of the fused optimizer step's CUDA kernels, generated on this machine (``codegen.py``).

For every option and master storage, plain bucket and distributed-optimizer shard, sm_90 and sm_80,
the rules:

* ``compiles``: every kernel compiles for the architecture (the rules on PTX fail for one that does not);
* ``instructions``: no approximate or flushing floating-point instruction (:data:`FORBIDDEN`) and no
  contracted multiply-add (the step plans none: TwoProdFMA is computed exactly in a wider format),
  but for the BF16 adds and products that LLVM narrows from FP32 ones (:func:`narrowed_bf16_operations`);
* ``fp32 only``: no FP64 arithmetic (it runs at 1/64 of FP32 on L4, L40S and RTX cards);
* ``one launch``: one kernel launch per bucket (per shard) in a step;
* ``no recompilation``: a later step, another learning rate, another parameter group's scalars, a
  bucket of one FP8 group and (shards) a shard of two parameter groups reuse the first step's code;
* ``bytes``: the global memory traffic per element, from every ``ld.global``/``st.global`` of the
  PTX (vector widths counted, a static count per thread over the elements each thread handles),
  equals the minimum of the option's state layout (:func:`layout_bytes`). A load whose address the
  kernel's Triton source computes from the element's 128-element group or 64-element row alone
  (directly, or through values loaded per group or row: a table of one value per row, then small
  per-entry tables) reads one address per group or row, so it counts once per group or row
  (:func:`source_loads`); this applies only where
  every load of the PTX is one of the source's, once per element (no hidden search). In a kernel
  over rows of one group each (a reduction whose ``r0_numel`` is 128: FP8 group statistics), a load
  or store at the row's address is once per group, and each thread accesses it once per row it
  holds: counted once per group where the PTX holds exactly the source's element accesses once
  per element plus its group accesses a whole number of times (:func:`access_counts`).

Option D runs torch's own fused AdamW (no generated kernel): its bytes are its layout's.

Muon's fused step (:func:`audit_muon`: its two compiled calls per bucket around Newton-Schulz, whose
matmuls stay eager) is held to the same rules for every option and master storage over a plain
bucket and over its bucket in megatron's shard-aligned layer-wise layout (kind ``shard``: whole
parameters left in DDP's buffer, the bucket laid out in place there, ``Muon(params_in_buffer=True)``)
(``one launch``: one per call, two per bucket; ``bytes``: each call's against
:func:`muon_layout_bytes`, which counts the BF16 direction the momentum call hands Newton-Schulz and
the FP32 orthogonalized step the update call takes from it).

Run ``python -m tools.kernel_audit.audit`` from the repository root for the tables (``--help`` for a
subset; ``--interpret`` also runs the kernels under Triton's interpreter, ``interpret.py``;
``--markdown docs/results`` writes them as ``kernel_audit.md`` and ``kernel_audit_muon.md``, stamped
with where and from what they were generated).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import datetime
import multiprocessing
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tools.kernel_audit.codegen import (
    ARCHES,
    CALLS_PER_STEP,
    KINDS,
    Kernel,
    StepCode,
    generate_for,
    generate_function,
)
from megatron_lowprec.numerics import quant, square_sum
from megatron_lowprec.numerics.compiled import inductor_options
from megatron_lowprec.numerics.elementary import ieee_fp32_division
from megatron_lowprec.megatron.layout import ROW
from megatron_lowprec.optim.buckets import ALIGNMENT
from megatron_lowprec.optim.kernel import GROUP_SLOT_TABLE_BYTES, SR_GROUP_TABLE_BYTES, SR_ROW_TABLE_BYTES
from megatron_lowprec.optim.strategies import (
    LOW_PRECISION_BYTES,
    PrecisionStrategy,
    available_strategies,
    get_strategy,
)

FORBIDDEN = ("div.full", "div.approx", "rcp.approx", "sqrt.approx", "ex2.approx", "lg2.approx", ".ftz", "fma.")
"""PTX instruction fragments no step kernel may hold."""

FP64_ARITHMETIC = re.compile(r"\b(?:add|sub|mul|div|sqrt|fma|rcp)\.[\w.]*f64\b")

RULES = ("compiles", "instructions", "fp32 only", "one launch", "no recompilation", "bytes")

OPTIMIZERS = ("adamw", "muon")
"""Whose fused step the audit generates (``codegen.OPTIMIZERS``)."""

MUON_CALLS = ("momentum", "update")
"""Muon's compiled calls over a bucket, in the order of a step (the compiled graphs 0 and 1)."""

DIRECTION_BYTES = 2
"""The BF16 direction M per element that Muon's momentum call writes for Newton-Schulz."""

ORTHOGONAL_STEP_BYTES = 4
"""The FP32 step -lr·s·O per element that Muon's update call reads from Newton-Schulz."""

H100_BANDWIDTH = 3.35e12
"""Bytes per second of an H100 SXM's HBM3, for the roofline time."""

ROOFLINE_PARAMETERS = 1.3e9

_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")

GROUP = ALIGNMENT
"""Elements of an FP8 group, the rows of a kernel over groups (:func:`group_rows`)."""

GRANULARITIES = ("scalar", "group", "row", "element")
"""What a value of a kernel's source varies with, coarsest first: a ``group`` of :data:`GROUP`
elements, a ``row`` of :data:`~megatron_lowprec.megatron.layout.ROW` (a per-row table's lookups)."""


def configurations() -> list[tuple[str, str]]:
    """(option, master storage) of every registered option: ``fp32``, and ``remainder`` where the
    option keeps an FP32 master (``PrecisionStrategy.with_master_storage``); an option registered with
    another storage (res8's ``residual8``) in that one alone, its other forms being another option's
    kernels (coat's)."""
    pairs = []
    for strategy in available_strategies():
        if strategy.master_storage not in ("fp32", "remainder"):
            storages = (strategy.master_storage,)
        else:
            storages = ("fp32", "remainder") if strategy.master_weights else ("fp32",)
        pairs.extend((strategy.name, storage) for storage in storages)
    return pairs


def strategy_for(option: str, master_storage: str) -> PrecisionStrategy:
    """The registered ``option`` with its FP32 master stored as ``master_storage``."""
    strategy = get_strategy(option)
    return strategy if strategy.master_storage == master_storage else strategy.with_master_storage(master_storage)


def layout_bytes(strategy: PrecisionStrategy, kind: str = "plain") -> tuple[float, float]:
    """The least bytes per element one step reads and writes, from the option's state layout: the
    16-bit gradient and every state buffer read; the 16-bit parameter read unless an FP32 master
    replaces it; the parameter and every state buffer written. FP8 group metadata (scale, expansion
    exponent) per group of ``fp8_group_size`` elements. Stochastic rounding with shared randomness:
    the stream tables each row reads (``SR_ROW_TABLE_BYTES``: its entry, and that entry's place in
    its stream and round keys; rows of ``ALIGNMENT`` elements, of ``ROW`` in a shard; with FP8
    moments ``SR_GROUP_TABLE_BYTES`` per FP8 group: its entry, first index and round keys,
    :func:`stream_table_bytes`). A ``shard`` step (its state laid out in place in
    megatron's buffers, its entries of several parameter groups) also reads each row's parameter
    group (``GROUP_SLOT_TABLE_BYTES``; per FP8 group where the step runs over groups), but for
    torch's fused AdamW (D), which steps each group's entries apart."""
    group = strategy.fp8_group_size
    state = strategy.state_bytes(group) / group
    param_read = 0 if strategy.master_bytes == 4 else LOW_PRECISION_BYTES
    stream_tables = stream_table_bytes(strategy, kind)
    slot_rows = strategy.fp8_group_size if strategy.moments == "fp8" else ROW
    group_slots = GROUP_SLOT_TABLE_BYTES / slot_rows if kind == "shard" and strategy.adam_kernel != "torch_fused" else 0
    return LOW_PRECISION_BYTES + param_read + state + stream_tables + group_slots, LOW_PRECISION_BYTES + state


def stream_table_bytes(strategy: PrecisionStrategy, kind: str = "plain") -> float:
    """Bytes per element of stochastic rounding's stream tables (0 without it): ``SR_ROW_TABLE_BYTES``
    per row (``ALIGNMENT`` elements, ``ROW`` in a shard), or with FP8 moments, whose step runs over
    FP8 groups, ``SR_GROUP_TABLE_BYTES`` per group."""
    if strategy.param_update != "stochastic":
        return 0
    if strategy.moments == "fp8":
        return SR_GROUP_TABLE_BYTES / strategy.fp8_group_size
    return SR_ROW_TABLE_BYTES / (ROW if kind == "shard" else ALIGNMENT)


def muon_layout_bytes(strategy: PrecisionStrategy, kind: str = "plain") -> dict[str, tuple[float, float]]:
    """The least bytes per element each of Muon's calls reads and writes (``strategy``: a
    ``muon_strategy``), by :data:`MUON_CALLS`. ``momentum``: read the 16-bit gradient and the
    momentum, write the momentum and the BF16 direction (:data:`DIRECTION_BYTES`). ``update``: read
    the FP32 orthogonalized step (:data:`ORTHOGONAL_STEP_BYTES`), the 16-bit parameter unless an FP32
    master replaces it and the rest of the state (master, δθ or Kahan compensation), write the
    parameter and that state; stochastic rounding's stream tables as in :func:`layout_bytes` (per
    row of ``ROW`` elements in megatron's layout, ``kind="shard"``). FP8 momentum: its group metadata
    per ``fp8_group_size`` elements."""
    group = strategy.fp8_group_size
    momentum = strategy.moment_bytes(group) / group
    rest = strategy.state_bytes(group) / group - momentum
    param_read = 0 if strategy.master_bytes == 4 else LOW_PRECISION_BYTES
    stream_tables = stream_table_bytes(strategy, kind)
    return {
        "momentum": (LOW_PRECISION_BYTES + momentum, momentum + DIRECTION_BYTES),
        "update": (ORTHOGONAL_STEP_BYTES + param_read + rest + stream_tables, LOW_PRECISION_BYTES + rest),
    }


_BF16_FMA = re.compile(r"^\s*fma\.rn\.bf16\s+%\w+,\s*(%\w+),\s*(%\w+),\s*(%\w+);\s*$", re.MULTILINE)
_BF16_CONSTANT = re.compile(r"mov\.b16\s+(%rs\d+),\s*(0x[0-9A-Fa-f]{4});")
BF16_UNITS, BF16_NEGATIVE_ZERO = (0x3F80, 0xBF80), 0x8000
"""BF16 patterns of ±1.0 (the factor of a narrowed add or subtraction) and of -0.0 (the addend of a narrowed product)."""


def narrowed_bf16_operations(ptx: str) -> list[str]:
    """The ``fma.rn.bf16`` lines of ``ptx`` that are one BF16 add or subtraction (a factor ±1.0) or one
    BF16 product (an addend -0.0): LLVM narrows an FP32 add, subtraction or product of two BF16 values that is
    rounded to BF16 into the BF16 operation, which sm_80 runs as such an FMA (sm_90 has ``add.rn.bf16`` and
    ``mul.rn.bf16``). The bits are those of the FP32 operation then the rounding: rounding twice,
    first to 24 bits, gives the correctly rounded 8-bit result of a sum or product of 8-bit values
    (24 >= 2 x 8 + 2; the audit's tests check it against exact rationals), and the
    multiply by ±1.0 or add of -0.0 is exact."""
    constants = {register: int(value, 16) for register, value in _BF16_CONSTANT.findall(ptx)}
    return [
        match.group(0).strip() for match in _BF16_FMA.finditer(ptx)
        if {constants.get(match.group(1)), constants.get(match.group(2))} & set(BF16_UNITS)
        or constants.get(match.group(3)) == BF16_NEGATIVE_ZERO
    ]


def forbidden_instructions(ptx: str) -> list[str]:
    """The fragments of :data:`FORBIDDEN` that occur in ``ptx``, leaving out its
    :func:`narrowed_bf16_operations`."""
    for line in narrowed_bf16_operations(ptx):
        ptx = ptx.replace(line, "")
    return [
        fragment for fragment in FORBIDDEN
        if re.search(re.escape(fragment) if fragment.startswith(".") else r"\b" + re.escape(fragment), ptx)
    ]


def access_bytes(ptx: str) -> tuple[int, int]:
    """Bytes one thread reads and writes in global memory: each ``ld.global``/``st.global`` of the
    PTX once (a static count), its vector width times its type's width."""
    totals = {"ld": 0, "st": 0}
    for kind, suffixes in _GLOBAL_ACCESS.findall(ptx):
        parts = suffixes.split(".")
        vector = next((int(part[1:]) for part in parts if re.fullmatch(r"v\d", part)), 1)
        width = next((int(part[1:]) for part in parts if re.fullmatch(r"[bufs]\d+", part)), None)
        if width is None:
            raise ValueError(f"a global {kind} without a type: {kind}.global{suffixes}")
        totals[kind] += vector * width // 8
    return totals["ld"], totals["st"]


def _value_bytes(pointer_type: str) -> int:
    """Bytes of one value of a Triton pointer type of the signature (``*bf16`` -> 2, ``*fp8e4nv`` -> 1)."""
    bits = re.search(r"\d+", pointer_type)
    if bits is None:
        raise ValueError(f"a pointer type without a width: {pointer_type}")
    return max(1, int(bits.group()) // 8)


def source_loads(source: str) -> list[tuple[str, int, str]]:
    """Each ``tl.load`` of an Inductor kernel's Triton source: (pointer, bytes per value, what its
    address varies with, one of :data:`GRANULARITIES`) (:func:`source_accesses`)."""
    return source_accesses(source)[0]


def group_rows(source: str) -> bool:
    """Whether the kernel runs over rows of one :data:`GROUP`-element group each: a reduction kernel
    whose reduced extent ``r0_numel`` is the group (its x index counts groups)."""
    return re.search(rf"^\s*r0_numel = {GROUP}$", source, flags=re.M) is not None


def source_accesses(source: str) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """Each ``tl.load`` and each ``tl.store`` of an Inductor kernel's Triton source: (pointer, bytes
    per value, what its address varies with, one of :data:`GRANULARITIES`). The element index
    (``xindex``, also plus a scalar: a call's place in its rows) shifted right by at least
    log2(:data:`GROUP`) bits or divided by a multiple of it is a ``group`` value, by at least
    log2(``ROW``) bits or a multiple of it a ``row`` value; in a kernel over :func:`group_rows`,
    ``xindex`` itself is a ``group`` value (``r0_index`` is the
    element's place in its group); a value computed from group values, scalars and constants, or
    loaded at a group address, is a group value too; anything else computed from the element index
    is an ``element`` value (so are reductions' indices and the results of helpers such as a binary
    search)."""
    signature = dict(re.findall(r"'(\w+)': '(\*\w+)'", source))
    body = source.split("@triton.jit", 1)[-1]
    rows = group_rows(body)
    constants: dict[str, int] = {}
    granularity: dict[str, str] = {}
    index_names: set[str] = set()
    loads, stores = [], []

    def coarsest_covering(expression: str) -> str:
        names = re.findall(r"\b[A-Za-z_]\w*\b", expression)
        levels = [GRANULARITIES.index(granularity[name]) for name in names if name in granularity]
        return GRANULARITIES[max(levels, default=0)]

    def divided_into(operator: str, operand: str) -> str | None:
        value = constants.get(operand, int(operand) if re.fullmatch(r"\d+", operand) else None)
        if value is None or value <= 0:
            return None
        divisor = 1 << value if operator == ">>" else value
        return "group" if divisor % GROUP == 0 else "row" if divisor % ROW == 0 else None

    for line in body.splitlines():
        store = re.fullmatch(r"\s*tl\.store\((\w+) \+ \((.*?)\), .*", line)
        if store:
            pointer, address = store.groups()
            stores.append((pointer, _value_bytes(signature.get(pointer, "*i8")), coarsest_covering(address)))
            continue
        match = re.fullmatch(r"\s*(\w+) = (.+)", line)
        if match is None:
            continue
        name, expression = match.groups()
        full = re.fullmatch(r"tl\.full\(\[[^\]]*\], (-?\d+), tl\.\w+\)", expression)
        shift = re.fullmatch(r"\(?(\w+)\)? (>>|//) \(?(\w+)\)?", expression)
        offset = re.fullmatch(r"(\w+) \+ (\w+)", expression)
        load = re.match(r"tl\.load\((\w+) \+ \((.*?)\), ", expression)
        if full:
            constants[name] = int(full.group(1))
            granularity[name] = "scalar"
        elif rows and re.fullmatch(r"xoffset \+ tl\.arange\(.*", expression):
            granularity[name] = "group"
        elif rows and re.fullmatch(r"tl\.arange\(0, R0_BLOCK\).*", expression):
            granularity[name] = "element"
        elif re.fullmatch(r"xoffset \+ tl\.arange\(.*", expression) or expression in index_names:
            index_names.add(name)
            granularity[name] = "element"
        elif re.fullmatch(r"\((\w+)\)\.to\(tl\.u?int(?:32|64)\)", expression) and expression[1:].split(")")[0] in index_names:
            index_names.add(name)
            granularity[name] = "element"
        elif offset and {offset.group(1), offset.group(2)} & index_names and "element" not in {
            granularity.get(operand, "element") for operand in {offset.group(1), offset.group(2)} - index_names
        }:
            index_names.add(name)
            granularity[name] = "element"
        elif shift and shift.group(1) in index_names and divided_into(shift.group(2), shift.group(3)):
            granularity[name] = divided_into(shift.group(2), shift.group(3))
        elif load:
            pointer, address = load.groups()
            level = coarsest_covering(address)
            loads.append((pointer, _value_bytes(signature.get(pointer, "*i8")), level))
            granularity[name] = level
        else:
            granularity[name] = coarsest_covering(expression)
    return loads, stores


def _counted_per_element(
    ptx_bytes: int, accesses: list[tuple[str, int, str]], elements_per_thread: float, rows: bool, credit_pointwise: bool
) -> tuple[float, float]:
    """Bytes per element of one direction of a kernel: (all of them, those at group and row addresses
    counted once per group or row), from the PTX's static count per thread ``ptx_bytes`` and the
    source's ``accesses`` of that direction. Over :func:`group_rows`: where the PTX holds the
    element accesses once per element and the group accesses a whole number of times, at least one
    and at most the thread's elements (once per row a thread holds). Otherwise (``credit_pointwise``): where the PTX holds every access once per
    element. Else the PTX's count per element, nothing credited."""
    per_element = ptx_bytes / elements_per_thread
    element = sum(size for _, size, level in accesses if level == "element")
    grouped = sum(size for _, size, level in accesses if level == "group")
    rowed = sum(size for _, size, level in accesses if level == "row")
    if rows:
        remainder = ptx_bytes - element * elements_per_thread
        per_row = remainder / grouped if grouped else None
        if (grouped == 0 and abs(remainder) < 1e-9) or (
            per_row is not None and 1 <= per_row <= elements_per_thread and abs(per_row - round(per_row)) < 1e-9
        ):
            return element + grouped / GROUP, grouped / GROUP
        return per_element, 0.0
    shared = grouped / GROUP + rowed / ROW
    if credit_pointwise and grouped + rowed and abs(per_element - element - grouped - rowed) < 1e-9:
        return per_element - grouped - rowed + shared, shared
    return per_element, 0.0


def read_bytes(kernel_ptx: str, source: str, elements_per_thread: float) -> tuple[float, float]:
    """Bytes per element one kernel reads: (all of them, those at group addresses counted once per
    :data:`GROUP` elements). The PTX's static count per element, and, where every one of its loads
    is one of the source's once per element, the same with :func:`source_loads`'s group loads
    counted once per group; over :func:`group_rows`, see :func:`_counted_per_element`."""
    loads, _ = access_bytes(kernel_ptx)
    return _counted_per_element(loads, source_accesses(source)[0], elements_per_thread, group_rows(source), True)


def write_bytes(kernel_ptx: str, source: str, elements_per_thread: float) -> tuple[float, float]:
    """Bytes per element one kernel writes: (all of them, those at group addresses counted once per
    :data:`GROUP` elements). The PTX's static count per element; over :func:`group_rows`, a store
    at the row's address counted once per group (:func:`_counted_per_element`). A pointwise kernel's
    store is per element whatever its address."""
    _, stores = access_bytes(kernel_ptx)
    return _counted_per_element(stores, source_accesses(source)[1], elements_per_thread, group_rows(source), False)


@dataclasses.dataclass
class Check:
    """One rule on one generated step."""

    option: str
    master_storage: str
    kind: str
    arch: int
    rule: str
    passed: bool
    detail: str


@dataclasses.dataclass
class StepAudit:
    """The audit of one (option, master storage, kind, arch): its checks and its measured bytes."""

    code: StepCode
    checks: list[Check]
    bytes_read: float | None
    bytes_written: float | None
    layout: tuple[float, float]
    call_bytes: dict[str, tuple[float, float]] | None = None
    """Muon: the measured (read, written) bytes per element of each of :data:`MUON_CALLS`."""
    call_layout: dict[str, tuple[float, float]] | None = None
    """Muon: :func:`muon_layout_bytes`."""

    def check(self, rule: str) -> Check:
        return next(check for check in self.checks if check.rule == rule)


def _kernel_bytes(kernels: list[Kernel]) -> tuple[float, float, float, float]:
    """(read, read once per group, written, written once per group) bytes per element of the
    ``kernels`` of one call, each counted once per launch (:func:`read_bytes`, :func:`write_bytes`)."""
    read = written = grouped = grouped_written = 0.0
    for kernel in kernels:
        kernel_read, kernel_grouped = read_bytes(kernel.ptx, kernel.source, kernel.elements_per_thread)
        kernel_written, kernel_grouped_written = write_bytes(kernel.ptx, kernel.source, kernel.elements_per_thread)
        read += kernel.launches * kernel_read
        grouped += kernel.launches * kernel_grouped
        written += kernel.launches * kernel_written
        grouped_written += kernel.launches * kernel_grouped_written
    return read, grouped, written, grouped_written


def _bytes_detail(read: float, grouped: float, written: float, grouped_written: float, layout: tuple[float, float]) -> str:
    shared = f" ({grouped:g} of it read once per group or row)" if grouped else ""
    shared_written = f" ({grouped_written:g} of it written once per group or row)" if grouped_written else ""
    return f"read {read:g}{shared} + written {written:g}{shared_written} B/element; layout minimum {layout[0]:g} + {layout[1]:g}"


def _equal_bytes(measured: tuple[float, float], layout: tuple[float, float]) -> bool:
    return abs(measured[0] - layout[0]) < 1e-9 and abs(measured[1] - layout[1]) < 1e-9


def audit_step(code: StepCode) -> StepAudit:
    """Apply :data:`RULES` to one generated step."""
    strategy = strategy_for(code.option, code.master_storage)
    if code.optimizer == "muon":
        from megatron_lowprec.optim.muon import muon_strategy

        strategy = muon_strategy(strategy)
    layout = layout_bytes(strategy, code.kind)
    calls = CALLS_PER_STEP[code.optimizer]
    kernels = code.first_step_kernels
    torch_kernel = strategy.adam_kernel == "torch_fused"

    def check(rule: str, passed: bool, detail: str) -> Check:
        return Check(code.option, code.master_storage, code.kind, code.arch, rule, passed, detail)

    checks = [check("compiles", not code.compile_errors, "; ".join(f"{k}: {e}" for k, e in code.compile_errors.items()))]
    unchecked = [f"not compiled: {key}" for key in code.compile_errors]
    found = sorted({fragment for kernel in code.kernels for fragment in forbidden_instructions(kernel.ptx)})
    checks.append(check("instructions", not found and not unchecked, ", ".join(found + unchecked)))
    fp64 = sorted({match for kernel in code.kernels for match in FP64_ARITHMETIC.findall(kernel.ptx)})
    checks.append(check("fp32 only", not fp64 and not unchecked, ", ".join(fp64 + unchecked)))
    first = code.steps[0]
    if torch_kernel:
        checks.append(check("one launch", True, "torch's fused AdamW (multi-tensor launches, not generated)"))
    else:
        checks.append(check(
            "one launch", first.launches == calls and first.new_graphs == calls, f"{first.launches} launches, {calls} calls"
        ))
    recompiled = [step.label for step in code.steps[1:] if step.new_graphs]
    checks.append(check("no recompilation", not recompiled, ", ".join(recompiled)))
    if code.optimizer == "muon":
        return _muon_bytes(code, strategy, checks, check)
    if torch_kernel:
        read, written = layout
        codec = " (the remainder's join and split kernels around it not counted)" if kernels else ""
        checks.append(check("bytes", True, f"torch's fused AdamW, not generated: its layout's bytes{codec}"))
    elif code.compile_errors or not kernels:
        read = written = None
        checks.append(check("bytes", False, "no compiled kernel"))
    elif first.launches != 1:
        read = written = None
        checks.append(check("bytes", False, f"{first.launches} launches over rows and elements: not attributable per element"))
    else:
        read, grouped, written, grouped_written = _kernel_bytes(kernels)
        checks.append(check(
            "bytes", _equal_bytes((read, written), layout), _bytes_detail(read, grouped, written, grouped_written, layout)
        ))
    return StepAudit(code, checks, read, written, layout)


def _muon_bytes(code: StepCode, strategy: PrecisionStrategy, checks: list[Check], check: Callable[..., Check]) -> StepAudit:
    """Muon's ``bytes`` rule: each call of the first step (graph i: the i-th of :data:`MUON_CALLS`)
    one kernel whose bytes per element are :func:`muon_layout_bytes`'s for that call."""
    call_layout = muon_layout_bytes(strategy, code.kind)
    layout = tuple(sum(call_layout[call][side] for call in MUON_CALLS) for side in (0, 1))
    kernels = code.first_step_kernels
    per_call = {call: [kernel for kernel in kernels if kernel.graph == graph] for graph, call in enumerate(MUON_CALLS)}
    if code.compile_errors or any(len(found) != 1 or found[0].launches != 1 for found in per_call.values()):
        counts = ", ".join(f"{call}: {sum(k.launches for k in found)} launches" for call, found in per_call.items())
        checks.append(check("bytes", False, f"not one compiled kernel per call ({counts})"))
        return StepAudit(code, checks, None, None, layout, None, call_layout)
    call_bytes, details = {}, []
    for call, found in per_call.items():
        read, grouped, written, grouped_written = _kernel_bytes(found)
        call_bytes[call] = (read, written)
        details.append(f"{call}: " + _bytes_detail(read, grouped, written, grouped_written, call_layout[call]))
    exact = all(_equal_bytes(call_bytes[call], call_layout[call]) for call in MUON_CALLS)
    checks.append(check("bytes", exact, "; ".join(details)))
    read, written = (sum(call_bytes[call][side] for call in MUON_CALLS) for side in (0, 1))
    return StepAudit(code, checks, read, written, layout, call_bytes, call_layout)


def audit_configuration(
    option: str, storage: str, kind: str, arches: tuple[int, ...], optimizer: str = "adamw", fx_cache: str | None = None
) -> list[StepAudit]:
    """Generate one (option, master storage, kind) of ``optimizer``'s fused step for ``arches`` and
    audit it (compiled binaries dropped, so that the result pickles across processes); ``fx_cache``:
    :func:`~tools.kernel_audit.codegen.cuda_codegen`'s."""
    audits = []
    for code in generate_for(option, storage, kind, arches, optimizer=optimizer, fx_cache=fx_cache).values():
        for kernel in code.kernels:
            kernel.asm = None
        audits.append(audit_step(code))
    return audits


def audit_muon(
    option: str, master_storage: str = "fp32", arches: tuple[int, ...] = ARCHES, kind: str = "plain"
) -> list[StepAudit]:
    """Muon's fused step of ``option`` over a ``kind`` bucket (``shard``: megatron's shard-aligned
    layer-wise layout), generated for ``arches`` and audited."""
    return audit_configuration(option, master_storage, kind, arches, optimizer="muon")


def run_audit(
    pairs: Iterable[tuple[str, str]] | None = None,
    kinds: Iterable[str] = KINDS,
    arches: tuple[int, ...] = ARCHES,
    workers: int = 1,
    muon_pairs: Iterable[tuple[str, str]] = (),
    muon_kinds: Iterable[str] = ("plain",),
    fx_cache: str | None = None,
    arches_for: Callable[[str, str, str, str], tuple[int, ...]] | None = None,
) -> list[StepAudit]:
    """Generate and audit every (option, master storage) of ``pairs`` (default :func:`configurations`)
    for each kind and arch, and Muon's step for each of ``muon_pairs`` and ``muon_kinds``, in
    ``workers`` processes (each generates whole configurations; results in the order of
    ``muon_pairs`` and ``muon_kinds``, then ``pairs`` and ``kinds``: Muon's first, so that the pool
    starts its longest tasks early); ``fx_cache``: :func:`~tools.kernel_audit.codegen.cuda_codegen`'s.
    ``arches_for(option, master_storage, kind, optimizer)``: the arches of one configuration, where
    not all of ``arches``."""
    def arches_of(option: str, storage: str, kind: str, optimizer: str) -> tuple[int, ...]:
        return tuple(arches) if arches_for is None else arches_for(option, storage, kind, optimizer)

    tasks = [
        (option, storage, kind, arches_of(option, storage, kind, "muon"), "muon", fx_cache)
        for option, storage in muon_pairs for kind in muon_kinds
    ]
    tasks += [
        (option, storage, kind, arches_of(option, storage, kind, "adamw"), "adamw", fx_cache)
        for option, storage in (configurations() if pairs is None else pairs) for kind in kinds
    ]
    if workers <= 1:
        results = [audit_configuration(*task) for task in tasks]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            results = list(pool.map(audit_configuration, *zip(*tasks)))
    return [audit for result in results for audit in result]


def roofline_ms(bytes_per_element: float) -> float:
    """Milliseconds of one optimizer step of :data:`ROOFLINE_PARAMETERS` parameters that moves
    ``bytes_per_element`` at :data:`H100_BANDWIDTH`."""
    return bytes_per_element * ROOFLINE_PARAMETERS / H100_BANDWIDTH * 1e3


def _rule_results(group: list[StepAudit]) -> list[str]:
    """Each rule's result over the arches of one configuration: ✓, or ✗ with the arches that fail."""
    results = []
    for rule in RULES:
        failing = [str(a.code.arch) for a in group if not a.check(rule).passed]
        results.append("✓" if not failing else "✗ sm_" + "/".join(failing))
    return results


def _by_configuration(audits: list[StepAudit], optimizer: str) -> dict[tuple[str, str, str], list[StepAudit]]:
    rows: dict[tuple[str, str, str], list[StepAudit]] = {}
    for audit in audits:
        code = audit.code
        if code.optimizer == optimizer:
            rows.setdefault((code.option, code.master_storage, code.kind), []).append(audit)
    return rows


def table(audits: list[StepAudit]) -> str:
    """A Markdown table of AdamW's steps: one row per option, master storage and kind (bytes at
    sm_90), with the roofline time of the layout's bytes and each rule's result (✓, or ✗ with the
    arches that fail)."""
    header = ["option", "master", "step", "layout B/elem (read+write)", "PTX B/elem (sm_90)", "1.3B step at 3.35 TB/s", *RULES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (option, storage, kind), group in _by_configuration(audits, "adamw").items():
        layout = group[0].layout
        measured = next((a for a in group if a.code.arch == 90), group[0])
        if strategy_for(option, storage).adam_kernel == "torch_fused":
            ptx = "torch's kernel"
        else:
            ptx = "—" if measured.bytes_read is None else f"{measured.bytes_read:g} + {measured.bytes_written:g}"
        lines.append(
            f"| {option} | {storage} | {kind} | {layout[0]:g} + {layout[1]:g} = {sum(layout):g} | {ptx} | "
            f"{roofline_ms(sum(layout)):.1f} ms | " + " | ".join(_rule_results(group)) + " |"
        )
    return "\n".join(lines)


def _call_bytes_text(read: float, written: float) -> str:
    return f"{read:g} + {written:g}"


def muon_table(audits: list[StepAudit]) -> str:
    """A Markdown table of Muon's fused steps: one row per option, master storage and kind, each call's
    layout bytes (:func:`muon_layout_bytes`) and PTX bytes at sm_90 (read + written), the step's
    total and its roofline time, and each rule's result (✓, or ✗ with the arches that fail)."""
    header = [
        "option", "master", "kind", "momentum call: layout B/elem", "update call: layout B/elem", "PTX B/elem (sm_90)",
        "layout total", "1.3B element-wise at 3.35 TB/s", *RULES,
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (option, storage, kind), group in _by_configuration(audits, "muon").items():
        layout = group[0].call_layout
        measured = next((a for a in group if a.code.arch == 90), group[0])
        ptx = "—" if measured.call_bytes is None else ", ".join(
            _call_bytes_text(*measured.call_bytes[call]) for call in MUON_CALLS
        )
        total = sum(group[0].layout)
        lines.append(
            f"| {option} | {storage} | {kind} | {_call_bytes_text(*layout['momentum'])} | {_call_bytes_text(*layout['update'])} | "
            f"{ptx} | {total:g} | {roofline_ms(total):.1f} ms | " + " | ".join(_rule_results(group)) + " |"
        )
    return "\n".join(lines)


def failures(audits: list[StepAudit]) -> list[Check]:
    return [check for audit in audits for check in audit.checks if not check.passed]


NORM_ELEMENTS = 1 << 20
"""Gradient elements of the generated exact norm: enough rows for Inductor to split their sum in two."""

TRITON_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def gradient_norm_reads(dtype: torch.dtype, windowed: bool = True, arch: int = 90) -> list[float]:
    """Bytes per gradient element that each kernel of the exact gradient norm on CUDA (the compiled
    digit sums of ``numerics/square_sum.py``: ``windowed``, the rows' windows, else every digit)
    reads, for the kernels that take the gradient: one kernel reading each value once is
    ``[dtype's size]``. The kernels after it read only its per-row or per-block sums."""
    function = square_sum._windowed_digit_sums if windowed else square_sum._torch_digit_sums
    with torch._inductor.config.patch(square_sum.COMPILE_OPTIONS):
        kernels = generate_function(function, ((NORM_ELEMENTS,),), dtype, arch)
    gradient = f"'in_ptr0': '{TRITON_POINTER_TYPES[dtype]}'"
    return [access_bytes(kernel.ptx)[0] / kernel.elements_per_thread for kernel in kernels if gradient in kernel.source]


ACTIVATION_ELEMENTS = 1 << 16
"""Elements of the activation whose FP8 quantization :func:`fp8_quantization_kernels` generates."""


def fp8_quantization_kernels(fp8_dtype: torch.dtype, group_size: int | None, arch: int = 90) -> list[Kernel]:
    """The CUDA kernels of COAT's FP8 quantization of a BF16 activation (``numerics/quant.py:
    quantize_rows``, compiled as on a GPU that converts FP8 in Triton): per tensor (``group_size``
    None: one row) or per 1 x ``group_size`` group."""
    shape = (1, ACTIVATION_ELEMENTS) if group_size is None else (ACTIVATION_ELEMENTS // group_size, group_size)
    with torch._inductor.config.patch(inductor_options()), ieee_fp32_division():
        return generate_function(functools.partial(quant._quantize_rows, fp8_dtype=fp8_dtype), (shape,), torch.bfloat16, arch)


def fp8_matrix_quantization_kernels(fp8_dtype: torch.dtype, arch: int = 90) -> list[Kernel]:
    """The CUDA kernels of COAT's per-tensor FP8 quantization of a BF16 linear-layer operand in both
    layouts (``numerics/quant.py: quantize_matrix``, the column count a constant as it marks it),
    compiled as on a GPU that converts FP8 in Triton."""
    function = functools.partial(quant._quantize_matrix, fp8_dtype=fp8_dtype, row_major=True, column_major=True)
    with torch._inductor.config.patch(inductor_options()), ieee_fp32_division():
        return generate_function(function, (MATRIX_SHAPE,), torch.bfloat16, arch, static_dims=(1,))


MATRIX_SHAPE = (4096, 2048)
"""A linear layer's input at GPT-1.3B's hidden size: tokens x hidden."""


MARKDOWN_FILES = {"adamw": "kernel_audit.md", "muon": "kernel_audit_muon.md"}
"""The result file of each optimizer's table under ``--markdown DIR``."""

MARKDOWN_TITLES = {"adamw": "Kernel audit: AdamW's fused step", "muon": "Kernel audit: Muon's fused step"}

MARKDOWN_LEGENDS = {
    "adamw": (
        "One row per option, master storage and step (a plain bucket, a distributed optimizer's shard): "
        "the bytes per element of the option's state layout, read + written; the bytes of every global "
        "load and store of the generated PTX at sm_90 (option D runs torch's own fused AdamW: no "
        "generated kernel); the step's time for 1.3B parameters at 3.35 TB/s (an H100's HBM3) from the "
        "layout's bytes; and each rule of the audit over the audited architectures (✓, or ✗ with the "
        "architectures that fail)."
    ),
    "muon": (
        "One row per option, master storage and kind (a plain bucket; `shard`: its bucket in megatron's "
        "layer-wise layout, laid out in place in DDP's buffer): the layout bytes per element, read + "
        "written, of Muon's two compiled calls around Newton-Schulz (momentum, update), the bytes of "
        "their generated PTX at sm_90, the total and its time for 1.3B parameters at 3.35 TB/s (an "
        "H100's HBM3), and each rule of the audit over the audited architectures (✓, or ✗ with the "
        "architectures that fail)."
    ),
}


def generation_stamp(command: str) -> str:
    """Where, when and from what the tables were generated: the UTC date, the machine, the torch and
    triton versions, the commit of the repository (with ``+ uncommitted changes`` where its tree
    differs) and ``command``."""
    import triton

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += " + uncommitted changes"
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs (kernels generated and compiled for the GPU architectures, none run)"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"- Generated: {date}\n- Machine: {machine}\n- torch {torch.__version__}, triton {triton.__version__}\n"
        f"- Commit: {commit}\n- Command: `{command}`"
    )


def markdown_report(optimizer: str, audits: list[StepAudit], stamp: str, extra: list[str] = ()) -> str:
    """The result file of ``optimizer``'s table: a title, the stamp, the legend, the table, ``extra``
    lines and the failing checks (or that none failed)."""
    rows = table(audits) if optimizer == "adamw" else muon_table(audits)
    failed = failures([audit for audit in audits if audit.code.optimizer == optimizer])
    verdict = "Every rule passes for every row." if not failed else "\n".join(
        f"- FAIL {check.option} ({check.master_storage}, {check.kind}, sm_{check.arch}) {check.rule}: {check.detail}"
        for check in failed
    )
    return "\n\n".join([f"# {MARKDOWN_TITLES[optimizer]}", stamp, MARKDOWN_LEGENDS[optimizer], rows, *extra, verdict]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_audit.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", help="an option (repeatable; default: every option)")
    parser.add_argument("--kind", action="append", choices=KINDS, help="plain or shard (default: both; Muon's shard: its bucket in megatron's layer-wise layout)")
    parser.add_argument("--arch", action="append", type=int, choices=ARCHES, help="compute capability (default: 90 and 80)")
    parser.add_argument(
        "--optimizer", action="append", choices=OPTIMIZERS, help="whose fused step (repeatable; default: AdamW's and Muon's)"
    )
    parser.add_argument("--workers", type=int, default=1, help="processes that generate configurations in parallel")
    parser.add_argument(
        "--interpret", action="store_true",
        help="also run the generated kernels under Triton's interpreter against the eager step (interpret.py)",
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="DIR",
        help=f"also write the tables as Markdown result files in DIR ({', '.join(MARKDOWN_FILES.values())}), stamped",
    )
    args = parser.parse_args(argv)
    pairs = configurations()
    if args.option:
        names = {get_strategy(option).name for option in args.option}
        pairs = [pair for pair in pairs if pair[0] in names]
    optimizers = args.optimizer or OPTIMIZERS
    adamw_pairs = pairs if "adamw" in optimizers else []
    muon_pairs = pairs if "muon" in optimizers else []
    audits = run_audit(adamw_pairs, args.kind or KINDS, tuple(args.arch or ARCHES), args.workers, muon_pairs, args.kind or KINDS)
    norm_lines = []
    if adamw_pairs:
        print(table(audits))
        for dtype in (torch.float32, torch.bfloat16):
            norm_lines.append(f"exact gradient norm, {dtype}: bytes read per gradient element by each kernel that reads it: "
                              f"{gradient_norm_reads(dtype)}")
            print(norm_lines[-1])
    if muon_pairs:
        print("Muon:")
        print(muon_table(audits))
    if args.markdown is not None:
        command = shlex.join(["python", "-m", "tools.kernel_audit.audit", *(sys.argv[1:] if argv is None else argv)])
        stamp = generation_stamp(command)
        args.markdown.mkdir(parents=True, exist_ok=True)
        for optimizer, extra in (("adamw", ["\n".join(f"- {line}" for line in norm_lines)]), ("muon", [])):
            if (adamw_pairs if optimizer == "adamw" else muon_pairs):
                (args.markdown / MARKDOWN_FILES[optimizer]).write_text(
                    markdown_report(optimizer, audits, stamp, extra), encoding="utf-8"
                )
    failed = failures(audits)
    for check in failed:
        print(f"FAIL {check.option} ({check.master_storage}, {check.kind}, sm_{check.arch}) {check.rule}: {check.detail}")
    differing = []
    if args.interpret:
        from tools.kernel_audit import interpret

        comparisons = interpret.run_comparisons(adamw_pairs, args.kind or KINDS, args.workers, muon_pairs, args.kind or KINDS)
        print(interpret.report(comparisons))
        differing = [result for result in comparisons if not result.identical]
    return 1 if failed or differing else 0


if __name__ == "__main__":
    sys.exit(main())
