"""The Megatron-LM entry at megatron-core 0.16's call pattern, where the wheel lacks Megatron-LM's
``megatron.training``: a stand-in of it (``megatron_lm_0_16/``) whose ``setup_model_and_optimizer``
calls megatron-core's ``get_megatron_muon_optimizer`` for ``'muon' in config.optimizer`` and
``get_megatron_optimizer`` otherwise, looked up in its ``training`` module as Megatron-LM 0.16 and
0.17 do, with the plugin installed; at DP=1 and TP=2, on CPU. Where the real ``megatron.training``
is installed (megatron-core 0.17+), ``test_megatron_lm.py`` runs Megatron-LM's own instead."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from megatron_lowprec.megatron import compat, megatron_lm

from .launch import run_ranks

WORKER = Path(__file__).with_name("_megatron_lm_call_pattern_worker.py")
MEGATRON_CORE = compat.megatron_core_version()

without_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is not None,
    reason="Megatron-LM's own megatron.training is installed: test_megatron_lm.py runs it",
)


def _setup(tmp_path: Path, world_size: int, argv: list[str], megatrons_own_builder: bool = False) -> list[dict]:
    arguments = {"argv": ["--bf16", "--lr", "1e-3", "--seed", "5", "--no-lowprec-fused", *argv],
                 "megatrons_own_builder": megatrons_own_builder}
    return run_ranks(WORKER, tmp_path, world_size, "setup_as_megatron_lm_0_16", json.dumps(arguments), timeout_seconds=300)


@without_megatron_training
@pytest.mark.parametrize("optimizer, chained", [("adam", ["AdamW"]), ("muon", ["Muon", "AdamW"])], ids=["adam", "muon"])
@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["dp1", "tp2"])
def test_setup_model_and_optimizer_of_0_16_builds_the_option(tmp_path, optimizer, chained, tensor_parallel):
    """``--optimizer adam`` and ``--optimizer muon`` with ``--lowprec-option B``: the project's AdamW,
    or its Muon chained with its AdamW, with option B on every rank, without emerging-optimizers;
    the plugin's first line names what was asked, its line after the build what is in use, and a step trains."""
    ranks = _setup(tmp_path, tensor_parallel, ["--optimizer", optimizer, "--lowprec-option", "B",
                                               "--tensor-model-parallel-size", str(tensor_parallel)])
    for rank, result in enumerate(ranks):
        assert result["exit"] is None
        assert result["project_optimizer"] and result["chained"] == chained and result["options"] == ["B"] * len(chained)
        assert result["stepped"]
        if rank == 0:
            assert result["printed"][0].startswith(f"megatron-lowprec: option B with --optimizer {optimizer}: the project's")
            stepped_by = " + ".join(f"{name} with option B" for name in chained)
            assert result["printed"][1].startswith(f"megatron-lowprec: option B, optimizer {result['optimizer']}[{stepped_by}], every one of")
            builder = "get_megatron_muon_optimizer" if optimizer == "muon" else "get_megatron_optimizer"
            assert f"megatron-core {MEGATRON_CORE}" in result["printed"][1] and f"the plugin's {builder}" in result["printed"][1]
        else:
            assert result["printed"] == []


@without_megatron_training
def test_dist_muon_of_0_16_is_the_layer_wise_muon_of_the_option(tmp_path):
    """``--optimizer dist_muon``, which 0.16 passes to ``get_megatron_muon_optimizer`` as
    ``layer_wise_distributed_optimizer``, at DP=2: the project's layer-wise distributed Muon with option B."""
    for result in _setup(tmp_path, 2, ["--optimizer", "dist_muon", "--lowprec-option", "B"]):
        assert (result["optimizer"], result["chained"], result["options"]) == (
            "LayerWiseLowPrecisionMuonOptimizer", ["Muon", "AdamW"], ["B", "B"])
        assert result["stepped"]


@without_megatron_training
def test_an_optimizer_the_plugin_did_not_build_stops_the_run_in_one_line(tmp_path):
    """A ``setup_model_and_optimizer`` that builds through a function the plugin does not replace
    (megatron-core's own ``get_megatron_optimizer``) stops before the first step: rank 0 says, in
    one line, the megatron-core version, the path taken, what steps the parameters and what to do."""
    ranks = _setup(tmp_path, 1, ["--optimizer", "adam", "--lowprec-option", "B"], megatrons_own_builder=True)
    message = ranks[0]["exit"]
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("megatron-lowprec: --lowprec-option asked for option B, but ")
    assert f"megatron-core {MEGATRON_CORE}, Megatron-LM's setup_model_and_optimizer with --optimizer adam through none of" in message
    assert "the optimizer is ChainedOptimizer[Float16OptimizerWithFloat16Params over torch.optim." in message
    assert message.endswith("or build the optimizer with megatron_lowprec.megatron.optimizer.build_optimizer")


def _megatron_lm_parse_args(argv: list[str]):
    """A Megatron-LM ``parse_args`` over ``argv`` with the two flags at stake, with the plugin's arguments."""

    def parse_args(extra_args_provider=None):
        parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
        parser.add_argument("--optimizer", default="adam")
        parser.add_argument("--use-distributed-optimizer", action="store_true")
        return extra_args_provider(parser).parse_args(argv)

    return megatron_lm._with_precision_arguments(parse_args)


@pytest.mark.parametrize("optimizer", ["muon", "dist_muon"])
def test_muon_with_megatrons_distributed_optimizer_is_refused_in_one_line_where_megatron_lm_refuses_it(
    monkeypatch, capsys, optimizer
):
    """Megatron-LM before megatron-core 0.18 refuses ``--optimizer muon --use-distributed-optimizer``
    (and ``dist_muon``): with ``--lowprec-option``, one line naming ``--optimizer dist_muon`` instead of
    its assertion; from 0.18 the pair passes; without ``--lowprec-option`` it is Megatron-LM's to judge."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(megatron_lm, "_PRINTED", set())
    flags = ["--optimizer", optimizer, "--use-distributed-optimizer"]
    assert _megatron_lm_parse_args(flags)().lowprec_option is None
    assert capsys.readouterr().out == f"megatron-lowprec: no --lowprec-option; megatron's own optimizer (--optimizer {optimizer})\n"
    parse_args = _megatron_lm_parse_args([*flags, "--lowprec-option", "B"])
    if MEGATRON_CORE >= megatron_lm.MUON_WITH_DISTRIBUTED_OPTIMIZER:
        assert parse_args().lowprec_option == "B"
        return
    with pytest.raises(SystemExit) as stopped:
        parse_args()
    assert stopped.value.code == (
        f"megatron-lowprec: Megatron-LM at megatron-core {MEGATRON_CORE} refuses --optimizer {optimizer} with "
        "--use-distributed-optimizer; to shard option B's Muon over the data-parallel ranks use --optimizer dist_muon "
        "without --use-distributed-optimizer (the layer-wise distributed optimizer: each matrix and its state on one "
        "rank), or megatron-core 0.18+"
    )
