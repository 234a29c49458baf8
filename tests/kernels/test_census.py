"""The traffic census of one transformer layer (tools/kernel_audit/census.py) at the embedded default shape.

The fence: the launches, bytes, saved activation bytes and compiled graphs of one layer's forward and backward,
stock, coat eager and coat as Inductor generates its compiled calls for sm_90, are today's figures;
a change that adds a launch or a byte fails here, and one that removes some updates the figures. GEMM FLOPs are checked against the analytic count of the layer's linears, and attention's
against flash attention's causal matmuls.
"""

from pathlib import Path

import pytest

from benchmarks.report import STAMP_PREFIX
from tools.kernel_audit import census

RESULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "coat_census.md"
TINY = census.SHAPES["tiny"]

FENCE = {
    ("stock", "eager"): (49, 3_498_112, 1_973_888, 600_064, 0),
    ("coat", "eager"): (305, 16_400_268, 12_424_652, 442_384, 0),
    ("coat", "compiled"): (102, 4_674_868, 3_021_672, 442_384, 8),
}
"""(launches, bytes read, bytes written, bytes saved for backward, graphs compiled) of one tiny layer's
forward and backward; the graphs are what a first step from an empty cache compiles for the layers."""


@pytest.fixture(scope="module")
def counted():
    return census.censuses(TINY)


@pytest.fixture(scope="module")
def kernels(counted):
    return {key: value[0] for key, value in counted.items()}


@pytest.mark.parametrize("key", list(FENCE), ids=lambda key: "-".join(key).replace(" ", "_"))
def test_launches_and_bytes_per_layer_stay_at_the_fence(counted, key):
    summary = counted[key][1]
    assert (summary.launches, summary.read, summary.written, summary.saved, summary.compiled_graphs) == FENCE[key]


def test_compiled_per_tensor_quantization_moves_the_bytes_of_its_tensors(kernels):
    """The generated quantization of fc2's input (tokens x ffn BF16 elements): an amax reduction and
    a cast, each reading the input once, the cast reading the scale and writing one byte per element
    in each layout (the row-major payload and the transposed one fc2's weight gradient takes)."""
    elements = TINY.tokens * TINY.ffn
    quantization = [k for k in kernels["coat", "compiled"] if k.region == "_quantize_matrix" and k.phase == "forward"
                    and f"in bfloat16[{elements}]" in k.signature]
    amax = [k for k in quantization if "amax" in k.op and k.written < 64]
    cast = [k for k in quantization if k.written >= elements]
    assert [k.read for k in amax][:1] == [2 * elements]
    assert [(k.read, k.written) for k in cast] == [(2 * elements + 4, 2 * elements)]


def test_gemm_flops_are_the_linears_analytic_count(kernels):
    hidden, ffn = TINY.hidden, TINY.ffn
    linear_weights = hidden * 3 * hidden + hidden * hidden + hidden * ffn + ffn * hidden
    forward_and_backward = 3 * 2 * TINY.tokens * linear_weights
    stock = census.summarize(kernels["stock", "eager"]).gemm_flops
    coat = census.summarize(kernels["coat", "eager"]).gemm_flops
    assert stock == {"bf16": forward_and_backward, "fp8": 0}
    assert coat == {"bf16": 0, "fp8": forward_and_backward}


def test_attention_flops_are_seven_causal_matmuls(kernels):
    head_dim = TINY.hidden // TINY.heads
    causal_matmul = 2 * TINY.micro_batch * TINY.heads * TINY.seq * TINY.seq * head_dim / 2
    assert census.summarize(kernels["stock", "eager"]).attention_flops == 7 * causal_matmul


def test_the_census_names_the_non_minimal_kernels(kernels):
    def reasons(key):
        return [(kernel.op, reason) for kernel in kernels[key] for reason in kernel.reasons]

    coat = reasons(("coat", "eager"))
    assert coat.count(("row_major", "standalone copy of an FP8 payload")) == 12
    assert ("_to_copy", "standalone cast bfloat16 to float32") in coat
    assert ("amax", "FP32 tensor of activation size") in coat
    assert ("amax", "re-reads what abs in _quantize_rows wrote") in coat
    compiled = [(kernel.region, reason) for kernel in kernels["coat", "compiled"] for reason in kernel.reasons]
    assert not [reason for region, reason in compiled if region and "standalone" in reason]
    assert compiled.count(("_quantize_matrix", "re-reads what native_layer_norm wrote")) == 2
    assert not [reason for region, reason in compiled if region and "FP32" in reason]
    stock = reasons(("stock", "eager"))
    assert not [reason for _, reason in stock if "FP32" in reason or "FP8" in reason or "cast" in reason]
    assert all(not kernel.reasons for kernel in kernels["stock", "eager"] if kernel.kind in ("gemm", "attention"))


def test_unknown_flavour_is_refused():
    with pytest.raises(ValueError, match="'bf16'.*valid: stock, coat"):
        census.Layer(TINY, "bf16")


def test_result_file_holds_todays_tiny_rows(counted):
    lines = RESULT.read_text().splitlines()
    assert lines[2].startswith(STAMP_PREFIX)
    for key in census.COUNTS:
        row = census.summary_row("tiny", key, counted[key][1], None)
        assert "| " + " | ".join(map(str, row)) + " |" in lines
