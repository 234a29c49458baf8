"""The bytes/param that ``lowprec-train`` reports are the bytes megatron-core and the optimizer allocate.

For every registered option (each of its master storages, and the gradient buffer in its default
and its other format; with Muon in its default; the lean options with companded INT8 moments too), a tiny GPT is built as ``lowprec-train`` builds it
(``train/model.py``, megatron-core's DDP with ``precision.grad_reduce_in_fp32`` resolved by the app's
own rule, the option's optimizer from ``build_optimizer``) in one gloo rank on the CPU bridge. The
storages its parameters, DDP's gradient buffer and the optimizer's state tensors hold, counted each
once, must be the summary's bytes/param (and the plan's, and ``bytes_per_param``'s) times the
parameter count, and building the optimizer must allocate nothing besides its state. Every tensor of
the model is a multiple of 128 elements (whole FP8 groups, no alignment padding), so the two are
equal exactly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_lowprec.optim.strategies import MASTER_STORAGES, available_strategies

from .allocations import kept_allocations

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("hydra") is None,
    reason="megatron-core and hydra-core are needed",
)

MODEL = ["model.hidden_size=128", "model.num_layers=1", "model.seq_length=16", "model.vocab_size=128"]
"""A GPT whose every weight, bias and norm has a multiple of 128 elements."""


def _cases() -> list[tuple[str, str, str | None, bool, str | None]]:
    """(optimizer, option, master storage or None for the option's own, flip the default gradient
    format, moment storage or None for the option's own)."""
    cases = []
    for strategy in available_strategies():
        storages = MASTER_STORAGES if strategy.master_weights else (None,)
        cases += [("adamw", strategy.name, storage, flip, None) for storage in storages for flip in (False, True)]
        cases.append(("muon", strategy.name, None, False, None))
    cases += [("adamw", "sr8", None, False, "int8"), ("adamw", "res8", None, False, "int8"), ("muon", "sr8", None, False, "int8")]
    return cases


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def _state_tensors(megatron_optimizer) -> list[torch.Tensor]:
    """Every state tensor of a precision optimizer built by ``build_optimizer``: per parameter, or per
    shard of megatron's distributed optimizer; Muon's and AdamW's where they are chained."""
    chained = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    tensors = []
    for wrapper in chained:
        if hasattr(wrapper, "state_buckets"):
            tensors += [tensor for bucket in wrapper.state_buckets() for tensor in bucket.state.values()]
        else:
            tensors += [value for state in wrapper.optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return tensors


@pytest.mark.parametrize("optimizer, option, master_storage, flip_gradient_format, moment_storage", _cases())
def test_reported_bytes_per_param_are_the_bytes_megatron_and_the_optimizer_allocate(
    megatron_rank, optimizer, option, master_storage, flip_gradient_format, moment_storage
):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lowprec.megatron.optimizer import build_optimizer
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.config import precision_strategy, reduces_grads_in_fp32
    from megatron_lowprec.train.loop import megatron_optimizer_config
    from megatron_lowprec.train.metrics import allocated_bytes_per_param
    from megatron_lowprec.train.model import gpt_model
    from megatron_lowprec.train.plan import describe

    overrides = [f"precision={option}", f"optimizer={optimizer}", *MODEL]
    if master_storage is not None:
        overrides.append(f"precision.master_storage={master_storage}")
    if moment_storage is not None:
        overrides.append(f"precision.moment_storage={moment_storage}")
    default_fp32 = reduces_grads_in_fp32(compose(overrides).precision)
    if flip_gradient_format:
        overrides.append(f"precision.grad_reduce_in_fp32={str(not default_fp32).lower()}")
    config = compose(overrides)
    fp32_gradients = reduces_grads_in_fp32(config.precision)
    assert fp32_gradients == (default_fp32 != flip_gradient_format)

    module = gpt_model(config, config.model.vocab_size)
    model = DistributedDataParallel(
        config=module.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_gradients),
        module=module,
    )
    strategy = precision_strategy(config.precision)
    built = kept_allocations(
        lambda: build_optimizer(
            strategy.name, [model], megatron_optimizer_config(config.optimizer), fused=False,
            background_compile=False, master_storage=config.precision.master_storage,
            moment_storage=config.precision.moment_storage,
        )
    )
    parameters = list(model.parameters())
    numel = sum(parameter.numel() for parameter in parameters)
    gradient_buffer = _storage_bytes(buffer.grad_data for buffer in model.buffers)
    state = _storage_bytes(_state_tensors(built.result))

    assert gradient_buffer == numel * (4 if fp32_gradients else 2)
    assert all(parameter.dtype == torch.bfloat16 for parameter in parameters)
    held = _storage_bytes(parameters) + gradient_buffer + state
    reported = allocated_bytes_per_param(config, parameters, world_size=1)
    assert held == pytest.approx(reported * numel, rel=1e-12), (held / numel, reported)
    assert state <= built.end <= state + _storage_bytes(parameters)
    if optimizer == "adamw":
        assert reported == strategy.bytes_per_param(grad_reduce_in_fp32=fp32_gradients)
        assert f"{reported:g} bytes/param: 2 parameter + {4 if fp32_gradients else 2} gradient" in describe(config, 1)
