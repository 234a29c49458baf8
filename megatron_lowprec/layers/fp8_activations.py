"""Non-linear layers that save their input for backward in FP8 (COAT, Xi et al., 2024, section 5.2).

RMSNorm, LayerNorm, GELU and SwiGLU compute their forward exactly as torch does (same output bits
as torch.nn.LayerNorm / RMSNorm / F.gelu / F.silu(a) * b) but keep, for backward, only their input
quantized to E4M3 with one float32 scale per 1 x G group of consecutive elements along the hidden
(last) dimension, G = 16 (section 6.1). A group never spans two tokens: section 5.2 and Fig. 4(a)
show that sharing a scale across the token axis costs accuracy; a row whose length is not a
multiple of G is zero-padded to one. Backward dequantizes the input and recomputes what it needs
(normalisation statistics, activation derivatives) in FP32, 1/σ as a correctly rounded division by a
correctly rounded square root (the same function on every backend). On GPUs that convert FP8 in
Triton the quantization and each backward pass are one compiled call (:func:`_backward`); their
reductions add in another order than eager ones. Parameters are saved as they are: they are not
activation memory.

Storage per saved element: 1 byte of FP8 plus 4/G bytes of scale (1.25 bytes for G = 16), against
2 bytes for BF16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_lowprec.numerics.compiled import compiled_where_fp8_converts
from megatron_lowprec.numerics.elementary import div_rn, sqrt_rn
from megatron_lowprec.numerics.quant import QuantizedTensor, dequantize_rows, quantize_rows

GROUP_SIZE = 16
"""COAT's 1 x 16 per-group quantization of non-linear layer activations (section 6.1)."""
GELU_APPROXIMATIONS = ("none", "tanh")


def quantize_along_last_dim(x: torch.Tensor, group_size: int = GROUP_SIZE) -> QuantizedTensor:
    """E4M3 with one scale per 1 x ``group_size`` group along the last dim, groups never spanning rows.

    Returns the quantization of x viewed as rows [tokens, hidden], each row zero-padded to a multiple
    of ``group_size`` (``QuantizedTensor.shape`` is the padded shape). Non-finite values give NaN
    on dequantization instead of raising.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    rows = x.detach().reshape(-1, x.shape[-1])
    padding = -rows.shape[-1] % group_size
    if padding:
        rows = F.pad(rows, (0, padding))
    payload, scale = quantize_rows(rows.reshape(-1, group_size), torch.float8_e4m3fn)
    return QuantizedTensor(
        payload=payload.view(rows.shape),
        scale=scale.view(-1),
        expansion_exponent=None,
        group_size=group_size,
        shape=rows.shape,
        fp8_dtype=torch.float8_e4m3fn,
    )


def _saved_rows(payload: torch.Tensor, scale: torch.Tensor, group_size: int, width: int) -> torch.Tensor:
    """FP32 rows [tokens, width] from what :func:`quantize_along_last_dim` saved."""
    return dequantize_rows(payload.view(-1, group_size), scale.view(-1, 1)).view(payload.shape)[:, :width]


def _save_fp8_input(ctx, x: torch.Tensor, group_size: int, *parameters: torch.Tensor | None) -> None:
    quantized = quantize_along_last_dim(x, group_size)
    ctx.save_for_backward(quantized.payload, quantized.scale, *parameters)
    ctx.group_size = group_size
    ctx.input_shape = x.shape
    ctx.input_dtype = x.dtype


def _backward(ctx, function: Callable, grad_output: torch.Tensor, *arguments) -> tuple:
    """``function`` (a backward pass's arithmetic, from the saved FP8 input to the gradients) of the
    saved payload, scales and ``arguments``: one compiled call on GPUs that convert FP8 in Triton
    (the dequantization, the recomputed statistics and the gradients fused over the rows, where eager
    operations take a dozen passes over FP32 rows), eager operations elsewhere. Compiled reductions
    add in another order than eager ones: the gradients agree within FP32 rounding, not to the bit."""
    payload, scale, *parameters = ctx.saved_tensors
    return compiled_where_fp8_converts(function, payload.device)(payload, scale, ctx.group_size, ctx.input_shape[-1], ctx.input_dtype, grad_output, *parameters, *arguments)


def _parameter_grad(ctx, index: int, grad: torch.Tensor, parameter: torch.Tensor | None) -> torch.Tensor | None:
    return grad.to(parameter.dtype) if parameter is not None and ctx.needs_input_grad[index] else None


def _layer_norm_grads(payload, scale, group_size, width, input_dtype, grad_output, weight, bias, eps):
    """LayerNorm's input, weight and bias gradients (the last two in FP32) from the saved FP8 input."""
    x = _saved_rows(payload, scale, group_size, width)
    centered = x - x.mean(dim=-1, keepdim=True)
    inverse_std = div_rn(1.0, sqrt_rn(centered.square().mean(dim=-1, keepdim=True) + eps))
    normalized = centered * inverse_std
    grad_rows = grad_output.reshape(normalized.shape).float()
    grad_normalized = grad_rows * weight.float() if weight is not None else grad_rows
    grad_input = inverse_std * (
        grad_normalized
        - grad_normalized.mean(dim=-1, keepdim=True)
        - normalized * (grad_normalized * normalized).mean(dim=-1, keepdim=True)
    )
    return grad_input.to(input_dtype), (grad_rows * normalized).sum(dim=0), grad_rows.sum(dim=0)


def _rms_norm_grads(payload, scale, group_size, width, input_dtype, grad_output, weight, eps):
    """RMSNorm's input and weight gradients (the latter in FP32) from the saved FP8 input."""
    x = _saved_rows(payload, scale, group_size, width)
    inverse_rms = div_rn(1.0, sqrt_rn(x.square().mean(dim=-1, keepdim=True) + eps))
    normalized = x * inverse_rms
    grad_rows = grad_output.reshape(normalized.shape).float()
    grad_normalized = grad_rows * weight.float() if weight is not None else grad_rows
    grad_input = inverse_rms * (grad_normalized - normalized * (grad_normalized * normalized).mean(dim=-1, keepdim=True))
    return grad_input.to(input_dtype), (grad_rows * normalized).sum(dim=0)


def _gelu_grad(payload, scale, group_size, width, input_dtype, grad_output, approximate):
    """GELU's input gradient from the saved FP8 input."""
    x = _saved_rows(payload, scale, group_size, width)
    grad_rows = grad_output.reshape(x.shape).float()
    return torch.ops.aten.gelu_backward(grad_rows, x, approximate=approximate).to(input_dtype)


def _swiglu_grad(payload, scale, group_size, width, input_dtype, grad_output):
    """SwiGLU's input gradient from the saved FP8 input."""
    x = _saved_rows(payload, scale, group_size, width)
    gate, value = torch.chunk(x, 2, dim=-1)
    grad_rows = grad_output.reshape(gate.shape).float()
    grad_gate = torch.ops.aten.silu_backward(grad_rows * value, gate)
    return torch.cat([grad_gate, grad_rows * F.silu(gate)], dim=-1).to(input_dtype)


class FP8LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim; saves the FP8 input, recomputes mean and 1/std in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group_size):
        _save_fp8_input(ctx, x, group_size, weight, bias)
        ctx.eps = eps
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    @staticmethod
    def backward(ctx, grad_output):
        _, _, weight, bias = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = _backward(ctx, _layer_norm_grads, grad_output, ctx.eps)
        return (
            grad_input.view(ctx.input_shape),
            _parameter_grad(ctx, 1, grad_weight, weight),
            _parameter_grad(ctx, 2, grad_bias, bias),
            None,
            None,
        )


class FP8RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dim; saves the FP8 input, recomputes 1/rms in backward."""

    @staticmethod
    def forward(ctx, x, weight, eps, group_size):
        _save_fp8_input(ctx, x, group_size, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, grad_output):
        _, _, weight = ctx.saved_tensors
        grad_input, grad_weight = _backward(ctx, _rms_norm_grads, grad_output, ctx.eps)
        return grad_input.view(ctx.input_shape), _parameter_grad(ctx, 1, grad_weight, weight), None, None


class FP8GELUFunction(torch.autograd.Function):
    """GELU (exact or tanh approximation); saves the FP8 input, recomputes GELU' in backward."""

    @staticmethod
    def forward(ctx, x, approximate, group_size):
        _save_fp8_input(ctx, x, group_size)
        ctx.approximate = approximate
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, _gelu_grad, grad_output, ctx.approximate).view(ctx.input_shape), None, None


class FP8SwiGLUFunction(torch.autograd.Function):
    """SiLU(a) * b for [a, b] = x split in two halves of the last dim (megatron's gated linear unit,
    ``torch.chunk(x, 2, dim=-1)``); saves FP8 x, recomputes SiLU(a) and SiLU'(a) in backward."""

    @staticmethod
    def forward(ctx, x, group_size):
        _save_fp8_input(ctx, x, group_size)
        gate, value = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * value

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, _swiglu_grad, grad_output).view(ctx.input_shape), None


def _check_hidden(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> None:
    if len(normalized_shape) != 1 or x.shape[-1:] != tuple(normalized_shape):
        raise ValueError(
            f"FP8 norms normalize over the last dim only: normalized_shape {tuple(normalized_shape)} "
            f"must be (hidden,) with hidden = input.shape[-1] of input shape {tuple(x.shape)}"
        )


def fp8_layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim, saving its input as per-group E4M3 (FP8LayerNormFunction)."""
    _check_hidden(x, normalized_shape)
    return FP8LayerNormFunction.apply(x, weight, bias, eps, group_size)


def fp8_rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """``F.rms_norm`` over the last dim, saving its input as per-group E4M3 (FP8RMSNormFunction).

    eps None means what it means to torch: the machine epsilon of the compute dtype (FP32 for
    BF16, FP16 and FP32 inputs).
    """
    _check_hidden(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    return FP8RMSNormFunction.apply(x, weight, eps, group_size)


def fp8_gelu(x: torch.Tensor, approximate: str = "none", group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``F.gelu`` saving its input as per-group E4M3 (FP8GELUFunction)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"unknown GELU approximation {approximate!r}; valid: {', '.join(GELU_APPROXIMATIONS)}")
    return FP8GELUFunction.apply(x, approximate, group_size)


def fp8_swiglu(x: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """SiLU(x[..., :n]) * x[..., n:] with n = x.shape[-1] / 2, saving x as per-group E4M3."""
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU splits the last dim in two halves; got odd size {x.shape[-1]}")
    return FP8SwiGLUFunction.apply(x, group_size)


class FP8LayerNorm(torch.nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` (one normalized dim) that saves its input in FP8."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None,
                 group_size: int = GROUP_SIZE):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FP8LayerNorm normalizes over one (the last) dim; got {self.normalized_shape}")
        self.group_size = group_size

    @classmethod
    def from_module(cls, norm: torch.nn.LayerNorm, group_size: int = GROUP_SIZE) -> FP8LayerNorm:
        """An FP8LayerNorm holding ``norm``'s own parameters (the same Parameter objects)."""
        converted = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None,
                        device="meta", group_size=group_size)
        converted.weight, converted.bias = norm.weight, norm.bias
        return converted.train(norm.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, self.group_size)


class FP8RMSNorm(torch.nn.RMSNorm):
    """Drop-in ``torch.nn.RMSNorm`` (one normalized dim) that saves its input in FP8."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None,
                 group_size: int = GROUP_SIZE):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FP8RMSNorm normalizes over one (the last) dim; got {self.normalized_shape}")
        self.group_size = group_size

    @classmethod
    def from_module(cls, norm: torch.nn.RMSNorm, group_size: int = GROUP_SIZE) -> FP8RMSNorm:
        """An FP8RMSNorm holding ``norm``'s own weight (the same Parameter object)."""
        converted = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine, device="meta",
                        group_size=group_size)
        converted.weight = norm.weight
        return converted.train(norm.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_rms_norm(input, self.normalized_shape, self.weight, self.eps, self.group_size)


class FP8GELU(torch.nn.GELU):
    """Drop-in ``torch.nn.GELU`` that saves its input in FP8."""

    def __init__(self, approximate: str = "none", group_size: int = GROUP_SIZE):
        super().__init__(approximate)
        self.group_size = group_size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_gelu(input, self.approximate, self.group_size)


class FP8SwiGLU(torch.nn.Module):
    """SiLU(a) * b on the two halves [a, b] of the last dim, saving its input in FP8."""

    def __init__(self, group_size: int = GROUP_SIZE):
        super().__init__()
        self.group_size = group_size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_swiglu(input, self.group_size)
