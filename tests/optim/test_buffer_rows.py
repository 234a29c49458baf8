"""BufferRows (optim/buckets.py): a bucket's values in rows of another flat buffer, written back from
compiled code without ATen's index_put_ (which sorts its indices on CUDA in deterministic mode), and
the padding that repeats its entry's last elements."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from megatron_lowprec.optim.buckets import BufferRows, build_bucket, repeated_index
from megatron_lowprec.optim.fused import fused_available
from megatron_lowprec.optim.strategies import PrecisionStrategy, get_strategy

WIDTH = 32
NUMELS = [100, 37, 64]
SOURCE_STARTS = [5, 120, 200]
OFFSETS = [0, 128, 192]
"""Each entry's first element in the bucket: its predecessors' rows of ``WIDTH`` (4, 2 and 2 rows)."""


def _rows(source: torch.Tensor) -> BufferRows:
    row_entries = [entry for entry, numel in enumerate(NUMELS) for _ in range(-(-numel // WIDTH))]
    return BufferRows(
        source,
        torch.tensor(row_entries, dtype=torch.int32),
        torch.tensor([start - offset for start, offset in zip(SOURCE_STARTS, OFFSETS)]),
        torch.tensor([offset + numel - 1 for offset, numel in zip(OFFSETS, NUMELS)]),
        WIDTH,
        1,
        torch.tensor(0, dtype=torch.int32),
    )


@pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")
def test_compiled_write_in_deterministic_mode_stores_each_entry_and_no_index_put():
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(300, generator=generator).bfloat16()
    rows = _rows(source)
    values = torch.randn(256, generator=generator).bfloat16()
    expected = source.clone()
    for offset, start, count in zip(OFFSETS, SOURCE_STARTS, NUMELS):
        expected[start : start + count] = values[offset : offset + count]
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


def test_reads_give_padding_zero_or_the_entry_s_last_element_and_a_repeating_store_keeps_the_source():
    """read: each entry's source elements, zero in its padding; read_repeating: its padding holds the
    entry's last element; storing what read_repeating read changes no element of the source (the
    duplicates carry equal values; elements outside the entries untouched); repetition marks each
    entry's own elements and names the element each padding element repeats."""
    source = torch.arange(300, dtype=torch.float32)
    rows = _rows(source)
    zero_padded, repeating = torch.zeros(256), torch.zeros(256)
    own, repeats = torch.zeros(256, dtype=torch.bool), torch.arange(256, dtype=torch.int32)
    for offset, start, count, end in zip(OFFSETS, SOURCE_STARTS, NUMELS, OFFSETS[1:] + [256]):
        zero_padded[offset : offset + count] = source[start : start + count]
        repeating[offset:end] = source[start + count - 1]
        repeating[offset : offset + count] = source[start : start + count]
        own[offset : offset + count] = True
        repeats[offset + count : end] = offset + count - 1
    assert torch.equal(rows.read(torch.Size([256])), zero_padded)
    assert torch.equal(rows.read_repeating(torch.Size([256])), repeating)
    assert [torch.equal(a, b) for a, b in zip(rows.repetition(torch.Size([256])), (own, repeats))] == [True, True]
    rows.store_repeating(repeating)
    assert torch.equal(source, torch.arange(300, dtype=torch.float32))


def test_padding_of_groups_repeats_the_entry_s_last_group_column_by_column():
    """An entry of 70 elements in groups of 32 (last element 69, in group 2): padding in group 2
    repeats element 69; group 3, all padding, repeats group 2 column by column (64..69, then 69)."""
    index = torch.arange(70, 128)
    expected = torch.tensor([69] * 26 + [64, 65, 66, 67, 68, 69] + [69] * 26)
    assert torch.equal(repeated_index(index, 69, 32), expected)
    assert torch.equal(repeated_index(index, 69, 1), torch.full((58,), 69))
    assert torch.equal(repeated_index(torch.arange(70), 69, 32), torch.arange(70))


@pytest.mark.parametrize("option", ["C", "e5m2-64"])
def test_repeat_into_padding_copies_each_entry_s_last_element_into_its_state_s_padding(option):
    """In a packed shard's bucket (its parameters rows of another buffer), every per-element state
    buffer's padding holds its entry's last element (FP8 payloads by their bits), and a group of
    padding holds the entry's last group's scale; the entries' own state is unchanged. FP8 moments in
    groups of 64 in 128-element rows: an entry of 70 elements has a whole group of padding. Any other
    bucket's padding is left as it is."""
    strategy = get_strategy(option) if option == "C" else PrecisionStrategy(
        "e5m2-64", "FP8 E5M2 moments in groups of 64", moments="fp8", fp8_format="e5m2", fp8_group_size=64, fp8_expand=False,
    )
    params = [torch.nn.Parameter(torch.zeros(50, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(128, dtype=torch.bfloat16))]
    bucket, _ = build_bucket(strategy, 0, params, own_params=False)
    generator = torch.Generator().manual_seed(0)
    for buffer in bucket.state.values():
        bits = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
        bits.copy_(torch.randint(0, 60, bits.shape, generator=generator).to(bits.dtype))
    before = {key: buffer.clone() for key, buffer in bucket.state.items()}
    bucket.repeat_into_padding_()
    assert all(torch.equal(buffer, before[key]) for key, buffer in bucket.state.items())
    bucket.param_rows = ([0, 64], bucket.rows_in(torch.zeros(192, dtype=torch.bfloat16), [0, 64]))
    bucket.repeat_into_padding_()
    for key, buffer in bucket.state.items():
        bits, old = (buffer.view(torch.uint8), before[key].view(torch.uint8)) if buffer.element_size() == 1 else (buffer, before[key])
        if key.endswith("_scale"):
            assert torch.equal(bits, torch.cat([old[:1], old[:1], old[2:]]))
            continue
        expected = old.clone()
        expected[50:128] = old[49]
        if strategy.moments == "fp8":
            expected[64:114] = old[:50]
        assert torch.equal(bits, expected), key
