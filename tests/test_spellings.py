"""One spelling per setting, declared once (:class:`~megatron_lowprec.optim.settings.OptimizerPrecision`,
:class:`~megatron_lowprec.layers.settings.LayerPrecision`): ``lowprec-train``'s ``precision`` keys,
the Megatron-LM entry's ``--lowprec-*`` flags, ``build_optimizer``'s keywords,
``LowPrecisionOptimizerConfig``'s fields and the layer converters name each setting alike, and Muon's
scale modes are megatron-core's ``muon_scale_mode`` names."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import warnings

import pytest
import torch

from megatron_lowprec.train.config import PrecisionConfig

PRECISION_KEYS_WITHOUT_A_FLAG = {
    "grad_reduce_in_fp32": "Megatron-LM's own --accumulate-allreduce-grads-in-fp32",
    "te_fp8_recipe": "Megatron-LM's own --fp8-format and --fp8-recipe",
    "megatron_optimizer": "Megatron-LM without --lowprec-option",
    "emulate_exclude": "the earlier spelling of layers_exclude",
}
"""The ``precision`` keys that the Megatron-LM entry spells with Megatron-LM's own flags."""


def test_each_lowprec_flag_is_the_precision_key_of_its_name_with_its_default():
    """``--lowprec-KEY`` is ``precision.KEY`` with the same default (``--lowprec-option``: none, for
    megatron's own optimizer; ``--lowprec-seed``: Megatron-LM's ``--seed``), a switch ``--lowprec-KEY`` /
    ``--no-lowprec-KEY``; every other key has a Megatron-LM flag of its own."""
    from megatron_lowprec.megatron.megatron_lm import PRECISION_FLAG_DEFAULTS, add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    fields = {field.name: field for field in dataclasses.fields(PrecisionConfig)}
    defaults = PrecisionConfig()
    flagged = set()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings[0].startswith("--lowprec-"):
            continue
        key = action.option_strings[0].removeprefix("--lowprec-").replace("-", "_")
        assert action.dest == f"lowprec_{key}"
        assert key in fields, action.option_strings
        flagged.add(key)
        assert action.default == PRECISION_FLAG_DEFAULTS.get(key, getattr(defaults, key)), key
        switch = "bool" in str(fields[key].type)
        assert switch == isinstance(action, argparse.BooleanOptionalAction), key
        if switch:
            assert action.option_strings == [f"--lowprec-{key.replace('_', '-')}", f"--no-lowprec-{key.replace('_', '-')}"]
    assert set(fields) - flagged == set(PRECISION_KEYS_WITHOUT_A_FLAG)
    assert set(PRECISION_FLAG_DEFAULTS) == {"option", "seed"}


def test_every_way_in_takes_every_optimizer_setting_under_its_one_declaration():
    """Each :class:`OptimizerPrecision` field is a ``precision`` key, a ``--lowprec-`` flag whose help
    is the field's docstring, a ``lowprec_`` field of ``LowPrecisionOptimizerConfig`` (Bridge's config)
    and, but the option that names the optimizer, a keyword of ``build_optimizer``."""
    from megatron_lowprec.megatron.megatron_lm import add_arguments
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig, build_optimizer
    from megatron_lowprec.optim.settings import OptimizerPrecision, field_docs, plain_text
    from megatron_lowprec.train.reference import config_keys

    names = [field.name for field in dataclasses.fields(OptimizerPrecision)]
    docs = field_docs(OptimizerPrecision)
    assert set(names) <= set(docs)
    app_keys = {key.key: key for key in config_keys()}
    helps = {action.dest: action.help for action in add_arguments(argparse.ArgumentParser())._actions if action.help != argparse.SUPPRESS}
    config_fields = {field.name for field in dataclasses.fields(LowPrecisionOptimizerConfig)}
    keywords = {
        name for name, parameter in inspect.signature(build_optimizer).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    for name in names:
        assert app_keys[f"precision.{name}"].doc == docs[name]
        assert helps[f"lowprec_{name}"].replace("%%", "%").startswith(plain_text(docs[name]))
    assert keywords == set(names) - {"option"}
    assert {name for name in config_fields if name.startswith("lowprec_")} == {f"lowprec_{name}" for name in names}


def test_a_setting_that_cannot_apply_is_named_as_each_caller_spells_it():
    """A master storage for an option without a master is refused once, by the settings' check, in one
    line that names the setting as the caller wrote it and the options that have a master."""
    from megatron_lowprec.megatron import megatron_lm
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig
    from megatron_lowprec.optim.settings import OptimizerPrecision, SettingError
    from megatron_lowprec.train.config import ConfigError, TrainConfig, validate

    reason = "option 'A' keeps no FP32 master, so master_storage='remainder' cannot apply; options with one: D, coat"
    with pytest.raises(SettingError, match=reason) as raised:
        OptimizerPrecision(option="a", master_storage="remainder").check()
    assert raised.value.field == "master_storage"
    config = TrainConfig()
    config.precision.master_storage = "remainder"
    with pytest.raises(ConfigError, match=f"^precision.master_storage: {reason}"):
        validate(config, world_size=1)
    with pytest.raises(ValueError, match=f"^lowprec_master_storage: {reason}"):
        LowPrecisionOptimizerConfig(lowprec_option="A", lowprec_master_storage="remainder")
    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--lowprec-option", "A", "--lowprec-master-storage", "remainder"]
    )
    with pytest.raises(SystemExit, match=f"^megatron-lowprec: --lowprec-master-storage: {reason}"):
        megatron_lm._check_precision_flags(args)
    config.precision.master_storage = "half"
    with pytest.raises(ConfigError, match=r"^precision.master_storage='half' is not valid; choose one of: fp32, remainder, residual8$"):
        validate(config, world_size=1)


def test_every_way_in_takes_every_layer_setting_under_its_one_declaration():
    """Each :class:`LayerPrecision` field is a ``precision`` key and a ``--lowprec-`` flag whose help is
    the field's docstring, with the field's default; the app's config and the flags build the same
    settings."""
    from megatron_lowprec.layers.settings import LayerPrecision, layer_precision_of
    from megatron_lowprec.megatron.megatron_lm import add_arguments
    from megatron_lowprec.optim.settings import field_docs, lowprec_field, plain_text
    from megatron_lowprec.train.reference import config_keys

    names = [field.name for field in dataclasses.fields(LayerPrecision)]
    docs = field_docs(LayerPrecision)
    assert set(names) <= set(docs)
    app_keys = {key.key: key for key in config_keys()}
    parser = add_arguments(argparse.ArgumentParser())
    helps = {action.dest: action.help for action in parser._actions if action.help != argparse.SUPPRESS}
    for name in names:
        assert app_keys[f"precision.{name}"].doc == docs[name]
        assert helps[f"lowprec_{name}"].replace("%%", "%") == plain_text(docs[name])
    assert layer_precision_of(parser.parse_args([]), lowprec_field) == LayerPrecision() == layer_precision_of(PrecisionConfig())
    given = ["--lowprec-emulate", "E5M2", "--lowprec-emulate-rounding", "stochastic", "--no-lowprec-emulate-clamp-inner-range",
             "--lowprec-layers-exclude", "output_layer", "linear_fc2"]
    assert layer_precision_of(parser.parse_args(given), lowprec_field) == LayerPrecision(
        emulate="E5M2", emulate_rounding="stochastic", emulate_clamp_inner_range=False, layers_exclude=["output_layer", "linear_fc2"]
    )


@pytest.mark.parametrize(
    ("settings", "flags", "line"),
    [
        ({"option": "coat", "emulate": "E4M3"}, ["--lowprec-option", "coat", "--lowprec-emulate", "E4M3"],
         "{emulate} and {fp8_layers} replace the same matmuls; choose one"),
        ({"option": "C", "emulate": "E8M5", "fp8_layers": True}, ["--lowprec-emulate", "E8M5", "--lowprec-fp8-layers"],
         "{emulate} and {fp8_layers} replace the same matmuls; choose one"),
        ({"option": "C", "emulate_rounding": "up"}, None,
         "{emulate_rounding}='up' is not valid; choose one of: nearest, stochastic"),
        ({"option": "C", "emulate": "E9M9"}, None, "{emulate}='E9M9': "),
    ],
    ids=["coat-emulated", "fp8-layers-emulated", "rounding", "format"],
)
def test_a_layer_setting_that_cannot_apply_is_named_as_each_caller_spells_it(settings, flags, line):
    """A layer setting is refused once, by :meth:`LayerPrecision.check`, in one line naming it as the
    app's config (``precision.KEY``), Megatron-LM's flags (``--lowprec-KEY``, checked as they are
    parsed) and the converters (``LayerPrecision.KEY``) spell it; an unset ``fp8_layers`` is the option's."""
    import re

    from megatron_lowprec.layers.settings import LayerPrecision
    from megatron_lowprec.megatron import megatron_lm
    from megatron_lowprec.megatron.layers import pre_wrap_hook
    from megatron_lowprec.train.config import ConfigError, TrainConfig, validate

    def spelled(spelling, opening: str = "") -> str:
        keys = ("emulate", "fp8_layers", "emulate_rounding")
        return "^" + re.escape(opening + line.format(**{key: spelling(key) for key in keys}))

    config = TrainConfig()
    for key, value in settings.items():
        setattr(config.precision, key, value)
    with pytest.raises(ConfigError, match=spelled(lambda key: f"precision.{key}")):
        validate(config, world_size=1)
    layer_settings = {key: value for key, value in settings.items() if key != "option"}
    with pytest.raises(ValueError, match=spelled(lambda key: f"LayerPrecision.{key}")):
        pre_wrap_hook(LayerPrecision(**layer_settings), option=settings["option"])
    if flags is not None:
        args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(flags)
        flag = spelled(lambda key: "--lowprec-" + key.replace("_", "-"), opening="megatron-lowprec: ")
        with pytest.raises(SystemExit, match=flag):
            megatron_lm._check_precision_flags(args)


@pytest.mark.parametrize(("rows", "columns"), [(64, 16), (16, 64), (48, 48)])
def test_muon_scale_modes_are_megatron_cores_names(rows, columns):
    """megatron-core's ``muon_scale_mode`` formulas: ``shape_scaling`` √max(1, m/n) (Keller Jordan's,
    torch's ``adjust_lr_fn="original"``), ``spectral`` √max(m, n), ``unit_rms_norm`` √(m/n)."""
    from megatron_lowprec.megatron.optimizer import MUON_SCALE_MODES
    from megatron_lowprec.optim.muon import update_scale

    expected = {
        "shape_scaling": math.sqrt(max(1.0, rows / columns)),
        "spectral": math.sqrt(max(rows, columns)),
        "unit_rms_norm": math.sqrt(rows / columns),
    }
    assert set(MUON_SCALE_MODES) == set(expected)
    for mode, scale in expected.items():
        assert update_scale((rows, columns), mode) == pytest.approx(scale, rel=1e-15)
    assert update_scale((rows, columns), "original") == update_scale((rows, columns), "shape_scaling")


def test_muon_takes_the_earlier_scale_mode_original_as_shape_scaling_with_one_warning():
    """``Muon(scale_mode="original")`` (torch's name) is ``"shape_scaling"``: its groups hold the
    current name, one warning names both, and a step gives the same bits; the current name warns nothing."""
    from megatron_lowprec.optim import Muon

    def stepped(scale_mode: str) -> tuple[torch.Tensor, Muon]:
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(32, 8).to(torch.bfloat16))
        param.grad = torch.randn(32, 8).to(torch.bfloat16)
        optimizer = Muon([param], lr=0.01, scale_mode=scale_mode, option="D", fused=False)
        optimizer.step()
        return param.detach().clone(), optimizer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        earlier, optimizer = stepped("original")
    assert [str(warning.message) for warning in caught if issubclass(warning.category, FutureWarning)] == [
        "scale_mode='original' is deprecated; use scale_mode='shape_scaling' (megatron-core's name)"
    ]
    assert optimizer.param_groups[0]["scale_mode"] == "shape_scaling"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        current, _ = stepped("shape_scaling")
    assert torch.equal(earlier.view(torch.int16), current.view(torch.int16))
