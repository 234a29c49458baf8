"""The precision-aware AdamW family (torch.optim API), driven by declarative strategies."""

from megatron_lowprec.optim.adamw import AdamW, adamw_step_, init_state, state_keys
from megatron_lowprec.optim.strategies import (
    PrecisionStrategy,
    available_strategies,
    get_strategy,
    register_strategy,
    strategy_names,
)

__all__ = [
    "AdamW",
    "PrecisionStrategy",
    "adamw_step_",
    "available_strategies",
    "get_strategy",
    "init_state",
    "register_strategy",
    "state_keys",
    "strategy_names",
]
