"""The Megatron-LM entry (``megatron_lowprec.megatron.megatron_lm``): the ``--lowprec-*`` arguments,
the model-build hook on each version's ``setup_model_and_optimizer`` signature, and, where
megatron-core ships Megatron-LM's ``megatron.training`` (0.17+), megatron's own argument parsing,
``initialize_megatron`` and ``setup_model_and_optimizer`` with the plugin installed, at DP=2 on CPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import warnings
from pathlib import Path

import pytest

from megatron_lowprec.megatron import megatron_lm

from .launch import run_ranks

WORKER = Path(__file__).with_name("_megatron_lm_worker.py")
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--train-iters", "10", "--lr-warmup-iters", "1", "--bf16",
    "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--seed", "7", "--no-lowprec-background-compile", "--no-gradient-accumulation-fusion",
]
"""``--no-gradient-accumulation-fusion``: on GPUs Megatron-LM's linear layers otherwise need apex's
``fused_weight_gradient_mlp_cuda`` and refuse to build without it (the CPU trial adds the flag itself;
the two one-rank tests below failed on an H200 without apex, their output lost, most likely so)."""

requires_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training (Megatron-LM's training loop, in the megatron-core package from 0.17) is not installed",
)


UNCOMPILED = ["--no-lowprec-fused"]
"""For runs whose subject is not the compiled step: the same bits (tests/optim/test_fused.py), without
each rank compiling each option's step (tens of CPU-seconds apiece on CI's 2 cores)."""


def _run(tmp_path: Path, world_size: int, argv: list[str], steps: int = 2) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    arguments = {"argv": [*TINY_GPT, "--global-batch-size", str(2 * world_size), *argv], "steps": steps}
    return run_ranks(WORKER, tmp_path, world_size, "pretrain_routing", json.dumps(arguments), timeout_seconds=300)


def test_arguments_parse_into_the_configs_fields():
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([
        "--lowprec-option", "sr", "--lowprec-seed", "3", "--no-lowprec-shared-randomness", "--no-lowprec-fused",
        "--no-lowprec-background-compile", "--lowprec-track-update-quality", "--lowprec-master-storage", "remainder",
        "--lowprec-moment-storage", "int8", "--lowprec-emulate", "E8M5", "--lowprec-emulate-rounding", "stochastic",
        "--lowprec-layers-exclude", "output_layer", "linear_fc2",
    ])
    assert megatron_lm.precision_settings(args) == {
        "lowprec_option": "sr", "lowprec_seed": 3, "lowprec_shared_randomness": False, "lowprec_fused": False,
        "lowprec_background_compile": False, "lowprec_track_update_quality": True, "lowprec_master_storage": "remainder",
        "lowprec_convert_checkpoint": False,
        "lowprec_moment_storage": "int8",
    }
    assert (args.lowprec_emulate, args.lowprec_emulate_rounding, args.lowprec_layers_exclude) == (
        "E8M5", "stochastic", ["output_layer", "linear_fc2"])
    defaults = parser.parse_args([])
    defaults.seed = 1234
    assert megatron_lm.precision_settings(defaults)["lowprec_seed"] == 1234
    assert defaults.lowprec_option is None and defaults.lowprec_fp8_layers is None
    assert defaults.lowprec_background_compile is True


@pytest.mark.parametrize(
    "earlier, current",
    [
        ("--lowprec-no-shared-randomness", "--no-lowprec-shared-randomness"),
        ("--lowprec-emulate-no-clamp-outer-range", "--no-lowprec-emulate-clamp-outer-range"),
        ("--lowprec-emulate-no-clamp-inner-range", "--no-lowprec-emulate-clamp-inner-range"),
    ],
)
def test_an_earlier_flag_spelling_sets_what_the_current_one_sets_with_one_warning(earlier, current):
    """The negations once spelt ``--lowprec-no-KEY`` are ``--no-lowprec-KEY`` (argparse's and
    Megatron-LM's spelling): the earlier one still parses to the same arguments, with one warning
    naming both, and is not in ``--help``; the current one warns nothing."""
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        earlier_args = parser.parse_args([earlier])
    assert [str(warning.message) for warning in caught] == [f"{earlier} is deprecated; use {current}"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parser.parse_args([current]) == earlier_args != parser.parse_args([])
    assert current in parser.format_help() and earlier not in parser.format_help()


def test_options_by_any_name_and_an_unknown_one_refused_with_the_valid_ones(capsys):
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--lowprec-option", "collage_plus"]).lowprec_option == "C"
    assert parser.parse_args(["--lowprec-option", "d-mw"]).lowprec_option == "D-MW"
    with pytest.raises(SystemExit):
        parser.parse_args(["--lowprec-option", "E"])
    assert "unknown precision option 'E'; valid options: A, bf16, B" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lowprec-option", "E"], "argument --lowprec-option: unknown precision option 'E'; valid options: A, bf16, B"),
    (["--lowprec-seed", "x"], "argument --lowprec-seed: invalid int value: 'x'"),
    (["--lowprec-emulate", "X9"], "argument --lowprec-emulate: unknown float format 'X9'; valid names: bf16"),
    (["--lowprec-emulate-rounding", "up"], "argument --lowprec-emulate-rounding: invalid choice: 'up' (choose from"),
    (["--lowprec-option"], "argument --lowprec-option: expected one argument"),
], ids=["option", "seed", "emulate", "rounding", "missing"])
def test_a_bad_value_of_our_flags_stops_with_one_line_and_exit_2(capsys, argv, message):
    """Megatron-LM's parser holds hundreds of arguments: their usage must not bury the one line."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    for number in range(50):
        parser.add_argument(f"--megatron-flag-{number}", type=int)
    megatron_lm.add_arguments(parser)
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["--megatron-flag-1", "3", *argv])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt.py: error: {message}")
    with pytest.raises(SystemExit):
        parser.parse_args(["--megatron-flag-1", "x"])
    assert "usage: pretrain_gpt.py" in capsys.readouterr().err, "megatron's own flags keep argparse's usage"


@requires_megatron_training
def test_megatron_lms_parser_refuses_a_bad_option_in_one_line(capsys, monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--lowprec-option", "E"])
    with pytest.raises(SystemExit) as stopped:
        parse_args(extra_args_provider=megatron_lm.add_arguments)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: error: argument --lowprec-option: unknown precision option 'E'; "
        f"valid options: {', '.join(megatron_lm.strategy_names())}"
    ]


@pytest.mark.parametrize("newer", [False, True], ids=["until-0.18", "0.19"])
def test_the_model_hook_sees_the_built_chunks_on_both_signatures(newer):
    """Until 0.18 ``setup_model_and_optimizer(model_provider_func, model_type, ...)`` builds through the
    provider; 0.19 takes the model type first and, from a config container, builds with the model
    config's ``pre_wrap_hooks``."""
    from types import SimpleNamespace

    from megatron_lowprec.megatron import compat

    seen = []
    if newer:
        def setup(model_type, model_provider_func=None, checkpointing_context=None, *, cfg_container=None, pg_collection=None):
            chunks = ["chunk0", "chunk1"]
            for hook in cfg_container.model.pre_wrap_hooks:
                chunks = hook(chunks)
            return chunks

        container = SimpleNamespace(model=SimpleNamespace(pre_wrap_hooks=[]))
        built = compat.add_model_hook(setup, seen.append)("encoder_or_decoder", cfg_container=container)
    else:
        def setup(model_provider_func, model_type, checkpointing_context=None):
            return [model_provider_func(pre_process=True, post_process=True)]

        built = compat.add_model_hook(setup, seen.append)(lambda **kwargs: "chunk0", "encoder_or_decoder")
    assert seen == [built]


def test_the_launcher_names_what_is_missing():
    with pytest.raises(SystemExit, match="usage: lowprec-megatron-lm PRETRAIN_SCRIPT"):
        megatron_lm.main([])
    with pytest.raises(SystemExit, match="no script"):
        megatron_lm.main(["/nonexistent/pretrain_gpt.py"])


@requires_megatron_training
def test_megatron_lm_builds_coat_with_the_distributed_optimizer(tmp_path):
    """``--lowprec-option coat --use-distributed-optimizer`` through megatron's ``parse_args``,
    ``initialize_megatron`` and ``setup_model_and_optimizer`` (DP=2): the sharded precision optimizer
    with the SR seed of ``--seed``, COAT's FP8 linears in the model, biases and norms without weight
    decay, finite losses (uncompiled steps)."""
    for rank in _run(tmp_path, 2, ["--lowprec-option", "coat", "--use-distributed-optimizer", *UNCOMPILED]):
        assert rank["lowprec_option"] == "coat" and rank["option"] == "coat"
        assert rank["optimizer"] == "DistributedLowPrecisionOptimizer"
        assert rank["seed"] == 7
        assert rank["fp8_linears"] > 0 and rank["emulated_linears"] == 0
        assert rank["weight_decays"] == [0.0, 0.1]
        assert rank["losses_finite"]


@requires_megatron_training
def test_megatron_lm_builds_an_emulated_model_and_without_the_flag_megatrons_optimizer(tmp_path):
    emulated = _run(tmp_path / "emulated", 1, ["--lowprec-option", "C", "--lowprec-emulate", "E8M5", "--lowprec-seed", "3", *UNCOMPILED])[0]
    assert (emulated["optimizer"], emulated["option"], emulated["seed"]) == ("LowPrecisionOptimizer", "C", 3)
    assert emulated["emulated_linears"] > 0 and emulated["fp8_linears"] == 0
    assert emulated["plugin_lines"][0] == "megatron-lowprec: option C with --optimizer adam: the project's AdamW with option C"
    stock = _run(tmp_path / "stock", 1, [])[0]
    assert stock["lowprec_option"] is None and stock["option"] is None
    assert stock["optimizer"] in ("Float16OptimizerWithFloat16Params", "ChainedOptimizer")
    assert stock["losses_finite"]
    assert stock["plugin_lines"][0] == "megatron-lowprec: no --lowprec-option; megatron's own optimizer (--optimizer adam)"
    assert stock["plugin_lines"][1].startswith(f"megatron-lowprec: no precision option; megatron's optimizer {stock['optimizer']}[")


@requires_megatron_training
def test_megatron_lm_builds_muon_with_its_own_muon_flags_and_the_option(tmp_path):
    """``--optimizer muon --lowprec-option sr`` with Megatron-LM's ``--muon-*`` flags: our Muon for the
    2-D weights that megatron-core's Muon takes (the transformer layers' and, untagged as embedding
    there, the learned position embeddings), with each flag's value, chained with AdamW for the
    rest, its fused QKV weights split into query, key and value rows (Megatron-LM's default); the
    iterations train (finite losses, none skipped)."""
    rank = _run(tmp_path, 1, [
        "--optimizer", "muon", "--lowprec-option", "sr", "--muon-nesterov",
        "--muon-momentum", "0.9", "--muon-scale-mode", "shape_scaling", "--muon-num-ns-steps", "4",
        "--muon-extra-scale-factor", "0.5",
    ])[0]
    assert (rank["optimizer"], rank["chained"], rank["option"]) == ("LowPrecisionMuonOptimizer", ["Muon", "AdamW"], "sr")
    assert rank["muon_group"] == {"momentum": 0.9, "nesterov": True, "ns_steps": 4, "scale_mode": "shape_scaling",
                                  "extra_scale_factor": 0.5}
    assert rank["muon_params"] == sorted([
        *(f"module.module.decoder.layers.{layer}.{module}.weight" for layer in range(2)
          for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")),
        "module.module.embedding.position_embeddings.weight",
    ])
    assert rank["split_rows"] == {
        f"module.module.decoder.layers.{layer}.self_attention.linear_qkv.weight": [8, 8, 8] for layer in range(2)
    }, "Megatron-LM splits QKV by default: 4 heads of 8 channels, a query group per head"
    assert rank["losses_finite"] and rank["weight_decays"] == [0.0, 0.1]
    _assert_plugin_lines(rank, "muon", "sr", ["Muon", "AdamW"])


def _assert_plugin_lines(rank: dict, optimizer: str, option: str, chained: list[str]) -> None:
    """The plugin's first line names the option and optimizer asked for; its line after the build,
    the optimizer in use, the megatron-core version and the builder that Megatron-LM's
    ``setup_model_and_optimizer`` called (``get_megatron_muon_optimizer`` for Muon until 0.17)."""
    from megatron_lowprec.megatron import compat

    version = compat.megatron_core_version()
    builder = "get_megatron_muon_optimizer" if optimizer == "muon" and version < megatron_lm.MUON_WITH_DISTRIBUTED_OPTIMIZER else "get_megatron_optimizer"
    first, in_use = rank["plugin_lines"]
    assert first.startswith(f"megatron-lowprec: option {option} with --optimizer {optimizer}: the project's {chained[0]}")
    stepped_by = " + ".join(f"{name} with option {option}" for name in chained)
    assert in_use.startswith(f"megatron-lowprec: option {option}, optimizer {rank['optimizer']}[{stepped_by}], every one of the")
    assert in_use.endswith(f"(megatron-core {version}, Megatron-LM's setup_model_and_optimizer with --optimizer {optimizer} "
                           f"through the plugin's {builder})")


@requires_megatron_training
@pytest.mark.parametrize("optimizer, chained", [("adam", ["AdamW"]), ("muon", ["Muon", "AdamW"])], ids=["adam", "muon"])
@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["dp1", "tp2"])
def test_megatron_lms_setup_builds_the_option(tmp_path, optimizer, chained, tensor_parallel):
    """``--optimizer adam`` and ``--optimizer muon`` with ``--lowprec-option B`` at DP=1 and TP=2
    through Megatron-LM's own ``setup_model_and_optimizer`` (whichever builder it calls at the
    installed version): the project's optimizers with option B on every rank, the plugin's lines
    on rank 0 only, an iteration trains."""
    ranks = _run(tmp_path, tensor_parallel, [
        "--optimizer", optimizer, "--lowprec-option", "B", "--tensor-model-parallel-size", str(tensor_parallel),
        "--global-batch-size", "2", *UNCOMPILED,
    ], steps=1)
    for rank in ranks:
        assert rank["option"] == "B" and rank.get("chained", ["AdamW"]) == chained and rank["losses_finite"]
    assert all(rank["plugin_lines"] == [] for rank in ranks[1:])
    _assert_plugin_lines(ranks[0], optimizer, "B", chained)


@requires_megatron_training
def test_dist_muon_is_the_layer_wise_muon_of_the_option(tmp_path):
    """``--optimizer dist_muon --lowprec-option B`` at DP=2 through Megatron-LM's own
    ``setup_model_and_optimizer``: the project's layer-wise distributed Muon with option B (each
    matrix and its state on one data-parallel rank), the alternative to ``--optimizer muon
    --use-distributed-optimizer`` where Megatron-LM refuses that pair (before 0.18); an iteration trains."""
    ranks = _run(tmp_path, 2, ["--optimizer", "dist_muon", "--lowprec-option", "B", *UNCOMPILED], steps=1)
    for rank in ranks:
        assert (rank["optimizer"], rank["option"], rank["chained"][0]) == ("LayerWiseLowPrecisionMuonOptimizer", "B", "Muon")
        assert rank["losses_finite"]
    assert ranks[0]["plugin_lines"][0].endswith("both with option B, sharded by layer over the data-parallel ranks")
    assert ranks[0]["plugin_lines"][1].startswith("megatron-lowprec: option B, optimizer LayerWiseLowPrecisionMuonOptimizer[")


def _extras() -> dict[str, list[str]]:
    """setup.py's ``extras_require``, read by running it with ``setup`` replaced."""
    import runpy
    from unittest import mock

    root = Path(__file__).resolve().parents[2]
    with mock.patch("setuptools.setup") as setup, mock.patch("os.getcwd", return_value=str(root)):
        runpy.run_path(str(root / "setup.py"), run_name="__main__")
    return setup.call_args.kwargs["extras_require"]


def test_the_megatron_lm_extra_adds_what_pretrain_gpt_needs_to_the_megatron_extra():
    from packaging.requirements import Requirement

    extras = _extras()
    names = {Requirement(requirement).name for requirement in extras["megatron-lm"]}
    assert {Requirement(requirement).name for requirement in extras["megatron"]} <= names
    assert {"six", "regex", "pyyaml", "pydantic", "pybind11", "triton"} <= names


def test_dataset_helpers_compile_for_the_running_python_or_name_what_is_missing(monkeypatch):
    """megatron's Makefile is given the running Python's include directory and extension suffix (not
    those of whatever python3-config PATH finds) and pybind11's headers; a missing pybind11 or a failed
    build stops with one line naming the extra or the command."""
    import subprocess
    import sys
    import sysconfig
    import types

    monkeypatch.setitem(sys.modules, "pybind11", None)
    with pytest.raises(SystemExit, match=r"need pybind11 .*megatron-lowprec\[megatron-lm\]"):
        megatron_lm.compile_dataset_helpers()
    monkeypatch.setitem(sys.modules, "pybind11", types.SimpleNamespace(get_include=lambda: "/pybind11/include"))
    commands = []
    returncode = 0
    monkeypatch.setattr(subprocess, "run", lambda command: commands.append(command) or types.SimpleNamespace(returncode=returncode))
    megatron_lm.compile_dataset_helpers()
    make, directory_flag, directory, cppflags, libext = commands[0]
    assert (make, directory_flag) == ("make", "-C") and directory.endswith("datasets")
    assert cppflags == f"CPPFLAGS=-I/pybind11/include -I{sysconfig.get_paths()['include']}"
    assert libext == f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"
    returncode = 2
    with pytest.raises(SystemExit, match="did not compile: make -C"):
        megatron_lm.compile_dataset_helpers()


@requires_megatron_training
def test_every_unconditional_import_of_megatron_training_is_in_the_extra():
    """The modules ``megatron.training.training`` loads import, outside any ``try``, only the standard
    library, megatron-core's and torch's requirements and the ``megatron-lm`` extra's packages."""
    import importlib
    import importlib.metadata
    import re
    import sys

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    importlib.import_module("megatron.training.training")
    requirements = list(_extras()["megatron-lm"])
    for distribution in ("torch", "megatron-core", "numpy"):
        requirements += importlib.metadata.requires(distribution) or []
    allowed = {canonicalize_name(Requirement(requirement).name) for requirement in requirements}
    distributions = importlib.metadata.packages_distributions()
    unlisted = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not name.startswith("megatron.") or not path or not path.endswith(".py"):
            continue
        for imported in re.findall(r"^(?:import|from)\s+(\w+)", Path(path).read_text(), re.MULTILINE):
            if imported in sys.stdlib_module_names or imported in ("megatron", "__future__"):
                continue
            if not {canonicalize_name(package) for package in distributions.get(imported, [imported])} & allowed:
                unlisted.setdefault(imported, name)
    assert unlisted == {}, f"imported unconditionally, not in the megatron-lm extra: {unlisted}"


TRAIN_ITERATIONS = 4
LAYOUTS = {
    "tp2-C": (2, 4, ["--tensor-model-parallel-size", "2"], "C"),
    "pp2-sr": (2, 4, ["--pipeline-model-parallel-size", "2"], "sr"),
    "tp2-pp2-D-BF16-remainder": (4, 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                        "--lowprec-master-storage", "remainder"], "D-BF16"),
    "pp2-vpp2-coat": (2, 4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1"], "coat"),
    "tp2-dp2-distopt-sr": (4, 4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], "sr"),
}
"""Layout: ranks, global batch size, Megatron-LM's arguments, the precision option (one per family)."""
COMPILED_LAYOUTS = ("tp2-dp2-distopt-sr",)
"""Layouts whose option runs the compiled step (the default); the others run it uncompiled."""


@pytest.fixture(scope="module")
def indexed_corpus(tmp_path_factory) -> str:
    """A tiny corpus written by megatron-core's own ``IndexedDatasetBuilder``: 200 documents of 20 to 60
    random tokens; the ``--data-path`` prefix."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus_text_document")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(20, 61, (), generator=generator))
        builder.add_document(torch.randint(0, 127, (length,), generator=generator, dtype=torch.int32), [length])
    builder.finalize(f"{prefix}.idx")
    return prefix


@requires_megatron_training
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_through_megatron_lms_loop_on_an_indexed_dataset_as_its_own_optimizer(
    tmp_path, indexed_corpus, layout
):
    """Megatron-LM's own ``pretrain`` (``pretrain_gpt.py``'s calls, on ``--data-path``) trains with the
    option and with megatron's own optimizer at the same layout; the losses agree as at DP=1
    (within 1e-3 over 4 iterations: the options differ from AdamW in BF16 rounding only), and the
    tensor-parallel ranks of the last stage agree exactly. Compiled at TP=2 x DP=2 only (:data:`COMPILED_LAYOUTS`)."""
    world_size, global_batch, layout_argv, option = LAYOUTS[layout]
    argv = [*TINY_GPT, "--global-batch-size", str(global_batch), "--data-path", indexed_corpus, "--split", "90,5,5",
            "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1", *layout_argv]
    argv[argv.index("--train-iters") + 1] = str(TRAIN_ITERATIONS)
    runs = {}
    compiled = [] if layout in COMPILED_LAYOUTS else UNCOMPILED
    for name, extra in (("option", ["--lowprec-option", option, *compiled]), ("stock", [])):
        (tmp_path / name).mkdir()
        ranks = run_ranks(WORKER, tmp_path / name, world_size, "pretrain_gpt",
                          json.dumps({"argv": [*argv, *extra]}), timeout_seconds=600)
        last_stage = max(rank["pipeline_rank"] for rank in ranks)
        losses = {(rank["data_rank"], rank["tensor_rank"]): rank["losses"] for rank in ranks
                  if rank["pipeline_rank"] == last_stage}
        for (data_rank, tensor_rank), rank_losses in losses.items():
            assert rank_losses == losses[(data_rank, 0)], f"{name}: tensor-parallel ranks disagree"
            assert rank_losses and all(math.isfinite(loss) for loss in rank_losses)
        runs[name] = losses
    for key, stock_losses in runs["stock"].items():
        option_losses = runs["option"][key]
        assert len(option_losses) == len(stock_losses)
        assert max(abs(a - b) for a, b in zip(option_losses, stock_losses)) < 1e-3, (option_losses, stock_losses)

def _checkpoint_tensors(save_dir: Path) -> dict:
    """Every tensor of the last ``torch_dist`` checkpoint under ``save_dir``, whole (model space)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    iteration = (save_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    whole = save_dir / "whole.pt"
    dcp_to_torch_save(save_dir / f"iter_{int(iteration):07d}", whole)
    return {key: value for key, value in torch.load(whole, weights_only=False).items() if isinstance(value, torch.Tensor)}


TP2_TO_TP1 = ((2, ["--tensor-model-parallel-size", "2"]), (1, []))
DP2_TO_DP1 = ((2, ["--use-distributed-optimizer"]), (1, ["--use-distributed-optimizer"]))
MOMENTS = ("exp_avg", "exp_avg_sq")
FP8_MOMENTS = tuple(f"{moment}_{part}" for moment in MOMENTS for part in ("payload", "scale", "expansion_exponent"))


@requires_megatron_training
@pytest.mark.parametrize("layouts, option, states", [
    (TP2_TO_TP1, ["--lowprec-option", "C"], (*MOMENTS, "param_lo", "exp_avg_sq_lo")),
    (TP2_TO_TP1, ["--lowprec-option", "kahan"], (*MOMENTS, "kahan_compensation")),
    (DP2_TO_DP1, ["--lowprec-option", "coat", "--lowprec-master-storage", "remainder"], (*FP8_MOMENTS, "master")),
    (TP2_TO_TP1, ["--lowprec-option", "D-BF16", "--lowprec-master-storage", "remainder"], (*MOMENTS, "master")),
    (DP2_TO_DP1, ["--lowprec-option", "D-BF16", "--lowprec-master-storage", "remainder"], (*MOMENTS, "master")),
], ids=["tp2-to-tp1-C", "tp2-to-tp1-kahan", "dp2-to-dp1-distopt-coat-remainder", "tp2-to-tp1-D-BF16-remainder",
        "dp2-to-dp1-distopt-D-BF16-remainder"])
def test_a_checkpoint_saved_at_one_layout_resumes_at_another_with_every_state_bit_for_bit(
    tmp_path, indexed_corpus, layouts, option, states
):
    """Megatron-LM trains 2 iterations at one layout and saves (``torch_dist``); a run at another layout
    loads it and, with nothing left to train, saves again: both checkpoints hold the same tensors, bit
    for bit (parameters, moments, δθ and δv, Kahan's compensation, COAT's FP8 payloads with their
    group scales and expansion exponents per element, FP32 masters from their remainders, D-BF16's
    BF16 moments), and the
    optimizer states are the option's ``states``. The vocabulary is padded to 128 at both
    tensor-parallel sizes (by default megatron pads to 128 x TP). COAT is resharded across
    data-parallel sizes: across tensor-parallel sizes a group at TP=1 that gathers elements of two
    ranks' groups (a row-parallel weight's rows, a column-parallel bias shorter than a group) is
    quantized afresh, and its payloads and scale change (``checkpoint_state``). Uncompiled steps."""
    argv = [*TINY_GPT, "--global-batch-size", "4", "--data-path", indexed_corpus, "--split", "90,5,5",
            "--eval-iters", "1", "--eval-interval", "1000", "--ckpt-format", "torch_dist",
            "--make-vocab-size-divisible-by", "64", *option, *UNCOMPILED]
    argv[argv.index("--train-iters") + 1] = "2"
    checkpoints = {}
    resume = ["--load", str(tmp_path / "saved" / "ckpt"), "--no-load-rng"]
    saved_at, resumed_at = layouts
    for name, (world_size, layout_argv), load in (("saved", saved_at, []), ("resumed", resumed_at, resume)):
        (tmp_path / name).mkdir()
        run_ranks(WORKER, tmp_path / name, world_size, "pretrain_gpt", json.dumps({"argv": [
            *argv, *layout_argv, *load, "--save", str(tmp_path / name / "ckpt"), "--save-interval", "1000"]}),
            timeout_seconds=600)
        checkpoints[name] = _checkpoint_tensors(tmp_path / name / "ckpt")
    import torch

    saved, resumed = checkpoints["saved"], checkpoints["resumed"]
    assert sorted(saved) == sorted(resumed)
    prefix = "optimizer.state."
    assert {key[len(prefix):].split(".")[0] for key in saved if key.startswith(prefix)} == set(states)
    unequal = [key for key in saved if not torch.equal(saved[key], resumed[key])]
    assert unequal == []


@requires_megatron_training
def test_megatrons_own_checkpoint_resumes_into_an_option_and_converted_back_into_megatrons_own(tmp_path, indexed_corpus):
    """Stock -> option -> stock through Megatron-LM's ``pretrain`` (``torch_dist``): 2 iterations with
    megatron's own optimizer, saved; iteration 3 with ``--lowprec-option B --lowprec-convert-checkpoint``,
    which says per state kind what it converted, saved; that checkpoint converted by ``lowprec-convert
    --to stock``; iteration 4 with megatron's own optimizer from it. Every run trains its iteration
    with finite losses (each converted value is checked in ``tests/megatron/test_convert_checkpoint.py``)."""
    from megatron_lowprec.train.convert import convert_checkpoint

    argv = [*TINY_GPT, "--global-batch-size", "2", "--data-path", indexed_corpus, "--split", "90,5,5",
            "--eval-iters", "1", "--eval-interval", "1000", "--ckpt-format", "torch_dist", "--log-interval", "1",
            "--save-interval", "1000", "--no-load-rng", "--override-opt_param-scheduler"]

    def run(name: str, iterations: int, *extra: str) -> str:
        argv[argv.index("--train-iters") + 1] = str(iterations)
        (tmp_path / name).mkdir()
        (rank,) = run_ranks(WORKER, tmp_path / name, 1, "pretrain_gpt", json.dumps({"argv": [*argv, *extra]}),
                            timeout_seconds=300)
        log = (tmp_path / name / "rank0.log").read_text()
        trained = [line.split("/")[0].split()[-1] for line in log.splitlines() if " iteration " in line and "lm loss:" in line]
        assert trained[-1:] == [str(iterations)], log[-3000:]
        assert rank["losses"] and all(math.isfinite(loss) for loss in rank["losses"]), rank
        return log

    run("stock", 2, "--save", str(tmp_path / "stock_ckpt"))
    log = run("option", 3, "--load", str(tmp_path / "stock_ckpt"), "--save", str(tmp_path / "b_ckpt"),
              "--lowprec-option", "B", "--lowprec-convert-checkpoint", *UNCOMPILED)
    lines = [line for line in log.splitlines() if line.startswith("megatron-lowprec: converted stock -> B: ")]
    assert [line.split(": ")[2] for line in lines] == ["value", "exp_avg", "exp_avg_sq"], log[-3000:]

    (tmp_path / "back_ckpt").mkdir()
    lines = convert_checkpoint(tmp_path / "b_ckpt" / "iter_0000003", tmp_path / "back_ckpt" / "iter_0000003", "stock")
    assert [line.split(": ")[:2] for line in lines] == [["converted B -> stock", kind] for kind in ("value", "exp_avg", "exp_avg_sq")]
    (tmp_path / "back_ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    run("back", 4, "--load", str(tmp_path / "back_ckpt"))
