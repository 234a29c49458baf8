"""Numerics code compiled by ``torch.compile`` to the bits its eager form computes, on CPUs and GPUs.

Inductor keeps every cast to a 16-bit or FP8 dtype a real rounding (``emulate_precision_casts``),
keeps FP32 subnormals in Triton's libdevice functions (``eager_numerics.disable_ftz``; its default
flushes them, eager CUDA does not) and compiles an FP32 ``/`` in Triton to the IEEE ``div.rn.f32``
(``eager_numerics.division_rounding``; ``div.full.f32``, within 2 ulp, otherwise), which
:func:`~megatron_lowprec.numerics.elementary.div_rn` is told while the code is traced
(:func:`~megatron_lowprec.numerics.elementary.ieee_fp32_division`). No multiply and add are fused:
Inductor compiles C++ with ``-ffp-contract=off`` and Triton without FP fusion under
``emulate_precision_casts``. The fused optimizer steps (``optim/fused.py``) and COAT's FP8
quantization of activations, weights and gradients (``numerics/quant.py``) are compiled so.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from megatron_lowprec.numerics import inductor
from megatron_lowprec.numerics.elementary import ieee_fp32_division

INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
"""``emulate_precision_casts``: see above. ``cpp.dynamic_threads``: an OpenMP loop whatever the size
hint; with dynamic shapes Inductor otherwise judges the work too small and runs one thread (2x slower
on 2 cores)."""

IEEE_DIVISION_OPTION = "eager_numerics.division_rounding"
OPTIONAL_INDUCTOR_OPTIONS = {"eager_numerics.disable_ftz": True, IEEE_DIVISION_OPTION: True}
"""Set where this torch's Inductor has them (see above)."""

FP8_CONVERSION_CAPABILITY = (8, 9)
"""The CUDA compute capability from which Triton converts to and from FP8 E4M3 (its ``fp8e4nv``: Ada,
Hopper and later). Below it (A100, V100, T4) the fused optimizer step reads and writes FP8 payloads
as their uint8 codes (``optim/fused.py: fp8_payloads_as_codes``)."""


def inductor_options() -> dict[str, Any]:
    """:data:`INDUCTOR_OPTIONS` and those of :data:`OPTIONAL_INDUCTOR_OPTIONS` this torch has."""
    return {**INDUCTOR_OPTIONS, **inductor.supported_options(OPTIONAL_INDUCTOR_OPTIONS)}


def compile_exact(
    function: Callable, options: dict[str, Any] | None = None,
    around: tuple[Callable[[], contextlib.AbstractContextManager], ...] = (),
) -> Callable:
    """``function`` compiled with :func:`inductor_options` (and ``options``, more Inductor options),
    dynamic shapes and one graph, traced under :func:`ieee_fp32_division` where those options compile
    FP32 division to the IEEE instruction: the bits of its eager form on every backend, as long as it
    is built from operations that every backend computes alike (``numerics/elementary.py``). Python
    numbers among its arguments are constants of the graph: a new value compiles again, as a new
    shape does not. Without duck shapes: sizes and storage offsets that are equal by chance (a
    shard's parameters at the offsets of its state, a grid of as many rows as columns) keep symbols
    of their own, so that the next call, where they differ, does not compile again (sizes that must
    be equal are made so by the operations' guards). These Dynamo settings, and the contexts
    ``around``, apply around each call only (:func:`~megatron_lowprec.numerics.inductor.compile_scoped`)."""
    options = {**inductor_options(), **(options or {})}
    division = (ieee_fp32_division,) if options.get(IEEE_DIVISION_OPTION) else ()
    return inductor.compile_scoped(function, options, specialize_numbers=True, duck_shapes=False, around=(*around, *division))


def triton_converts_fp8(device: torch.device) -> bool:
    """Whether Inductor compiles FP8 casts on ``device``: a GPU of compute capability
    :data:`FP8_CONVERSION_CAPABILITY` or later, with Triton installed."""
    return (
        device.type == "cuda"
        and importlib.util.find_spec("triton") is not None
        and torch.cuda.get_device_capability(device) >= FP8_CONVERSION_CAPABILITY
    )


@functools.cache
def _compiled_once(function: Callable) -> Callable:
    return compile_exact(function)


def compiled_where_fp8_converts(function: Callable, device: torch.device) -> Callable:
    """``function`` compiled by :func:`compile_exact` (once per function) where Inductor compiles FP8
    casts on ``device`` (:func:`triton_converts_fp8`), else ``function`` itself: how COAT's layers run
    their quantization and backward passes. Outside the torch and triton versions the package's
    compiler internals were written for, ``function`` itself, after one warning
    (:func:`~megatron_lowprec.numerics.inductor.warn_unsupported`)."""
    if not triton_converts_fp8(device):
        return function
    unsupported = inductor.unsupported_reason(device.type)
    if unsupported is not None:
        inductor.warn_unsupported(unsupported)
        return function
    return _compiled_once(function)
