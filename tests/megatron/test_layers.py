"""``apply_layer_precision`` on tiny megatron GPTs: two gloo ranks through the CPU bridge, or two NCCL
ranks on two GPUs where CUDA is present.

The scenarios run once per module in two worker processes (:mod:`tests.megatron._layers_worker`);
each test checks one scenario.

FP8 tolerance: E4M3 keeps 3 mantissa bits (unit roundoff u4 = 2^-4), E5M2 2 bits (u5 = 2^-3). One
FP8 linear's gradient terms carry a relative error below u5 + u4 each (the output gradient and the
weight or input), so the model's gradients, flattened, must agree with BF16's within u5 + u4 in
relative L2 norm (measured: 0.045 for the GPT, 0.031 for the Llama-style model, cosine > 0.998), and
each tensor within 2 u5 (the gradient of a layer passes the E5M2 quantization of every layer above
it; measured worst 0.15). At TP=2 each rank quantizes its own shard with its own scales, so TP=2
differs from TP=1 by another FP8 rounding of the same size (measured 0.053), while BF16 TP=2 and
TP=1 differ by 0.007.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from .launch import run_ranks, scenario_results

WORKER = Path(__file__).with_name("_layers_worker.py")
U_E4M3 = 2.0**-4
U_E5M2 = 2.0**-3
GRADIENT_TOLERANCE = U_E5M2 + U_E4M3
TENSOR_GRADIENT_TOLERANCE = 2 * U_E5M2
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("layers"), 2, timeout_seconds=180)


def _assert_within_fp8_tolerance(comparison: dict) -> None:
    assert comparison["relative_error"] < GRADIENT_TOLERANCE
    assert comparison["worst_tensor_relative_error"] < TENSOR_GRADIENT_TOLERANCE
    assert comparison["cosine"] > 0.99


def test_fp8_layers_convert_linears_norms_and_activations_but_not_the_lm_head(ranks):
    result = scenario_results(ranks, "conversion_tp1")[0]
    expected = {"module.decoder.final_layernorm": "FP8LayerNorm"}
    for layer in range(2):
        prefix = f"module.decoder.layers.{layer}."
        expected |= {prefix + norm: "FP8LayerNorm" for norm in ("input_layernorm", "pre_mlp_layernorm")}
        expected[prefix + "mlp"] = "FP8ActivationMLP"
        expected |= {
            prefix + ("self_attention." if name in LINEARS[:2] else "mlp.") + name: (
                "FP8ColumnParallelLinear" if name in ("linear_qkv", "linear_fc1") else "FP8RowParallelLinear"
            )
            for name in LINEARS
        }
    assert result["fp8_types"] == expected
    assert result["parameters_kept"] and result["state_dict_keys_kept"]
    assert set(result["llama_types"].values()) == set(expected.values()) - {"FP8LayerNorm"} | {"FP8RMSNorm"}
    assert sorted(result["partial_names"]) == sorted(
        name for name in expected if not name.startswith("module.decoder.layers.0.")
    )


def test_emulation_converts_every_linear_and_only_linears(ranks):
    result = scenario_results(ranks, "conversion_tp1")[0]
    linears = [name for name in result["emulated_types"] if name.rsplit(".", 1)[-1] in (*LINEARS, "output_layer")]
    assert len(linears) == len(result["emulated_types"]) == 9
    assert "module.output_layer" in result["emulated_types"]
    assert result["emulated_formats"] == ["FloatFormat(name='E8M5', exponent_bits=8, mantissa_bits=5, specials='ieee')"]


def test_layer_settings_convert_as_their_keywords_and_through_the_bridge_hook(ranks):
    """A :class:`LayerPrecision` converts what its keywords convert: unset ``fp8_layers`` is the
    option's (coat: the FP8 flow), Megatron-Bridge's pre-wrap hook emulates with its rounding and
    returns the chunks, settings that ask for no flow convert nothing (their exclude unchecked), and
    settings with keywords are refused."""
    result = scenario_results(ranks, "conversion_tp1")[0]
    assert result["settings_types"] == result["fp8_types"]
    assert result["hook_returns_its_chunks"] and result["hook_roundings"] == ["stochastic"]
    assert set(result["hook_types"]) == set(result["emulated_types"])
    assert result["settings_without_a_flow"] == []
    assert result["settings_and_keywords_error"] == "give a LayerPrecision or the keywords fp8_layers, not both"


def test_bad_requests_raise_naming_the_valid_choices(ranks):
    result = scenario_results(ranks, "conversion_tp1")[0]
    assert "'lm_head' matches no convertible module" in result["unknown_exclude_error"]
    assert "output_layer" in result["unknown_exclude_error"] and "linear_qkv" in result["unknown_exclude_error"]
    assert "not a string" in result["string_exclude_error"]
    assert "not both" in result["both_modes_error"]
    assert "got FP8LayerNorm" in result["second_conversion_error"]
    assert result["unchanged_by_failed_conversion"]


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_fp8_gradients_match_bf16_within_fp8_tolerance(ranks, architecture):
    result = scenario_results(ranks, "fp8_gradients_tp1")[0][architecture]
    _assert_within_fp8_tolerance(result)
    for fp8_loss, bf16_loss in zip(result["fp8_losses"], result["bf16_losses"]):
        assert fp8_loss == pytest.approx(bf16_loss, rel=1e-3)


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_e8m7_emulation_is_bit_identical_to_no_emulation(ranks, architecture):
    result = scenario_results(ranks, "emulation_tp1")[0][architecture]
    assert result["e8m7_losses"] == result["plain_losses"]
    assert result["grads_identical"]
    assert result["e8m3_losses"] != result["plain_losses"], "a 3-bit mantissa must change the loss"


def test_fp8_flow_trains_under_megatron_ddp_like_bf16(ranks):
    for result in scenario_results(ranks, "fp8_training_tp1"):
        fp8, bf16 = result["fp8_losses"], result["bf16_losses"]
        assert all(math.isfinite(loss) for loss in fp8)
        assert all(later < earlier for earlier, later in zip(fp8[::2], fp8[2::2])), "the loss must decrease"
        assert fp8[-1] < fp8[0] - 0.5
        assert fp8[-1] == pytest.approx(bf16[-1], rel=0.02)


def test_tensor_parallel_fp8_matches_tp1_within_fp8_tolerance(ranks):
    results = scenario_results(ranks, "tensor_parallel_fp8")
    assert results[0]["losses"] == results[1]["losses"], "the tensor-parallel ranks disagree on the loss"
    result = results[0]
    assert result["same_weights"], "TP=1 and TP=2 must start from the same full weights"
    assert result["bf16_tp2_vs_tp1"]["relative_error"] < 2.0**-6
    _assert_within_fp8_tolerance(result["fp8_tp2_vs_tp1"])
    for tp2_loss, tp1_loss in zip(result["losses"]["tp2_fp8"], result["losses"]["tp1_fp8"]):
        assert tp2_loss == pytest.approx(tp1_loss, rel=1e-3)


def test_pipeline_stages_convert_with_the_default_exclude(ranks):
    first, last = sorted(scenario_results(ranks, "pipeline_parallel_fp8"), key=lambda result: result["pipeline_rank"])
    assert "module.decoder.final_layernorm" not in first["names"]
    assert "module.decoder.final_layernorm" in last["names"]
    assert all(name.startswith("module.decoder.layers.0.") for name in first["names"])
    assert first["grads_finite"] and last["grads_finite"]
    assert len(last["losses"]) == 2 and all(math.isfinite(loss) for loss in last["losses"])
