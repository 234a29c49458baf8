"""The allocation measurements of ``tests/allocations.py``, against tensors whose fate is known."""

import torch
import torch.distributed as dist

from .allocations import kept_allocations


def test_kept_allocations_count_what_the_call_creates_and_keeps_and_not_a_collectives_output_argument():
    """A tensor the call creates and keeps counts; one it creates and drops does not; an all-gather
    into a buffer allocated before the call (c10d returns its output argument with no alias in its
    schema, and the caller keeps that buffer) creates nothing."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gathered = torch.zeros(128)
        kept = []

        def step():
            kept.append(torch.ones(16))
            gathered[:64] += torch.ones(64)
            dist.all_gather_into_tensor(gathered, gathered[:128])

        assert kept_allocations(step).end == 16 * 4
        assert gathered.sum() == 64
    finally:
        dist.destroy_process_group()
