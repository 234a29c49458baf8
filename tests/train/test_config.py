"""The Hydra config of ``lowprec-train``: composition, one file per option, fail-fast errors, dry run,
``--help`` and ``--version``."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from megatron_lowprec.optim.strategies import available_strategies

pytestmark = pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="hydra-core is not installed")

from megatron_lowprec.train.app import compose, config_dir, main  # noqa: E402
from megatron_lowprec.train.config import ConfigError, TrainConfig, run_shape, uses_fp8_layers, validate  # noqa: E402

OPTIONS = [strategy.name for strategy in available_strategies()]


def _fails(capsys, *overrides: str) -> str:
    """``lowprec-train overrides`` exits with status 2 before any work; its message."""
    assert main(list(overrides)) == 2
    assert not torch.distributed.is_initialized()
    return capsys.readouterr().err


def test_default_is_the_tiny_model_on_the_embedded_corpus():
    config = compose()
    assert isinstance(config, TrainConfig)
    assert (config.model.name, config.precision.option, config.data.kind) == ("tiny", "A", "embedded")
    validate(config, world_size=1)


def test_one_precision_file_per_option_and_the_baselines_in_their_own_group():
    """``precision/`` holds one file per option and nothing else; ``baseline/`` the stock runs the options
    are compared against: megatron (megatron-core's own optimizer, option D's numerics) and te_fp8
    (Transformer Engine's FP8 layers over option D)."""
    assert sorted(path.stem for path in (config_dir() / "precision").glob("*.yaml")) == sorted(OPTIONS)
    assert sorted(path.stem for path in (config_dir() / "baseline").glob("*.yaml")) == ["megatron", "te_fp8"]
    te_fp8 = compose(["baseline=te_fp8"]).precision
    assert (te_fp8.option, te_fp8.te_fp8_recipe, te_fp8.megatron_optimizer) == ("D", "delayed", False)
    assert compose().precision.te_fp8_recipe is None and not compose().precision.megatron_optimizer


def test_baseline_megatron_selects_megatron_cores_optimizer():
    from megatron_lowprec.train.config import option_label

    precision = compose(["baseline=megatron"]).precision
    assert precision.megatron_optimizer and precision.option == "D"
    assert option_label(precision) == "megatron" and option_label(compose().precision) == "A"
    assert compose(["precision=D", "baseline=megatron"]) == compose(["baseline=megatron"])
    assert compose(["+experiment=coat_olmo_1b", "baseline=megatron"]).precision.option == "D"


def test_a_precision_the_baseline_would_replace_is_refused(capsys):
    message = _fails(capsys, "precision=C", "baseline=megatron")
    assert message.count("\n") == 1 and "baseline=megatron trains option D; precision=C contradicts it, drop one" in message


def _compose_warning(overrides: list[str]) -> tuple[TrainConfig, list[str]]:
    """The config of ``overrides`` and the FutureWarnings composing it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = compose(overrides)
    return config, [str(warning.message) for warning in caught if issubclass(warning.category, FutureWarning)]


def test_lowprec_train_says_an_earlier_spelling_in_one_line(capsys):
    assert main(["precision=megatron", "trainer.dry_run=true"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines().count("lowprec-train: warning: precision=megatron is deprecated; use baseline=megatron") == 1
    assert "FutureWarning" not in err


@pytest.mark.parametrize(
    "earlier, current, message",
    [
        (["precision=megatron"], ["baseline=megatron"], "precision=megatron is deprecated; use baseline=megatron"),
        (["precision=Megatron"], ["baseline=megatron"], "precision=Megatron is deprecated; use baseline=megatron"),
        (["precision=te_fp8"], ["baseline=te_fp8"], "precision=te_fp8 is deprecated; use baseline=te_fp8"),
        (["precision.emulate=E8M5", "precision.emulate_exclude=[]"], ["precision.emulate=E8M5", "precision.layers_exclude=[]"],
         "precision.emulate_exclude is deprecated; use precision.layers_exclude"),
        (["optimizer.distributed=true"], ["optimizer.use_distributed_optimizer=true"],
         "optimizer.distributed is deprecated; use optimizer.use_distributed_optimizer"),
        (["baseline=te_fp8", "precision.te_fp8_recipe=current"], ["baseline=te_fp8", "precision.te_fp8_recipe=tensorwise"],
         "precision.te_fp8_recipe=current is deprecated; use precision.te_fp8_recipe=tensorwise"),
    ],
)
def test_earlier_spellings_compose_as_the_current_ones_with_one_warning(earlier, current, message):
    """Renamed group members, keys and values: the earlier spelling gives the config of the current one
    and one warning naming both; the current spelling warns nothing, and the run's YAML has no
    earlier key."""
    from megatron_lowprec.train.config import to_yaml

    config, warned = _compose_warning(earlier)
    assert warned == [message]
    expected, none = _compose_warning(current)
    assert config == expected and none == []
    assert "emulate_exclude" not in to_yaml(config) and "  distributed:" not in to_yaml(config)
    assert "layers_exclude" in to_yaml(config) and "use_distributed_optimizer" in to_yaml(config)


@pytest.mark.parametrize("option", OPTIONS)
def test_precision_flag_selects_the_option(option):
    assert compose([f"precision={option}"]).precision.option == option


def test_precision_accepts_every_name_and_alias_in_any_case_wherever_an_option_is_named():
    """Option names are case-insensitive, with aliases. The Hydra group (``precision=c``,
    ``precision=collage_plus``), ``precision.option``, Megatron-LM's ``--lowprec-option`` and the
    Python API's ``AdamW(option=...)`` all take them."""
    import argparse

    from megatron_lowprec.megatron.megatron_lm import add_arguments
    from megatron_lowprec.optim import AdamW

    parser = add_arguments(argparse.ArgumentParser())
    parameter = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    for strategy in available_strategies():
        for name in (strategy.name, *strategy.aliases):
            spelled = name.swapcase()
            assert compose([f"precision={spelled}"]).precision.option == strategy.name, spelled
            assert parser.parse_args(["--lowprec-option", spelled]).lowprec_option == strategy.name
            assert AdamW([parameter], option=spelled, fused=False).strategy.name == strategy.name
    assert compose(["precision.option=collage_PLUS"]).precision.option == "collage_PLUS"
    assert compose(["precision=collage_plus"]) == compose(["precision=C"])


def test_coat_turns_on_the_fp8_layer_flow():
    precision = compose(["precision=coat"]).precision
    assert uses_fp8_layers(precision) and precision.emulate is None
    assert not uses_fp8_layers(compose(["precision=coat", "precision.fp8_layers=false"]).precision)
    assert uses_fp8_layers(compose(["precision=A", "precision.option=fp8_states"]).precision)
    assert uses_fp8_layers(compose(["precision=C", "precision.fp8_layers=true"]).precision)
    assert not any(uses_fp8_layers(compose([f"precision={option}"]).precision) for option in OPTIONS if option != "coat")


def test_unknown_option_lists_the_valid_ones(capsys):
    message = _fails(capsys, "precision=Z")
    assert "precision/Z" in message and all(option in message for option in OPTIONS)
    message = _fails(capsys, "precision.option=Q")
    assert "'Q'" in message and "collage_plus" in message


def test_unknown_key_lists_the_valid_keys(capsys):
    message = _fails(capsys, "model.hidden=3")
    assert "hidden" in message and "hidden_size" in message and "num_attention_heads" in message
    message = _fails(capsys, "+trainer.steps=3")
    assert "trainer.steps" in message and "max_steps" in message


def test_wrongly_typed_value_is_named(capsys):
    assert "trainer.max_steps=many" in _fails(capsys, "trainer.max_steps=many")


def test_heads_not_divisible_by_tensor_parallel(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = _fails(capsys, "model.num_attention_heads=3", "model.hidden_size=48", "trainer.tensor_model_parallel_size=2")
    assert "num_attention_heads=3" in message and "tensor_model_parallel_size=2" in message


def test_global_batch_not_divisible_by_micro_batch_times_data_parallel(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = _fails(capsys, "trainer.micro_batch_size=4", "trainer.global_batch_size=12")
    assert "global_batch_size=12" in message and "4 x 2" in message


def test_layout_that_does_not_fit_the_world(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "world size 3" in _fails(capsys, "trainer.tensor_model_parallel_size=2")


def _without_te(*values):
    return pytest.param(
        *values, marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
    )


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.normalization=BatchNorm"], "RMSNorm"),
        (["model.activation=relu"], "swiglu"),
        (["data.kind=web"], "indexed"),
        (["optimizer.lr_decay_style=step"], "cosine"),
        (["trainer.micro_batch_size=0"], "micro_batch_size=0"),
        (["precision.emulate=E9M9"], "E9M9"),
        (["precision.emulate_rounding=up"], "stochastic"),
        (["precision=coat", "precision.emulate=E4M3"], "fp8_layers"),
        (["trainer.sharpness_eps=0"], "sharpness_eps=0"),
        (["model.attention_backend=flash"], "auto, sdpa, unfused, te"),
        (["baseline=megatron", "precision.option=A"], "precision.option='A'"),
        (["baseline=megatron", "precision.track_update_quality=true"], "megatron_optimizer=true"),
        (["baseline=te_fp8", "precision.te_fp8_recipe=current_scaling"], "choose one of: delayed, tensorwise"),
        _without_te(["model.attention_backend=te"], "model.attention_backend=sdpa"),
        _without_te(["model.transformer_impl=transformer_engine"], "model.transformer_impl=local"),
        _without_te(["baseline=te_fp8"], "baseline=te_fp8 (precision.te_fp8_recipe) needs Transformer Engine"),
    ],
)
def test_bad_choice_names_the_valid_ones(capsys, overrides, named):
    assert named in _fails(capsys, *overrides)


def test_attention_backend_auto_puts_sdpa_in_the_local_spec():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_lowprec.megatron.attention import SDPAttention
    from megatron_lowprec.train.model import attention_backend, layer_spec

    def core_attention(config):
        return layer_spec(config).submodules.self_attention.submodules.core_attention

    config = compose()
    assert config.model.attention_backend == "auto" and attention_backend(config) == "sdpa"
    assert core_attention(config) is SDPAttention
    assert core_attention(compose(["model.attention_backend=unfused"])) is DotProductAttention


def test_resume_true_needs_a_checkpoint(capsys, tmp_path):
    assert "run_dir" in _fails(capsys, "resume=true")
    assert "holds no intact checkpoint" in _fails(capsys, "resume=true", f"run_dir={tmp_path}")
    assert not (tmp_path / "checkpoints").exists()


def test_dry_run_prints_config_and_plan(capsys, tmp_path):
    assert main(["trainer.dry_run=true", "precision=C", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "option: C" in out
    assert "ranks: 1 = TP 1 x PP 1 x DP 1" in out
    assert "12 bytes/param" in out
    assert "attention: sdpa (model.attention_backend=auto)" in out
    assert "0.7M parameters" in out
    assert not Path(tmp_path / "run").exists()


def test_config_dir_variable_must_hold_train_yaml(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWPREC_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="LOWPREC_CONFIG_DIR"):
        compose()


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["optimizer.lr=-1"], "optimizer.lr=-1.0 is not valid; it must be finite and >= 0"),
        (["optimizer.adam_beta2=1.0"], "optimizer.adam_beta2=1.0 is not valid; it must be finite and in [0, 1)"),
        (["optimizer.adam_eps=0"], "optimizer.adam_eps=0.0"),
        (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 is not valid; it must be finite and in [0, optimizer.lr]"),
        (["optimizer.clip_grad=-0.5"], "optimizer.clip_grad=-0.5"),
        (["optimizer.lr_warmup_steps=-2"], "optimizer.lr_warmup_steps=-2"),
    ],
)
def test_bad_optimizer_values_are_config_errors(capsys, overrides, named):
    message = _fails(capsys, *overrides)
    assert message.startswith("lowprec-train: config error: ") and named in message


def test_indexed_data_needs_existing_files_and_a_tokenizer(capsys, tmp_path):
    missing = str(tmp_path / "nowhere" / "corpus_text_document")
    assert f"data.data_prefix entry {missing!r} has no {missing}.bin or {missing}.idx" in _fails(
        capsys, "data=indexed", f"data.data_prefix=[{missing}]"
    )
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    assert "data.tokenizer_type=byte_bpe needs data.tokenizer_dir" in _fails(
        capsys, "data=indexed", f"data.data_prefix=[{prefix}]"
    )
    assert "tokenizer.json' does not exist" in _fails(
        capsys, "data=indexed", f"data.data_prefix=[{prefix}]", f"data.tokenizer_dir={tmp_path}"
    )
    assert "needs data.vocab_file" in _fails(
        capsys, "data=indexed", f"data.data_prefix=[{prefix}]", "data.tokenizer_type=gpt2_bpe"
    )
    assert "choose one of: byte_bpe, gpt2_bpe, sentencepiece" in _fails(
        capsys, "data=indexed", f"data.data_prefix=[{prefix}]", "data.tokenizer_type=wordpiece"
    )


def test_a_run_dir_that_cannot_be_created_is_a_config_error(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    message = _fails(capsys, f"run_dir={blocker / 'run'}")
    assert message.startswith("lowprec-train: config error: run_dir=") and "cannot be created" in message


def test_distributed_optimizer_needs_data_parallel_ranks(capsys, monkeypatch):
    assert "data-parallel size of 1" in _fails(capsys, "optimizer.use_distributed_optimizer=true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "shared_randomness=false needs optimizer.use_distributed_optimizer=false" in _fails(
        capsys, "optimizer.use_distributed_optimizer=true", "precision=sr", "precision.shared_randomness=false"
    )


def test_dry_run_plan_shows_the_state_per_rank_with_and_without_sharding(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["trainer.dry_run=true", "precision=C", "model=gpt_125m", "optimizer.use_distributed_optimizer=true"]) == 0
    plan = capsys.readouterr().out.split("plan:")[1]
    line = next(line for line in plan.splitlines() if "optimizer state per rank:" in line)
    unsharded, sharded = (float(part.split(" GiB")[0].split()[-1]) for part in line.split(",")[:2])
    assert sharded == pytest.approx(unsharded / 2, abs=1e-3) and unsharded > 0
    assert "sharded over DP 2 (optimizer.use_distributed_optimizer=true: sharded)" in line


def test_master_storage_sets_how_the_fp32_master_is_stored(capsys, tmp_path):
    from megatron_lowprec.train.config import precision_strategy

    assert compose(["precision=D-BF16"]).precision.master_storage == "remainder"
    assert compose(["precision=D"]).precision.master_storage == "fp32"
    precision = compose(["precision=D", "precision.master_storage=remainder"]).precision
    assert precision_strategy(precision).bytes_per_param() == 2 + 4 + 2 + 8
    assert main(["trainer.dry_run=true", "precision=coat", "precision.master_storage=remainder", f"run_dir={tmp_path}"]) == 0
    assert "10.125 bytes/param: 2 parameter + 4 gradient (precision.grad_reduce_in_fp32=true)" in capsys.readouterr().out


def test_master_storage_is_checked_before_any_work(capsys, monkeypatch):
    assert "precision.master_storage='half' is not valid; choose one of: fp32, remainder" in _fails(
        capsys, "precision=D", "precision.master_storage=half"
    )
    message = _fails(capsys, "precision=A", "precision.master_storage=remainder")
    assert "option 'A' keeps no FP32 master" in message and "D, coat, D-BF16" in message
    assert "precision.master_storage belong to this package's AdamW" in _fails(
        capsys, "baseline=megatron", "precision.master_storage=remainder"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["trainer.dry_run=true", "precision=D-BF16", "optimizer.use_distributed_optimizer=true"]) == 0
    assert "sharded over DP 2 (optimizer.use_distributed_optimizer=true: sharded)" in capsys.readouterr().out


def test_moment_storage_stores_8_bit_moments_as_int8_and_is_checked_before_any_work(capsys, tmp_path):
    from megatron_lowprec.train.config import precision_strategy

    precision = compose(["precision=sr8", "precision.moment_storage=int8"]).precision
    assert precision_strategy(precision).moments == "int8"
    assert precision_strategy(precision).bytes_per_param() == 2 + 2 + 2 * (1 + 2 / 128)
    assert "precision.moment_storage='int4' is not valid; choose one of: fp8, int8" in _fails(
        capsys, "precision=sr8", "precision.moment_storage=int4"
    )
    message = _fails(capsys, "precision=A", "precision.moment_storage=int8")
    assert "option 'A' keeps low moments, so moment_storage='int8' cannot apply; options with 8-bit moments: coat, sr8, res8" in message


def test_help_lists_the_groups_the_most_used_keys_and_where_every_key_is(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    groups = out.split("config groups")[1].split("most used keys")[0]
    for strategy in available_strategies():
        line = next(line for line in groups.splitlines() if line.startswith(f"    {strategy.name} "))
        assert f" {strategy.bytes_per_param():g} bytes/param; " in line, line
    assert "Collage option C (Collage-plus): MCF parameters and second moment" in groups
    assert "\n    gpt_1.3b " in groups and "\n    indexed " in groups
    assert "collage_table5_gpt_1.3b" in groups and "Collage Table 5 (left), GPT-1.3B" in groups
    keys = out.split("most used keys")[1]
    assert "trainer.max_steps" in keys and "Optimizer steps to train [300]" in keys
    assert "trainer.exit_signal" in keys and "optimizer.override_opt_param_scheduler" in keys
    assert "lowprec-train --help-config" in out and "docs/reference/config.md" in out
    assert max(len(line) for line in out.splitlines() if str(config_dir()) not in line) <= 100
    assert main(["precision=C", "-h"]) == 0 and "config groups" in capsys.readouterr().out


def test_help_config_prints_every_key_with_its_type_and_default(capsys):
    from megatron_lowprec.train.reference import config_keys

    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    for key in config_keys():
        assert f"\n  {key.key} ({key.type}, default {key.default})\n" in out, key.key
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main(["precision=C", "--help-config"]) == 0 and capsys.readouterr().out == out


def test_version_names_the_package_torch_and_megatron_core(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert f"megatron-lowprec {metadata.version('megatron-lowprec')}" in out
    assert f"torch {torch.__version__}" in out and f"megatron-core {metadata.version('megatron-core')}" in out


def test_an_unknown_option_is_a_config_error(capsys):
    message = _fails(capsys, "--max-steps=3")
    assert "unknown option '--max-steps=3'" in message and "--help" in message


def test_dry_run_without_world_size_plans_for_the_layout_of_the_preset(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["trainer.dry_run=true", "+experiment=collage_table5_gpt_1.3b"]) == 0
    plan = capsys.readouterr().out.split("plan:")[1]
    assert "ranks: 8 = TP 8 x PP 1 x DP 1 (WORLD_SIZE is unset: planned for the 8 rank(s) of one model replica" in plan
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert main(["trainer.dry_run=true", "+experiment=collage_table5_gpt_1.3b"]) == 0
    assert "ranks: 16 = TP 8 x PP 1 x DP 2\n" in capsys.readouterr().out


def test_a_layout_needing_more_ranks_says_how_to_launch_them(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    message = _fails(capsys, "trainer.tensor_model_parallel_size=2", "trainer.pipeline_model_parallel_size=2")
    assert "world size 1 is not divisible" in message
    assert "torchrun --nproc-per-node 4 -m megatron_lowprec.train" in message
    assert "launch/torchrun.sh --nproc-per-node 4" in message


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["trainer.exit_signal=SIGKILL"], "choose one of: SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGTERM"),
        (["optimizer.override_opt_param_scheduler=true", "optimizer.use_checkpoint_opt_param_scheduler=true"],
         "contradict each other"),
        (["resume_from=/nowhere/iter_0000010", "resume=false"], "contradict each other"),
        (["resume_allow_changes=[model.num_layers]"],
         "resume_allow_changes entry='model.num_layers' is not valid; choose one of: trainer.global_batch_size, "),
        (["resume_from=/nowhere/iter_0000010"], "resume_from='/nowhere/iter_0000010' cannot be resumed from: does not exist"),
    ],
)
def test_fault_handling_keys_are_checked(capsys, overrides, named):
    assert named in _fails(capsys, *overrides)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["trainer.save_interval=-1"], "trainer.save_interval=-1 is not valid; it must be a positive integer, or 0"),
        (["trainer.eval_interval=0"], "trainer.eval_interval=0 must be a positive integer"),
        (["trainer.log_interval=-3"], "trainer.log_interval=-3 must be a positive integer"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 must be a positive integer"),
        (["model.seq_length=128", "model.max_position_embeddings=64"],
         "model.seq_length=128 is above model.max_position_embeddings=64"),
        (["data.split='100,0,0'"], "data.split='100,0,0' leaves no training or no validation samples"),
        (["data.split='980,-10,10'"], "data.split='980,-10,10' is not valid; give up to three comma-separated"),
        (["trainer.profile=true", "trainer.profile_step_start=3", "trainer.profile_step_end=3"],
         "trainer.profile_step_start=3 and trainer.profile_step_end=3 profile no step of trainer.max_steps=300"),
        (["trainer.profile=true", "trainer.max_steps=5", "trainer.profile_step_start=5", "trainer.profile_step_end=7"],
         "profile_step_start < max_steps"),
        (["trainer.profile=true", "trainer.profile_ranks=[0,1]"], "trainer.profile_ranks=[0, 1] must name ranks of this run: 0 to 0"),
    ],
)
def test_bad_cadence_length_and_split_values_stop_before_any_work(capsys, overrides, named):
    message = _fails(capsys, *overrides)
    assert message.count("\n") == 1 and message.startswith("lowprec-train: config error: ") and named in message, message


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["optimizer.name=lion"], "optimizer.name='lion' is not valid; choose one of: adamw, muon"),
        (["optimizer=muon", "optimizer.muon_scale_mode=original"],
         "optimizer.muon_scale_mode='original' is not valid; choose one of: spectral, shape_scaling, unit_rms_norm"),
        (["optimizer=muon", "optimizer.muon_momentum=1.0"], "optimizer.muon_momentum=1.0 must be in [0, 1)"),
        (["optimizer=muon", "optimizer.muon_tp_mode=distributed"],
         "optimizer.muon_tp_mode='distributed' is not valid; choose one of: blockwise, duplicated"),
        (["optimizer=muon", "optimizer.muon_coefficient_type=polar_express"],
         "optimizer.muon_coefficient_type='polar_express' is not valid; choose one of: simple, quintic"),
        (["optimizer=muon", "precision.track_update_quality=true"],
         "optimizer.name=muon cannot run with precision.track_update_quality=true"),
    ],
)
def test_muon_settings_are_checked_before_any_work(capsys, overrides, named):
    message = _fails(capsys, *overrides)
    assert message.count("\n") == 1 and message.startswith("lowprec-train: config error: ") and named in message, message


def test_baseline_megatron_with_muon_needs_megatron_cores_muon_to_import(capsys, monkeypatch):
    """``baseline=megatron`` with ``optimizer=muon`` is megatron-core's own Muon, which needs NVIDIA's
    emerging-optimizers: where it does not import, one line says so before any work; where it does,
    the config is valid (the run itself: by hand in the newest-megatron venv, see the README)."""
    from megatron_lowprec.train import config as train_config

    monkeypatch.setattr(train_config, "_megatron_muon_imports", lambda: False)
    message = _fails(capsys, "optimizer=muon", "baseline=megatron")
    assert message.count("\n") == 1 and "optimizer.name=muon cannot run with baseline=megatron" in message, message
    assert "needs NVIDIA's emerging-optimizers, which does not import here" in message and "megatron_newest.sh" in message
    monkeypatch.setattr(train_config, "_megatron_muon_imports", lambda: True)
    config = compose(["optimizer=muon", "baseline=megatron"])
    validate(config, world_size=1)
    assert config.precision.megatron_optimizer and config.optimizer.name == "muon"


def test_optimizer_muon_selects_moonshots_recipe_and_adamw_stays_the_default():
    default, muon = compose(), compose(["optimizer=muon", "precision=C"])
    assert default.optimizer.name == "adamw" and muon.optimizer.name == "muon"
    assert (muon.optimizer.muon_scale_mode, muon.optimizer.muon_extra_scale_factor) == ("spectral", 0.2)
    assert muon.optimizer.muon_use_nesterov and muon.optimizer.muon_momentum == 0.95
    assert muon.optimizer.muon_coefficient_type == "simple"
    assert muon.optimizer.lr == default.optimizer.lr and muon.precision.option == "C"
    assert run_shape(muon)["optimizer.name"] == "muon"


def test_resume_from_a_damaged_checkpoint_stops_before_any_work(capsys, tmp_path):
    import json

    from megatron_lowprec.train.checkpoint import COMPLETE_FILE, checkpoint_path

    path = checkpoint_path(tmp_path, 20)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / COMPLETE_FILE).write_text(json.dumps({"files": {"__0_0.distcp": 4096}}))
    message = _fails(capsys, f"resume_from={path}", f"run_dir={tmp_path / 'new'}")
    assert f"resume_from='{path}' cannot be resumed from: __0_0.distcp has 100 bytes, 4,096 were written" in message
    (path / COMPLETE_FILE).unlink()
    assert f"has no {COMPLETE_FILE}" in _fails(capsys, "resume=true", f"run_dir={tmp_path}")


def test_every_config_key_is_documented():
    """Each key of the schema has a docstring (what ``--help`` shows for the most used ones)."""
    import dataclasses

    from megatron_lowprec.train import config as schema
    from megatron_lowprec.train.usage import COMMON_KEYS, field_docs

    for section in (schema.ModelConfig, schema.PrecisionConfig, schema.OptimizerConfig, schema.DataConfig,
                    schema.TrainerConfig, schema.LoggingConfig):
        undocumented = set(field.name for field in dataclasses.fields(section)) - set(field_docs(section))
        assert not undocumented, (section.__name__, undocumented)
    assert {"run_dir", "resume", "resume_from"} <= set(field_docs(TrainConfig))
    for key in COMMON_KEYS:
        section, _, name = key.rpartition(".")
        owner = type(getattr(TrainConfig(), section)) if section else TrainConfig
        assert name in field_docs(owner), key
