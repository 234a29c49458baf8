"""The analytic parameter count equals megatron-core's, and the paper recipes are the sizes they are named.

Models are built by :func:`megatron_lowprec.train.model.gpt_model` on torch's meta device (shapes
only, no memory), inside one gloo rank and the CPU bridge, so even GPT-30B builds in a second.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from megatron_lowprec.train import model as model_module
from megatron_lowprec.train.app import compose
from megatron_lowprec.train.config import validate
from megatron_lowprec.train.model import padded_vocab_size
from megatron_lowprec.train.model_size import parameter_count

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
MODEL_CONFIGS = sorted(path.stem for path in (CONFIG_DIR / "model").glob("*.yaml"))
EXPERIMENT_PRESETS = sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))

# The counts the README's recipe table states, at tensor parallelism 1: GPT-2 BPE's 50257 tokens
# padded to 50304 (megatron's multiple of 128), LLaMA's 32000 and OLMo's 50280 (padded to 50304).
EXPECTED_PARAMETER_COUNTS = {
    "gpt_125m": 162_322_944,
    "gpt_1.3b": 1_414_647_808,
    "gpt_2.7b": 2_775_208_960,
    "gpt_6.7b": 6_856_253_440,
    "gpt_30b": 35_253_901_312,
    "openllama_7b": 6_738_415_616,
    "gpt2_350m": 354_650_112,
    "gpt2_770m": 773_675_520,
    "gptneo_1.3b": 1_315_819_520,
    "gptneo_2.7b": 2_651_673_600,
    "gptneo_6.7b": 6_658_596_864,
    "olmo_1b": 1_176_832_000,
}

# Model names round their size, and count the LM head or not (GPT-3's sizes, which Collage's GPT names
# follow, count a tied one; LLaMA's count its untied one): the named size must lie within 10% of the
# count without an untied LM head or of the count with it.
NAMING_SLACK = 0.10
# Nominal names: Collage App. E.2's "GPT-30B" (56 layers, hidden 7168, 56 heads) has 34.9B
# parameters besides its untied LM head; OLMo-1B has 1.18B (COAT's pretraining model).
NAMING_SLACK_BY_MODEL = {"gpt_30b": 0.20, "olmo_1b": 0.20}

megatron_required = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"
)


def named_size(name: str) -> float:
    """125e6 for ``gpt_125m``, 1.3e9 for ``gptneo_1.3b``."""
    match = re.search(r"(\d+(?:\.\d+)?)([mb])$", name)
    assert match, f"no size in model name {name!r}"
    return float(match.group(1)) * {"m": 1e6, "b": 1e9}[match.group(2)]


def model_vocab_size(model) -> int:
    """The padded vocabulary a single-GPU-layout build uses (tensor parallelism 1)."""
    return padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)


@pytest.fixture
def build_on_meta(megatron_rank, monkeypatch):
    """Count the parameters of ``gpt_model(config, vocab_size)`` built on the meta device."""
    # Megatron allocates on the current CUDA device, bypassing the meta device, unless it
    # initialises on the CPU (always so without CUDA): keep CPU initialisation on GPU machines too.
    transformer_config = model_module.transformer_config
    monkeypatch.setattr(
        model_module,
        "transformer_config",
        lambda config: dataclasses.replace(transformer_config(config), use_cpu_initialization=True),
    )

    def count(config, vocab_size: int) -> int:
        with torch.device("meta"):
            model = model_module.gpt_model(config, vocab_size)
        parameters = list(model.parameters())
        assert all(parameter.is_meta for parameter in parameters)
        return sum(parameter.numel() for parameter in parameters)

    return count


SHAPES = {
    "gpt_rope_untied": [],
    "gpt_learned_positions_tied": [
        "model.position_embedding_type=learned_absolute",
        "model.max_position_embeddings=96",
        "model.untie_embeddings_and_output_weights=false",
    ],
    "llama_rmsnorm_swiglu_no_bias": [
        "model.normalization=RMSNorm",
        "model.activation=swiglu",
        "model.add_bias_linear=false",
        "model.ffn_hidden_size=176",
    ],
    "grouped_query_attention": ["model.num_attention_heads=8", "model.num_query_groups=2"],
    "multi_query_attention_swiglu_with_bias": [
        "model.num_query_groups=1",
        "model.activation=swiglu",
        "model.normalization=RMSNorm",
    ],
    "layernorm_no_bias_wide_mlp": ["model.add_bias_linear=false", "model.ffn_hidden_size=320", "model.num_layers=3"],
}


@megatron_required
@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_matches_megatron_for_small_shapes(shape, build_on_meta):
    config = compose(SHAPES[shape])
    vocab_size = padded_vocab_size(1000, config.model.make_vocab_size_divisible_by, 1)
    assert parameter_count(config.model, vocab_size) == build_on_meta(config, vocab_size)


@megatron_required
@pytest.mark.parametrize("overrides", [[f"model={name}"] for name in MODEL_CONFIGS] + [["+experiment=coat_olmo_1b"]])
def test_parameter_count_matches_megatron_for_every_model_config(overrides, build_on_meta):
    config = compose(overrides)
    vocab_size = padded_vocab_size(config.model.vocab_size or 4096, config.model.make_vocab_size_divisible_by, 1)
    assert parameter_count(config.model, vocab_size) == build_on_meta(config, vocab_size)


@pytest.mark.parametrize("name", [name for name in MODEL_CONFIGS if name != "tiny"])
def test_model_configs_have_the_size_of_their_name(name):
    model = compose([f"model={name}"]).model
    assert model.name == name
    count = parameter_count(model, model_vocab_size(model))
    assert count == EXPECTED_PARAMETER_COUNTS[name]
    assert_named_size(model, count)


def assert_named_size(model, count: int) -> None:
    untied_head = model_vocab_size(model) * model.hidden_size if model.untie_embeddings_and_output_weights else 0
    slack = NAMING_SLACK_BY_MODEL.get(model.name, NAMING_SLACK)
    nominal = named_size(model.name)
    assert (1 - slack) * (count - untied_head) <= nominal <= (1 + slack) * count, (
        f"{model.name}: {count / 1e9:.3f}B parameters ({(count - untied_head) / 1e9:.3f}B without an untied LM head)"
    )


def test_every_model_config_is_listed_in_the_readme_counts():
    assert set(MODEL_CONFIGS) - {"tiny"} <= set(EXPECTED_PARAMETER_COUNTS)


def test_coat_preset_model_is_olmo_1b():
    model = compose(["+experiment=coat_olmo_1b"]).model
    count = parameter_count(model, model_vocab_size(model))
    assert count == EXPECTED_PARAMETER_COUNTS["olmo_1b"]
    assert_named_size(model, count)


# The GPUs each preset's paper ran it on (Collage Fig. 4 and Section 5.3, SR App. C.1, COAT: 8 here).
PAPER_WORLD_SIZES = {
    "collage_table5_gpt_125m": 1,
    "collage_table5_gpt_1.3b": 8,
    "collage_table5_gpt_2.7b": 8,
    "collage_table5_gpt_6.7b": 8,
    "collage_table5_openllama_7b": 8,
    "collage_table5_openllama_7b_beta2_0.99": 8,
    "collage_table6": 1,
    "collage_table8_gpt_30b": 16,
    "sr_table1_gpt2_350m": 8,
    "sr_table1_gpt2_350m_mp": 8,
    "sr_table1_gpt2_770m": 8,
    "sr_table1_gpt2_770m_mp": 8,
    "sr_table1_gptneo_1.3b": 32,
    "sr_table1_gptneo_1.3b_mp": 32,
    "sr_table1_gptneo_2.7b": 64,
    "sr_table1_gptneo_2.7b_mp": 64,
    "sr_table1_gptneo_6.7b": 64,
    "sr_table1_gptneo_6.7b_mp": 64,
    "coat_olmo_1b": 8,
}


def test_every_experiment_preset_has_a_paper_layout():
    assert set(EXPERIMENT_PRESETS) == set(PAPER_WORLD_SIZES)


@pytest.mark.parametrize("preset", EXPERIMENT_PRESETS)
def test_every_experiment_preset_composes_and_fits_its_paper_layout(preset):
    config = compose([f"+experiment={preset}"])
    validate(config, world_size=PAPER_WORLD_SIZES[preset])
    assert config.model.name in EXPECTED_PARAMETER_COUNTS
