"""COAT FP8 linear: quantization against torch's float8 casts, _scaled_mm and the emulated path against fp64,
what is saved for backward, and gradients against a BF16 linear.

Gradient tolerance: E4M3 rounds to 3 mantissa bits (unit roundoff u4 = 2^-4), E5M2 to 2 (u5 = 2^-3).
Each product term of the forward carries a relative error below 2 u4 (input and weight), each term
of the backward below u5 + u4 (output gradient and weight or input). Sums of such terms on random
data stay below the same bounds in relative L2 norm (measured: forward 0.023, gradients 0.059), and
the BF16 linear's own error (~2^-8) is negligible next to them.
"""

import contextlib
import importlib

import pytest
import torch

from megatron_lowprec.layers import FP8Linear, fp8_linear
from megatron_lowprec.layers import fp8_weight_cache
from megatron_lowprec.layers.fp8_linear import fp8_matmul, quantize_per_tensor
from megatron_lowprec.numerics.quant import quantize_fp8

U_E4M3 = 2.0**-4
U_E5M2 = 2.0**-3
FORWARD_TOLERANCE = 2 * U_E4M3
BACKWARD_TOLERANCE = U_E5M2 + U_E4M3
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
fp8_linear_module = importlib.import_module("megatron_lowprec.layers.fp8_linear")
"""The module itself (the package exports its function ``fp8_linear`` under the module's name)."""


def sample(*shape, seed, scale=1.0, dtype=torch.bfloat16, device=None):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.cpu().double(), reference.cpu().double()
    return float((value - reference).norm() / reference.norm())


def forward_backward(function, input, weight, bias, grad_seed=1):
    """Output and gradients of input, weight and bias for a fixed random output gradient."""
    leaves = [tensor.detach().clone().requires_grad_() for tensor in (input, weight, bias)]
    output = function(*leaves)
    output.backward(sample(*output.shape, seed=grad_seed, dtype=output.dtype, device=output.device))
    return [output.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("shape", [(7, 33), (1000,), (3, 128), (0, 5)])
def test_the_per_tensor_scale_is_the_max_magnitude_over_the_format_max(shape, device):
    x = sample(*shape, seed=3, scale=7.0)
    payload, scale = quantize_per_tensor(x.to(device), "e4m3")
    expected = x.abs().max().double() / 448 if x.numel() else torch.tensor(1.0, dtype=torch.float64)
    assert payload.shape == x.shape and payload.dtype == torch.float8_e4m3fn
    assert torch.equal(scale.cpu(), expected.float())


@pytest.mark.parametrize("fp8_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_per_tensor_is_torchs_cast_at_the_current_scale(fp8_format, dtype, device):
    x = sample(37, 53, seed=4, scale=300.0, dtype=dtype)
    payload, scale = quantize_per_tensor(x.to(device), fp8_format)
    payload, scale = payload.cpu(), scale.cpu()
    expected_scale = x.abs().max().float() / torch.finfo(FP8_DTYPES[fp8_format]).max
    assert torch.equal(scale, expected_scale)
    expected_payload = (x.float() / expected_scale).to(FP8_DTYPES[fp8_format])
    assert torch.equal(payload.view(torch.uint8), expected_payload.view(torch.uint8))
    reference = quantize_fp8(x, fp8_format)
    assert torch.equal(payload.view(torch.uint8).flatten(), reference.payload.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", list(FP8_DTYPES.values()), ids=list(FP8_DTYPES))
def test_row_major_copies_a_transposed_payload_to_the_same_values(fp8_dtype, device):
    """The layout ``torch._scaled_mm`` takes (one compiled copy on GPUs that convert FP8 in Triton)."""
    payload = sample(48, 80, seed=9, scale=30.0, dtype=torch.float32).to(fp8_dtype).to(device)
    copied = fp8_linear_module.row_major(payload.t())
    assert copied.is_contiguous() and copied.shape == (80, 48)
    assert torch.equal(copied.cpu().view(torch.uint8), payload.t().cpu().contiguous().view(torch.uint8))
    assert fp8_linear_module.row_major(payload) is payload


def test_all_zero_input_has_unit_scale(device):
    payload, scale = quantize_per_tensor(torch.zeros(4, 16, device=device), "e4m3")
    assert float(scale) == 1.0 and not payload.float().any()


def fp32_accumulation_bound(a, a_scale, b, b_scale, out_dtype):
    """|a b| scaled, times the error bound of an FP32 dot product of length K in any summation order
    (gamma_K = K u / (1 - K u), u = 2^-24, Higham Thm. 3.4) plus the rounding of each dequantized
    operand (2u) and of the output (half an ulp of ``out_dtype``, relative)."""
    unit = 2.0**-24
    k = a.shape[1]
    magnitude = (a.double().abs() @ b.double().abs()) * float(a_scale) * float(b_scale)
    output_rounding = torch.finfo(out_dtype).eps / 2
    return magnitude * (k * unit / (1 - k * unit) + 2 * unit) + magnitude * output_rounding


@pytest.mark.parametrize(("a_format", "b_format"), [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_and_the_emulation_are_fp32_accumulations_of_the_exact_products(a_format, b_format, out_dtype, monkeypatch):
    """CPU: both backends sum the exact FP8 products in FP32, each in an order of its own (torch's
    _scaled_mm kernel picks one by instruction set: AVX2, AVX-512, AMX), so each lies within the FP32
    summation bound of the exact fp64 product, and "auto" is the emulation (torch's CPU kernel is
    orders of magnitude slower)."""
    a, a_scale = quantize_per_tensor(sample(48, 320, seed=5, scale=20.0), a_format)
    b, b_scale = quantize_per_tensor(sample(320, 24, seed=6, scale=0.1), b_format)
    exact = (a.double() @ b.double()) * float(a_scale) * float(b_scale)
    bound = fp32_accumulation_bound(a, a_scale, b, b_scale, out_dtype)
    for backend in ("scaled_mm", "emulated"):
        result = fp8_matmul(a, a_scale, b, b_scale, out_dtype, backend=backend)
        assert result.dtype == out_dtype
        assert ((result.double() - exact).abs() <= bound).all(), backend
    emulated = fp8_matmul(a, a_scale, b, b_scale, out_dtype, backend="emulated")
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: pytest.fail("auto called _scaled_mm on a CPU"))
    assert torch.equal(fp8_matmul(a, a_scale, b, b_scale, out_dtype), emulated)


def test_forward_and_backward_agree_between_backends():
    """CPU: the two backends differ only in the FP32 summation order of the same exact products
    (see above), so outputs and gradients agree within one BF16 rounding of each other."""
    input, weight, bias = sample(4, 9, 96, seed=7, scale=3.0), sample(80, 96, seed=8, scale=0.05), sample(80, seed=9)
    scaled_mm = forward_backward(lambda *a: fp8_linear(*a, backend="scaled_mm"), input, weight, bias)
    emulated = forward_backward(lambda *a: fp8_linear(*a, backend="emulated"), input, weight, bias)
    for from_scaled_mm, from_emulation in zip(scaled_mm, emulated):
        assert from_scaled_mm.dtype == from_emulation.dtype == torch.bfloat16
        torch.testing.assert_close(from_scaled_mm, from_emulation, rtol=2.0**-7, atol=1e-6)


def test_forward_is_the_fp32_product_of_torch_casts():
    """The emulated backend is this FP32 matmul of torch's casts (CPU only: on a GPU the product runs on
    the FP8 tensor cores, or a cuBLAS FP32 kernel of another operand layout)."""
    input, weight, bias = sample(5, 64, seed=10, scale=4.0), sample(32, 64, seed=11, scale=0.02), sample(32, seed=12)
    input_scale = input.abs().max().float() / 448
    weight_scale = weight.abs().max().float() / 448
    input_fp8 = (input.float() / input_scale).to(torch.float8_e4m3fn).float() * input_scale
    weight_fp8 = (weight.float() / weight_scale).to(torch.float8_e4m3fn).float() * weight_scale
    expected = (input_fp8 @ weight_fp8.t()).to(torch.bfloat16) + bias
    assert torch.equal(fp8_linear(input, weight, bias, backend="emulated"), expected)


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradients_agree_with_a_bf16_linear(with_bias, device):
    input = sample(4, 32, 256, seed=13, scale=2.0, device=device)
    weight = sample(384, 256, seed=14, scale=0.05, device=device)
    bias = sample(384, seed=15, device=device)
    fp8 = forward_backward(lambda x, w, b: fp8_linear(x, w, b if with_bias else None), input, weight, bias)
    bf16 = forward_backward(lambda x, w, b: torch.nn.functional.linear(x, w, b if with_bias else None),
                            input, weight, bias)
    assert fp8[0].dtype == torch.bfloat16
    assert relative_error(fp8[0], bf16[0]) < FORWARD_TOLERANCE
    for fp8_grad, bf16_grad in zip(fp8[1:3], bf16[1:3]):
        assert fp8_grad.dtype == torch.bfloat16
        assert relative_error(fp8_grad, bf16_grad) < BACKWARD_TOLERANCE
    if with_bias:
        assert relative_error(fp8[3], bf16[3]) < 2.0**-7
    else:
        assert fp8[3] is None and bf16[3] is None


def test_only_the_fp8_input_and_its_scale_are_saved(device):
    linear = FP8Linear(64, 48, dtype=torch.bfloat16, device=device)
    input = sample(2, 8, 64, seed=16, device=device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(input)
    activations = [tensor for tensor in saved if tensor is not linear.weight]
    assert len(activations) == 2 and len(saved) == 3
    payload, scale = activations
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == (16, 64)
    assert scale.dtype == torch.float32 and scale.numel() == 1


def _two_micro_batches(linear: FP8Linear, cached: bool, batch: int = 3) -> list[torch.Tensor]:
    """Outputs and input gradients of two micro-batches, and the weight and bias gradients they accumulate."""
    linear.zero_grad(set_to_none=True)
    results = []
    with fp8_weight_cache() if cached else contextlib.nullcontext():
        for seed in (20, 21):
            input = sample(batch, 8, 64, seed=seed, scale=2.0).requires_grad_()
            output = linear(input)
            output.backward(sample(*output.shape, seed=seed + 10))
            results += [output.detach(), input.grad]
    return [*results, linear.weight.grad.clone(), linear.bias.grad.clone()]


def test_weight_cache_quantizes_each_weight_once_per_step_with_the_same_bits(monkeypatch):
    """Without the cache every forward and every backward quantizes the weight (4 quantizations per
    micro-batch: input, weight, output gradient, weight); with it, once for the whole step."""
    linear = FP8Linear(64, 48, dtype=torch.bfloat16)
    calls = []
    quantize = fp8_linear_module.quantize_per_tensor
    monkeypatch.setattr(fp8_linear_module, "quantize_per_tensor", lambda x, f: calls.append(x) or quantize(x, f))
    uncached = _two_micro_batches(linear, cached=False)
    weight_quantizations = sum(tensor.shape == linear.weight.shape for tensor in calls)
    calls.clear()
    cached = _two_micro_batches(linear, cached=True)
    assert (weight_quantizations, sum(tensor.shape == linear.weight.shape for tensor in calls)) == (4, 1)
    assert len(calls) == 5
    for from_cache, reference in zip(cached, uncached):
        assert torch.equal(from_cache, reference)
    assert fp8_linear_module._weight_cache is None


def test_weight_cache_sees_a_weight_changed_between_steps():
    linear = FP8Linear(64, 48, dtype=torch.bfloat16)
    first = _two_micro_batches(linear, cached=True)
    with torch.no_grad():
        linear.weight.mul_(0.5)
    assert not torch.equal(_two_micro_batches(linear, cached=True)[0], first[0])
    assert torch.equal(_two_micro_batches(linear, cached=True)[0], _two_micro_batches(linear, cached=False)[0])


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_transposes_written_by_the_quantization_give_the_same_bits_and_row_major_operands(cached, monkeypatch):
    """Where the quantizations write the transposed payloads (``transposes_in_quantization``: a GPU
    that compiles them, here forced on the CPU), outputs and gradients of two micro-batches are the
    bits of the path without, every GEMM gets ``torch._scaled_mm``'s layouts (a row-major first
    operand, a second one whose transpose is row-major: ``row_major`` copies nothing), and backward
    keeps the input's transposed payload alone."""
    linear = FP8Linear(64, 48, dtype=torch.bfloat16)
    reference = _two_micro_batches(linear, cached, batch=2)
    operands = []
    matmul = fp8_linear_module.fp8_matmul
    monkeypatch.setattr(fp8_linear_module, "triton_converts_fp8", lambda device: True)
    monkeypatch.setattr(fp8_linear_module, "fp8_matmul", lambda a, a_scale, b, *rest: operands.append((a, b)) or matmul(a, a_scale, b, *rest))
    assert fp8_linear_module.transposes_in_quantization("auto", torch.device("cpu"), (48, 64, 48))
    assert not fp8_linear_module.transposes_in_quantization("auto", torch.device("cpu"), (24, 64, 40))
    assert not fp8_linear_module.transposes_in_quantization("emulated", torch.device("cpu"), (48, 64, 48))
    for fused, expected in zip(_two_micro_batches(linear, cached, batch=2), reference):
        assert torch.equal(fused, expected)
    assert len(operands) == 6
    assert all(a.is_contiguous() and b.t().is_contiguous() for a, b in operands)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(sample(3, 16, 64, seed=22).requires_grad_())
    (payload,) = [tensor for tensor in saved if tensor.dtype == torch.float8_e4m3fn]
    assert payload.shape == (48, 64) and payload.t().is_contiguous()


def test_leading_dims_flatten_into_rows(device):
    input, weight = sample(2, 3, 5, 40, seed=17, device=device), sample(24, 40, seed=18, device=device)
    assert torch.equal(fp8_linear(input, weight).reshape(30, 24), fp8_linear(input.reshape(30, 40), weight))


def test_module_matches_the_function(device):
    linear = FP8Linear(40, 24, dtype=torch.bfloat16, device=device)
    input = sample(6, 40, seed=19, device=device)
    assert torch.equal(linear(input), fp8_linear(input, linear.weight, linear.bias))


def test_non_finite_input_gives_nan_output(device):
    input = sample(4, 32, seed=20, device=device)
    input[1, 3] = float("nan")
    assert torch.isnan(fp8_linear(input, sample(8, 32, seed=21, device=device))).any()


def test_bad_arguments_are_rejected_naming_the_valid_choices():
    input, weight = sample(4, 32, seed=22), sample(8, 32, seed=23)
    with pytest.raises(ValueError, match="auto, scaled_mm, emulated"):
        fp8_linear(input, weight, backend="cublas")
    with pytest.raises(ValueError, match=r"\(8, 16\)"):
        fp8_linear(input, sample(8, 16, seed=24))
