"""One rank of the Megatron-LM 0.16/0.17 call-pattern checks: the stand-in ``megatron.training`` of
``megatron_lm_0_16/`` (megatron-core 0.16's wheel has no ``megatron.training``) with the plugin's
``install()``, whose ``setup_model_and_optimizer`` builds the optimizer as Megatron-LM 0.16 and 0.17
do (``get_megatron_muon_optimizer`` for ``'muon' in config.optimizer``, else
``get_megatron_optimizer``), then one training step.

Launched by ``test_megatron_lm_call_pattern.py`` as ``python _megatron_lm_call_pattern_worker.py
RESULT_DIR SCENARIO JSON``; writes ``RESULT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path

from _cpu_bridge_worker import _seeded_model, _train_step, _transformer_config

from tests.megatron.launch import run_scenario

STAND_IN = Path(__file__).with_name("megatron_lm_0_16")
"""The folder whose ``megatron/training`` stands in for Megatron-LM 0.16's."""


def _model_provider(pre_process=True, post_process=True):
    from megatron.core import parallel_state

    config = _transformer_config(
        tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(), hidden_dropout=0.0, attention_dropout=0.0
    )
    return _seeded_model(config)


def setup_as_megatron_lm_0_16(argv: list[str], megatrons_own_builder: bool) -> dict:
    """``initialize_megatron`` and ``setup_model_and_optimizer`` of the stand-in with the plugin
    installed, then one step; what the plugin printed and, where it stopped the run, its exit code.
    ``megatrons_own_builder``: the stand-in's ``get_megatron_optimizer`` is megatron-core's again after
    ``install()``, as in a Megatron-LM whose ``setup_model_and_optimizer`` builds through a function
    the plugin does not replace."""
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import get_megatron_optimizer

    sys.path.insert(0, str(STAND_IN))
    from megatron.training import initialize, training

    from megatron_lowprec.megatron import megatron_lm, optimizer as lowprec_optimizer

    sys.argv = ["pretrain_gpt.py", *argv]
    megatron_lm.install()
    if megatrons_own_builder:
        training.get_megatron_optimizer = get_megatron_optimizer
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            initialize.initialize_megatron()
            model, optimizer, _ = training.setup_model_and_optimizer(_model_provider, ModelType.encoder_or_decoder)
        except SystemExit as stopped:
            return {"printed": printed.getvalue().splitlines(), "exit": stopped.code}
    model[0].zero_grad_buffer()
    losses = _train_step(model[0], data_seed=3)
    model[0].finish_grad_sync()
    success, grad_norm, _ = optimizer.step()
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return {
        "printed": printed.getvalue().splitlines(),
        "exit": None,
        "optimizer": type(optimizer).__name__,
        "chained": [type(inner.optimizer).__name__ for inner in chained],
        "options": [getattr(getattr(inner.optimizer, "strategy", None), "name", None) for inner in chained],
        "project_optimizer": isinstance(optimizer, (lowprec_optimizer.LowPrecisionOptimizer, lowprec_optimizer.LowPrecisionMuonOptimizer)),
        "stepped": bool(success) and math.isfinite(grad_norm) and all(math.isfinite(loss) for loss in losses),
    }


if __name__ == "__main__":
    run_scenario({"setup_as_megatron_lm_0_16": setup_as_megatron_lm_0_16})
