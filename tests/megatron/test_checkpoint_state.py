"""Optimizer state in checkpoint form: coat's FP8 groups per element, restored exactly or regrouped."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_lowprec.numerics.quant import dequantize_fp8, quantize_fp8
from megatron_lowprec.optim import get_strategy
from megatron_lowprec.optim.kernel import init_state

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")

COAT = get_strategy("coat")


def _coat_state(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """A coat state whose moments hold ``values`` quantized per 1x128 group."""
    state = {key: value for key, value in init_state(torch.zeros(values.numel(), dtype=torch.bfloat16), COAT).items() if torch.is_tensor(value)}
    for moment in ("exp_avg", "exp_avg_sq"):
        quantized = quantize_fp8(values.abs() if moment == "exp_avg_sq" else values, COAT.fp8_format,
                                 group_size=COAT.fp8_group_size, expand=COAT.fp8_expand)
        for part in ("payload", "scale", "expansion_exponent"):
            if getattr(quantized, part) is not None:
                state[f"{moment}_{part}"].copy_(getattr(quantized, part))
    return state


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def test_same_groups_restore_payloads_scales_and_exponents_exactly():
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state

    values = torch.randn(300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 0, 300)
    saved = _coat_state(values)
    form = {key: value.clone() for key, value in checkpoint_state(saved, 300, COAT).items()}
    assert all(value.numel() == 300 for value in form.values())
    restored = _coat_state(torch.zeros(300))
    restore_checkpoint_state(restored, form, 300, COAT)
    for key, value in saved.items():
        assert torch.equal(_bits(restored[key]), _bits(value)), key


def test_groups_that_gather_two_saved_groups_are_quantized_afresh():
    """Elements 64..319 of a saved 428-element run, loaded as a run of their own: both new groups
    straddle two saved groups and hold the quantization of the saved (dequantized) values."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state

    values = torch.randn(428, generator=torch.Generator().manual_seed(1))
    saved = _coat_state(values)
    form = checkpoint_state(saved, 428, COAT)
    window = {key: value[64:320].clone() for key, value in form.items()}
    restored = _coat_state(torch.zeros(256))
    restore_checkpoint_state(restored, window, 256, COAT)
    for moment in ("exp_avg", "exp_avg_sq"):
        saved_values = dequantize_fp8(
            quantize_fp8(values.abs() if moment == "exp_avg_sq" else values, COAT.fp8_format,
                         group_size=COAT.fp8_group_size, expand=COAT.fp8_expand)
        )[64:320]
        expected = quantize_fp8(saved_values, COAT.fp8_format, group_size=COAT.fp8_group_size, expand=COAT.fp8_expand)
        assert torch.equal(_bits(restored[f"{moment}_payload"]), _bits(expected.payload)), moment
        assert torch.equal(restored[f"{moment}_scale"], expected.scale), moment
