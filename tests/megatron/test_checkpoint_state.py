"""Optimizer state in checkpoint form: coat's FP8 groups (and companded INT8 groups) per element,
restored exactly or regrouped."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_lowprec.numerics.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8_into
from megatron_lowprec.optim import AdamW, get_strategy
from megatron_lowprec.optim.kernel import init_state

from ..options import MASTER_OPTIONS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")

COAT = get_strategy("coat")
SR8_INT8 = get_strategy("sr8").with_moment_storage("int8")


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


def _int8_state(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """An sr8 state with companded INT8 moments holding ``values`` (v: their magnitudes) per 1x128 group."""
    state = {key: value for key, value in init_state(torch.zeros(values.numel(), dtype=torch.bfloat16), SR8_INT8).items()
             if torch.is_tensor(value)}
    for moment in ("exp_avg", "exp_avg_sq"):
        quantize_int8_into(values.abs() if moment == "exp_avg_sq" else values, state[f"{moment}_payload"],
                           state[f"{moment}_scale"], SR8_INT8.fp8_group_size)
    return state


def test_int8_moments_restore_exactly_in_the_same_groups_and_are_encoded_afresh_across_them():
    """Companded INT8 moments in checkpoint form (payloads as uint8, the BF16 scale per element):
    the same groups restore every bit; elements 64..319 of a 428-element run, loaded as a run of
    their own, hold the INT8 encoding of the saved (decoded) values."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_dtypes, checkpoint_state, restore_checkpoint_state

    values = torch.randn(428, generator=torch.Generator().manual_seed(2)) * torch.logspace(-4, 0, 428)
    saved = _int8_state(values)
    form = {key: value.clone() for key, value in checkpoint_state(saved, 428, SR8_INT8).items()}
    assert {key: value.dtype for key, value in form.items()} == checkpoint_dtypes(SR8_INT8, torch.bfloat16)
    restored = _int8_state(torch.zeros(428))
    restore_checkpoint_state(restored, form, 428, SR8_INT8)
    for key, value in saved.items():
        assert torch.equal(_bits(restored[key]), _bits(value)), key
    window = {key: value[64:320].clone() for key, value in form.items()}
    restored = _int8_state(torch.zeros(256))
    restore_checkpoint_state(restored, window, 256, SR8_INT8)
    for moment in ("exp_avg", "exp_avg_sq"):
        decoded = dequantize_int8(saved[f"{moment}_payload"], saved[f"{moment}_scale"], 128, torch.Size([428]))[64:320]
        expected = _int8_state(torch.zeros(256))
        quantize_int8_into(decoded, expected[f"{moment}_payload"], expected[f"{moment}_scale"], 128)
        assert torch.equal(restored[f"{moment}_payload"], expected[f"{moment}_payload"]), moment
        assert torch.equal(restored[f"{moment}_scale"], expected[f"{moment}_scale"]), moment


def _remainder_state(option: str, numel: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A BF16 parameter and its ``option`` state with the master as a remainder, after 3 steps."""
    from megatron_lowprec.optim import AdamW

    generator = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(numel, generator=generator).bfloat16())
    optimizer = AdamW([param], lr=1e-2, option=option, master_storage="remainder", fused=False)
    for _ in range(3):
        param.grad = torch.randn(numel, generator=generator).bfloat16()
        optimizer.step()
    return param, {key: value for key, value in optimizer.state[param].items() if torch.is_tensor(value)}


@pytest.mark.parametrize("option", MASTER_OPTIONS)
def test_a_remainder_master_is_saved_as_the_fp32_master_and_loads_into_either_storage(option):
    """The checkpoint form of a remainder master is the FP32 master under ``master`` (the same tensor a
    whole master saves), and it loads back exactly into the remainder and its parameter, or into a
    whole master, and from a whole master into a remainder."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state
    from megatron_lowprec.optim.master import master_value

    strategy = get_strategy(option).with_master_storage("remainder")
    param, state = _remainder_state(option, 300, seed=2)
    master = master_value(param.detach(), state["master_remainder"]).clone()
    form = {key: value.clone() for key, value in checkpoint_state(state, 300, strategy, param=param).items()}
    assert "master_remainder" not in form and torch.equal(form["master"].view(torch.int32), master.view(torch.int32))
    assert set(form) == set(checkpoint_state(state, 300, strategy, is_loading=True))

    other_param, other = _remainder_state(option, 300, seed=5)
    restore_checkpoint_state(other, form, 300, strategy, param=other_param)
    for key, value in state.items():
        assert torch.equal(_bits(other[key]), _bits(value)), key
    assert torch.equal(other_param.detach(), param.detach())

    whole_strategy = get_strategy(option).with_master_storage("fp32")
    whole = {key: value for key, value in init_state(torch.zeros(300, dtype=torch.bfloat16), whole_strategy).items() if torch.is_tensor(value)}
    restore_checkpoint_state(whole, form, 300, whole_strategy)
    assert torch.equal(whole["master"].view(torch.int32), master.view(torch.int32))
    back_param, back = _remainder_state(option, 300, seed=7)
    restore_checkpoint_state(back, checkpoint_state(whole, 300, whole_strategy), 300, strategy, param=back_param)
    assert torch.equal(master_value(back_param.detach(), back["master_remainder"]).view(torch.int32), master.view(torch.int32))


def test_a_checkpoint_form_that_dropped_one_remainder_bit_is_seen():
    """Mutation: the saved master loses its lowest bit; the restored remainder differs."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state

    strategy = get_strategy("D").with_master_storage("remainder")
    param, state = _remainder_state("D", 300, seed=2)
    form = {key: value.clone() for key, value in checkpoint_state(state, 300, strategy, param=param).items()}
    form["master"] = (form["master"].view(torch.int32) & ~1).view(torch.float32)
    other_param, other = _remainder_state("D", 300, seed=5)
    restore_checkpoint_state(other, form, 300, strategy, param=other_param)
    assert not torch.equal(other["master_remainder"], state["master_remainder"])


def test_a_remainder_master_needs_its_parameters():
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state

    strategy = get_strategy("D").with_master_storage("remainder")
    param, state = _remainder_state("D", 300, seed=2)
    with pytest.raises(ValueError, match=r"pass param= \(300 elements\), got None"):
        checkpoint_state(state, 300, strategy)
    form = checkpoint_state(state, 300, strategy, param=param)
    with pytest.raises(ValueError, match=r"pass param= \(300 elements\), got 299"):
        restore_checkpoint_state(state, form, 300, strategy, param=param[:299])


def test_a_residual_master_is_saved_as_the_fp32_master_and_restores_exactly():
    """res8's int8 residual is saved as its FP32 master (the parameter joined with it) and restores
    into the residual and the parameter bit for bit: a checkpoint resumes it exactly."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state
    from megatron_lowprec.optim.master import master_value

    def trained(seed):
        generator = torch.Generator().manual_seed(seed)
        param = torch.nn.Parameter(torch.randn(300, generator=generator).bfloat16())
        optimizer = AdamW([param], lr=1e-2, option="res8", fused=False)
        for _ in range(3):
            param.grad = torch.randn(300, generator=generator).bfloat16()
            optimizer.step()
        return param, {key: value for key, value in optimizer.state[param].items() if torch.is_tensor(value)}

    strategy = get_strategy("res8")
    param, state = trained(2)
    master = master_value(param.detach(), state["master_residual8"]).clone()
    form = {key: value.clone() for key, value in checkpoint_state(state, 300, strategy, param=param).items()}
    assert "master_residual8" not in form and torch.equal(form["master"].view(torch.int32), master.view(torch.int32))
    assert set(form) == set(checkpoint_state(state, 300, strategy, is_loading=True))
    other_param, other = trained(5)
    restore_checkpoint_state(other, form, 300, strategy, param=other_param)
    for key, value in state.items():
        assert torch.equal(_bits(other[key]), _bits(value)), key
    assert torch.equal(other_param.detach(), param.detach())
