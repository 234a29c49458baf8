"""Bytes that torch's CPU allocator hands out while a function runs, measured with torch's profiler.

Every allocation of the CPU allocator is reported to the profiler (inside an operator, as that
operator's own memory; outside one, such as the buffers of Inductor-compiled code, as a ``[memory]``
event), and so is every free. Summing them in time order gives the bytes live at each moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.profiler import ProfilerActivity, profile


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
    live = peak = 0
    for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return Allocations(peak, live, result)
