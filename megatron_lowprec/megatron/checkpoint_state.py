"""Optimizer state in checkpoint form: one value per parameter element for every state.

``dist_checkpointing`` reshards tensors that follow their parameter's shape. Most states do; COAT's
FP8 moments keep a float8 payload per element but a scale (and an expansion exponent k) per group
of the parameter's flattened elements (companded INT8 moments: an int8 or uint8 payload and a scale), and how a tensor-parallel or data-parallel shard cuts those
groups depends on the layout. In checkpoint form each element carries its payload (as uint8, which
every checkpoint backend stores) and its group's scale and k. Restored at a layout whose groups
hold elements of one saved group each, the payload, scale and k come back exactly, so the moments'
values are unchanged; a group that gathers elements of several saved groups (another TP layout
with rows that are not whole groups) is decoded in checkpoint form (the moment codec with groups of
one element) and encoded afresh (COAT §3) by the moment codec.

An FP32 master is saved as the FP32 master under ``master`` whichever its storage: a master stored
as the BF16 parameter plus an int16 remainder (``master_storage="remainder"``) or an int8 residual
(``"residual8"``) is joined with the parameter when saving and split back into both when loading.
So a checkpoint is the same for either storage, loads into another, and reshards like any
per-element state.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_lowprec.optim.buckets import PER_GROUP_PARTS, state_dtypes
from megatron_lowprec.optim.codecs import MASTER_CODECS
from megatron_lowprec.optim.master import MASTER_KEYS, master_value, store_master_
from megatron_lowprec.optim.strategies import PrecisionStrategy

SPLIT_MASTER_KEYS = tuple(codec.key for codec in MASTER_CODECS.values() if codec.below_bf16)
"""The state keys of masters stored below the BF16 parameter, saved joined as the FP32 master."""


def checkpoint_state(
    state: dict[str, torch.Tensor],
    numel: int,
    strategy: PrecisionStrategy,
    is_loading: bool = False,
    param: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Each state of a run of ``numel`` flattened parameter elements (``state``: per-element
    tensors of ``numel`` values, per-group FP8 parts of one value per group) as a flat tensor of
    ``numel`` values: per-element states as they are (views), FP8 payloads as uint8, per-group
    parts repeated over their group's elements, a master's remainder joined with ``param`` (the
    run's 16-bit parameters) into the FP32 master. ``is_loading``: empty tensors to load into."""
    result = {}
    for key, value in state.items():
        if key in SPLIT_MASTER_KEYS:
            result[MASTER_KEYS["fp32"]] = (
                torch.empty(numel, dtype=torch.float32, device=value.device)
                if is_loading
                else master_value(_flat_param(param, numel), value.reshape(-1))
            )
        elif key.endswith(PER_GROUP_PARTS):
            result[key] = (
                torch.empty(numel, dtype=value.dtype, device=value.device)
                if is_loading
                else value.repeat_interleave(strategy.moment_codec.elements_per_value(key))[:numel]
            )
        elif key.endswith("_payload"):
            result[key] = value.reshape(-1).view(torch.uint8)
        else:
            result[key] = value.reshape(-1)
    return result


def checkpoint_dtypes(strategy: PrecisionStrategy, param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each tensor :func:`checkpoint_state` returns for ``strategy`` with 16-bit
    parameters of ``param_dtype``: FP8 payloads as uint8, a remainder master as the FP32 master."""
    dtypes = {}
    for key, dtype in state_dtypes(strategy, param_dtype).items():
        if key in SPLIT_MASTER_KEYS:
            dtypes[MASTER_KEYS["fp32"]] = torch.float32
        else:
            dtypes[key] = torch.uint8 if dtype.itemsize == 1 else dtype
    return dtypes


def _groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``values`` as [groups, group_size], the last group padded with its own last value."""
    values = values.reshape(-1)
    groups = math.ceil(values.numel() / group_size)
    padding = groups * group_size - values.numel()
    return torch.cat([values, values[-1:].expand(padding)]).view(groups, group_size)


def _flat_param(param: torch.Tensor | None, numel: int) -> torch.Tensor:
    """The run's 16-bit parameters as a flat view; ``ValueError`` if the caller gave none."""
    if param is None or param.numel() != numel:
        found = None if param is None else param.numel()
        raise ValueError(
            f"a master stored as a remainder is saved and loaded with its parameters: pass param= ({numel} "
            f"elements), got {found}"
        )
    return param.detach().view(-1)


def restore_checkpoint_state(
    state: dict[str, torch.Tensor],
    loaded: dict[str, torch.Tensor],
    numel: int,
    strategy: PrecisionStrategy,
    param: torch.Tensor | None = None,
) -> None:
    """Write ``loaded`` (:func:`checkpoint_state` form) into ``state`` in place (see the module
    docstring); a master stored as a remainder is split into it and ``param`` (the run's 16-bit
    parameters, written too)."""
    for key, value in state.items():
        if key in SPLIT_MASTER_KEYS:
            store_master_(_flat_param(param, numel), value.view(-1), loaded[MASTER_KEYS["fp32"]].reshape(-1))
        elif not key.endswith((*PER_GROUP_PARTS, "_payload")):
            value.copy_(loaded[key].reshape(value.shape))
    codec = strategy.moment_codec
    if not codec.grouped:
        return
    group_size = codec.group_size
    per_element = dataclasses.replace(codec, size=1)
    for moment in strategy.moment_names:
        payload = state[f"{moment}_payload"]
        saved_payload = loaded[f"{moment}_payload"].reshape(-1).view(payload.dtype)
        parts = [key for key in codec.keys(moment) if key.endswith(PER_GROUP_PARTS)]
        grouped = {part: _groups(loaded[part].reshape(-1), group_size) for part in parts}
        whole = torch.stack([(values == values[:, :1]).all(dim=1) for values in grouped.values()]).all(dim=0)
        if not bool(whole.all()):
            saved = {f"{moment}_payload": saved_payload, **{part: loaded[part].reshape(-1) for part in parts}}
            codec.encode_(state, moment, per_element.decode(saved, moment, torch.Size([numel])), check_finite=True)
        payload_groups = _groups(payload.view(torch.uint8), group_size)
        payload_groups[whole] = _groups(saved_payload.view(torch.uint8), group_size)[whole]
        payload.view(torch.uint8).copy_(payload_groups.reshape(-1)[:numel])
        for part, values in grouped.items():
            state[part][whole] = values[whole, 0]
