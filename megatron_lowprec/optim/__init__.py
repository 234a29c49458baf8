"""The precision-aware AdamW and Muon (torch.optim API), driven by declarative strategies."""

from megatron_lowprec.optim.adamw import AdamW
from megatron_lowprec.optim.buckets import state_keys
from megatron_lowprec.optim.kernel import adamw_step_, init_state
from megatron_lowprec.optim.muon import Muon, muon_step_
from megatron_lowprec.optim.strategies import (
    PrecisionStrategy,
    available_strategies,
    get_strategy,
    register_strategy,
    strategy_names,
)

__all__ = [
    "AdamW",
    "Muon",
    "PrecisionStrategy",
    "adamw_step_",
    "available_strategies",
    "get_strategy",
    "init_state",
    "muon_step_",
    "register_strategy",
    "state_keys",
    "strategy_names",
]
