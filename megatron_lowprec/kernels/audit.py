"""Audit of the fused optimizer step's CUDA kernels, generated on this machine (``codegen.py``).

For every option and master storage, plain bucket and distributed-optimizer shard, sm_90 and sm_80,
the rules (issue 27):

* ``compiles``: every kernel compiles for the architecture (the rules on PTX fail for one that does not);
* ``instructions``: no approximate or flushing floating-point instruction (:data:`FORBIDDEN`) and no
  contracted multiply-add (the step plans none: TwoProdFMA is computed exactly in a wider format);
* ``fp32 only``: no FP64 arithmetic (it runs at 1/64 of FP32 on L4, L40S and RTX cards);
* ``one launch``: one kernel launch per bucket (per shard) in a step;
* ``no recompilation``: a later step, another learning rate, another parameter group's scalars, a
  bucket of one FP8 group and (shards) a shard of two parameter groups reuse the first step's code;
* ``bytes``: the global memory traffic per element, from every ``ld.global``/``st.global`` of the
  PTX (vector widths counted, a static count per thread over the elements each thread handles),
  equals the minimum of the option's state layout (:func:`layout_bytes`).

Option D runs torch's own fused AdamW (no generated kernel): its bytes are its layout's.

Run ``python -m megatron_lowprec.kernels.audit`` for the table (``--help`` for a subset;
``--interpret`` also runs the kernels under Triton's interpreter, ``interpret.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import re
import sys
from collections.abc import Iterable

from megatron_lowprec.kernels.codegen import ARCHES, KINDS, StepCode, generate_for
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

H100_BANDWIDTH = 3.35e12
"""Bytes per second of an H100 SXM's HBM3, for the roofline time."""

ROOFLINE_PARAMETERS = 1.3e9

_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")


def configurations() -> list[tuple[str, str]]:
    """(option, master storage) of every registered option: ``fp32``, and ``remainder`` where the
    option keeps an FP32 master (``PrecisionStrategy.with_master_storage``)."""
    pairs = []
    for strategy in available_strategies():
        storages = ("fp32", "remainder") if strategy.master_weights else ("fp32",)
        pairs.extend((strategy.name, storage) for storage in storages)
    return pairs


def strategy_for(option: str, master_storage: str) -> PrecisionStrategy:
    """The registered ``option`` with its FP32 master stored as ``master_storage``."""
    strategy = get_strategy(option)
    return strategy if strategy.master_storage == master_storage else strategy.with_master_storage(master_storage)


def layout_bytes(strategy: PrecisionStrategy) -> tuple[float, float]:
    """The least bytes per element one step reads and writes, from the option's state layout: the
    16-bit gradient and every state buffer read; the 16-bit parameter read unless an FP32 master
    replaces it; the parameter and every state buffer written. FP8 group metadata (scale, expansion
    exponent) per group of ``fp8_group_size`` elements."""
    group = strategy.fp8_group_size
    state = strategy.state_bytes(group) / group
    param_read = 0 if strategy.master_bytes == 4 else LOW_PRECISION_BYTES
    return LOW_PRECISION_BYTES + param_read + state, LOW_PRECISION_BYTES + state


def forbidden_instructions(ptx: str) -> list[str]:
    """The fragments of :data:`FORBIDDEN` that occur in ``ptx``."""
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

    def check(self, rule: str) -> Check:
        return next(check for check in self.checks if check.rule == rule)


def audit_step(code: StepCode) -> StepAudit:
    """Apply :data:`RULES` to one generated step."""
    strategy = strategy_for(code.option, code.master_storage)
    layout = layout_bytes(strategy)
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
        checks.append(check("one launch", first.launches == 1 and first.new_graphs == 1, f"{first.launches} launches"))
    recompiled = [step.label for step in code.steps[1:] if step.new_graphs]
    checks.append(check("no recompilation", not recompiled, ", ".join(recompiled)))
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
        read = written = 0.0
        for kernel in kernels:
            loads, stores = access_bytes(kernel.ptx)
            read += kernel.launches * loads / kernel.elements_per_thread
            written += kernel.launches * stores / kernel.elements_per_thread
        exact = abs(read - layout[0]) < 1e-9 and abs(written - layout[1]) < 1e-9
        checks.append(check(
            "bytes", exact, f"read {read:g} + written {written:g} B/element; layout minimum {layout[0]:g} + {layout[1]:g}"
        ))
    return StepAudit(code, checks, read, written, layout)


def audit_configuration(option: str, storage: str, kind: str, arches: tuple[int, ...]) -> list[StepAudit]:
    """Generate one (option, master storage, kind) for ``arches`` and audit it (compiled binaries
    dropped, so that the result pickles across processes)."""
    audits = []
    for code in generate_for(option, storage, kind, arches).values():
        for kernel in code.kernels:
            kernel.asm = None
        audits.append(audit_step(code))
    return audits


def run_audit(
    pairs: Iterable[tuple[str, str]] | None = None,
    kinds: Iterable[str] = KINDS,
    arches: tuple[int, ...] = ARCHES,
    workers: int = 1,
) -> list[StepAudit]:
    """Generate and audit every (option, master storage) of ``pairs`` (default :func:`configurations`)
    for each kind and arch, in ``workers`` processes (each generates whole configurations; results in
    the order of ``pairs`` and ``kinds``)."""
    tasks = [(option, storage, kind, tuple(arches)) for option, storage in pairs or configurations() for kind in kinds]
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


def table(audits: list[StepAudit]) -> str:
    """A Markdown table: one row per option, master storage and kind (bytes at sm_90), with the
    roofline time of the layout's bytes and each rule's result (✓, or ✗ with the arches that fail)."""
    rows = {}
    for audit in audits:
        code = audit.code
        rows.setdefault((code.option, code.master_storage, code.kind), []).append(audit)
    header = ["option", "master", "step", "layout B/elem (read+write)", "PTX B/elem (sm_90)", "1.3B step at 3.35 TB/s", *RULES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (option, storage, kind), group in rows.items():
        layout = group[0].layout
        measured = next((a for a in group if a.code.arch == 90), group[0])
        if strategy_for(option, storage).adam_kernel == "torch_fused":
            ptx = "torch's kernel"
        else:
            ptx = "—" if measured.bytes_read is None else f"{measured.bytes_read:g} + {measured.bytes_written:g}"
        results = []
        for rule in RULES:
            failing = [str(a.code.arch) for a in group if not a.check(rule).passed]
            results.append("✓" if not failing else "✗ sm_" + "/".join(failing))
        lines.append(
            f"| {option} | {storage} | {kind} | {layout[0]:g} + {layout[1]:g} = {sum(layout):g} | {ptx} | "
            f"{roofline_ms(sum(layout)):.1f} ms | " + " | ".join(results) + " |"
        )
    return "\n".join(lines)


def failures(audits: list[StepAudit]) -> list[Check]:
    return [check for audit in audits for check in audit.checks if not check.passed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lowprec.kernels.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", help="an option (repeatable; default: every option)")
    parser.add_argument("--kind", action="append", choices=KINDS, help="plain or shard (default: both)")
    parser.add_argument("--arch", action="append", type=int, choices=ARCHES, help="compute capability (default: 90 and 80)")
    parser.add_argument("--workers", type=int, default=1, help="processes that generate configurations in parallel")
    parser.add_argument(
        "--interpret", action="store_true",
        help="also run the generated kernels under Triton's interpreter against the eager step (kernels/interpret.py)",
    )
    args = parser.parse_args(argv)
    pairs = configurations()
    if args.option:
        names = {get_strategy(option).name for option in args.option}
        pairs = [pair for pair in pairs if pair[0] in names]
    audits = run_audit(pairs, args.kind or KINDS, tuple(args.arch or ARCHES), args.workers)
    print(table(audits))
    failed = failures(audits)
    for check in failed:
        print(f"FAIL {check.option} ({check.master_storage}, {check.kind}, sm_{check.arch}) {check.rule}: {check.detail}")
    differing = []
    if args.interpret:
        from megatron_lowprec.kernels import interpret

        comparisons = interpret.run_comparisons(pairs, args.kind or KINDS, args.workers)
        print(interpret.report(comparisons))
        differing = [result for result in comparisons if not result.identical]
    return 1 if failed or differing else 0


if __name__ == "__main__":
    sys.exit(main())
