"""Elementwise operations whose rounding belongs to ATen, kept as ATen calls inside compiled code.

Some of ATen's CPU kernels do not round like a plain sequence of IEEE operations: ``lerp`` and
``addcmul`` are fused multiply-adds, and ``sqrt``, ``log`` and ``pow`` come from SLEEF and are not
always correctly rounded. Inductor would re-derive them from its own primitives (no FMA, correctly
rounded ``sqrt``), so a compiled kernel would no longer match eager code bit for bit. The functions
here are opaque custom ops: eager and compiled code both run the same ATen kernel. Scalars may be
Python floats or 0-d tensors (so that compiled code need not specialise on them).

:func:`sqrt_rn` is the opposite case: a correctly rounded square root, computed the cheapest exact
way in each mode.
"""

from __future__ import annotations

import torch

Scalar = float | torch.Tensor


@torch.library.custom_op("megatron_lowprec::aten_lerp", mutates_args=())
def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.lerp(start, end, weight.item())


@torch.library.custom_op("megatron_lowprec::aten_addcmul", mutates_args=())
def _addcmul(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(base, first, second, value=value.item())


@torch.library.custom_op("megatron_lowprec::aten_sqrt", mutates_args=())
def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x)


@torch.library.custom_op("megatron_lowprec::aten_log", mutates_args=())
def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


@torch.library.custom_op("megatron_lowprec::aten_pow", mutates_args=())
def _pow(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return torch.pow(x, exponent)


@_lerp.register_fake
def _(start, end, weight):
    return torch.empty_like(start)


@_addcmul.register_fake
def _(base, first, second, value):
    return torch.empty_like(base)


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


def lerp(start: torch.Tensor, end: torch.Tensor, weight: Scalar) -> torch.Tensor:
    """``torch.lerp(start, end, weight)`` exactly as ATen computes it (a fused multiply-add on CPU)."""
    if not torch.compiler.is_compiling() and not torch.is_tensor(weight):
        return torch.lerp(start, end, weight)
    return _lerp(start, end, _as_tensor(weight, start))


def addcmul(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, value: Scalar) -> torch.Tensor:
    """``torch.addcmul(base, first, second, value=value)`` exactly as ATen computes it."""
    if not torch.compiler.is_compiling() and not torch.is_tensor(value):
        return torch.addcmul(base, first, second, value=value)
    return _addcmul(base, first, second, _as_tensor(value, base))


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
