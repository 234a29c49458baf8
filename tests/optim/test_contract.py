"""The optimizer contract, one matrix: {AdamW, Muon} x {owned, in-place shard, packed} x every
registered option (read from the registry) x {eager, fused}.

Each (optimizer, option) steps its parameters eagerly in buffers it owns once (:func:`_owned_eager`):
that run is checked against the independent reference (``tests/optim/references.py``: torch's AdamW
in FP64, torch's Muon in FP32) within the option's storage bounds, and every other cell of the
matrix must end with its bits in every parameter and state tensor.

Layouts: *owned*, the optimizer's own buckets; *in place*, a distributed optimizer's shard of
megatron's flat buffers whose state mirrors the buffer's range; *packed*, a shard read and written as
rows of the buffer where the in-place layout cannot hold it (entries off megatron's 64-element rows;
FP8 groups that would straddle parameters). AdamW steps a shard through a layout source in both
paths; its packed cells place the parameters off megatron's rows, which packs every option, but
compile the fused step only for the options that megatron's own layout packs (FP8 moments): the
others never run packed in training (their packed eager cells stay). Muon steps weights left in one buffer (``params_in_buffer``) in its fused path only (its eager
path is the owned one); megatron's layout puts them in place, but FP8 moments, whose groups would
straddle weights, make them rows: Muon's packed cells are the options with FP8 moments, its in-place
cells the others.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_lowprec.megatron.layout import ROW
from megatron_lowprec.optim import AdamW, available_strategies, get_strategy
from megatron_lowprec.optim.fused import BUCKET_STREAM_DEVICES, fused_available
from megatron_lowprec.optim.muon import Muon, muon_strategy, update_scale

from . import references

OPTIONS = [strategy.name for strategy in available_strategies()]

FUSED = fused_available(torch.device("cpu"))


def _packed_in_megatron(option):
    """Whether megatron's layout (every parameter's start padded to a 64-element row) can make a shard
    of ``option`` packed: only FP8 groups (of 128) straddle those starts."""
    return get_strategy(option).moments == "fp8"


ADAMW_CELLS = [
    ("adamw", layout, option, path)
    for option in OPTIONS for layout in ("owned", "in_place", "packed") for path in ("eager", "fused")
    if layout == "owned" or (layout, path) != ("packed", "fused") or _packed_in_megatron(option)
]
MUON_CELLS = [("muon", "owned", option, path) for option in OPTIONS for path in ("eager", "fused")] + [
    ("muon", "packed" if _packed_in_megatron(option) else "in_place", option, "fused") for option in OPTIONS
]


def _cell(optimizer, layout, option, path):
    marks = [pytest.mark.skipif(not FUSED, reason="no C++ compiler for Inductor")] if path == "fused" else []
    return pytest.param(optimizer, layout, option, path, marks=marks, id=f"{optimizer}-{layout}-{option}-{path}")


# AdamW: four parameters as megatron's DDP buffer holds them, in two parameter groups.

ADAMW_SIZES = (256, 128, 100, 64)
ADAMW_STARTS = {"owned": (0, 256, 384, 512), "in_place": (0, 256, 384, 512), "packed": (0, 288, 416, 544)}
"""Each parameter's start in the 640-element buffer: on megatron's 64-element rows (each start padded
to a row; a multiple of 128 too, so FP8 groups of 128 fit in place), or off them (packed)."""
SHARD_START = 128
"""The shard steps the buffer from element 128: the first parameter's run from its element 128."""
ADAMW_GROUPS = [([0, 2], dict(lr=1e-2, weight_decay=0.1)), ([1, 3], dict(lr=3e-3, weight_decay=0.0))]
BETAS, EPS = (0.9, 0.95), 1e-8
ADAMW_STEPS = 7
"""Gradients scaled by 10^-3 ... 10^3, one scale per step."""


def _adamw_problem():
    generator = torch.Generator().manual_seed(3)
    initial = [torch.randn(size, generator=generator).bfloat16() for size in ADAMW_SIZES]
    grads = [
        [(torch.randn(size, generator=generator) * 10.0 ** (step - 3)).bfloat16() for size in ADAMW_SIZES]
        for step in range(ADAMW_STEPS)
    ]
    return initial, grads


def _adamw_groups(params):
    return [{"params": [params[index] for index in indices], **hyper} for indices, hyper in ADAMW_GROUPS]


def _adamw_run(option, layout, path):
    """The AdamW of ``option`` stepped :data:`ADAMW_STEPS` times in ``layout`` by ``path``: its
    parameters (whole, or the buffer's views), the optimizer, and the layout source (``None``: owned)."""
    initial, grads = _adamw_problem()
    source = None
    if layout == "owned":
        params = [torch.nn.Parameter(values.clone()) for values in initial]
        grad_views = None
    else:
        param_data, grad_data = torch.zeros(640, dtype=torch.bfloat16), torch.zeros(640, dtype=torch.bfloat16)
        params, grad_views = [], []
        for first, values in zip(ADAMW_STARTS[layout], initial):
            param_data[first : first + values.numel()] = values
            params.append(torch.nn.Parameter(param_data[first : first + values.numel()]))
            grad_views.append(grad_data[first : first + values.numel()])
        source = references.BufferShard(param_data, grad_data, SHARD_START)
    optimizer = AdamW(_adamw_groups(params), betas=BETAS, eps=EPS, option=option, fused=path == "fused", seed=5, layout=source)
    for step_grads in grads:
        for index, (param, grad) in enumerate(zip(params, step_grads)):
            if grad_views is None:
                param.grad = grad.clone()
            else:
                grad_views[index].copy_(grad)
        optimizer.step()
    return params, optimizer, source


# Muon: wide, tall and tiny weights, the last a fused QKV weight of two query groups split (8, 4, 4).

MUON_SHAPES = [(16, 24), (40, 8), (3, 5), (32, 8)]
MUON_SPLIT = {len(MUON_SHAPES) - 1: (8, 4, 4)}
MUON_LR, MUON_STEPS = 0.02, 3
"""lr 0.02 / (step + 1), a new one each step (lr is a kernel input: no recompilation)."""


def _muon_problem():
    initial = [torch.randn(shape, generator=torch.Generator().manual_seed(index)).bfloat16() for index, shape in enumerate(MUON_SHAPES)]
    grads = [
        [(torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + index)) * 10.0 ** (step - 1)).bfloat16()
         for index, shape in enumerate(MUON_SHAPES)]
        for step in range(MUON_STEPS)
    ]
    return initial, grads


def _compiled_regions(optimizer) -> int:
    """The compiled regions one ``optimizer.step()`` enters (profiler events Dynamo records)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    return sum(event.name.startswith("Torch-Compiled Region") for event in profile.events())


def _muon_run(option, layout, path):
    """The Muon of ``option`` stepped :data:`MUON_STEPS` times in ``layout`` by ``path``: its
    weights and the optimizer. Fused, the steps after the first compile nothing more and the last
    enters two compiled regions per bucket (momentum, update), or one per weight for the update under
    stochastic rounding outside ``BUCKET_STREAM_DEVICES`` (a CPU) but with FP8 moments; in a buffer, the other ranks'
    elements stay untouched."""
    from torch._dynamo.utils import counters

    initial, grads = _muon_problem()
    if layout == "owned":
        params = [torch.nn.Parameter(values.clone()) for values in initial]
    else:
        params, buffer, outside = references.in_one_buffer(initial, gap=64, megatron=True)
        kept = buffer[outside].clone()
    split = {param: MUON_SPLIT.get(index) for index, param in enumerate(params)}
    optimizer = Muon(params, lr=MUON_LR, option=option, fused=path == "fused", seed=3, split_rows=split.get,
                     params_in_buffer=layout != "owned", buffer_row=None if layout == "owned" else ROW)
    if layout == "in_place":
        assert [bucket.in_place for bucket in optimizer.buckets] == [True]
    elif layout == "packed":
        assert [bucket.param_rows is not None for bucket in optimizer.buckets] == [True]
    for step, step_grads in enumerate(grads):
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.param_groups[0]["lr"] = MUON_LR / (step + 1)
        if path == "eager" or step < MUON_STEPS - 1:
            optimizer.step()
        else:
            graphs = counters["stats"]["unique_graphs"]
            strategy = get_strategy(option)
            per_weight = strategy.param_update == "stochastic" and strategy.moments != "fp8" and "cpu" not in BUCKET_STREAM_DEVICES
            assert _compiled_regions(optimizer) == 1 + (len(params) if per_weight else 1)
            assert counters["stats"]["unique_graphs"] == graphs
    if layout != "owned":
        assert torch.equal(buffer[outside].view(torch.int16), kept.view(torch.int16))
    return params, optimizer


@functools.cache
def _owned_eager(optimizer_name, option):
    """The eager step in owned buffers, the matrix's reference cell: (parameters, per-parameter
    states, state dict), copied."""
    if optimizer_name == "adamw":
        params, optimizer, _ = _adamw_run(option, "owned", "eager")
    else:
        params, optimizer = _muon_run(option, "owned", "eager")
    states = [{key: value.clone() if torch.is_tensor(value) else value for key, value in optimizer.state[p].items()} for p in params]
    return [p.detach().clone() for p in params], states, optimizer.state_dict()


def _check_owned_eager_against_the_reference(optimizer_name, option):
    params, states, _ = _owned_eager(optimizer_name, option)
    initial, grads = _adamw_problem() if optimizer_name == "adamw" else _muon_problem()
    if optimizer_name == "adamw":
        strategy = get_strategy(option)
        expected = references.torch_adamw_fp64(initial, grads, ADAMW_GROUPS, BETAS, EPS)
        for index, (param, state, reference) in enumerate(zip(params, states, expected)):
            lr = next(hyper["lr"] for indices, hyper in ADAMW_GROUPS if index in indices)
            references.assert_within_reference(strategy, references.represented(param, state), reference, ADAMW_STEPS, lr)
        return
    strategy = muon_strategy(option)
    compared = [index for index in range(len(MUON_SHAPES)) if index not in MUON_SPLIT]
    lrs = [MUON_LR / (step + 1) for step in range(MUON_STEPS)]
    expected = _torch_muon_with_lrs([initial[i] for i in compared], [[g[i] for i in compared] for g in grads], lrs)
    for index, reference in zip(compared, expected):
        scale = update_scale(MUON_SHAPES[index], "shape_scaling")
        references.assert_within_reference(
            strategy, references.represented(params[index], states[index]), reference.reshape(-1), MUON_STEPS,
            MUON_LR * scale, direction_floor=2**-6,
        )


def _torch_muon_with_lrs(initial, grads, lrs):
    params = [torch.nn.Parameter(value.float()) for value in initial]
    optimizer = torch.optim.Muon(params, lr=lrs[0])
    for lr, step_grads in zip(lrs, grads):
        optimizer.param_groups[0]["lr"] = lr
        for param, grad in zip(params, step_grads):
            param.grad = grad.float()
        optimizer.step()
    return [param.detach().double() for param in params]


def _check_adamw_cell(layout, option, path):
    expected_params, expected_states, expected_dict = _owned_eager("adamw", option)
    params, optimizer, source = _adamw_run(option, layout, path)
    if source is None:
        references.assert_same_bits(
            [p.detach() for p in params], [optimizer.state[p] for p in params], expected_params, expected_states, (layout, path)
        )
        return
    assert [bucket.in_place for bucket in optimizer.buckets] == [layout == "in_place"]
    strategy = get_strategy(option)
    group = strategy.fp8_group_size if strategy.moments == "fp8" else 1
    index_of = {param: index for index, param in enumerate(params)}
    assert [index_of[param] for param, _ in source.runs] == [0, 1, 2, 3]
    runs = [(index_of[param], first) for param, first in source.runs]
    references.assert_same_bits(
        [params[index].detach()[first:] for index, first in runs],
        [optimizer.state[params[index]] for index, _ in runs],
        [expected_params[index][first:] for index, first in runs],
        [references.part_of_state(expected_states[index], first, group) for index, first in runs],
        (layout, path),
    )
    state_dict = optimizer.state_dict()
    assert sorted(state_dict["state"]) == sorted(expected_dict["state"])
    assert sorted(state_dict["lowprec"]) == sorted(expected_dict["lowprec"])


def _check_muon_cell(layout, option, path):
    expected_params, expected_states, _ = _owned_eager("muon", option)
    params, optimizer = _muon_run(option, layout, path)
    references.assert_same_bits(
        [p.detach() for p in params], [optimizer.state[p] for p in params], expected_params, expected_states, (layout, path)
    )


@pytest.mark.parametrize("optimizer_name,layout,option,path", [_cell(*cell) for cell in ADAMW_CELLS + MUON_CELLS])
def test_every_cell_steps_with_the_bits_of_the_owned_eager_step_which_follows_the_reference(optimizer_name, layout, option, path):
    """The owned eager cell within the option's storage bounds of the independent reference (AdamW:
    torch's in FP64, two parameter groups with their own lr and weight decay, gradients from 10^-3 to
    10^3; Muon: torch's in FP32 at a new lr each step, the split QKV weight left out); every other
    cell the owned eager cell's bits in every parameter and state tensor (a shard: each run's
    elements and state, per-group parts from the run's first group; its state dict the owned one's
    entries)."""
    if layout == "owned" and path == "eager":
        _check_owned_eager_against_the_reference(optimizer_name, option)
    elif optimizer_name == "adamw":
        _check_adamw_cell(layout, option, path)
    else:
        _check_muon_cell(layout, option, path)

