"""A distributed optimizer's shard laid out in place (optim/buckets.py): its state mirrors the range
of megatron's DDP buffers it updates, its parameters and gradients are slices of them, and its
per-row tables name each row's entry."""

import pytest
import torch

import megatron_lowprec.optim.fused as fused_module
from megatron_lowprec.megatron.layout import ROW, build_shard_bucket
from megatron_lowprec.optim.buckets import BufferRows, InPlace, build_bucket, in_place_offsets
from megatron_lowprec.optim.kernel import adamw_step_, bucket_kernel_, init_state
from megatron_lowprec.optim.strategies import get_strategy

from .conftest import OPTIONS

SIZES = (256, 128, 100, 64)
GROUPS = (0, 1, 0, 1)
"""Four parameters of two alternating parameter groups, as megatron puts them in a DDP bucket:
each start padded to 64 elements (0, 256, 384, 512), the bucket to 128 (640)."""
HYPER = {
    0: dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    1: dict(lr=3e-3, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.0),
}


def _megatron_starts(sizes):
    starts, position = [], 0
    for size in sizes:
        position = -(-position // 64) * 64
        starts.append(position)
        position += size
    return starts, -(-position // 128) * 128


def _shard(strategy, start, generator):
    """The shard [start, end of the bucket) of a DDP bucket of :data:`SIZES`, its buffers filled with
    random values outside megatron's padding (which is zero)."""
    starts, total = _megatron_starts(SIZES)
    param_data = torch.zeros(total, dtype=torch.bfloat16)
    grad_data = torch.zeros(total, dtype=torch.bfloat16)
    for first, size in zip(starts, SIZES):
        param_data[first : first + size] = torch.randn(size, generator=generator).bfloat16()
    params, runs, run_starts, groups = [], [], [], []
    for first, size, group in zip(starts, SIZES, GROUPS):
        begin = max(first, start)
        if begin < first + size:
            params.append(torch.nn.Parameter(param_data[first : first + size]))
            runs.append((begin - first, first + size - begin))
            run_starts.append(begin)
            groups.append(group)
    bucket, grad = build_shard_bucket(strategy, params, runs, run_starts, groups, None, param_data, grad_data, start, total)
    return bucket, grad, param_data, grad_data, run_starts, runs


def test_in_place_offsets_mirror_megatron_s_range_or_refuse_a_layout_that_does_not_fit():
    """The offsets are the entries' places in the range; the first entry may start anywhere (a run
    of a parameter cut by the shard's start), a later one only on a row of 64 elements of the
    buffer; with FP8 moments every entry and the range's end on an FP8 group of the range."""
    adam, coat = get_strategy("A"), get_strategy("coat")
    assert in_place_offsets(adam, [40, 128, 448], 40, 600, ROW) == [0, 88, 408]
    assert in_place_offsets(adam, [40, 160], 40, 600, ROW) is None
    assert in_place_offsets(coat, [128, 256, 512], 128, 640, ROW) == [0, 128, 384]
    assert in_place_offsets(coat, [128, 256, 448], 128, 640, ROW) is None
    assert in_place_offsets(coat, [128, 256], 128, 600, ROW) is None


def test_an_in_place_shard_is_megatron_s_range_with_one_entry_per_row():
    """The bucket's parameters and gradients are the range of megatron's buffers (the same memory),
    each entry's parameter view is its place there, the state's padding (megatron's) is zero, and the
    per-row tables give each row of 64 elements of the buffer one entry: a shard starting 32 elements
    into a row has a first row of 32 elements."""
    generator = torch.Generator().manual_seed(0)
    bucket, grad, param_data, grad_data, run_starts, runs = _shard(get_strategy("C"), 160, generator)
    assert bucket.param_buffer.data_ptr() == param_data[160:].data_ptr() and bucket.numel == 480
    assert grad.data_ptr() == grad_data[160:].data_ptr() and grad.numel() == 480
    assert bucket.param_rows is None and bucket.row_phase == 32
    for view, first, (_, numel) in zip(bucket.entry_params(), run_starts, runs):
        assert view.data_ptr() == param_data[first].data_ptr() and view.numel() == numel
    assert bucket.offsets == [0, 96, 224, 352]
    assert bucket.entry_rows() == [2, 2, 2, 2]
    assert bucket.row_table((0, 1, 0, 1), torch.int32).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert all(not value.any() for value in bucket.state.values())


def test_a_shard_whose_fp8_groups_would_straddle_two_parameters_is_packed():
    """coat's FP8 groups of 128 from a range start of 64: megatron's parameter at 256 would start in
    the middle of a group, so the shard takes the packed layout, its parameters and gradients rows
    of megatron's buffers."""
    bucket, grad, *_ = _shard(get_strategy("coat"), 64, torch.Generator().manual_seed(0))
    assert bucket.param_rows is not None and isinstance(grad, BufferRows)
    assert bucket.offsets == [0, 256, 384, 512]


def test_a_row_of_two_entries_is_refused():
    params = [torch.nn.Parameter(torch.zeros(40, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(40, dtype=torch.bfloat16))]
    source = torch.zeros(128, dtype=torch.bfloat16)
    bucket, _ = build_bucket(get_strategy("A"), 0, params, own_params=False, in_place=InPlace(source, [0, 48], 0, ROW))
    with pytest.raises(ValueError, match="entry 1 of the bucket starts at element 48, inside a row of 64 elements"):
        bucket.entry_rows()


@pytest.mark.parametrize("option", [option for option in OPTIONS if get_strategy(option).param_update != "stochastic"])
def test_an_in_place_shard_steps_each_run_as_the_reference_and_leaves_the_rest_of_megatron_s_buffer(option, monkeypatch):
    """Three fused steps (the function the fused step compiles, run uncompiled: the compiled one is
    checked against it by the kernel tests) over a shard of two alternating parameter groups give
    each run of a parameter the bits of the eager reference step on it with its group's
    hyperparameters; megatron's padding stays zero and the elements before the shard are untouched.
    With one run's update not counted (a tensor-parallel replica), the update quality is the other
    runs' (FP64 sums in another order: within 1e-12)."""
    monkeypatch.setattr(fused_module, "compiled_kernel", lambda group_statistics=False: bucket_kernel_)
    strategy = get_strategy(option)
    generator = torch.Generator().manual_seed(1)
    start = 128 if strategy.moments == "fp8" else 160
    bucket, grad, param_data, grad_data, run_starts, runs = _shard(strategy, start, generator)
    assert bucket.param_rows is None
    bucket.entry_counted = [True, False, True, True]
    expected = param_data.clone()
    references = [expected[first : first + numel] for first, (_, numel) in zip(run_starts, runs)]
    states = [init_state(reference, strategy) for reference in references]
    entry_grads = [grad_data[first : first + numel] for first, (_, numel) in zip(run_starts, runs)]
    for step in range(1, 4):
        for first, (_, numel) in zip(run_starts, runs):
            grad_data[first : first + numel] = (torch.randn(numel, generator=generator) * 10.0 ** (step - 2)).bfloat16()
        quality = fused_module.fused_bucket_step_(
            bucket, strategy, grad, entry_grads, HYPER, step=step, sr_seed=None, track_update_quality=True,
        )
        pieces = [
            adamw_step_(reference, entry_grad, state, strategy, track_update_quality=True, **HYPER[group])
            for reference, entry_grad, state, group in zip(references, entry_grads, states, bucket.entry_groups)
        ]
        assert torch.equal(param_data.view(torch.int16), expected.view(torch.int16)), step
        counted = sum(piece for piece, counts in zip(pieces, bucket.entry_counted) if counts)
        assert quality.tolist() == pytest.approx(counted.tolist(), rel=1e-12, abs=1e-300)
