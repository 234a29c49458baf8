"""``SDPAttention`` against megatron's ``DotProductAttention`` in tiny GPTs on CPU (two gloo ranks).

The scenarios run once per module in two worker processes (:mod:`tests.megatron._attention_worker`).

BF16 tolerance: both backends compute in BF16 (unit roundoff u = 2^-8) with FP32 softmax, and differ
in where they round (the unfused path rounds the scores and the probabilities to BF16, SDPA's CPU
kernel keeps its running softmax in FP32). The logits may differ by two BF16 steps of the largest
logit (measured: one), the flattened gradients by 4u in relative L2 norm (measured 1.5u), the
losses by u relative (measured 3e-5).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .launch import run_ranks, scenario_results

WORKER = Path(__file__).with_name("_attention_worker.py")
BF16_UNIT_ROUNDOFF = 2.0**-8
BF16_STEP = 2 * BF16_UNIT_ROUNDOFF
"""Spacing of BF16 numbers relative to the lower power of two of their binade (8 significand bits)."""

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("attention"), 2, timeout_seconds=180, on_cpu=True)


@pytest.mark.parametrize("scenario", ["equivalence_tp1", "equivalence_tp2"])
@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_sdpa_matches_unfused_attention_forward_and_gradients(ranks, scenario, attention):
    for rank, result in enumerate(scenario_results(ranks, scenario)):
        assert result["tensor_parallel_size"] == (2 if scenario.endswith("tp2") else 1)
        run = result[attention]
        assert run["core_attention"] == "SDPAttention"
        assert run["sdpa_losses"] == pytest.approx(run["unfused_losses"], rel=BF16_UNIT_ROUNDOFF), rank
        assert run["logits_max_abs_error"] <= 2 * BF16_STEP * run["logits_max_abs"], rank
        assert run["grads_nonzero"]
        assert run["grad_relative_error"] < 4 * BF16_UNIT_ROUNDOFF, rank


def test_attention_dropout_draws_from_the_tracker_stream(ranks):
    """Dropout changes the loss, leaves torch's default generator alone (megatron's tracker stream is
    forked), repeats from the seed, and activation recompute redraws the same masks."""
    for result in scenario_results(ranks, "dropout_tp2"):
        assert result["losses"] != result["without_dropout"]
        assert result["default_generator_untouched"]
        assert result["again"] == result["losses"]
        assert result["recomputed_losses"] == result["losses"]
        assert result["recompute_grads_equal"]


def test_unsupported_settings_are_refused_naming_the_alternatives(ranks):
    errors = scenario_results(ranks, "unsupported_settings_tp1")[0]
    assert "sliding-window" in errors["window"] and "'unfused' or 'te'" in errors["window"]
    assert "softmax_type='vanilla'" in errors["softmax"] and "'off-by-one'" in errors["softmax"]


def test_deterministic_mode_keeps_sdpa_to_backends_with_a_deterministic_backward(ranks):
    """cuDNN's attention (no deterministic backward) is excluded under megatron's deterministic_mode
    (``trainer.deterministic``), and only there."""
    result = scenario_results(ranks, "deterministic_backends_tp1")[0]
    assert result["deterministic"] == ["flash", "mem_efficient", "math"]
    assert "cudnn" in result["default"]
