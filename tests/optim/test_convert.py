"""Conversion of optimizer state between every registered option and megatron-core's own (stock).

Every stored format is checked against a reference computed here from FP64 values: a 16-bit format
is the nearest value, ties to even, found among the neighbours of a candidate (not a cast, which
rounds FP64 to BF16 twice); FP32 is torch's FP64 -> FP32 cast (one rounding); a pair is the
nearest value and the nearest rest; FP8 moments are COAT's own quantization of the FP32 values.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lowprec.megatron.checkpoint_state import checkpoint_state
from megatron_lowprec.numerics.quant import QuantizedTensor, dequantize_fp8, dequantize_int8, fp8_dtype_of, quantize_fp8
from megatron_lowprec.optim import AdamW, available_strategies
from megatron_lowprec.optim.convert import STOCK, STOCK_MASTER_KEY, convert_state_dict, resolve_target, round_to
from megatron_lowprec.optim.muon import Muon

SHAPE = (3, 100)
TARGETS = [strategy.name for strategy in available_strategies()] + [STOCK]


def nearest(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP64 ``values`` rounded to nearest, ties to even, in the 16-bit ``dtype`` (FP64 result)."""
    bits = values.float().to(dtype).view(torch.int16).long()
    candidates = torch.stack([bits - 1, bits, bits + 1]).to(torch.int16).view(dtype).double()
    distance = (candidates - values).abs().nan_to_num(nan=float("inf"))
    best = distance.min(dim=0).values
    even = (torch.stack([bits - 1, bits, bits + 1]) & 1) == 0
    pick = torch.where((distance == best) & even, 0, 1) * 4 + torch.where(distance == best, 0, 1) * 2
    return candidates.gather(0, pick.argmin(dim=0, keepdim=True))[0]


def stored_value(param: torch.Tensor, state: dict) -> torch.Tensor:
    """The parameter's full-precision value in FP64, read here from the stored bits."""
    if "master" in state or STOCK_MASTER_KEY in state:
        return state.get("master", state.get(STOCK_MASTER_KEY)).double().reshape(-1)
    if "master_remainder" in state:
        upper = param.reshape(-1).view(torch.int16).int() << 16
        return (upper + state["master_remainder"].reshape(-1).int()).view(torch.float32).double()
    if "master_residual8" in state:
        upper = param.reshape(-1).view(torch.int16).int() << 16
        return (upper + (state["master_residual8"].reshape(-1).int() << 8)).view(torch.float32).double()
    low = state.get("param_lo", state.get("kahan_compensation"))
    return param.double().reshape(-1) + (0 if low is None else low.double().reshape(-1))


def sixteen_significant_bits(values: torch.Tensor) -> torch.Tensor:
    """FP64 ``values`` rounded to nearest, ties away from zero, on the grid of 16 significant bits
    that a residual master holds (a step of 2^-15 of each value's binade), in FP64 arithmetic."""
    magnitude = values.abs()
    _, exponent = torch.frexp(magnitude)
    step = torch.ldexp(torch.ones_like(magnitude), exponent - 16)
    return torch.sign(values) * torch.floor(magnitude / step + 0.5) * step


def stored_moment(strategy, moment: str, state: dict) -> torch.Tensor:
    if strategy.moments == "fp8":
        exponent = state.get(f"{moment}_expansion_exponent")
        return dequantize_fp8(QuantizedTensor(
            state[f"{moment}_payload"].reshape(-1), state[f"{moment}_scale"], exponent,
            strategy.fp8_group_size, torch.Size([state[f"{moment}_payload"].numel()]), fp8_dtype_of(strategy.fp8_format),
        )).double()
    low = state.get("exp_avg_sq_lo") if moment == "exp_avg_sq" and strategy.second_moment_mcf else None
    return state[moment].double().reshape(-1) + (0 if low is None else low.double().reshape(-1))


def _trained(option: str, optimizer_class=AdamW) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(7)
    param = torch.nn.Parameter(torch.randn(SHAPE).bfloat16())
    optimizer = optimizer_class([param], lr=0.01, option=option, fused=False)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer.state_dict(), param.detach().clone()


def _stock_state_dict() -> tuple[dict, torch.Tensor]:
    """megatron-core's state: option D's formats, the master under ``fp32_param``, no ``lowprec`` section."""
    state_dict, param = _trained("D")
    state = {key: value for key, value in state_dict["state"][0].items() if key != "master"}
    state[STOCK_MASTER_KEY] = state_dict["state"][0]["master"]
    return {"state": {0: state}, "param_groups": state_dict["param_groups"]}, param


@pytest.fixture(scope="module")
def saved() -> dict[str, tuple[dict, torch.Tensor]]:
    states = {option: _trained(option) for option in TARGETS if option != STOCK}
    states[STOCK] = _stock_state_dict()
    return states


def _check_stored(target, source_values: dict[str, torch.Tensor], param: torch.Tensor, state: dict, source, source_state) -> None:
    """Each state of ``target`` holds the reference rounding of the source's FP64 values."""
    value = source_values["value"]
    if target.master_weights:
        master = value.float().double()
        expected = sixteen_significant_bits(master) if target.master_storage == "residual8" else master
        assert torch.equal(stored_value(param, state), expected)
    elif "param_lo" in state or "kahan_compensation" in state:
        high = nearest(value, torch.bfloat16)
        low = state.get("param_lo", state.get("kahan_compensation"))
        assert torch.equal(param.double().reshape(-1), high)
        assert torch.equal(low.double().reshape(-1), nearest(value - high, torch.bfloat16))
    else:
        assert torch.equal(param.double().reshape(-1), nearest(value, torch.bfloat16))
    for moment in target.moment_names:
        values = source_values[moment]
        if target.moments == "fp32":
            assert torch.equal(state[moment].double().reshape(-1), values.float().double())
        elif target.moments == "fp8":
            if source.moments == "fp8" and source.fp8_exponent_storage == target.fp8_exponent_storage:
                for part in ("payload", "scale", "expansion_exponent"):
                    key = f"{moment}_{part}"
                    assert torch.equal(state[key].view(torch.uint8) if part == "payload" else state[key],
                                       source_state[key].view(torch.uint8) if part == "payload" else source_state[key])
            else:
                expected = quantize_fp8(
                    values.float(), target.fp8_format, target.fp8_group_size, target.fp8_expand, target.fp8_exponent_storage
                )
                assert torch.equal(state[f"{moment}_payload"].view(torch.uint8), expected.payload.view(torch.uint8))
                assert torch.equal(state[f"{moment}_scale"], expected.scale)
                assert torch.equal(state[f"{moment}_expansion_exponent"], expected.expansion_exponent)
        elif moment == "exp_avg_sq" and target.second_moment_mcf:
            high = nearest(values, torch.bfloat16)
            assert torch.equal(state[moment].double().reshape(-1), high)
            assert torch.equal(state["exp_avg_sq_lo"].double().reshape(-1), nearest(values - high, torch.bfloat16))
        else:
            assert torch.equal(state[moment].double().reshape(-1), nearest(values, torch.bfloat16))


@pytest.mark.parametrize("source_name", TARGETS)
def test_every_option_converts_to_every_option_by_correct_rounding(saved, source_name):
    state_dict, param = saved[source_name]
    source = resolve_target(source_name)
    source_state = state_dict["state"][0]
    values = {"value": stored_value(param, source_state)}
    values.update({moment: stored_moment(source, moment, source_state) for moment in source.moment_names})
    for target_name in TARGETS:
        target = resolve_target(target_name)
        converted, params, lines = convert_state_dict(state_dict, [param], target)
        state = converted["state"][0]
        _check_stored(target, values, params[0], state, source, source_state)
        assert len(lines) == 1 + len(target.moment_names), lines
        assert converted["lowprec"]["option"] == target.name
        assert state["step"] == source_state["step"]
        resumed = torch.nn.Parameter(params[0].clone())
        optimizer = AdamW([resumed], lr=0.01, option=target, fused=False)
        optimizer.load_state_dict(converted)
        resumed.grad = torch.ones_like(resumed)
        optimizer.step()
        assert resumed.isfinite().all()


def test_fp32_masters_convert_bit_exactly_between_d_remainder_master_and_stock(saved):
    """D, D with its master stored as a remainder, and megatron-core's state carry the same bits."""
    state_dict, param = saved["D"]
    remainder = resolve_target("D", master_storage="remainder")
    as_remainder, remainder_params, lines = convert_state_dict(state_dict, [param], remainder)
    assert all(line.endswith("exact") for line in lines), lines
    as_stock, stock_params, _ = convert_state_dict(as_remainder, remainder_params, resolve_target(STOCK))
    back, back_params, _ = convert_state_dict(saved[STOCK][0], [saved[STOCK][1]], resolve_target("D"))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(as_stock["state"][0][key], state_dict["state"][0][key])
        assert torch.equal(back["state"][0][key], state_dict["state"][0][key])
    assert torch.equal(as_stock["state"][0]["master"], state_dict["state"][0]["master"])
    assert torch.equal(back["state"][0]["master"], state_dict["state"][0]["master"])
    assert torch.equal(back_params[0], param)


def test_richer_targets_are_exact_and_report_it(saved):
    """BF16 values are FP32 values, a pair holds a BF16 value or a pair, FP8 codes dequantize to FP32 values."""
    for source, target in [("A", "D"), ("A", "C"), ("B", "C"), ("kahan", "B"), ("coat", "D"), ("D-BF16", "D")]:
        state_dict, param = saved[source]
        _, _, lines = convert_state_dict(state_dict, [param], resolve_target(target))
        assert all(line.endswith("exact") for line in lines), (source, target, lines)


def test_checkpoint_form_converts_as_the_optimizer_form(saved):
    """Per-element FP8 parts with codes as uint8 (the checkpoint's form) give the same conversion."""
    state_dict, param = saved["coat"]
    strategy = resolve_target("coat")
    tensors = {key: value for key, value in state_dict["state"][0].items() if torch.is_tensor(value)}
    form = checkpoint_state(tensors, param.numel(), strategy, param=param)
    as_checkpoint = {**state_dict, "state": {0: {**form, "step": state_dict["state"][0]["step"]}}}
    for target in ("D", "coat"):
        expected, _, _ = convert_state_dict(state_dict, [param], resolve_target(target))
        found, _, _ = convert_state_dict(as_checkpoint, [param], resolve_target(target))
        assert found["state"][0].keys() == expected["state"][0].keys()
        for key, value in expected["state"][0].items():
            if torch.is_tensor(value):
                assert torch.equal(found["state"][0][key].reshape(-1).view(torch.uint8),
                                   value.reshape(-1).view(torch.uint8)), (target, key)


def test_a_res8_state_saved_with_fp32_exponents_is_refused_as_it_is_and_converts(saved):
    """A res8 state dict written while its FP8 exponents were FP32 (its section records no exponent
    storage) is refused in one line by res8's optimizer (its payloads were quantized with another k
    than BF16 stores), and converts: the master carries over exactly, each moment is quantized afresh
    from the saved one's values with BF16 exponents, and the section then records them."""
    from dataclasses import replace

    res8 = resolve_target("res8")
    old = replace(res8, fp8_exponent_storage="fp32")
    state_dict, param = _trained(old)
    assert state_dict["lowprec"]["option"] == "res8" and "fp8_exponent_storage" not in state_dict["lowprec"]
    assert state_dict["state"][0]["exp_avg_expansion_exponent"].dtype == torch.float32
    loading = AdamW([torch.nn.Parameter(param.clone())], lr=0.01, option="res8", fused=False)
    with pytest.raises(ValueError, match=r"^the optimizer state of option 'res8' was saved with its FP8 expansion exponents "
                                         r"in fp32, this optimizer stores them in bf16; .*convert_state_dict converts it$"):
        loading.load_state_dict(state_dict)
    converted, params, lines = convert_state_dict(state_dict, [param], res8)
    source_state = state_dict["state"][0]
    values = {"value": stored_value(param, source_state)}
    values.update({moment: stored_moment(old, moment, source_state) for moment in old.moment_names})
    _check_stored(res8, values, params[0], converted["state"][0], old, source_state)
    assert converted["state"][0]["exp_avg_expansion_exponent"].dtype == torch.bfloat16
    assert lines[0].endswith("exact") and converted["lowprec"]["fp8_exponent_storage"] == "bf16"
    loading.load_state_dict(converted)


def test_int8_moments_are_recorded_refused_by_the_fp8_optimizer_and_convert_to_it():
    """An sr8 state with companded INT8 moments records them in its section: an INT8 optimizer loads
    it bit for bit, sr8's FP8 optimizer refuses it in one line (it would read the INT8 codes as FP8),
    and it converts: each FP8 moment is the FP8 quantization of the INT8 moment's values."""
    int8 = resolve_target("sr8").with_moment_storage("int8")
    state_dict, param = _trained(int8)
    assert state_dict["lowprec"]["moment_storage"] == "int8"
    same = AdamW([torch.nn.Parameter(param.clone())], lr=0.01, option="sr8", moment_storage="int8", fused=False)
    same.load_state_dict(state_dict)
    for key, value in state_dict["state"][0].items():
        if torch.is_tensor(value):
            assert torch.equal(same.state_dict()["state"][0][key].view(torch.uint8), value.view(torch.uint8)), key
    fp8 = AdamW([torch.nn.Parameter(param.clone())], lr=0.01, option="sr8", fused=False)
    with pytest.raises(ValueError, match=r"^the optimizer state of option 'sr8' was saved with its moments in int8, "
                                         r"this optimizer stores them in fp8; .*convert_state_dict converts it$"):
        fp8.load_state_dict(state_dict)
    converted, _, lines = convert_state_dict(state_dict, [param], resolve_target("sr8"))
    source = state_dict["state"][0]
    for moment in int8.moment_names:
        values = dequantize_int8(source[f"{moment}_payload"], source[f"{moment}_scale"], 128, torch.Size([param.numel()]))
        expected = quantize_fp8(values, "e4m3", 128, expand=True, exponent_storage="bf16")
        assert torch.equal(converted["state"][0][f"{moment}_payload"].view(torch.uint8), expected.payload.view(torch.uint8))
    assert any("INT8 (companded, signed) 1x128 groups" in line for line in lines)
    assert "moment_storage" not in converted["lowprec"]
    fp8.load_state_dict(converted)


def test_muon_momentum_converts():
    state_dict, param = _trained("D", Muon)
    converted, params, lines = convert_state_dict(state_dict, [param], Muon([param.clone()], option="B").strategy)
    assert [line.split(":")[1].strip() for line in lines] == ["value", "momentum"]
    assert torch.equal(converted["state"][0]["momentum"].double(), nearest(state_dict["state"][0]["momentum"].double().reshape(-1), torch.bfloat16).view(SHAPE))


def test_round_to_is_correct_rounding_from_fp64():
    """A value just above a BF16 tie: rounding through FP32 by the cast ties it down, correctly it goes up."""
    values = torch.tensor([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 1 + 2.0**-8, 3.0e-39], dtype=torch.float64)
    assert torch.equal(round_to(values, torch.bfloat16).double(), nearest(values, torch.bfloat16))
    assert round_to(values, torch.bfloat16)[0].item() == 1 + 2.0**-7


def test_unknown_target_is_one_line():
    with pytest.raises(ValueError, match=r"unknown precision option 'E'; valid: .*stock"):
        resolve_target("E")
