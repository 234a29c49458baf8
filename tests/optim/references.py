"""The independent references of the optimizer contract tests, written once: torch's own AdamW in
FP64 and torch's own Muon in FP32, the value an option's stored tensors represent (read by integer
and FP64 arithmetic, not by the package), how far each storage may stray from the reference per
step, a layout source over a flat buffer as megatron's distributed optimizer lays out its shard,
and bit-for-bit comparison of parameters and states."""

from __future__ import annotations

import torch

from megatron_lowprec.megatron.layout import build_shard_bucket
from megatron_lowprec.optim.buckets import PER_GROUP_PARTS, elements_per_value
from megatron_lowprec.optim.layouts import Layout


def torch_adamw_fp64(initial, grads, groups, betas, eps):
    """``torch.optim.AdamW`` on FP64 copies of ``initial`` stepped with ``grads`` (per step, one
    gradient per parameter); ``groups``: (parameter indices, hyperparameters) per parameter group."""
    params = [torch.nn.Parameter(value.double()) for value in initial]
    optimizer = torch.optim.AdamW(
        [{"params": [params[index] for index in indices], **hyper} for indices, hyper in groups], betas=betas, eps=eps
    )
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.double()
        optimizer.step()
    return [param.detach() for param in params]


def torch_muon_fp32(initial, grads, **hyper):
    """``torch.optim.Muon`` on FP32 copies of the 2-D ``initial`` stepped with ``grads``."""
    params = [torch.nn.Parameter(value.float()) for value in initial]
    optimizer = torch.optim.Muon(params, **hyper)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.float()
        optimizer.step()
    return [param.detach().double() for param in params]


def joined_master(param, remainder):
    """The FP32 master whose upper 16 bits are the BF16 ``param`` and lower 16 bits ``remainder``, by
    integer arithmetic (the remainder is the signed distance from the BF16 value)."""
    upper = param.detach().view(torch.int16).to(torch.int32) << 16
    return (upper + remainder.to(torch.int32)).view(torch.float32)


def represented(param, state) -> torch.Tensor:
    """The value an option's stored tensors represent, in FP64: the FP32 master (whole or as a
    remainder below the parameter), the master of 16 significant bits (an 8-bit residual below the
    parameter: the remainder's bits 8..15, its bits 0..7 zero), the parameter plus its MCF or Kahan
    companion, or the parameter."""
    values = param.detach().reshape(-1)
    if "master" in state:
        return state["master"].reshape(-1).double()
    if "master_remainder" in state:
        return joined_master(values, state["master_remainder"].reshape(-1)).double()
    if "master_residual8" in state:
        return joined_master(values, state["master_residual8"].reshape(-1).to(torch.int32) << 8).double()
    for companion in ("param_lo", "kahan_compensation"):
        if companion in state:
            return values.double() + state[companion].reshape(-1).double()
    return values.double()


RELATIVE_ERROR_PER_STEP = {
    "master": 2**-22, "residual master": 2**-16 + 2**-22, "companion": 2**-14, "parameter": 2**-7,
}
"""How far, relative to the value, each step may move what the stored tensors represent from the
exact update: an FP32 master (an FP32 rounding), a master of 16 significant bits (the BF16 parameter
and an 8-bit residual: the FP32 master's step, then its rounding to nearest on a grid of 16
significant bits, half a step of 2^-15 of the binade, so 2^-16 of the value at most), a 16-bit
parameter with its MCF or Kahan companion (Collage: about 16 more bits), a bare 16-bit parameter (one
BF16 ulp, 2^-7 of the value at most: nearest rounds by half of it, stochastic rounding by less than
one)."""

DIRECTION_ERROR_PER_STEP = {"fp32": 2**-18, "low": 2**-8, "fp8": 2**-3}
"""How far, relative to lr (AdamW) or lr times the update's scale (Muon), each step's update may
move from the reference's through the moments' storage: FP32, BF16 (2^-9 per stored moment, the
second under a square root: 1.5 x 2^-9), FP8 E4M3 (2^-4 per stored moment, scaled per group:
1.5 x 2^-4)."""


def storage_of(strategy) -> str:
    """Which row of :data:`RELATIVE_ERROR_PER_STEP` bounds ``strategy``'s represented value."""
    if strategy.master_weights:
        return "residual master" if strategy.master_storage == "residual8" else "master"
    return "companion" if strategy.param_update in ("mcf", "kahan") else "parameter"


def assert_within_reference(strategy, values, reference, steps, update_size, direction_floor=0.0):
    """``values`` (what the stored tensors represent) within ``steps`` times the storage's and the
    moments' per-step errors of ``reference``; ``update_size``: lr (AdamW) or lr times the update's
    scale (Muon); ``direction_floor``: the direction's error whatever the moments (Muon: BF16
    Newton-Schulz, 2^-6)."""
    direction_error = max(DIRECTION_ERROR_PER_STEP[strategy.moments], direction_floor)
    bound = steps * (RELATIVE_ERROR_PER_STEP[storage_of(strategy)] * reference.abs() + update_size * direction_error)
    excess = (values - reference).abs() - bound
    assert (excess <= 0).all(), f"{strategy.name}: {excess.max().item():.3g} beyond the bound"


def assert_same_bits(params, states, expected_params, expected_states, context=()):
    """Each of ``params`` and each state tensor the bits of ``expected_params``' (uint8 views), and
    each other state value equal."""
    for index, (param, expected) in enumerate(zip(params, expected_params)):
        assert torch.equal(param.view(torch.uint8), expected.view(torch.uint8)), (*context, "parameter", index)
    for index, (state, expected) in enumerate(zip(states, expected_states)):
        assert sorted(state) == sorted(expected), (*context, index)
        for key, value in expected.items():
            if torch.is_tensor(value):
                other = state[key].contiguous()
                assert other.dtype == value.dtype and torch.equal(other.view(torch.uint8), value.contiguous().view(torch.uint8)), (
                    *context, index, key,
                )
            else:
                assert state[key] == value, (*context, index, key)


def part_of_state(state, first, group_size):
    """The state of the elements from ``first`` on of a parameter's flat ``state`` (per-group parts:
    from the group holding ``first``)."""
    return {
        key: value if not torch.is_tensor(value) else (
            value[first // group_size :] if key.endswith(PER_GROUP_PARTS) else value.reshape(-1)[first:]
        )
        for key, value in state.items()
    }


class BufferShard(Layout):
    """The layout source of a distributed optimizer's shard: the range [start, end) of flat parameter
    and gradient buffers that hold the parameters at their storage offsets, built as
    ``megatron/distributed.py`` builds a rank's shard
    (:func:`~megatron_lowprec.megatron.layout.build_shard_bucket`), in place where the starts allow,
    else packed rows."""

    def __init__(self, param_data: torch.Tensor, grad_data: torch.Tensor, start: int) -> None:
        self.param_data, self.grad_data, self.start = param_data, grad_data, start

    def build(self, strategy, param_groups, streams):
        group_of = {param: index for index, group in enumerate(param_groups) for param in group["params"]}
        by_start = sorted(group_of, key=lambda param: param.storage_offset())
        self.runs = [
            (param, max(self.start - param.storage_offset(), 0)) for param in by_start
            if param.storage_offset() + param.numel() > self.start
        ]
        self.sources = [param.storage_offset() + first for param, first in self.runs]
        params = [param for param, _ in self.runs]
        bucket, self.grad = build_shard_bucket(
            strategy, params, [(first, param.numel() - first) for param, first in self.runs], self.sources,
            [group_of[param] for param in params], [streams[param] for param in params], self.param_data, self.grad_data,
            self.start, self.param_data.numel(),
        )
        states = [
            {"step": 0, **{key: bucket.view(value, index, elements_per_value(key, strategy)) for key, value in bucket.state.items()}}
            for index in range(len(params))
        ]
        return [(bucket, states)]

    def bucket_grads(self, bucket):
        return self.grad, [self.grad_data[source : source + numel] for source, numel in zip(self.sources, bucket.numels)]


def in_one_buffer(
    values: list[torch.Tensor], gap: int = 64, megatron: bool = False,
) -> tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]:
    """Parameters of ``values`` that are views of one flat BF16 buffer, that buffer, and the mask of
    its elements outside them. Each parameter after ``gap`` elements of another owner (7.0); with
    ``megatron``, as megatron lays out one rank's shard of its DDP buffer: ``gap`` elements of other
    ranks' shards before and after the parameters, each start padded to 64 elements with zeros."""
    starts, position = [], 0
    for index, value in enumerate(values):
        position = -(-position // 64) * 64 if megatron and index else position + gap
        starts.append(position)
        position += value.numel()
    buffer = torch.full((position + gap,), 7.0, dtype=torch.bfloat16)
    outside = torch.ones(buffer.numel(), dtype=torch.bool)
    if megatron:
        buffer[starts[0] : position] = 0
    params = []
    for start, value in zip(starts, values):
        view = buffer[start : start + value.numel()].view(value.shape)
        view.copy_(value)
        outside[start : start + value.numel()] = False
        param = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
        param.data = view
        params.append(param)
    return params, buffer, outside
