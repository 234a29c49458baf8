"""Elementwise operations whose rounding belongs to ATen, kept as ATen calls inside compiled code.

ATen's CPU ``log`` and ``pow`` come from SLEEF and are not always correctly rounded. Inductor would
re-derive them from its own primitives, so a compiled kernel would no longer match eager code bit
for bit. The functions here are opaque custom ops: eager and compiled code both run the same ATen
kernel.

:func:`sqrt_rn` is the opposite case: a correctly rounded square root, computed the cheapest exact
way in each mode.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("megatron_lowprec::aten_log", mutates_args=())
def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x)


@torch.library.custom_op("megatron_lowprec::aten_pow", mutates_args=())
def _pow(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return torch.pow(x, exponent)


@_log.register_fake
def _(x):
    return torch.empty_like(x)


@_pow.register_fake
def _(x, exponent):
    return torch.empty(torch.broadcast_shapes(x.shape, exponent.shape), dtype=x.dtype, device=x.device)


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
