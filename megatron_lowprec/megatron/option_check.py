"""A run is what its flags say: every parameter is stepped by the project's optimizer with the option asked for.

Whichever way the optimizer was built (the Megatron-LM entry's replacements of megatron's
builders, ``lowprec-train``, :func:`~megatron_lowprec.megatron.optimizer.build_optimizer`), the
entry points call :func:`optimizer_in_use` once it is built and before the first iteration: it
walks the (chained) Megatron optimizer down to the torch optimizers that step the parameters, and
either names the option and optimizers in use in one line or stops with one line naming the
parameters that another optimizer steps, the path taken and what to do. It reads only this rank's
optimizer (no collective): under megatron's distributed optimizer the project's sharded AdamW keeps
the model's parameter groups whole, and the layer-wise Muon chain lists every rank's parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_lowprec.optim import AdamW, Muon, get_strategy

PROJECT_STEPPERS = (AdamW, Muon)
"""The torch optimizers of this project that apply a precision option to the parameters they step."""


class OptionNotInUse(RuntimeError):
    """Some parameter is not stepped by the project's optimizer with the option asked for."""


def _leaves(optimizer: Any) -> Iterator[Any]:
    """The unchained Megatron optimizers of ``optimizer`` (itself if it chains none)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
        return
    for inner in chained:
        yield from _leaves(inner)


def _describe(leaf: Any) -> str:
    """A Megatron optimizer by the torch optimizer that steps its parameters: the project's with its
    option, another by its full name."""
    stepper = getattr(leaf, "optimizer", leaf)
    if isinstance(stepper, PROJECT_STEPPERS):
        return f"{type(stepper).__name__} with option {stepper.strategy.name}"
    full_name = f"{type(stepper).__module__}.{type(stepper).__qualname__}"
    return full_name if stepper is leaf else f"{type(leaf).__name__} over {full_name}"


def optimizer_in_use(
    optimizer: Any,
    model_chunks: torch.nn.Module | list[torch.nn.Module],
    option: str | None,
    *,
    asked_by: str,
    path: str,
    remedy: str,
    error: type[Exception] = OptionNotInUse,
) -> str:
    """One line naming the precision option and the optimizers that step the trainable parameters of
    ``model_chunks``; with ``option`` (any of its names) given, ``error`` with one line unless
    each of them is stepped by one of :data:`PROJECT_STEPPERS` with that option. ``asked_by`` says
    where the option was asked for (``--lowprec-option B``), ``path`` how the optimizer was built
    (the megatron-core version and the functions called), ``remedy`` what to do otherwise."""
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    params = list({id(param): param for chunk in chunks for param in chunk.parameters() if param.requires_grad}.values())
    leaves = list(_leaves(optimizer))
    in_use = f"{type(optimizer).__name__}[{' + '.join(dict.fromkeys(map(_describe, leaves)))}]"
    if option is None:
        return f"megatron-lowprec: no precision option; megatron's optimizer {in_use} ({path})"
    option = get_strategy(option).name
    steppers = [getattr(leaf, "optimizer", leaf) for leaf in leaves]
    ours = [
        stepper for stepper in steppers
        if isinstance(stepper, PROJECT_STEPPERS) and stepper.strategy.name == option
    ]
    stepped = {id(param) for stepper in ours for group in stepper.param_groups for param in group["params"]}
    if len(ours) == len(steppers):
        stepped |= {id(param) for rank_params in getattr(optimizer, "params_by_rank", []) for param in rank_params}
    missing = [param for param in params if id(param) not in stepped]
    if missing:
        raise error(
            f"megatron-lowprec: {asked_by} asked for option {option}, but {len(missing)} of the {len(params)} trainable "
            f"parameters are not stepped by the project's optimizer with it: the optimizer is {in_use} ({path}); {remedy}"
        )
    return f"megatron-lowprec: option {option}, optimizer {in_use}, every one of the {len(params)} trainable parameters stepped with {option} ({path})"
