"""ExMy emulation of matrix multiplications ("To FP8 and Back Again", section 3.2).

The inputs, weights and outputs of a matmul (and, in backward, the gradients) are rounded to a
reduced format ExMy while storage and accumulation stay in high precision: removing mantissa bits
rounds them away (nearest-even or stochastic), removing exponent bits narrows the range at both
ends. E8M7 is BF16. Range handling, each end switchable for the paper's ablation (its Fig. 4):

- outer range (``clamp_outer_range``): magnitudes above the format's largest finite value saturate
  to +-max (the paper thresholds them), so E4M3 and E5M2 emulation equal torch's casts of the
  input clamped to +-448 and +-57344 (torch's own casts differ above that: to float8_e4m3fn, NaN on
  torch 2.11's CPU, +-448 on torch 2.13's; to float8_e5m2, +-inf). Off: large magnitudes keep the
  8-bit exponent range (they are rounded as E8My).
- inner range (``clamp_inner_range``): below the smallest normal the format's subnormals and zero
  apply (gradual underflow, bit-exact to torch's float8 casts). Off: small magnitudes keep y
  mantissa bits down to the 8-bit exponent range.

The matmul runs in the operands' storage dtype when the formats of the input and the weight are
representable in it (torch's BF16/FP16 GEMMs accumulate in FP32), else in FP32; its output, rounded
to the output format, is stored in the input's dtype (a format wider than that dtype is rounded
again there). A bias is added after the output rounding: only the matmul is emulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_lowprec.layers.fp8_linear import check_linear_operands
from megatron_lowprec.numerics.formats import FloatFormat, float_format, round_to_format
from megatron_lowprec.numerics.rounding import generator_random_bits, stochastic_round

ROUNDING_MODES = ("nearest", "stochastic")
FORMAT_FIELDS = ("input_format", "weight_format", "output_format", "grad_format")


@dataclass(frozen=True)
class EmulationConfig:
    """Formats of the matmul inputs, weights, outputs and gradients, rounding mode and range clamps.

    Formats are FloatFormat or anything :func:`float_format` reads ("E8M5", "e4m3", "bf16").
    """

    input_format: FloatFormat
    weight_format: FloatFormat
    output_format: FloatFormat
    grad_format: FloatFormat
    rounding: str = "nearest"
    clamp_outer_range: bool = True
    clamp_inner_range: bool = True

    def __post_init__(self) -> None:
        for name in FORMAT_FIELDS:
            object.__setattr__(self, name, float_format(getattr(self, name)))
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"unknown rounding {self.rounding!r}; valid: {', '.join(ROUNDING_MODES)}")
        for name in ("clamp_outer_range", "clamp_inner_range"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, spec: str | FloatFormat | Mapping | EmulationConfig) -> EmulationConfig:
        """A config from one format for all four roles ("E8M5"), or a mapping of field names.

        In a mapping, "format" sets the four formats at once and the other keys override it:
        ``{"format": "E8M5", "grad_format": "E5M2", "rounding": "stochastic"}``.
        """
        if isinstance(spec, EmulationConfig):
            return spec
        if isinstance(spec, (str, FloatFormat)):
            return cls(**dict.fromkeys(FORMAT_FIELDS, spec))
        if not isinstance(spec, Mapping):
            raise ValueError(f"an emulation spec is a format name like 'E8M5' or a mapping; got {spec!r}")
        valid_keys = ("format", *(field.name for field in dataclasses.fields(cls)))
        unknown = sorted(set(spec) - set(valid_keys))
        if unknown:
            raise ValueError(f"unknown emulation keys {unknown}; valid keys: {', '.join(valid_keys)}")
        settings = dict(spec)
        shared_format = settings.pop("format", None)
        missing = [name for name in FORMAT_FIELDS if name not in settings and shared_format is None]
        if missing:
            raise ValueError(
                f"emulation spec {dict(spec)!r} gives no format for {missing}; set 'format' or each of them"
            )
        return cls(**{name: settings.pop(name, shared_format) for name in FORMAT_FIELDS}, **settings)


def emulate_format(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    *,
    rounding: str = "nearest",
    clamp_outer_range: bool = True,
    clamp_inner_range: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round x (float32, bfloat16 or float16) to ``fmt`` as the module docstring says; float32 result.

    Stochastic rounding draws its 32-bit words from ``generator`` (torch's default when None).
    """
    fmt = float_format(fmt)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_MODES)}")
    random_bits = generator_random_bits(x.shape, generator, x.device) if rounding == "stochastic" else None

    def rounded(target: FloatFormat) -> torch.Tensor:
        if random_bits is None:
            return round_to_format(x, target, saturate=True)
        return stochastic_round(x, target, random_bits, saturate=True)

    narrow = rounded(fmt)
    if (clamp_outer_range and clamp_inner_range) or fmt.exponent_bits == 8:
        return narrow
    wide = rounded(FloatFormat(f"E8M{fmt.mantissa_bits}", 8, fmt.mantissa_bits))
    magnitude = x.abs()
    keep_wide = torch.zeros_like(magnitude, dtype=torch.bool)
    if not clamp_outer_range:
        keep_wide |= magnitude > fmt.max_finite
    if not clamp_inner_range:
        keep_wide |= magnitude < fmt.min_normal
    return torch.where(keep_wide, wide, narrow)


def _representable_in(fmt: FloatFormat, dtype: torch.dtype) -> bool:
    """Whether every value of ``fmt`` is a value of ``dtype`` (a float32, bfloat16 or float16)."""
    storage = float_format(dtype)
    return (
        fmt.mantissa_bits <= storage.mantissa_bits
        and fmt.max_exponent <= storage.max_exponent
        and fmt.min_exponent >= storage.min_exponent
    )


def _round(x: torch.Tensor, fmt: FloatFormat, config: EmulationConfig, dtype: torch.dtype) -> torch.Tensor:
    return emulate_format(
        x,
        fmt,
        rounding=config.rounding,
        clamp_outer_range=config.clamp_outer_range,
        clamp_inner_range=config.clamp_inner_range,
    ).to(dtype)


class EmulatedLinearFunction(torch.autograd.Function):
    """y = round_out(round_in(x) round_w(W)^T) + b; backward rounds dY and dX, dW to the grad format.

    The matmuls follow megatron's linear (x @ W^T, dY @ W, dY_2d^T @ x_2d), so that E8M7 on BF16
    gives the bits of megatron's own BF16 linear. The rounded input and weight are saved.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, config):
        representable = all(
            _representable_in(fmt, input.dtype) for fmt in (config.input_format, config.weight_format)
        )
        compute_dtype = input.dtype if representable else torch.float32
        input_rounded = _round(input, config.input_format, config, compute_dtype)
        weight_rounded = _round(weight, config.weight_format, config, compute_dtype)
        output = _round(torch.matmul(input_rounded, weight_rounded.t()), config.output_format, config, input.dtype)
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input_rounded, weight_rounded)
        ctx.config = config
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_rounded, weight_rounded = ctx.saved_tensors
        config = ctx.config
        input_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = _round(grad_output, config.grad_format, config, input_rounded.dtype)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = _round(grad.matmul(weight_rounded), config.grad_format, config, input_dtype)
        if ctx.needs_input_grad[1]:
            grad_rows = grad.reshape(-1, grad.shape[-1])
            input_rows = input_rounded.reshape(-1, input_rounded.shape[-1])
            grad_weight = _round(grad_rows.t().matmul(input_rows), config.grad_format, config, weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0).to(bias_dtype)
        return grad_input, grad_weight, grad_bias, None


def emulated_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: EmulationConfig
) -> torch.Tensor:
    """``torch.nn.functional.linear`` with its matmul emulated in ``config``'s formats (any leading dims)."""
    if not isinstance(config, EmulationConfig):
        raise ValueError(f"config must be an EmulationConfig (see EmulationConfig.parse), got {config!r}")
    check_linear_operands(input, weight)
    return EmulatedLinearFunction.apply(input, weight, bias, config)
