"""FP8-saving norms and activations: forward bits equal torch's, per-group 1 x 16 quantization along
the hidden dim against torch's float8 cast, backward formulas against float64 autograd, and
gradients against BF16 torch modules.

Gradient tolerance: backward sees the input rounded to E4M3 per 1 x 16 group, within relative
u = 2^-4 of each element (3 mantissa bits; every element above 2^-6 / 448 of its group's max is a
normal number). The gradients of norms and activations are smooth functions of the input with
derivatives of order one at unit scale, so their relative L2 error stays below u (measured at most
0.025), while the BF16 modules' own error stays below u / 4 (BF16 parameter gradients sum
over tokens in BF16: about 0.01).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lowprec.layers import (
    FP8GELU,
    FP8LayerNorm,
    FP8RMSNorm,
    FP8SwiGLU,
    fp8_gelu,
    fp8_layer_norm,
    fp8_rms_norm,
    fp8_swiglu,
)
from megatron_lowprec.layers.fp8_activations import quantize_along_last_dim

U_E4M3 = 2.0**-4
HIDDEN = 96


def sample(*shape, seed, scale=1.0, dtype=torch.float32, device=None):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)


def relative_error(value, reference) -> float:
    value, reference = value.cpu().double(), reference.cpu().double()
    return float((value - reference).norm() / reference.norm())


class MegatronSwiGLU(torch.nn.Module):
    """megatron.core.transformer.mlp's gated linear unit: x_glu, x_linear = chunk(x, 2); silu(x_glu) * x_linear."""

    def forward(self, x):
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        return F.silu(x_glu) * x_linear


def affine(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(1 + 0.5 * torch.randn(parameter.shape, generator=generator))
    return module


def layer_norm():
    return affine(torch.nn.LayerNorm(HIDDEN), seed=1)


def rms_norm():
    return affine(torch.nn.RMSNorm(HIDDEN, eps=1e-5), seed=2)


PAIRS = {
    "layer_norm": (layer_norm, lambda: FP8LayerNorm.from_module(layer_norm()), HIDDEN),
    "layer_norm_plain": (lambda: torch.nn.LayerNorm(HIDDEN, elementwise_affine=False),
                         lambda: FP8LayerNorm(HIDDEN, elementwise_affine=False), HIDDEN),
    "layer_norm_no_bias": (lambda: torch.nn.LayerNorm(HIDDEN, bias=False), lambda: FP8LayerNorm(HIDDEN, bias=False),
                           HIDDEN),
    "rms_norm": (rms_norm, lambda: FP8RMSNorm.from_module(rms_norm()), HIDDEN),
    "rms_norm_default_eps": (lambda: torch.nn.RMSNorm(HIDDEN), lambda: FP8RMSNorm(HIDDEN), HIDDEN),
    "gelu": (torch.nn.GELU, FP8GELU, HIDDEN),
    "gelu_tanh": (lambda: torch.nn.GELU("tanh"), lambda: FP8GELU("tanh"), HIDDEN),
    "swiglu": (MegatronSwiGLU, FP8SwiGLU, HIDDEN // 2),
}


def outputs_and_grads(module, x, grad_output):
    x = x.detach().clone().requires_grad_()
    output = module(x)
    output.backward(grad_output.to(output.device, output.dtype))
    return [output.detach(), x.grad] + [parameter.grad for parameter in module.parameters()]


def test_groups_are_1x16_along_the_hidden_dim_and_never_span_tokens(device):
    rows = torch.stack([sample(24, seed=3, scale=1e4), sample(24, seed=4, scale=1e-3)])
    quantized = quantize_along_last_dim(rows.to(device))
    assert quantized.payload.shape == (2, 32)
    padded = F.pad(rows, (0, 8)).reshape(-1, 16)
    expected_scale = padded.abs().amax(dim=1) / 448
    assert torch.equal(quantized.scale.cpu(), expected_scale)
    expected_payload = (padded / expected_scale[:, None]).to(torch.float8_e4m3fn).reshape(2, 32)
    assert torch.equal(quantized.payload.cpu().view(torch.uint8), expected_payload.view(torch.uint8))
    dequantized = quantized.payload.float().reshape(-1, 16) * quantized.scale[:, None]
    small_row = dequantized.reshape(2, 32)[1, :24]
    assert relative_error(small_row, rows[1]) < U_E4M3, "the small token kept its own scales"


@pytest.mark.parametrize("name", PAIRS)
def test_forward_bits_equal_the_torch_module(name, device):
    make_reference, make_fp8, _ = PAIRS[name]
    x = sample(4, 16, HIDDEN, seed=5, scale=3.0, dtype=torch.bfloat16, device=device)
    reference, fp8 = make_reference().to(device, torch.bfloat16), make_fp8().to(device, torch.bfloat16)
    assert torch.equal(fp8(x), reference(x))


@pytest.mark.parametrize("name", PAIRS)
def test_backward_is_exact_when_the_input_is_exactly_representable(name, device):
    """With an input that E4M3 per-group quantization keeps exactly (group max 448, E4M3 values), the
    FP8 layer's FP32 backward must equal float64 autograd of the torch module up to FP32 rounding."""
    make_reference, make_fp8, output_width = PAIRS[name]
    e4m3_values = sample(8, HIDDEN, seed=6, scale=60.0).to(torch.float8_e4m3fn).float()
    e4m3_values.view(-1, 16)[:, 0] = 448.0
    x = e4m3_values / 64
    grad_output = sample(8, output_width, seed=7)
    fp8 = outputs_and_grads(make_fp8().to(device), x.to(device), grad_output)
    exact = outputs_and_grads(make_reference().double(), x.double(), grad_output.double())
    for fp8_grad, exact_grad in zip(fp8[1:], exact[1:]):
        assert relative_error(fp8_grad, exact_grad) < 1e-6


@pytest.mark.parametrize("name", PAIRS)
def test_gradients_agree_with_bf16_modules(name, device):
    make_reference, make_fp8, output_width = PAIRS[name]
    x = sample(4, 16, HIDDEN, seed=8, scale=3.0)
    grad_output = sample(4, 16, output_width, seed=9)
    exact = outputs_and_grads(make_reference().double(), x.double(), grad_output.double())
    bf16 = outputs_and_grads(make_reference().to(device, torch.bfloat16), x.to(device, torch.bfloat16), grad_output)
    fp8 = outputs_and_grads(make_fp8().to(device, torch.bfloat16), x.to(device, torch.bfloat16), grad_output)
    for fp8_grad, bf16_grad, exact_grad in zip(fp8[1:], bf16[1:], exact[1:]):
        assert fp8_grad.dtype == bf16_grad.dtype == torch.bfloat16
        assert relative_error(bf16_grad, exact_grad) < U_E4M3 / 4
        assert relative_error(fp8_grad, bf16_grad) < U_E4M3


@pytest.mark.parametrize("name", PAIRS)
def test_only_fp8_payload_scales_and_parameters_are_saved(name, device):
    _, make_fp8, _ = PAIRS[name]
    module = make_fp8().to(device, torch.bfloat16)
    x = sample(3, 5, HIDDEN, seed=10, dtype=torch.bfloat16, device=device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(x)
    parameters = [tensor for tensor in saved if any(tensor is p for p in module.parameters())]
    payload, scale = [tensor for tensor in saved if all(tensor is not p for p in module.parameters())]
    assert len(parameters) == len(list(module.parameters()))
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == (15, HIDDEN)
    assert scale.dtype == torch.float32 and scale.numel() == 15 * HIDDEN // 16


def test_converted_norms_hold_the_same_parameters_and_state_dict():
    for norm, converted_class in ((layer_norm(), FP8LayerNorm), (rms_norm(), FP8RMSNorm)):
        converted = converted_class.from_module(norm.eval())
        assert isinstance(converted, type(norm)) and not converted.training
        assert all(a is b for a, b in zip(converted.parameters(), norm.parameters()))
        assert converted.state_dict().keys() == norm.state_dict().keys()
        assert converted.eps == norm.eps


def test_functional_forms_match_the_modules(device):
    x = sample(2, 7, HIDDEN, seed=11, dtype=torch.bfloat16, device=device)
    norm = layer_norm().to(device, torch.bfloat16)
    assert torch.equal(fp8_layer_norm(x, (HIDDEN,), norm.weight, norm.bias), norm(x))
    assert torch.equal(fp8_rms_norm(x, (HIDDEN,)), torch.nn.RMSNorm(HIDDEN).to(device, torch.bfloat16)(x))
    assert torch.equal(fp8_gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    assert torch.equal(fp8_swiglu(x), MegatronSwiGLU()(x))


def test_bad_arguments_are_rejected_naming_the_valid_choices():
    x = sample(2, HIDDEN, seed=12)
    with pytest.raises(ValueError, match="none, tanh"):
        fp8_gelu(x, "sigmoid")
    with pytest.raises(ValueError, match="odd size 95"):
        fp8_swiglu(x[:, :95])
    with pytest.raises(ValueError, match="positive int"):
        fp8_gelu(x, group_size=0)
    with pytest.raises(ValueError, match="last dim"):
        fp8_layer_norm(x, (2, HIDDEN))
    with pytest.raises(ValueError, match="one"):
        FP8RMSNorm((4, HIDDEN))
