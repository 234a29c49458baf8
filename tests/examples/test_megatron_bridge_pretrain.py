"""The Megatron-Bridge recipe of examples/megatron_bridge_pretrain.py saves a configuration that
Bridge's ``ConfigContainer.from_yaml`` reloads with our optimizer config, after the one call the
README gives. Runs only where Megatron-Bridge is importable (it is not part of the CI install)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import yaml

bridge_config = pytest.importorskip("megatron.bridge.training.config", reason="Megatron-Bridge is not importable")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_bridge_pretrain.py"
TARGET = "megatron_lowprec.megatron.optimizer.LowPrecisionOptimizerConfig"


def load_example():
    spec = importlib.util.spec_from_file_location("megatron_bridge_pretrain", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_saved_config_reloads_with_the_optimizer_config_after_allowing_it(tmp_path):
    from megatron.training.config import target_allowlist
    from megatron.training.config.instantiate_utils import InstantiationException

    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    config = load_example().recipe("coat", str(tmp_path), train_iters=4)
    config.optimizer.lowprec_master_storage = "remainder"
    config.optimizer.lowprec_seed = 7
    path = tmp_path / "run_config.yaml"
    config.to_yaml(str(path))
    assert yaml.safe_load(path.read_text())["optimizer"]["_target_"] == TARGET

    if not target_allowlist.is_allowed(TARGET):
        with pytest.raises(InstantiationException, match="allowlist"):
            bridge_config.ConfigContainer.from_yaml(str(path))
    target_allowlist.add_exact(TARGET)  # the README's call
    reloaded = bridge_config.ConfigContainer.from_yaml(str(path)).optimizer

    assert type(reloaded) is LowPrecisionOptimizerConfig
    for field in dataclasses.fields(LowPrecisionOptimizerConfig):
        assert getattr(reloaded, field.name) == getattr(config.optimizer, field.name), field.name
    assert (reloaded.lowprec_option, reloaded.lowprec_master_storage, reloaded.lowprec_seed) == ("coat", "remainder", 7)
