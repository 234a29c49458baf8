"""Elementwise operations whose rounding belongs to ATen, kept as ATen calls inside compiled code.

Some of ATen's CPU kernels do not round like a plain sequence of IEEE operations: ``lerp`` and
``addcmul`` are fused multiply-adds, and ``sqrt``, ``log`` and ``pow`` come from SLEEF and are not
always correctly rounded. Inductor would re-derive them from its own primitives (no FMA, correctly
rounded ``sqrt``), so a compiled kernel would no longer match eager code bit for bit. The functions
here are opaque custom ops: eager and compiled code both run the same ATen kernel, in place where
the name ends in ``_`` (so a compiled step allocates nothing for them). Scalars may be Python floats
or 0-d tensors (so that compiled code need not specialise on them).

:func:`sqrt_rn` is the opposite case: a correctly rounded square root, computed the cheapest exact
way in each mode.
"""

from __future__ import annotations

import torch

Scalar = float | torch.Tensor


@torch.library.custom_op("megatron_lowprec::aten_lerp_", mutates_args=("start",))
def _lerp_(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> None:
    start.lerp_(end, weight.item())


@torch.library.custom_op("megatron_lowprec::aten_scale_addcmul_", mutates_args=("base",))
def _scale_addcmul_(
    base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: torch.Tensor, value: torch.Tensor
) -> None:
    base.mul_(scale.item()).addcmul_(first, second, value=value.item())


@torch.library.custom_op("megatron_lowprec::aten_sqrt", mutates_args=())
def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x)


@torch.library.custom_op("megatron_lowprec::aten_log", mutates_args=())
def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


@torch.library.custom_op("megatron_lowprec::aten_pow", mutates_args=())
def _pow(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return torch.pow(x, exponent)


@_sqrt.register_fake
def _(x):
    return torch.empty_like(x)


@_log.register_fake
def _(x):
    return torch.empty_like(x)


@_pow.register_fake
def _(x, exponent):
    return torch.empty(torch.broadcast_shapes(x.shape, exponent.shape), dtype=x.dtype, device=x.device)


def _as_tensor(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.tensor(value, dtype=like.dtype, device=like.device)


def lerp_(start: torch.Tensor, end: torch.Tensor, weight: Scalar) -> None:
    """``start.lerp_(end, weight)`` in place, exactly as ATen computes it (a fused multiply-add on CPU)."""
    if torch.compiler.is_compiling() or torch.is_tensor(weight):
        _lerp_(start, end, _as_tensor(weight, start))
    else:
        start.lerp_(end, weight)


def scale_addcmul_(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: Scalar, value: Scalar) -> None:
    """``base.mul_(scale).addcmul_(first, second, value=value)`` in place, exactly as ATen computes it."""
    if torch.compiler.is_compiling() or torch.is_tensor(scale):
        _scale_addcmul_(base, first, second, _as_tensor(scale, base), _as_tensor(value, base))
    else:
        base.mul_(scale).addcmul_(first, second, value=value)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """``torch.sqrt`` exactly as ATen computes it (SLEEF on CPU, not always correctly rounded)."""
    return _sqrt(x) if torch.compiler.is_compiling() else torch.sqrt(x)


def log(x: torch.Tensor) -> torch.Tensor:
    """``torch.log`` exactly as ATen computes it."""
    return _log(x) if torch.compiler.is_compiling() else torch.log(x)


def pow(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``torch.pow`` (tensor exponent, broadcast) exactly as ATen computes it."""
    return _pow(x, exponent) if torch.compiler.is_compiling() else torch.pow(x, exponent)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of an FP32 tensor.

    Eager: through float64 (the square root of a float is correctly rounded twice without harm, as
    53 >= 2·24 + 2). Compiled: Inductor's own ``sqrt``, the IEEE instruction on CPU and GPU.
    """
    if torch.compiler.is_compiling():
        return torch.sqrt(x)
    return x.double().sqrt().to(x.dtype)
