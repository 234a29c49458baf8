"""The audit of the fused step's CUDA kernels (issue 27 item 1), generated on this CPU-only machine.

The module generates every step once (:func:`audits`, the slow part: every configuration of AdamW's
step and of Muon's, issue 28 item 5, each in a plain bucket and in megatron's distributed layout:
AdamW's shard, Muon's layer-wise layout, for the architectures of :func:`audited_arches`) and each
test reads one rule of one (optimizer, option, master storage, kind, arch). Defects of the kernels as they are today are strict xfails that name
the defect (:data:`KNOWN_DEFECTS`, :data:`KNOWN_MUON_DEFECTS`): they pass, and must then be
removed, once fixed.
"""

import ctypes
import importlib
import inspect
import operator
import os
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from megatron_lowprec.numerics import formats
from megatron_lowprec.optim.muon import muon_strategy
from megatron_lowprec.optim import fused, kernel, muon
from megatron_lowprec.optim.strategies import EXPANSION_EXPONENT_BYTES, FP8_BYTES, FP8_SCALE_BYTES, get_strategy
from tests.conftest import KERNEL_FX_CACHE_VARIABLE
from tests.numerics.test_mcf import BF16, round_nearest_even
from tools.kernel_audit import audit, codegen, interpret

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
"""The recorded result files: the audit's tables (``--markdown``) and the H200's step kernels."""


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table under the line that starts with ``header``."""
    lines = text.split(header, 1)[1].splitlines()[2:]
    rows = lines[: next((index for index, line in enumerate(lines) if not line.lstrip().startswith("| ")), len(lines))]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in rows]


def _stamped(text: str) -> bool:
    """Whether a result file names its date, machine or device, torch and triton versions and commit."""
    return all(re.search(pattern, text, re.M) for pattern in (
        r"^- (Generated|Measured): \d{4}-\d{2}-\d{2}", r"^- (Machine|Device): \S", r"torch \d+\.\d+", r"triton \d+\.\d+",
        r"^- Commits?: [0-9a-f]{7}",
    ))


def audited_arches(option: str, storage: str, kind: str, optimizer: str) -> tuple[int, ...]:
    """The architectures this module audits a configuration for: every one of ``codegen.ARCHES``
    where they share one trace (:func:`~tools.kernel_audit.codegen.trace_groups`: each arch costs a
    compile of the traced kernels only). FP8 moments trace the step once more below sm_89, whose
    payloads are uint8 codes converted by integer arithmetic (``fused.fp8_payloads_as_codes``): that
    trace is audited where ``test_interpret.py`` also runs it
    (:func:`~tools.kernel_audit.interpret.compared_arches`: AdamW's plain step of each FP8 option
    with an FP32 master, coat's with an FP32 exponent k and sr8's with a BF16 one; the two modules
    share one compile of it through the run's FX graph cache). The other configurations are left to
    sm_90: there a step differs from its sm_80 twin only in how its payloads are loaded and stored,
    which is one codec (``codecs.FP8GroupMoment``, through ``formats.to_fp8_codes`` and
    ``from_fp8_codes``) in every FP8 configuration, layout and optimizer, audited above, while master
    storage, rounding and layout are the same code on both."""
    if len(codegen.trace_groups(audit.strategy_for(option, storage), codegen.ARCHES)) == 1:
        return codegen.ARCHES
    return tuple(arch for arch in codegen.ARCHES if arch in interpret.compared_arches(option, storage, kind, optimizer))


def test_the_fused_step_depends_on_the_architecture_only_through_its_fp8_payloads():
    """What :func:`audited_arches` relies on: the fused steps' modules (AdamW's, Muon's) ask for the compute capability
    only to tell whether they can compile (``fused_unavailable_reason``) and whether FP8 payloads are
    codes (``fp8_payloads_as_codes``), whose one caller, ``kernel_state``, views the ``_payload``
    buffers as uint8 and hands every other buffer over as it is."""
    capability = "get_device_capability("
    deciders = (fused.fused_unavailable_reason, fused.fp8_payloads_as_codes)
    assert inspect.getsource(fused).count(capability) == sum(inspect.getsource(f).count(capability) for f in deciders) == 2
    assert all(capability not in inspect.getsource(module) for module in (kernel, muon))
    callers = [line for line in inspect.getsource(fused).splitlines() if "fp8_payloads_as_codes(" in line and "def " not in line]
    assert len(callers) == 1 and callers[0].strip() in inspect.getsource(fused.kernel_state)
    assert 'value.view(torch.uint8) if key.endswith("_payload") else value' in inspect.getsource(fused.kernel_state)


CASES = [
    (option, storage, kind, arch)
    for option, storage in audit.configurations() for kind in codegen.KINDS
    for arch in audited_arches(option, storage, kind, "adamw")
]
MUON_CASES = [
    (option, storage, kind, arch)
    for option, storage in audit.configurations() for kind in codegen.KINDS
    for arch in audited_arches(option, storage, kind, "muon")
]

KNOWN_DEFECTS: list = []
"""(rule, the cases it fails in today, the defect) of AdamW's kernels on main: none."""


def _marks(rule, case, defects):
    reasons = [defect for rule_, applies, defect in defects if rule_ == rule and applies(*case)]
    return [pytest.mark.xfail(strict=True, reason=reasons[0])] if reasons else []


WORKERS = 2
"""Processes that generate the steps (CI's machine has two cores)."""


@pytest.fixture(scope="module")
def audits():
    """Every AdamW and Muon step, generated and audited once, in one pool: (optimizer, option,
    storage, kind, arch) -> StepAudit. Inductor's FX graph cache of this run keeps the code
    (``tests/conftest.py``), which the interpreter's comparisons (``test_interpret.py``) load."""
    return {
        (a.code.optimizer, a.code.option, a.code.master_storage, a.code.kind, a.code.arch): a
        for a in audit.run_audit(
            audit.configurations(), codegen.KINDS, codegen.ARCHES, workers=WORKERS,
            muon_pairs=audit.configurations(), muon_kinds=codegen.KINDS, fx_cache=os.environ[KERNEL_FX_CACHE_VARIABLE],
            arches_for=audited_arches,
        )
    }


def _params(defects, cases):
    return [
        pytest.param(rule, *case, marks=_marks(rule, case, defects), id="-".join(map(str, (rule, *case))))
        for rule in audit.RULES
        for case in cases
    ]


@pytest.mark.parametrize("rule,option,storage,kind,arch", _params(KNOWN_DEFECTS, CASES))
def test_every_rule_holds_for_every_generated_step(audits, rule, option, storage, kind, arch):
    """Each rule of :data:`~tools.kernel_audit.audit.RULES` (compiles; no approximate, flushing or
    contracted instruction; no FP64; one launch per bucket; no recompilation; global bytes equal to
    the layout's minimum) for each option, storage and kind, on each architecture of :func:`audited_arches`."""
    check = audits[("adamw", option, storage, kind, arch)].check(rule)
    assert check.passed, f"{rule}: {check.detail}"


def test_a_shard_step_is_one_kernel_that_updates_megatron_s_buffer_in_place(audits):
    """A shard laid out in place (``optim/buckets.py``) steps in one kernel, which reads and writes
    its parameters and gradients as slices of megatron's buffers and each row's parameter group from
    a table: no gather of the parameters by a kernel of its own, no store at loaded places, no copy
    of a whole buffer."""
    launches = {
        (option, storage, kind, arch): step_audit.code.steps[0].launches
        for (optimizer, option, storage, kind, arch), step_audit in audits.items()
        if optimizer == "adamw" and kind == "shard" and audit.strategy_for(option, storage).adam_kernel != "torch_fused"
    }
    assert launches and set(launches.values()) == {1}, launches


def test_layout_bytes_of_option_a_and_coat():
    """A reads θ, g, m, v at 2 bytes and writes θ, m, v (14 B); coat's FP32 master replaces reading
    θ, its FP8 moments carry a scale and an exponent (8 B) per 128 elements each."""
    assert audit.layout_bytes(audit.strategy_for("A", "fp32")) == (8, 6)
    assert audit.layout_bytes(audit.strategy_for("coat", "fp32")) == (2 + 4 + 2 + 2 * 8 / 128, 2 + 4 + 2 + 2 * 8 / 128)


def test_layout_bytes_of_a_shard_hold_its_group_slots():
    """A shard's step also reads each 64-element row's parameter group (int32); coat's, each FP8 group's."""
    assert audit.layout_bytes(audit.strategy_for("A", "fp32"), "shard") == (8 + 4 / 64, 6)
    coat = audit.strategy_for("coat", "fp32")
    assert audit.layout_bytes(coat, "shard")[0] == audit.layout_bytes(coat)[0] + 4 / 128


def test_layout_bytes_of_sr_hold_its_stream_tables():
    """sr reads θ, g, m, v at 2 bytes and writes θ, m, v; each 128-element row (64 in a shard) reads
    its entry (int32) and that entry's column shift, row length (int32), first row start, row stride
    (int64) and three round keys (int32); a shard's rows also their parameter group."""
    sr = audit.strategy_for("sr", "fp32")
    assert audit.layout_bytes(sr) == (8 + (4 + 4 + 4 + 8 + 8 + 12) / 128, 6)
    assert audit.layout_bytes(sr, "shard") == (8 + (4 + 4 + 4 + 8 + 8 + 12 + 4) / 64, 6)


def test_layout_bytes_of_sr8_hold_its_group_stream_tables():
    """sr8 reads θ and g at 2 bytes and m, v as FP8 with their groups' metadata, and writes θ, m, v;
    each FP8 group of 128 reads its entry, its first element's index (two int32 words) and three
    round keys (int32); a shard's groups also their parameter group."""
    sr8 = audit.strategy_for("sr8", "fp32")
    moments = 2 * (FP8_BYTES + (FP8_SCALE_BYTES + EXPANSION_EXPONENT_BYTES["bf16"]) / 128)
    assert audit.layout_bytes(sr8) == (4 + moments + (4 + 8 + 12) / 128, 2 + moments)
    assert audit.layout_bytes(sr8, "shard") == (4 + moments + (4 + 8 + 12 + 4) / 128, 2 + moments)


SOURCE = """
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*i32', 'in_ptr2': '*i64', 'in_ptr3': '*i32', 'in_ptr4': '*fp32', 'in_ptr5': '*i32', 'in_ptr6': 'i32', 'ks0': 'i64'}},
@triton.jit
def triton_poi_fused_0(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, in_ptr5, in_ptr6, ks0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask).to(tl.float32)
    tmp1 = (x0).to(tl.int32)
    tmp2 = tl.full([1], 7, tl.int32)
    tmp3 = tmp1 >> tmp2
    tmp4 = tmp3 + (ks0).to(tl.int32)
    tmp5 = tl.load(in_ptr1 + (tmp4), xmask, eviction_policy='evict_last')
    tmp6 = tl.load(in_ptr2 + (tmp5), xmask, eviction_policy='evict_last')
    tmp7 = tl.full([1], 3, tl.int32)
    tmp8 = tmp1 >> tmp7
    tmp9 = tl.load(in_ptr3 + (tmp8), xmask, eviction_policy='evict_last')
    tmp10 = tmp0 + tmp6.to(tl.float32)
    tmp11 = triton_helpers.bucketize_binary_search(tmp1, in_ptr3, ks0, ks0, 1, 0, tl.int32, True, None, None, None, )
    tmp12 = tl.load(in_ptr4 + (tmp11), xmask, eviction_policy='evict_last')
    tmp13 = in_ptr6
    tmp14 = tmp1 + tmp13
    tmp15 = tl.full([1], 6, tl.int64)
    tmp16 = tmp14 >> tmp15
    tmp17 = tl.load(in_ptr5 + (tmp16), xmask, eviction_policy='evict_last')
    tmp18 = tmp1 + tmp12
    tmp19 = tmp18 >> tmp15
    tmp20 = tl.load(in_ptr5 + (tmp19), xmask, eviction_policy='evict_last')
"""


def test_source_loads_count_group_addresses_once_per_group():
    """The element's own load is per element; a table indexed by the element's 128-element group, and
    a table indexed by a value loaded from it, once per group; a table indexed by the element's
    64-element row (its index plus a scalar, the call's place in its rows, shifted), once per row; a
    table indexed by 8-element blocks, one indexed by a binary search's result, and one indexed by
    the element's index plus a loaded value, shifted, per element."""
    assert audit.source_loads(SOURCE) == [
        ("in_ptr0", 2, "element"), ("in_ptr1", 4, "group"), ("in_ptr2", 8, "group"),
        ("in_ptr3", 4, "element"), ("in_ptr4", 4, "element"), ("in_ptr5", 4, "row"), ("in_ptr5", 4, "element"),
    ]


def test_read_bytes_counts_group_loads_once_per_group_only_when_the_ptx_holds_nothing_else():
    """Four elements per thread: the PTX's loads per element equal the source's (2 + 4 + 8 + 4 + 4 +
    4 + 4 B), so the group loads count 12/128 and the row's 4/64; with one load more in the PTX (a
    hidden search), nothing is counted once per group or row."""
    per_thread = 4 * (2 + 4 + 8 + 4 + 4 + 4 + 4)
    ptx = "\tld.global.b8 {%rs1}, [%rd1];\n" * per_thread
    shared = 12 / 128 + 4 / 64
    assert audit.read_bytes(ptx, SOURCE, 4.0) == (14 + shared, shared)
    hidden = ptx + "\tld.global.b32 {%r1}, [%rd2];\n"
    assert audit.read_bytes(hidden, SOURCE, 4.0) == ((per_thread + 4) / 4, 0.0)


ROWS_SOURCE = """
    triton_meta={'signature': {'in_ptr0': '*fp8e4nv', 'in_ptr1': '*fp32', 'in_ptr2': '*bf16', 'out_ptr0': '*fp32', 'out_ptr1': '*fp8e4nv', 'xnumel': 'i32', 'r0_numel': 'i32'}},
@triton.jit
def triton_per_fused_0(in_ptr0, in_ptr1, in_ptr2, out_ptr0, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr):
    r0_numel = 128
    R0_BLOCK: tl.constexpr = 128
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    x0 = xindex
    r0_1 = r0_index
    tmp0 = tl.load(in_ptr0 + (r0_1 + 128*x0), xmask, other=0.0)
    tmp1 = tl.load(in_ptr1 + (x0), xmask, eviction_policy='evict_last')
    tmp2 = tl.load(in_ptr2 + (r0_1 + 128*x0), xmask, other=0.0).to(tl.float32)
    tmp3 = tmp0.to(tl.float32) * tmp1 + tmp2
    tmp4 = tl.max(tl.abs(tmp3), 1)[:, None]
    tl.store(out_ptr0 + (x0), tmp4, xmask)
    tl.store(out_ptr1 + (r0_1 + 128*x0), (tmp3 / tmp4).to(tl.float8e4nv), xmask)
"""


def test_a_kernel_over_rows_of_one_group_counts_the_rows_accesses_once_per_group():
    """A reduction over rows of one 128-element group (FP8 group statistics): the payload and the
    gradient are read per element and the old scale once per row; the new scale is stored once per
    row and the payload per element. With two elements per thread and one row per thread, the PTX
    holds 2 x (1 + 2) + 4 bytes of loads and 2 x 1 + 4 of stores: 3 + 4/128 read and 1 + 4/128
    written per element. One load more in the PTX (2 bytes, not a whole number of rows' scales)
    credits nothing; a pointwise kernel's store at a group address is per element."""
    assert audit.group_rows(ROWS_SOURCE) and not audit.group_rows(SOURCE)
    assert audit.source_accesses(ROWS_SOURCE) == (
        [("in_ptr0", 1, "element"), ("in_ptr1", 4, "group"), ("in_ptr2", 2, "element")],
        [("out_ptr0", 4, "group"), ("out_ptr1", 1, "element")],
    )
    ptx = "\tld.global.b8 {%rs1}, [%rd1];\n" * (2 * 3 + 4) + "\tst.global.b8 [%rd2], {%rs2};\n" * (2 * 1 + 4)
    assert audit.read_bytes(ptx, ROWS_SOURCE, 2.0) == (3 + 4 / 128, 4 / 128)
    assert audit.write_bytes(ptx, ROWS_SOURCE, 2.0) == (1 + 4 / 128, 4 / 128)
    two_rows = "\tld.global.b8 {%rs1}, [%rd1];\n" * (4 * 3 + 2 * 4)
    assert audit.read_bytes(two_rows, ROWS_SOURCE, 4.0) == (3 + 4 / 128, 4 / 128)
    hidden = ptx + "\tld.global.b16 {%rs3}, [%rd3];\n"
    assert audit.read_bytes(hidden, ROWS_SOURCE, 2.0) == ((2 * 3 + 4 + 2) / 2, 0.0)
    pointwise_store = SOURCE + "    tl.store(in_ptr4 + (tmp3), tmp10, xmask)\n"
    assert audit.write_bytes("\tst.global.b32 [%rd2], {%r2};\n" * 4, pointwise_store, 4.0) == (4.0, 0.0)


def test_access_bytes_counts_vector_widths():
    ptx = "\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n\t@%p1 st.global.b16 [%rd2], %rs1;\n\tld.global.L1::evict_last.v2.b16 {%rs2, %rs3}, [%rd3];"
    assert audit.access_bytes(ptx) == (16 + 4, 2)


def test_audit_rejects_a_plain_fp32_division():
    """The audit can fail: Inductor's FP32 ``/`` is ``div.full.f32`` (approximate) on CUDA."""
    kernels = codegen.generate_function(lambda a, b: a / b, ((64,), (64,)), torch.float32, arch=90)
    assert [fragment for kernel in kernels for fragment in audit.forbidden_instructions(kernel.ptx)] == ["div.full"]


def _fast_two_sum_error(rounding):
    """Fast2Sum's error term e = r(b - r(r(a + b) - a)): three roundings to bfloat16 between FP32 operations."""
    return lambda a, b: rounding(b - rounding(rounding(a + b) - a))


BF16_MAGNITUDE_MASK = "2147418112"
"""0x7FFF0000 in PTX: the integer form clears a rounded magnitude's low 16 bits with it, once per rounding."""


@pytest.mark.parametrize(
    "form,conversions,masks",
    [
        (lambda x: x.to(torch.bfloat16).to(torch.float32), 0, 0),
        (formats.round_to_bfloat16_through_bits, 3, 0),
        (lambda x: formats.round_to_16bit(x, torch.bfloat16), 0, 3),
    ],
    ids=["cast-round-trip", "through-bits", "integer"],
)
def test_roundings_to_bfloat16_between_fp32_operations_survive_cuda_codegen(form, conversions, masks):
    """Per element, Inductor's Triton code drops all three cast round trips (the error term is then
    computed from unrounded sums: why MCF arithmetic cannot use them on GPUs); the cast read back
    through its bits keeps each rounding as one ``cvt.rn.bf16.f32``, the integer form as integer
    operations (one magnitude mask each)."""
    (kernel,) = codegen.generate_function(_fast_two_sum_error(form), ((64,), (64,)), torch.float32, arch=90)
    per_element = kernel.elements_per_thread
    assert kernel.ptx.count("cvt.rn.bf16.f32") == conversions * per_element
    assert kernel.ptx.count(BF16_MAGNITUDE_MASK) == masks * per_element


def test_bf16_adds_and_products_rounded_once_equal_fp32_ones_rounded_to_bf16():
    """What :func:`~tools.kernel_audit.audit.narrowed_bf16_operations` accepts: for BF16 ``a`` and
    ``b``, ``fp32(a + b)`` and ``fp32(a * b)`` rounded to BF16 are the exact sum and product rounded
    once (a subtraction is the sum with -b), against exact rationals: random patterns, operands of close exponents (sums that cancel or
    carry), subnormals and values near the largest."""
    generator = torch.Generator().manual_seed(5)

    def bf16_values(count, low_exponent, high_exponent):
        exponent = torch.randint(low_exponent, high_exponent + 1, (count,), generator=generator)
        mantissa = torch.randint(0, 128, (count,), generator=generator)
        sign = torch.randint(0, 2, (count,), generator=generator)
        bits = (sign << 15) | (exponent << 7) | mantissa
        return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)

    pairs = [
        (bf16_values(4000, 0, 254), bf16_values(4000, 0, 254)),
        (bf16_values(4000, 100, 104), bf16_values(4000, 100, 104)),
        (bf16_values(2000, 0, 3), bf16_values(2000, 0, 12)),
        (bf16_values(2000, 0, 2), bf16_values(2000, 120, 134)),
        (bf16_values(1000, 250, 254), bf16_values(1000, 125, 128)),
    ]
    for a, b in pairs:
        for operation in (operator.add, operator.mul):
            got = operation(a.float(), b.float()).to(torch.bfloat16).float().tolist()
            exact = [
                float(round_nearest_even(operation(Fraction(x), Fraction(y)), BF16))
                for x, y in zip(a.float().tolist(), b.float().tolist())
            ]
            assert got == exact, next((x, y) for x, y, g, e in zip(a.tolist(), b.tolist(), got, exact) if g != e)


def test_audit_accepts_only_the_narrowed_bf16_fmas():
    """An FMA of BF16 values with a factor ±1.0 or an addend -0.0 is one narrowed add, subtraction or
    product; any other FMA, of any type, stays forbidden."""
    constants = "\tmov.b16 \t%rs1, 0x3F80;\n\tmov.b16 \t%rs2, 0x8000;\n\tmov.b16 \t%rs3, 0x4000;\n\tmov.b16 \t%rs9, 0xBF80;\n"
    narrowed = (
        "\tfma.rn.bf16 \t%rs5, %rs4, %rs1, %rs6;\n\tfma.rn.bf16 \t%rs7, %rs4, %rs6, %rs2;\n"
        "\tfma.rn.bf16 \t%rs10, %rs9, %rs4, %rs6;\n"
    )
    assert audit.forbidden_instructions(constants + narrowed) == []
    assert len(audit.narrowed_bf16_operations(constants + narrowed)) == 3
    for other in ("\tfma.rn.bf16 \t%rs8, %rs4, %rs3, %rs6;\n", "\tfma.rn.f32 \t%r1, %r2, %r3, %r4;\n"):
        assert audit.forbidden_instructions(constants + narrowed + other) == ["fma."]


def test_codegen_restores_what_it_patches():
    import triton

    from torch._dynamo import device_interface

    before = (
        torch.cuda.get_device_properties, torch.cuda.device_count, device_interface.CudaInterface.is_available,
        triton.runtime.driver._active, os.environ.get("TRITON_CACHE_DIR"), torch._C.__dict__.get("_cuda_getCurrentRawStream"),
    )
    with codegen.cuda_codegen(90, "/nonexistent"):
        assert torch.cuda.get_device_properties(0).major == 9
    after = (
        torch.cuda.get_device_properties, torch.cuda.device_count, device_interface.CudaInterface.is_available,
        triton.runtime.driver._active, os.environ.get("TRITON_CACHE_DIR"), torch._C.__dict__.get("_cuda_getCurrentRawStream"),
    )
    assert after == before
    registry = (ctypes.c_void_p * 2).in_dll(
        ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
        "_ZN3c104impl26device_guard_impl_registryE",
    )
    assert registry[codegen.CUDA_DEVICE_TYPE] is None
    assert not torch.cuda.is_available()


def test_a_changed_internal_raises_codegen_setup_error(monkeypatch):
    from torch._inductor import async_compile

    monkeypatch.delattr(async_compile.AsyncCompile, "triton")
    with pytest.raises(codegen.CodegenSetupError, match="AsyncCompile"):
        codegen.generate("A")


def test_audit_result_file_states_each_layouts_bytes_and_roofline():
    """docs/results/kernel_audit.md (``--markdown``): stamped, one row per option, master storage and
    step, each row's layout bytes and 1.3B roofline time the audit's."""
    text = (RESULTS / "kernel_audit.md").read_text(encoding="utf-8")
    assert _stamped(text)
    rows = _table_rows(text, "| option | master | step | layout B/elem (read+write) |")
    assert sorted((option, storage, kind) for option, storage, kind, *_ in rows) == sorted(
        (option, storage, kind) for kind in codegen.KINDS for option, storage in audit.configurations()
    )
    for option, storage, kind, layout, _, roofline, *_ in rows:
        read, written = audit.layout_bytes(audit.strategy_for(option, storage), kind)
        assert layout == f"{read:g} + {written:g} = {read + written:g}"
        assert roofline == f"{audit.roofline_ms(read + written):.1f} ms"


def test_gpu_step_kernel_result_divides_each_layouts_bytes_by_the_measured_time():
    """docs/results/gpu_step_kernels.md (the H200's step kernels): stamped, one row per option, each
    row's bytes its layout's (plain bucket), its bandwidth those bytes for 256M elements over the
    measured kernel time, and its share of the copy's bandwidth measured beside it; an option no GPU
    measured says so in each measured cell."""
    text = (RESULTS / "gpu_step_kernels.md").read_text(encoding="utf-8")
    assert _stamped(text)
    copies = {cells[0]: float(cells[-1]) for cells in _table_rows(text, "| measurement |")}
    rows = _table_rows(text, "| option (master) |")
    assert sorted(cells[0].split()[0] for cells in rows) == sorted({option for option, _ in audit.configurations()})
    for name, _, milliseconds, layout, bandwidth, of_copy, *_, measurement in rows:
        option, _, storage = name.partition(" ")
        read, written = audit.layout_bytes(audit.strategy_for(option, storage.strip("()") or "fp32"))
        assert float(layout) == read + written
        if milliseconds == "not measured":
            assert {bandwidth, of_copy} == {"not measured"} and measurement == "—", name
            continue
        measured = (read + written) * 256e6 / (float(milliseconds) * 1e-3) / 1e12
        assert bandwidth == f"{measured:.2f}"
        assert of_copy == f"{measured / copies[measurement]:.0%}"


@pytest.mark.parametrize("windowed", [True, False], ids=["windowed", "every_digit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_the_exact_gradient_norm_reads_each_gradient_element_once(dtype, windowed):
    """On CUDA each of the norm's digit sums (the rows' windows, and every digit where a value
    escapes its window) compiles to one kernel that loads each value once (BF16: 2 bytes, the
    conversion to FP32 fused); the rest of its kernels read only that kernel's per-row sums."""
    assert audit.gradient_norm_reads(dtype, windowed) == [dtype.itemsize]


KNOWN_MUON_DEFECTS: list = []
"""(rule, the cases it fails in today, the defect) of Muon's kernels on main: none."""


@pytest.mark.parametrize("rule,option,storage,kind,arch", _params(KNOWN_MUON_DEFECTS, MUON_CASES))
def test_every_rule_holds_for_muon_s_fused_step(audits, rule, option, storage, kind, arch):
    """Muon's element-wise calls (momentum before Newton-Schulz, update after it), for every option
    and master storage, in a plain bucket and in megatron's layer-wise layout: every kernel compiles;
    no approximate, flushing or contracted instruction; no FP64; one launch per call (two per
    bucket); a later step with another lr and a bucket of another parameter group compile nothing;
    each call moves its layout's least bytes; on each architecture of :func:`audited_arches`."""
    check = audits[("muon", option, storage, kind, arch)].check(rule)
    assert check.passed, f"{rule}: {check.detail}"


def test_muon_layout_bytes_count_the_state_and_what_newton_schulz_exchanges():
    """A's momentum call reads g and m and writes m and the BF16 direction; its update call reads θ
    and the FP32 step -lr·s·O and writes θ. B adds δθ to the update call, D-MW's momentum is FP32,
    D reads and writes an FP32 master instead of reading θ (and still writes θ), coat's FP8 momentum
    carries a scale and an exponent (8 B) per 128 elements, sr's update reads its stream tables
    (40 B per 128 elements; per 64 in megatron's layout, where the bucket lies in place)."""
    def layout(option, storage="fp32"):
        return audit.muon_layout_bytes(muon_strategy(audit.strategy_for(option, storage)))

    assert layout("A") == {"momentum": (2 + 2, 2 + 2), "update": (2 + 4, 2)}
    assert layout("B") == {"momentum": (2 + 2, 2 + 2), "update": (2 + 4 + 2, 2 + 2)}
    assert layout("D-MW") == {"momentum": (2 + 4, 4 + 2), "update": (2 + 4, 2)}
    assert layout("D") == {"momentum": (2 + 4, 4 + 2), "update": (4 + 4, 4 + 2)}
    assert layout("D", "remainder") == {"momentum": (2 + 4, 4 + 2), "update": (2 + 2 + 4, 2 + 2)}
    assert layout("coat") == {"momentum": (2 + 1 + 8 / 128, 1 + 8 / 128 + 2), "update": (4 + 4, 4 + 2)}
    assert layout("sr") == {"momentum": (2 + 2, 2 + 2), "update": (2 + 4 + 40 / 128, 2)}
    in_megatron_s_layout = audit.muon_layout_bytes(muon_strategy(audit.strategy_for("sr", "fp32")), "shard")
    assert in_megatron_s_layout["update"] == (2 + 4 + 40 / 64, 2)


def test_muon_audit_result_file_states_each_calls_layout_bytes():
    """docs/results/kernel_audit_muon.md (``--markdown``): stamped, every option and master storage of
    each kind (a plain bucket, megatron's layer-wise layout), each call's layout bytes, the total and
    its 1.3B roofline time the audit's."""
    text = (RESULTS / "kernel_audit_muon.md").read_text(encoding="utf-8")
    assert _stamped(text)
    rows = _table_rows(text, "| option | master | kind | momentum call: layout B/elem |")
    assert sorted((option, storage, kind) for option, storage, kind, *_ in rows) == sorted(
        (option, storage, kind) for kind in codegen.KINDS for option, storage in audit.configurations()
    )
    for option, storage, kind, momentum, update, _, total, roofline, *_ in rows:
        layout = audit.muon_layout_bytes(muon_strategy(audit.strategy_for(option, storage)), kind)
        assert (momentum, update) == tuple(f"{read:g} + {written:g}" for read, written in layout.values())
        whole = sum(sum(pair) for pair in layout.values())
        assert total == f"{whole:g}" and roofline == f"{audit.roofline_ms(whole):.1f} ms"


def _muon_code(momentum_ptx: str, update_ptx: str, update_kernels: int = 1) -> codegen.StepCode:
    """A Muon step of option A whose first step ran one kernel per call with these PTX accesses
    (one element per thread, a source without loads to credit per group)."""
    kernels = [codegen.Kernel("momentum", 0, "", momentum_ptx, 1, 1.0)]
    kernels += [codegen.Kernel(f"update{index}", 1, "", update_ptx, 1, 1.0) for index in range(update_kernels)]
    launches = 1 + update_kernels
    steps = [codegen.StepRecord("first step", 2, launches), codegen.StepRecord("next step, new lr", 0, launches)]
    return codegen.StepCode("A", "fp32", "plain", 90, kernels, steps, [], {}, "muon")


def test_muon_bytes_rule_fails_on_an_access_more_or_a_second_kernel():
    """A's calls at their layout's bytes (momentum: g, m read, m and the direction written; update: θ
    and the FP32 step read, θ written) pass; one 2-byte store more, or an update call in two
    kernels, fails the rule."""
    load16, load32, store16 = "\tld.global.b16 {%rs1}, [%rd1];\n", "\tld.global.b32 {%r1}, [%rd2];\n", "\tst.global.b16 [%rd3], {%rs2};\n"
    momentum, update = 2 * load16 + 2 * store16, load16 + load32 + store16
    exact = audit.audit_step(_muon_code(momentum, update))
    assert exact.check("bytes").passed and exact.call_bytes == {"momentum": (4, 4), "update": (6, 2)}
    assert not audit.audit_step(_muon_code(momentum + store16, update)).check("bytes").passed
    split = audit.audit_step(_muon_code(momentum, update, update_kernels=2))
    assert not split.check("bytes").passed and not split.check("one launch").passed


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("group_size", [None, 16], ids=["per_tensor", "per_group_16"])
def test_coat_activation_quantization_compiles_to_exact_kernels_that_read_the_activation_twice_at_most(fp8_dtype, group_size):
    """COAT's FP8 quantization of activations as a GPU compiles it (sm_90): correctly rounded
    division (``div.rn.f32``), no approximate, flushing or contracted instruction, each kernel launched
    once; per tensor, the maximum's two reduction kernels and the cast (the activation read twice),
    per 1 x 16 group one kernel."""
    kernels = audit.fp8_quantization_kernels(fp8_dtype, group_size)
    assert all(audit.forbidden_instructions(kernel.ptx) == [] for kernel in kernels)
    assert all(kernel.launches == 1 for kernel in kernels)
    payload_type = {torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}[fp8_dtype]
    (storing,) = [kernel for kernel in kernels if payload_type in kernel.source]
    assert "div.rn.f32" in storing.ptx
    reading = [kernel for kernel in kernels if "'in_ptr0': '*bf16'" in kernel.source]
    assert (len(kernels), len(reading)) == ((3, 2) if group_size is None else (1, 1))


def test_coat_linear_quantization_writes_both_layouts_from_one_read_of_its_input():
    """COAT's per-tensor quantization of a linear layer's operand in both layouts (``quantize_matrix``;
    E5M2, an output gradient's) as a GPU compiles it (sm_90): the maximum's two reduction kernels,
    then one kernel, launched once, that reads each BF16 element once (and the scale) and stores its
    FP8 byte in each layout, with correctly rounded division (``div.rn.f32``) and no approximate,
    flushing or contracted instruction."""
    kernels = audit.fp8_matrix_quantization_kernels(torch.float8_e5m2)
    assert len(kernels) == 3 and all(kernel.launches == 1 for kernel in kernels)
    assert all(audit.forbidden_instructions(kernel.ptx) == [] for kernel in kernels)
    (storing,) = [kernel for kernel in kernels if "*fp8e5" in kernel.source]
    read, written = audit.access_bytes(storing.ptx)
    scale_bytes = 4
    assert "div.rn.f32" in storing.ptx
    assert (read - scale_bytes, written) == (2 * storing.elements_per_thread, 2 * storing.elements_per_thread)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_the_fp8_linear_layers_transposed_operands_are_copied_by_one_kernel_moving_each_byte_once(fp8_dtype):
    """``fp8_linear.row_major`` of a transposed FP8 payload (the backward pass's operands of
    ``torch._scaled_mm``) as a GPU compiles it: one kernel, one byte read and one written per element."""
    fp8_linear = importlib.import_module("megatron_lowprec.layers.fp8_linear")
    (kernel,) = codegen.generate_function(lambda payload: fp8_linear._copied(payload.t()), ((4096, 2048),), fp8_dtype)
    read, written = audit.access_bytes(kernel.ptx)
    assert kernel.launches == 1
    assert read / kernel.elements_per_thread == written / kernel.elements_per_thread == 1
