"""Megatron's fusion flags follow what is importable (``train/model.py megatron_fusions``).

Each flag is checked with its extension made absent (``sys.modules[name] = None``) and present (a
stand-in module with a spec), on a machine with CUDA (``cuda=True``) and without.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
import types

import pytest

from megatron_lowprec.train.config import TrainConfig
from megatron_lowprec.train.model import (
    GRADIENT_ACCUMULATION_EXTENSION,
    MASKED_SOFTMAX_EXTENSIONS,
    TRANSFORMER_ENGINE,
    megatron_fusions,
)

ALL_EXTENSIONS = (*MASKED_SOFTMAX_EXTENSIONS, GRADIENT_ACCUMULATION_EXTENSION, TRANSFORMER_ENGINE)


def _extensions(monkeypatch, present: tuple[str, ...]) -> None:
    for name in ALL_EXTENSIONS:
        if name in present:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
            monkeypatch.setitem(sys.modules, name, module)
        else:
            monkeypatch.setitem(sys.modules, name, None)


def _config(transformer_impl: str = "local", activation: str = "gelu", add_bias_linear: bool = True) -> TrainConfig:
    config = TrainConfig()
    config.model = dataclasses.replace(
        config.model, transformer_impl=transformer_impl, activation=activation, add_bias_linear=add_bias_linear
    )
    return config


def test_no_fusion_without_cuda_even_with_every_extension(monkeypatch):
    _extensions(monkeypatch, ALL_EXTENSIONS)
    assert not any(megatron_fusions(_config("transformer_engine"), cuda=False).values())


@pytest.mark.parametrize("present", [False, True])
def test_masked_softmax_fusion_needs_megatron_s_softmax_kernels(monkeypatch, present):
    _extensions(monkeypatch, MASKED_SOFTMAX_EXTENSIONS if present else ())
    assert megatron_fusions(_config(), cuda=True)["masked_softmax_fusion"] is present


def test_masked_softmax_fusion_needs_all_of_its_kernels(monkeypatch):
    _extensions(monkeypatch, MASKED_SOFTMAX_EXTENSIONS[:-1])
    assert megatron_fusions(_config(), cuda=True)["masked_softmax_fusion"] is False


@pytest.mark.parametrize("present", [False, True])
def test_gradient_accumulation_fusion_needs_apex_s_wgrad_kernel_with_the_local_spec(monkeypatch, present):
    _extensions(monkeypatch, (GRADIENT_ACCUMULATION_EXTENSION,) if present else ())
    assert megatron_fusions(_config(), cuda=True)["gradient_accumulation_fusion"] is present


@pytest.mark.parametrize("flag", ["persist_layer_norm", "apply_rope_fusion", "gradient_accumulation_fusion"])
@pytest.mark.parametrize("te_present", [False, True])
def test_transformer_engine_fusions_need_its_spec_and_its_package(monkeypatch, flag, te_present):
    _extensions(monkeypatch, (TRANSFORMER_ENGINE,) if te_present else ())
    assert megatron_fusions(_config("transformer_engine"), cuda=True)[flag] is te_present
    assert megatron_fusions(_config("local"), cuda=True)[flag] is False, "torch norms reject persist_layer_norm"


@pytest.mark.parametrize(
    "activation, bias, expected", [("gelu", True, True), ("swiglu", False, False), ("gelu", False, False)]
)
def test_bias_activation_fusion_needs_a_bias_and_gelu(monkeypatch, activation, bias, expected):
    _extensions(monkeypatch, ())
    fusions = megatron_fusions(_config(activation=activation, add_bias_linear=bias), cuda=True)
    assert fusions["bias_activation_fusion"] is expected
    assert fusions["bias_dropout_fusion"] is True


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
def test_the_transformer_config_takes_the_flags_of_this_machine():
    import torch

    from megatron_lowprec.train.model import transformer_config

    built = transformer_config(TrainConfig())
    expected = megatron_fusions(TrainConfig(), torch.cuda.is_available())
    assert {name: getattr(built, name) for name in expected} == expected


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
def test_on_a_cuda_machine_without_apex_or_te_the_local_spec_builds(monkeypatch):
    """As on the H100 without apex or TE: ``persist_layer_norm`` was on and megatron's torch norm
    asserted; ``masked_softmax_fusion`` was on and needed apex's softmax kernels."""
    import torch
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_lowprec.train.model import transformer_config

    _extensions(monkeypatch, ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = transformer_config(TrainConfig())
    assert (built.persist_layer_norm, built.masked_softmax_fusion, built.gradient_accumulation_fusion) == (False,) * 3
    assert built.bias_activation_fusion and built.bias_dropout_fusion
    assert isinstance(WrappedTorchNorm(built, 8), torch.nn.LayerNorm)
