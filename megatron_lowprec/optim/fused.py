"""Fused AdamW steps: the reference kernel compiled by ``torch.compile``, run once per flat bucket.

The kernel is :func:`megatron_lowprec.optim.kernel.adamw_kernel_` itself, so fused and eager
steps share one specification. Inductor turns it into C++/OpenMP loops on CPU and Triton kernels on
GPU. What keeps the compiled step bit-identical to the eager one:

* ``emulate_precision_casts``: every explicit cast to a 16-bit dtype is a real rounding. Without it
  Inductor keeps 16-bit intermediates in FP32, which silently drops the MCF error terms.
* Inductor compiles C++ with ``-ffp-contract=off`` (its default), so no multiply and add are fused
  unless the specification asks for it; the operations that do (``torch_lerp`` and
  ``torch_addcmul`` of option D) run as ATen kernels inside the compiled graph.
* Step-dependent scalars and the SR round keys are 0-d tensors, and shapes are dynamic, so one
  compilation per strategy and dtype serves every step and bucket.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from collections.abc import Callable

import torch

from megatron_lowprec.metrics.update_quality import UpdateQuality, measure_update_quality
from megatron_lowprec.numerics.rounding import counter_round_keys
from megatron_lowprec.optim.buckets import Bucket
from megatron_lowprec.optim.kernel import (
    CounterStream,
    StepScalars,
    adamw_kernel_,
    beta2_expansion_for,
    represented_value,
)
from megatron_lowprec.optim.strategies import PrecisionStrategy

RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit is raised to at least this: each strategy and dtype is one compilation."""


def fused_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can build the fused step here: a C++ compiler on CPU, Triton on GPU."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device.type == "cpu":
        return any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name)
    return False


@functools.cache
def compiled_kernel() -> Callable:
    """The compiled :func:`adamw_kernel_` (built once; Dynamo specialises it per strategy and dtype)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(adamw_kernel_, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


@torch.no_grad()
def fused_bucket_step_(
    bucket: Bucket,
    grad: torch.Tensor,
    strategy: PrecisionStrategy,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    sr_seed: int | None,
    track_update_quality: bool,
) -> UpdateQuality | None:
    """One AdamW step over a whole bucket (its parameters all at ``step`` after this call)."""
    param = bucket.param_buffer
    device = param.device
    scalars = StepScalars.for_step(step, lr, beta1, beta2, eps, weight_decay).as_tensors(device)
    beta2_expansion = tuple(
        None if part is None else torch.tensor(part, dtype=param.dtype, device=device)
        for part in beta2_expansion_for(strategy, beta2, param.dtype)
    )
    random_source = None
    if sr_seed is not None:
        keys = tuple(torch.tensor(key, dtype=torch.int64, device=device) for key in counter_round_keys(sr_seed, step))
        random_source = CounterStream(keys, torch.tensor(bucket.element_base, dtype=torch.int64, device=device))
    before = represented_value(param, bucket.state) if track_update_quality else None
    update = compiled_kernel()(
        param, grad, bucket.state, strategy, scalars, beta2_expansion, random_source, track_update_quality
    )
    if before is None:
        return None
    return measure_update_quality(update, before, represented_value(param, bucket.state))
