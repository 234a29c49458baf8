"""benchmarks/activation_memory.py: the COAT flow saves at most 1/1.6 of BF16's activations for a
Llama-style layer (COAT Table 2: 13.33U against 22.66U), and the byte accounting itself."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_memory.py"
SHAPE = {"batch": 2, "seq": 64, "hidden": 256}
FP8_GROUP_BYTES = 1 + 4 / 16
"""Bytes per element of a 1 x 16 per-group E4M3 tensor: the payload and one float32 scale per group."""


@pytest.fixture(scope="module")
def activation_memory():
    spec = importlib.util.spec_from_file_location("activation_memory", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama(activation_memory):
    return {flow: activation_memory.measure("llama", flow, **SHAPE) for flow in activation_memory.FLOWS}


def test_coat_flow_saves_at_most_one_over_1_6_of_bf16_for_a_llama_layer(llama):
    assert llama["coat"]["total"] <= llama["bf16"]["total"] / 1.6


def test_linear_inputs_are_counted_once_in_bf16_and_as_fp8_in_the_coat_flow(activation_memory, llama):
    ffn_units = activation_memory.llama_ffn_hidden(SHAPE["hidden"]) / SHAPE["hidden"]
    assert llama["bf16"]["mlp.fc2"] == pytest.approx(ffn_units)
    assert llama["coat"]["mlp.fc2"] == pytest.approx(ffn_units / 2, rel=1e-3)
    assert llama["coat"]["mlp.act"] == pytest.approx(2 * ffn_units * FP8_GROUP_BYTES / 2)
    assert llama["coat"]["norm1"] == pytest.approx(FP8_GROUP_BYTES / 2)
    assert llama["coat"]["attention"] == llama["bf16"]["attention"], "attention is outside the FP8 flow"


def test_parameters_are_not_counted(activation_memory):
    layer = activation_memory.build_layer("gpt", "bf16", 64)
    hidden_states = torch.randn(1, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    total = sum(activation_memory.saved_bytes_by_module(layer, hidden_states).values())
    parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert total < parameter_bytes


def test_the_table_prints_both_layers_and_flows(activation_memory, capsys):
    activation_memory.main(["--batch", "1", "--seq", "32", "--hidden", "128"])
    output = capsys.readouterr().out
    for row in ("llama  bf16", "llama  coat", "gpt  bf16", "gpt  coat", "total U", "22.66U"):
        assert row in output


def test_unknown_layer_names_are_rejected(activation_memory):
    with pytest.raises(ValueError, match="llama, gpt"):
        activation_memory.build_layer("mamba", "bf16", 64)
    with pytest.raises(ValueError, match="bf16, coat"):
        activation_memory.build_layer("llama", "te", 64)
