"""The traffic census of one transformer layer (tools/kernel_audit/census.py) at the embedded default shape.

The fence: the launches and bytes of one layer's forward and backward, stock and coat, are today's
figures; a change that adds a launch or a byte fails here, and one that removes some updates the
figures. GEMM FLOPs are checked against the analytic count of the layer's linears, and attention's
against flash attention's causal matmuls.
"""

from pathlib import Path

import pytest

from benchmarks.report import STAMP_PREFIX
from tools.kernel_audit import census

RESULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "coat_census.md"
TINY = census.SHAPES["tiny"]

FENCE = {
    ("stock", "eager"): (49, 3_498_112, 1_973_888),
    ("coat", "eager"): (308, 16_596_876, 12_621_260),
    ("coat", "fused regions"): (87, 4_422_880, 3_211_952),
}
"""(launches, bytes read, bytes written) of one tiny layer's forward and backward."""


@pytest.fixture(scope="module")
def kernels():
    return census.censuses(TINY)


@pytest.mark.parametrize("key", list(FENCE), ids=lambda key: "-".join(key).replace(" ", "_"))
def test_launches_and_bytes_per_layer_stay_at_the_fence(kernels, key):
    summary = census.summarize(kernels[key])
    assert (summary.launches, summary.read, summary.written) == FENCE[key]


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
    fused = reasons(("coat", "fused regions"))
    assert fused.count(("_copied", "standalone copy of an FP8 payload")) == 12
    assert fused.count(("_quantize_rows", "re-reads what native_layer_norm wrote")) == 2
    stock = reasons(("stock", "eager"))
    assert not [reason for _, reason in stock if "FP32" in reason or "FP8" in reason or "cast" in reason]
    assert all(not kernel.reasons for kernel in kernels["stock", "eager"] if kernel.kind in ("gemm", "attention"))


def test_unknown_flavour_is_refused():
    with pytest.raises(ValueError, match="'bf16'.*valid: stock, coat"):
        census.Layer(TINY, "bf16")


def test_result_file_holds_todays_tiny_rows(kernels):
    lines = RESULT.read_text().splitlines()
    assert lines[2].startswith(STAMP_PREFIX)
    for key in census.COUNTS:
        row = census.summary_row("tiny", key, census.summarize(kernels[key]), None)
        assert "| " + " | ".join(map(str, row)) + " |" in lines
