"""The app's optimizer settings as megatron's ``OptimizerConfig`` (``loop.megatron_optimizer_config``)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hydra") is None or importlib.util.find_spec("megatron.core") is None,
    reason="hydra-core and megatron-core are needed",
)


def _megatron_config(*overrides: str):
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import megatron_optimizer_config

    return megatron_optimizer_config(compose(list(overrides)).optimizer)


def test_muon_preset_takes_megatron_cores_qkv_split_and_tensor_parallel_defaults():
    """``optimizer=muon`` gives megatron-core's own defaults for the fused QKV weight and for tensor
    parallelism (its ``OptimizerConfig``'s), and the same names change them."""
    from megatron.core.optimizer import OptimizerConfig

    stock = OptimizerConfig()
    preset = _megatron_config("optimizer=muon")
    assert preset.optimizer == "muon" and not preset.use_distributed_optimizer
    assert (preset.muon_split_qkv, preset.muon_tp_mode) == (stock.muon_split_qkv, stock.muon_tp_mode) == (True, "blockwise")
    changed = _megatron_config(
        "optimizer=muon", "optimizer.muon_split_qkv=false", "optimizer.muon_tp_mode=duplicated", "optimizer.muon_coefficient_type=quintic"
    )
    assert (changed.muon_split_qkv, changed.muon_tp_mode) == (False, "duplicated")
    assert (preset.muon_coefficient_type, changed.muon_coefficient_type) == ("simple", "quintic")


def test_distributed_is_the_layer_wise_optimizer_for_muon_and_zero1_for_adam():
    """``optimizer.use_distributed_optimizer=true``: megatron's distributed optimizer with AdamW, its layer-wise one
    with Muon (the config field from megatron-core 0.19, ``optimizer="dist_muon"`` before), as
    Megatron-LM's ``--use-distributed-optimizer`` maps them."""
    from megatron.core.optimizer import OptimizerConfig

    adam = _megatron_config("optimizer.use_distributed_optimizer=true")
    assert adam.optimizer == "adam" and adam.use_distributed_optimizer
    muon = _megatron_config("optimizer=muon", "optimizer.use_distributed_optimizer=true")
    assert not muon.use_distributed_optimizer
    if "use_layer_wise_distributed_optimizer" in {field.name for field in dataclasses.fields(OptimizerConfig)}:
        assert muon.optimizer == "muon" and muon.use_layer_wise_distributed_optimizer
    else:
        assert muon.optimizer == "dist_muon"
