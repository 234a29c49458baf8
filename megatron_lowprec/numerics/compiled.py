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
    from torch._inductor import config as inductor_config

    options = dict(INDUCTOR_OPTIONS)
    options.update({name: value for name, value in OPTIONAL_INDUCTOR_OPTIONS.items() if _has_option(inductor_config, name)})
    return options


def _has_option(config: Any, dotted_name: str) -> bool:
    for part in dotted_name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def compile_exact(function: Callable, options: dict[str, Any] | None = None) -> Callable:
    """``function`` compiled with :func:`inductor_options` (and ``options``, more Inductor options),
    dynamic shapes and one graph, traced under :func:`ieee_fp32_division` where those options compile
    FP32 division to the IEEE instruction: the bits of its eager form on every backend, as long as it
    is built from operations that every backend computes alike (``numerics/elementary.py``). Python
    numbers among its arguments are constants of the graph (``specialize_int``, ``specialize_float``):
    a new value compiles again, as a new shape does not. ``automatic_dynamic_shapes`` is off: every
    size is dynamic from the first compile anyway, and Dynamo's memory of earlier calls would otherwise
    give a later compile's sizes symbols of their own, and Inductor's cache key with them (a compile
    child could then not fill the training process's cache entry). Without duck shapes: sizes and
    storage offsets that are equal by chance (a shard's parameters at the offsets of its state, a
    grid of as many rows as columns) keep symbols of their own, so that the next call, where they
    differ, does not compile again (sizes that must be equal are made so by the operations' guards)."""
    from torch.fx.experimental import _config as symbolic_shapes_config

    options = {**inductor_options(), **(options or {})}
    compiled = torch.compile(function, dynamic=True, fullgraph=True, options=options)
    compiled = torch._dynamo.config.patch(specialize_int=True, specialize_float=True, automatic_dynamic_shapes=False)(compiled)
    compiled = symbolic_shapes_config.patch(use_duck_shape=False)(compiled)
    division = ieee_fp32_division if options.get(IEEE_DIVISION_OPTION) else contextlib.nullcontext

    @functools.wraps(function)
    def call(*args):
        with division():
            return compiled(*args)

    return call


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
    their quantization and backward passes."""
    return _compiled_once(function) if triton_converts_fp8(device) else function
