"""The fused step's generated CUDA kernels, run by Triton's interpreter on CPU tensors (issue 27 item 2).

The module compares every configuration of AdamW's step and those of :data:`MUON_PAIRS` of Muon's,
each in a plain bucket and in megatron's distributed layout (AdamW's shard, Muon's layer-wise layout), once
(:func:`comparisons`, in processes started with ``TRITON_INTERPRET=1``, so that this process's
Triton is untouched) and each test reads one (optimizer, option, master storage, kind, arch). Every generated kernel agrees today, so none is marked xfail.
"""

import os
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.conftest import KERNEL_FX_CACHE_VARIABLE
from tools.kernel_audit import audit, codegen, interpret

CASES = [
    (option, storage, kind, arch)
    for option, storage in audit.configurations() for kind in codegen.KINDS
    for arch in interpret.compared_arches(option, storage, kind)
]

WORKERS = 2
"""Processes that compare the steps (CI's machine has two cores)."""


def _muon_pairs() -> list[tuple[str, str]]:
    """The configurations whose Muon step is interpreted: every one without FP8 moments, and of those
    with FP8 moments the first of each exponent storage (coat's FP32 k, sr8's BF16 k). Muon's
    compared buckets are laid out apart from AdamW's, so each compiles here, and an FP8 one costs
    half a minute; the others (coat's remainder master, res8's residual) update the parameter through
    the same parameter codec as their AdamW steps, interpreted above, beside the same momentum codec."""
    chosen, storages = [], set()
    for option, storage in audit.configurations():
        strategy = audit.strategy_for(option, storage)
        if strategy.moments == "fp8":
            if strategy.fp8_exponent_storage in storages:
                continue
            storages.add(strategy.fp8_exponent_storage)
        chosen.append((option, storage))
    return chosen


MUON_PAIRS = _muon_pairs()
MUON_CASES = [
    (option, storage, kind, arch) for option, storage in MUON_PAIRS for kind in codegen.KINDS
    for arch in interpret.compared_arches(option, storage, kind, "muon")
]


@pytest.fixture(scope="module")
def comparisons():
    """Every interpreted AdamW and Muon step against its eager step, once, in one pool: (optimizer,
    option, storage, kind, arch) -> Comparison. The steps compile through Inductor's FX graph cache
    of this run (``tests/conftest.py``): a step that the audit (``test_audit.py``, started earlier)
    has generated is loaded, the very code it audited, not compiled again; the rest compile here.
    The configurations go in the audit's reverse order, so that where both run at once each finds
    the other's half."""
    configurations = audit.configurations()[::-1]
    return {
        (result.optimizer, result.option, result.master_storage, result.kind, result.arch): result
        for result in interpret.run_comparisons(
            configurations, codegen.KINDS, workers=WORKERS, muon_pairs=MUON_PAIRS[::-1], muon_kinds=codegen.KINDS,
            fx_cache=os.environ[KERNEL_FX_CACHE_VARIABLE],
        )
    }


@pytest.mark.parametrize("option,storage,kind,arch", [pytest.param(*case, id="-".join(map(str, case))) for case in CASES])
def test_interpreted_kernels_are_bit_identical_to_the_eager_step(comparisons, option, storage, kind, arch):
    """Three steps through the generated CUDA kernels (interpreted, with :data:`interpret.SHIMS`) leave
    every parameter and state bit as the eager step does; the generated kernels really ran (option D
    with an FP32 master runs torch's own fused AdamW: no generated kernel). coat's plain step also on
    an A100 (sm_80), whose kernels convert FP8 by integer arithmetic."""
    result = comparisons[("adamw", option, storage, kind, arch)]
    assert result.error is None, result.error
    assert result.mismatches == {}
    torch_kernel_only = audit.strategy_for(option, storage).adam_kernel == "torch_fused" and storage == "fp32"
    assert (result.launches == 0) if torch_kernel_only else (result.launches >= interpret.STEPS)


def test_the_exact_gradient_norms_generated_kernels_give_the_exact_sums():
    """The exact gradient norm's CUDA kernels (``numerics/square_sum.py``, compiled as on a GPU) interpreted
    on FP32 and BF16 values, in full rows and a padded one: gradient-like values, which the windowed
    kernel sums alone, and values from every binade, with zeros, subnormals, the largest finite value,
    infinities and a NaN, which escape their windows and are summed by every digit again: Σ x² · 2^298
    exactly, and the counts."""
    assert interpret.norm_comparisons() == {"float32": None, "bfloat16": None}


def test_coat_layers_generated_kernels_agree_with_their_eager_operations():
    """COAT's FP8 quantization (per tensor and per 1 x 16 group; per tensor in both layouts at once)
    and the FP8 linear layer's copies of transposed operands, as a GPU that converts FP8 compiles
    them, interpreted on CPU tensors: the bits of the eager operations; the FP8 activations' backward
    passes within FP32 rounding of theirs."""
    results = interpret.coat_layer_comparisons()
    assert len(results) == 9 and all(result is None for result in results.values()), results


@pytest.mark.parametrize("option,storage,kind,arch", [pytest.param(*case, id="-".join(map(str, case))) for case in MUON_CASES])
def test_interpreted_muon_kernels_are_bit_identical_to_the_eager_muon_step(comparisons, option, storage, kind, arch):
    """Three Muon steps through the generated CUDA kernels of its momentum and update calls
    (interpreted, with :data:`interpret.SHIMS`; Newton-Schulz eager between them) leave every
    parameter and state bit as the eager step does (in megatron's layer-wise layout, DDP's whole
    buffer, other ranks' elements included); both calls ran their generated kernel, one launch each,
    each step (in the layout too, where the bucket lies in place in DDP's buffer; an FP8-moment
    option's compared bucket there (coat's, sr8's), no whole number of FP8 groups, reads its weights
    as rows, and its update call gathers them first: more launches)."""
    result = comparisons[("muon", option, storage, kind, arch)]
    assert result.error is None, result.error
    assert result.mismatches == {}
    calls = len(audit.MUON_CALLS) * interpret.STEPS
    fp8_moments = audit.strategy_for(option, storage).moments == "fp8"
    assert (result.launches > calls) if kind == "shard" and fp8_moments else (result.launches == calls)


def test_bf16_shim_rounds_to_nearest_even_as_torch_does():
    """The BF16 shim against torch's FP32 -> BF16 conversion (RNE) on ties, carries into the exponent,
    subnormals, overflow to infinity and random values; NaN as the GPU's 0x7FFF."""
    special = np.array([1 + 2**-8, 1 + 3 * 2**-8, 2**-130, -(2**-149), 3.3961e38, -0.0, np.inf], dtype=np.float32)
    values = np.concatenate([special, np.random.default_rng(0).standard_normal(4096).astype(np.float32)])
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(interpret._bf16_rne(values), expected)
    assert interpret._bf16_rne(np.array([np.nan], dtype=np.float32))[0] == 0x7FFF


def test_bf16_widening_shim_is_torch_s_conversion_for_every_bf16_value():
    """All 65536 BF16 bit patterns (subnormals, which the interpreter renormalizes wrongly, included)
    widen to torch's FP32 bits."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().view(torch.int32).numpy()
    assert np.array_equal(interpret._bf16_widened(bits).view(np.int32), expected)


def test_e4m3_shim_rounds_to_nearest_even_and_saturates_as_ml_dtypes():
    """The FP8 E4M3 shim against ml_dtypes' float8_e4m3fn (RNE) on ties, subnormals and random values;
    beyond ±448 it saturates (satfinite), where a plain conversion gives NaN."""
    rng = np.random.default_rng(1)
    values = np.concatenate([
        np.array([2**-9 * 1.5, 2**-10, 2**-7 * 1.0625, 17.0, 448.0, -0.0], dtype=np.float32),
        (rng.standard_normal(4096) * 30).astype(np.float32),
    ])
    expected = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(interpret._e4m3_rne_satfinite(values), expected)
    assert list(interpret._e4m3_rne_satfinite(np.array([1e4, -500.0], dtype=np.float32))) == [0x7E, 0xFE]


def test_the_interpreter_without_shims_truncates_bf16():
    """Why the BF16 shim exists: Triton's interpreter converts FP32 to BF16 by truncation (1 + 3·2^-9,
    three quarters of a BF16 step above 1, becomes 1, not 1 + 2^-7 as on a GPU)."""
    import triton.language as tl
    from triton.runtime import interpreter

    value = np.array([1 + 3 * 2**-9], dtype=np.float32)
    truncated = interpreter._convert_float(value, tl.float32, tl.bfloat16, None)
    assert truncated[0] == 0x3F80 and interpret._bf16_rne(value)[0] == 0x3F81


def _without_size_hints(source):
    """A kernel's source without what the traced sizes set (its size hints and tiling scores) and
    whether Inductor's caches were off (the interpreter's comparisons compile through the run's FX
    graph cache, :func:`codegen.generate` without)."""
    source = re.sub(r"(size_hints=|'tiling_scores': )\{[^}]*\}", r"\1...", source)
    return re.sub(r"'force_disable_caches': (True|False)", "'force_disable_caches': ...", source)


def test_the_interpreted_kernels_are_those_the_audit_compiles(comparisons):
    """Option B's interpreted kernel is the one generated on fake CUDA tensors for the audit: the same
    Triton source but for the hints taken from the traced sizes (the CPU twin traces the GPU's code path)."""
    generated = {kernel.name: kernel.source for kernel in codegen.generate("B", arch=interpret.ARCH).first_step_kernels}
    interpreted = comparisons[("adamw", "B", "fp32", "plain", interpret.ARCH)].sources
    assert list(interpreted) == list(generated)
    for name, source in interpreted.items():
        assert _without_size_hints(source) == _without_size_hints(generated[name])
