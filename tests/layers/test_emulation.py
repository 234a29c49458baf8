"""ExMy emulation: rounding against torch's own bf16 / float8 casts and float64 arithmetic, the range
switches of the paper's ablation, and the emulated linear (E8M7 is BF16 bit for bit)."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_lowprec.layers import EmulationConfig, emulate_format, emulated_linear


def finite_float32_sample(numel: int, seed: int, max_magnitude: float = float("inf")) -> torch.Tensor:
    """Random bit patterns: every binade of float32 (subnormals included), finite, below max_magnitude."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**31), 2**31, (numel,), generator=generator, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)
    return x[torch.isfinite(x) & (x.abs() < max_magnitude)]


def wide_sample(*shape, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(3 * torch.randn(*shape, generator=generator))
    return (torch.randn(*shape, generator=generator) * magnitudes).to(dtype)


def rne_in_float64(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """Round to mantissa_bits explicit bits, 8-bit exponent range (no clamping in play here), float64 on the CPU."""
    values = x.double().cpu().numpy()
    fraction, exponent = np.frexp(values)
    rounded = np.ldexp(np.round(np.ldexp(fraction, mantissa_bits + 1)), exponent - mantissa_bits - 1)
    return torch.from_numpy(rounded)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of the float32 values of two tensors on any devices."""
    return torch.equal(a.float().cpu().view(torch.int32), b.float().cpu().view(torch.int32))


def test_e8m7_is_bf16_rounding_bit_for_bit(device):
    bf16_max = torch.finfo(torch.bfloat16).max
    x = finite_float32_sample(200_000, seed=1, max_magnitude=bf16_max)
    assert bits_equal(emulate_format(x.to(device), "E8M7"), x.to(torch.bfloat16))


def test_e4m3_is_torchs_saturating_float8_cast(device):
    x = torch.cat([finite_float32_sample(200_000, seed=2), torch.tensor([float("inf"), -float("inf"), 464.0, -480.0])])
    # Above the largest E4M3 value torch 2.11's CPU cast gives NaN, torch 2.13's saturates.
    assert bits_equal(emulate_format(x.to(device), "E4M3"), x.clamp(-448, 448).to(torch.float8_e4m3fn))
    assert torch.isnan(emulate_format(torch.tensor([float("nan")], device=device), "E4M3")).all()


def test_e5m2_is_torchs_float8_cast_of_the_saturated_input(device):
    x = torch.cat([finite_float32_sample(200_000, seed=3), torch.tensor([61440.0, -1e6])])
    saturated = x.clamp(-57344.0, 57344.0).to(torch.float8_e5m2)
    assert bits_equal(emulate_format(x.to(device), "E5M2"), saturated)
    unsaturated = x.to(torch.float8_e5m2).float()
    finite = torch.isfinite(unsaturated)
    assert bits_equal(emulate_format(x.to(device), "E5M2").cpu()[finite], unsaturated[finite])
    extremes = emulate_format(torch.tensor([61440.0, -1e6], device=device), "E5M2")
    assert (extremes.cpu() == torch.tensor([57344.0, -57344.0])).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inputs_of_16_bit_dtypes_round_like_their_float32_value(dtype, device):
    x = wide_sample(5000, seed=4).clamp(-6e4, 6e4).to(dtype)
    assert bits_equal(emulate_format(x.to(device), "E5M2"), x.float().to(torch.float8_e5m2))


def test_outer_range_switch_keeps_large_values_with_eight_exponent_bits(device):
    x = torch.tensor([1e5, -3.3e6, 70000.0, 1000.0, 1e-7])
    unclamped = emulate_format(x.to(device), "E5M2", clamp_outer_range=False).cpu()
    large = x.abs() > 57344
    assert torch.equal(unclamped[large].double(), rne_in_float64(x[large], 2))
    assert bits_equal(unclamped[~large], emulate_format(x[~large].to(device), "E5M2"))


def test_inner_range_switch_keeps_small_values_at_full_relative_precision(device):
    x = torch.tensor([3e-7, -1.1e-9, 2.0**-20 * 1.3, 1000.0, 1e5])
    unclamped = emulate_format(x.to(device), "E5M2", clamp_inner_range=False).cpu()
    small = x.abs() < 2.0**-14
    assert torch.equal(unclamped[small].double(), rne_in_float64(x[small], 2))
    assert bits_equal(unclamped[~small], emulate_format(x[~small].to(device), "E5M2"))
    both_off = emulate_format(x.to(device), "E5M2", clamp_inner_range=False, clamp_outer_range=False)
    assert torch.equal(both_off.cpu().double(), rne_in_float64(x, 2))


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(device):
    x = torch.full((200_000,), 1.0 + 2.0**-5, device=device)
    rounded = emulate_format(x, "E8M3", rounding="stochastic", generator=torch.Generator(device).manual_seed(5))
    assert set(rounded.unique().tolist()) == {1.0, 1.125}
    assert abs(float(rounded.double().mean()) - (1.0 + 2.0**-5)) < 1e-3


def sample_linear(seed, dtype=torch.bfloat16, device=None):
    generator = torch.Generator().manual_seed(seed)
    input = torch.randn(3, 7, 64, generator=generator).to(device, dtype)
    weight = (torch.randn(48, 64, generator=generator) * 0.1).to(device, dtype)
    bias = torch.randn(48, generator=generator).to(device, dtype)
    grad_output = torch.randn(3, 7, 48, generator=generator).to(device, dtype)
    return input, weight, bias, grad_output


def run_linear(function, input, weight, bias, grad_output):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in (input, weight, bias)]
    output = function(*leaves)
    output.backward(grad_output)
    return [output.detach()] + [leaf.grad for leaf in leaves]


def test_e8m7_linear_is_the_bf16_linear_bit_for_bit(device):
    input, weight, bias, grad_output = sample_linear(seed=6, device=device)
    config = EmulationConfig.parse("E8M7")
    emulated = run_linear(lambda x, w, b: emulated_linear(x, w, b, config), input, weight, bias, grad_output)
    plain = run_linear(lambda x, w, b: torch.matmul(x, w.t()) + b, input, weight, bias, grad_output)
    for from_emulation, from_bf16 in zip(emulated, plain):
        assert torch.equal(from_emulation, from_bf16)


def test_fp8_linear_rounds_inputs_weights_outputs_and_gradients_like_torch_casts(device):
    input, weight, bias, grad_output = sample_linear(seed=7, device=device)
    config = EmulationConfig.parse({"format": "E4M3", "grad_format": "E5M2"})
    output, grad_input, grad_weight, grad_bias = run_linear(
        lambda x, w, b: emulated_linear(x, w, b, config), input, weight, bias, grad_output
    )

    def e4m3(t):
        return t.float().to(torch.float8_e4m3fn).to(torch.bfloat16)

    def e5m2(t):
        return t.float().clamp(-57344, 57344).to(torch.float8_e5m2).to(torch.bfloat16)

    assert torch.equal(output, e4m3(torch.matmul(e4m3(input), e4m3(weight).t())) + bias)
    assert torch.equal(grad_input, e5m2(e5m2(grad_output).matmul(e4m3(weight))))
    expected_grad_weight = e5m2(e5m2(grad_output).reshape(-1, 48).t().matmul(e4m3(input).reshape(-1, 64)))
    assert torch.equal(grad_weight, expected_grad_weight)
    assert torch.equal(grad_bias, grad_output.reshape(-1, 48).sum(dim=0))


def test_formats_wider_than_the_storage_dtype_multiply_in_fp32(device):
    input, weight, bias, _ = sample_linear(seed=8, device=device)
    config = EmulationConfig.parse("E8M10")
    product = torch.matmul(input.float(), weight.float().t())
    expected = rne_in_float64(product, 10).float().to(device, torch.bfloat16) + bias
    assert torch.equal(emulated_linear(input, weight, bias, config), expected)


def test_config_parsing():
    config = EmulationConfig.parse("E8M5")
    assert {config.input_format, config.weight_format, config.output_format, config.grad_format} == {
        EmulationConfig.parse("e8m5").input_format
    }
    assert config.input_format.mantissa_bits == 5 and config.rounding == "nearest"
    mixed = EmulationConfig.parse({"format": "E8M5", "grad_format": "E5M2", "rounding": "stochastic",
                                   "clamp_inner_range": False})
    assert mixed.grad_format.name == "e5m2" and mixed.weight_format.mantissa_bits == 5
    assert mixed.rounding == "stochastic" and not mixed.clamp_inner_range and mixed.clamp_outer_range
    assert EmulationConfig.parse(mixed) is mixed
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rounding = "stochastic"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"format": "E8M5", "rouding": "nearest"}, "valid keys: format, input_format"),
        ({"format": "E8M5", "rounding": "down"}, "valid: nearest, stochastic"),
        ({"input_format": "E8M5"}, "no format for"),
        ("E9M3", "exponent_bits must be in 2..8"),
        ("bf17", "unknown float format"),
        ({"format": "E8M5", "clamp_outer_range": "no"}, "True or False"),
        (3, "format name like 'E8M5' or a mapping"),
    ],
)
def test_bad_specs_are_rejected_naming_the_valid_choices(spec, message):
    with pytest.raises(ValueError, match=message):
        EmulationConfig.parse(spec)


def test_emulated_linear_rejects_a_non_config():
    input, weight, bias, _ = sample_linear(seed=9)
    with pytest.raises(ValueError, match="EmulationConfig"):
        emulated_linear(input, weight, bias, "E8M5")
