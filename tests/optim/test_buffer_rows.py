"""BufferRows (optim/buckets.py): a bucket's values in rows of another flat buffer, written back from
compiled code without ATen's index_put_ (which sorts its indices on CUDA in deterministic mode)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from megatron_lowprec.optim.buckets import BufferRows
from megatron_lowprec.optim.fused import fused_available

pytestmark = pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")

WIDTH = 32
NUMELS = [100, 37, 64]
SOURCE_STARTS = [5, 120, 200]


def _rows(source: torch.Tensor) -> BufferRows:
    rows_per_entry = [-(-numel // WIDTH) for numel in NUMELS]
    first_rows = [sum(rows_per_entry[:index]) for index in range(len(NUMELS))]
    return BufferRows(
        source, torch.tensor(first_rows, dtype=torch.int32), torch.tensor(SOURCE_STARTS), torch.tensor(NUMELS),
        WIDTH, torch.tensor(0, dtype=torch.int32),
    ), first_rows, sum(rows_per_entry) * WIDTH


def test_compiled_write_in_deterministic_mode_stores_each_entry_and_no_index_put():
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(300, generator=generator).bfloat16()
    rows, first_rows, numel = _rows(source)
    values = torch.randn(numel, generator=generator).bfloat16()
    expected = source.clone()
    for first_row, start, count in zip(first_rows, SOURCE_STARTS, NUMELS):
        expected[start : start + count] = values[first_row * WIDTH : first_row * WIDTH + count]
    torch._dynamo.reset()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _, codes = run_and_get_code(torch.compile(BufferRows.write, fullgraph=True, dynamic=True), rows, values)
    finally:
        torch.use_deterministic_algorithms(previous)
    torch._dynamo.reset()
    assert torch.equal(source.view(torch.int16), expected.view(torch.int16))
    assert not any("index_put" in code for code in codes)
