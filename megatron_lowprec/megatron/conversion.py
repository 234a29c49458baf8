"""Another option's optimizer state loaded into this package's Megatron optimizers, carried by its meaning.

The plain optimizer, the distributed one and each optimizer of the Muon chain load what
``dist_checkpointing`` read for them: per parameter, its states in checkpoint form
(:mod:`~megatron_lowprec.megatron.checkpoint_state`) and the ``lowprec`` section that names the
option that saved them. A state of another option, of megatron-core's own optimizer (its common part
under :data:`~megatron_lowprec.megatron.torch_dist.STOCK_FORM_KEY`), or of this option with its 8-bit
moments stored in another form is converted into the optimizer's option where it was built with
``convert_checkpoint=True`` (:func:`convert_saved_otherwise_`, through
:func:`~megatron_lowprec.optim.convert.convert_entry`), else refused in one line naming the setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_lowprec.megatron.checkpoint_state import checkpoint_state
from megatron_lowprec.megatron.torch_dist import DISTRIBUTED_FORM_KEY, STOCK_FORM_KEY, stock_step
from megatron_lowprec.optim.convert import (
    STOCK, ConversionReport, KindReport, as_shaped_like, convert_entry, resolve_target, with_saved_exponent_storage,
)
from megatron_lowprec.optim.strategies import (
    STORAGE_RECORDS, PrecisionStrategy, check_exponent_storage, exponent_storage_record, stores_other_exponents,
)

CONVERT_REMEDY = "build_optimizer(..., convert_checkpoint=True) converts it"
"""What a state dict of another option, or of another FP8 exponent storage, takes to load."""


@torch.no_grad()
def convert_loaded_state_(
    state_dict: dict, params: list[torch.nn.Parameter], source: PrecisionStrategy, target: PrecisionStrategy,
    source_label: str | None = None,
) -> ConversionReport:
    """Carry an optimizer state dict of ``source`` (either form: a :meth:`LowPrecisionOptimizer.state_dict`
    or what ``dist_checkpointing`` loaded) into ``target``'s checkpoint form in place, and ``params``
    (indexed as the state dict's entries, holding the saved model's values) with it
    (:func:`~megatron_lowprec.optim.convert.convert_entry`); the ``lowprec`` section then names
    ``target``. The report says per state kind what was converted and its largest error, naming the
    source ``source_label`` (default: its option)."""
    report = ConversionReport(source, target, source_label)
    for index, entry in state_dict["state"].items():
        if index == "common_step" or not any(torch.is_tensor(value) for value in entry.values()):
            continue
        param = params[index]
        new_param, new_state, errors = convert_entry(source, target, param.detach(), entry)
        report.add(param, errors)
        tensors = {key: value.reshape(-1) for key, value in new_state.items() if torch.is_tensor(value)}
        form = checkpoint_state(tensors, param.numel(), target, param=new_param.reshape(-1))
        state_dict["state"][index] = {
            **{key: value for key, value in entry.items() if not torch.is_tensor(value)},
            **{key: value.view(param.shape) for key, value in form.items()},
        }
        param.copy_(new_param)
    extra = state_dict.setdefault("lowprec", {})
    for key in STORAGE_RECORDS:
        extra.pop(key, None)
    extra.update(option=target.name, master_storage=target.master_storage, **exponent_storage_record(target))
    return report


def convert_saved_otherwise_(
    state_dict: dict, params: list[torch.nn.Parameter], strategy: PrecisionStrategy, convert_checkpoint: bool,
    own_common_state: Callable[[], dict[str, Any]],
) -> ConversionReport | None:
    """Where ``state_dict`` (what ``dist_checkpointing`` loaded, or a state dict) was saved with
    another option than ``strategy``'s, by megatron-core's own optimizer, or with its 8-bit moments in
    another form: with ``convert_checkpoint``, converted in place into ``strategy``'s checkpoint form
    (``params``, indexed as its entries and holding the saved model's values, with it: load the model
    first) and the report returned; without, ``ValueError`` in one line naming the setting. A state of
    megatron-core's own optimizer takes its step from its torch state and ``own_common_state()``'s
    parameter groups (their learning rates are the scheduler's) and ``lowprec`` section. ``None``
    where the state is ``strategy``'s own."""
    from_stock = STOCK_FORM_KEY in state_dict
    extra = {} if from_stock else state_dict.get("lowprec") or {}
    saved_option = STOCK if from_stock else extra.get("option")
    if saved_option is None or (saved_option == strategy.name and not stores_other_exponents(extra, strategy)):
        return None
    if not convert_checkpoint:
        if saved_option == strategy.name:
            check_exponent_storage(extra, strategy, CONVERT_REMEDY)
        raise ValueError(
            f"the optimizer state was saved with option {saved_option!r}, this optimizer runs "
            f"{strategy.name!r}; {CONVERT_REMEDY}"
        )
    if from_stock:
        stock = state_dict.pop(STOCK_FORM_KEY)
        state_dict.pop(DISTRIBUTED_FORM_KEY, None)
        state_dict.setdefault("state", {})["common_step"] = stock_step(stock)
        state_dict.update(own_common_state())
    source = as_shaped_like(with_saved_exponent_storage(resolve_target(saved_option), extra), strategy)
    return convert_loaded_state_(state_dict, params, source, strategy, saved_option)


def agreed_over(report: ConversionReport, elements: int, group: torch.distributed.ProcessGroup) -> ConversionReport:
    """``report`` of this rank's conversion over the ranks of ``group`` (collective), where each rank
    converted its own share of the parameters (``elements`` of them): per state kind the ranks'
    elements summed and the largest error of any rank."""
    kinds = {kind: (found.source_format, found.target_format, found.largest_error) for kind, found in report.kinds.items()}
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, (elements, kinds), group=group)
    merged: dict[str, KindReport] = {}
    for rank_elements, rank_kinds in gathered:
        for kind, (source_format, target_format, error) in rank_kinds.items():
            found = merged.setdefault(kind, KindReport(kind, source_format, target_format))
            found.elements += rank_elements
            found.largest_error = max(found.largest_error, error)
    report.kinds = merged
    return report


def say_conversion(lines: list[str], label: str | None = None) -> None:
    """The report's ``lines`` on rank 0, each after ``label`` (the optimizer of a chain) where given."""
    if torch.distributed.get_rank() == 0:
        for line in lines:
            print(f"megatron-lowprec: {f'{label}: ' if label else ''}{line}", flush=True)
