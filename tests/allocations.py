"""What torch allocates while a function runs.

- :func:`measure_allocations`: bytes that torch's CPU allocator hands out, through torch's profiler,
  which records every allocation, and every free of memory allocated while it runs, as a ``[memory]``
  event with its time and size (inside operators, in compiled code and between operators alike).
  Summing them in time order gives the bytes live at each moment: the peak, and what is left at the
  end. (The per-operator "self memory" of the profiler's summary is no substitute: a free between two
  operators is booked to the range around them, such as the ``record_function`` that
  ``torch.optim.Optimizer.step`` opens, as of its start.) Frees of memory allocated before the call
  are not reported, and events of other threads (a collective's) interleave: use it in one process.
- :func:`kept_allocations`: the bytes of the tensors that operators create during the call and that
  are still alive afterwards (each storage once), through a dispatch mode. An operator that returns
  the storage of one of its arguments creates none, whether or not its schema marks the alias
  (c10d's collectives return their output arguments unmarked). Memory allocated inside compiled code
  is not seen, nothing from other threads is, and it does not depend on timing, except that a
  collective's worker thread (gloo's) may still hold a finished collective's tensors for a moment
  after the call returns: a tensor the call creates and hands to a collective is then seen kept.
  torch.compile does not compile under it: call it on code compiled before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Allocations:
    peak: int
    """Most bytes live at once, counted from the start of the call."""
    end: int
    """Bytes still live when the call returned (kept by its result or by the objects it changed)."""
    result: Any


def measure_allocations(function: Callable[[], Any]) -> Allocations:
    """Call ``function`` and measure what the CPU allocator gave out meanwhile."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = function()
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return Allocations(peak, live, result)


class _TensorRecorder(TorchDispatchMode):
    """Weak references to every tensor an operator returns, and the storages that were new. An
    "infra" mode, so that code compiled before it is pushed still runs as compiled."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref] = []
        self.new_storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arguments = {leaf.untyped_storage().data_ptr() for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
        result = func(*args, **kwargs)
        aliases = any(returned.alias_info is not None for returned in func._schema.returns)
        for tensor in pytree.tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self.tensors.append(weakref.ref(tensor))
                storage = tensor.untyped_storage().data_ptr()
                if not aliases and storage not in arguments:
                    self.new_storages.add(storage)
        return result


def kept_allocations(function: Callable[[], Any]) -> Allocations:
    """Call ``function``; ``end`` is the bytes of the storages created during the call that tensors
    still hold (``peak`` is not measured and equals ``end``)."""
    recorder = _TensorRecorder()
    with recorder:
        result = function()
    kept: dict[int, int] = {}
    for reference in recorder.tensors:
        tensor = reference()
        if tensor is not None:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in recorder.new_storages:
                kept[storage.data_ptr()] = storage.nbytes()
    total = sum(kept.values())
    return Allocations(total, total, result)
