"""The option lists of the tests, read from the registry (``optim/strategies.py``), never written out:
a newly registered option joins every test that takes these lists."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from megatron_lowprec.optim import available_strategies, get_strategy
from megatron_lowprec.optim.strategies import PrecisionStrategy

OPTIONS = [strategy.name for strategy in available_strategies()]
"""Every registered option, by its canonical name."""

MASTER_OPTIONS = [strategy.name for strategy in available_strategies() if strategy.master_weights]
"""The options that keep an FP32 master."""

OTHER_MASTER_STORAGES = [
    f"{strategy.name}:{'remainder' if strategy.master_storage == 'fp32' else 'fp32'}"
    for strategy in available_strategies() if strategy.master_weights
]
"""Each option with an FP32 master, its master in the other storage (NAME:MASTER_STORAGE): a
remainder below the BF16 parameter, or a whole FP32 tensor."""


def strategy_of(option: str) -> PrecisionStrategy:
    """The strategy of ``option``: a name, or NAME:MASTER_STORAGE."""
    name, _, master_storage = option.partition(":")
    strategy = get_strategy(name)
    return strategy.with_master_storage(master_storage) if master_storage else strategy


def one_per_kind(options: list[str], kind: Callable[[PrecisionStrategy], Hashable | None]) -> list[str]:
    """The first of ``options`` of each distinct ``kind(strategy)``, ``None`` kinds left out: the
    options a costly test needs to reach each code path once."""
    chosen: dict = {}
    for option in options:
        key = kind(strategy_of(option))
        if key is not None:
            chosen.setdefault(key, option)
    return list(chosen.values())


def layout_kind(strategy: PrecisionStrategy) -> tuple[bool, bool, bool] | None:
    """How a step over elements left in megatron's buffer differs from a flat one: stochastic
    rounding's row grids, FP8 groups, a remainder master read below the parameter buffer; ``None``
    for a flat one."""
    kind = (strategy.param_update == "stochastic", strategy.moments == "fp8",
            strategy.master_weights and strategy.master_storage != "fp32")
    return kind if any(kind) else None


def one_per_feature(options: list[str], features: Callable[[PrecisionStrategy], set[Hashable]]) -> list[str]:
    """Few of ``options`` that together hold every feature that any of them holds (``features(strategy)``),
    chosen greedily: the first option that holds the most features not yet held, until none is left
    (in ``options``' order). For a costly test that needs each code path once but not each
    combination of them: an option that combines two features counts for both."""
    held = {option: set(features(strategy_of(option))) for option in options}
    chosen: list[str] = []
    missing = set().union(*held.values())
    while missing:
        best = max(options, key=lambda option: len(held[option] & missing))
        chosen.append(best)
        missing -= held[best]
    return [option for option in options if option in chosen]

