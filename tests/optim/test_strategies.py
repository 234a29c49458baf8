from dataclasses import replace

import pytest

from megatron_lowprec.optim import PrecisionStrategy, available_strategies, get_strategy, strategy_names
from megatron_lowprec.optim.muon import muon_strategy
from megatron_lowprec.optim.strategies import resolve_option

# Collage Table 2 (A-D) with a 16-bit gradient; D-MW, Kahan and SR from their components: 2 (BF16
# parameter) + 2 (BF16 gradient) + moments (2 + 2 in BF16, 4 + 4 in FP32) + master (4) + δθ, δv or
# the Kahan compensation (2 each).
PAPER_BYTES_PER_PARAM = {"A": 8, "B": 10, "C": 12, "D": 16, "D-MW": 12, "kahan": 10, "sr": 8}
# An FP32 master as the BF16 parameter plus a 2-byte remainder, with a 16-bit gradient.
REMAINDER_BYTES_PER_PARAM = {"D": 14, "coat": 2 + 2 + 2 + 2 * (1 + 8 / 128), "D-BF16": 10}


@pytest.mark.parametrize("name, expected", sorted(PAPER_BYTES_PER_PARAM.items()))
def test_bytes_per_param_with_a_16_bit_gradient_matches_the_papers(name, expected):
    assert get_strategy(name).bytes_per_param(grad_reduce_in_fp32=False) == expected


@pytest.mark.parametrize("strategy", available_strategies(), ids=lambda strategy: strategy.name)
def test_bytes_per_param_counts_the_gradient_buffer_megatron_allocates(strategy):
    """By default the gradient is what megatron-core's DDP allocates for the option: 4 bytes where it
    reduces in FP32 (the options with an FP32 master, whole or as a remainder), else the parameter's
    2 (a master of 16 significant bits as an 8-bit residual too)."""
    fp32_gradients = strategy.master_weights and strategy.master_storage in ("fp32", "remainder")
    assert strategy.default_grad_reduce_in_fp32 == fp32_gradients
    sixteen_bit = strategy.bytes_per_param(grad_reduce_in_fp32=False)
    assert strategy.bytes_per_param(grad_reduce_in_fp32=True) == sixteen_bit + 2
    assert strategy.bytes_per_param() == sixteen_bit + (2 if fp32_gradients else 0)
    assert strategy.grad_bytes() == (4 if fp32_gradients else 2)


@pytest.mark.parametrize("strategy", available_strategies(), ids=lambda strategy: strategy.name)
def test_the_distributed_optimizer_divides_the_state_and_not_the_buffers(strategy):
    """Megatron's distributed optimizer shards moments and masters over the data-parallel ranks;
    parameter and gradient buffers stay whole on every rank."""
    whole = 2 + strategy.grad_bytes()
    state = strategy.bytes_per_param() - whole
    assert strategy.bytes_per_param(state_shards=8) == whole + state / 8
    with pytest.raises(ValueError, match="state_shards=0"):
        strategy.bytes_per_param(state_shards=0)


@pytest.mark.parametrize("name, expected", sorted(REMAINDER_BYTES_PER_PARAM.items()))
def test_a_remainder_master_takes_two_bytes_instead_of_four(name, expected):
    strategy = get_strategy(name)
    assert strategy.with_master_storage("remainder").bytes_per_param(grad_reduce_in_fp32=False) == expected
    assert strategy.with_master_storage("fp32").bytes_per_param(grad_reduce_in_fp32=False) == expected + 2
    assert strategy.with_master_storage("remainder").bytes_per_param() == expected + 2
    assert strategy.with_master_storage("remainder").name == name


# BF16 parameter + BF16 gradient + two FP8 moments of 1 byte and, per group of 128, an FP32 scale and
# a BF16 k (+ a 1-byte residual for res8).
LEAN_BYTES_PER_PARAM = {"sr8": (2 + 2 + 2 * (1 + (4 + 2) / 128), 6.1), "res8": (2 + 2 + 2 * (1 + (4 + 2) / 128) + 1, 7.1)}
# With Muon, one FP8 momentum: the 5.1- and 6.1-byte ceilings.
LEAN_MUON_BYTES_PER_PARAM = {"sr8": (2 + 2 + 1 + (4 + 2) / 128, 5.1), "res8": (2 + 2 + 1 + (4 + 2) / 128 + 1, 6.1)}


@pytest.mark.parametrize("name, expected, bound", [(name, *values) for name, values in sorted(LEAN_BYTES_PER_PARAM.items())])
def test_the_lean_options_take_at_most_6_1_and_7_1_bytes_with_their_bf16_gradient(name, expected, bound):
    strategy = get_strategy(name)
    assert strategy.bytes_per_param() == expected <= bound
    assert strategy.bytes_per_param(numel=128 * 1000) == expected
    assert not strategy.default_grad_reduce_in_fp32
    assert (strategy.moments, strategy.fp8_format, strategy.fp8_group_size, strategy.fp8_expand) == ("fp8", "e4m3", 128, True)
    assert strategy.fp8_exponent_storage == "bf16"
    muon_expected, muon_bound = LEAN_MUON_BYTES_PER_PARAM[name]
    assert muon_strategy(name).bytes_per_param() == muon_expected <= muon_bound


def test_fp8_group_metadata_follows_the_exponent_storage():
    """Per group an FP32 scale, and under range expansion k in 4 bytes (coat, whose checkpoints keep
    their FP32 k) or 2 (res8)."""
    coat = get_strategy("coat")
    assert coat.fp8_exponent_storage == "fp32" and coat.fp8_group_metadata_bytes == 8
    assert replace(coat, fp8_exponent_storage="bf16").fp8_group_metadata_bytes == 6
    assert replace(coat, fp8_expand=False).fp8_group_metadata_bytes == 4
    assert replace(coat, fp8_exponent_storage="bf16").moment_bytes(300) == 300 + 6 * 3
    with pytest.raises(ValueError, match="fp8_exponent_storage='fp16' is not valid; choose one of fp32, bf16"):
        replace(coat, fp8_exponent_storage="fp16")


@pytest.mark.parametrize("name, bound", [("sr8", 6.1), ("res8", 7.1)])
def test_int8_moments_take_one_byte_and_a_bf16_scale_per_group_under_the_lean_ceilings(name, bound):
    """Companded INT8 moments on the FP8 groups of 128: per moment 1 byte and 2 bytes of scale per group."""
    strategy = get_strategy(name).with_moment_storage("int8")
    assert (strategy.name, strategy.moments, strategy.fp8_group_size) == (name, "int8", 128)
    assert strategy.fp8_group_metadata_bytes == 2 and strategy.moment_bytes(300) == 300 + 2 * 3
    expected = get_strategy(name).bytes_per_param() - 2 * (4 + 2 - 2) / 128
    assert strategy.bytes_per_param() == expected <= bound
    assert muon_strategy(strategy).bytes_per_param() == expected - 1 - 2 / 128 <= bound - 1
    assert strategy.with_moment_storage("fp8") == get_strategy(name)


def test_moment_storage_applies_to_8_bit_moments_only_and_names_the_valid_choices():
    with pytest.raises(ValueError, match=r"^option 'D' keeps fp32 moments, so moment_storage='int8' cannot apply; "
                                         r"options with 8-bit moments: coat, sr8, res8$"):
        get_strategy("D").with_moment_storage("int8")
    with pytest.raises(ValueError, match=r"^moment_storage='int4' is not valid; choose one of fp8, int8$"):
        get_strategy("sr8").with_moment_storage("int4")
    assert resolve_option("coat", moment_storage="int8").moments == "int8"


def test_a_residual_master_takes_one_byte():
    for name in ("D", "coat", "D-BF16"):
        strategy = get_strategy(name)
        assert strategy.with_master_storage("residual8").bytes_per_param(grad_reduce_in_fp32=False) == (
            strategy.with_master_storage("fp32").bytes_per_param(grad_reduce_in_fp32=False) - 3
        )
    assert get_strategy("res8").with_master_storage("fp32").bytes_per_param(grad_reduce_in_fp32=False) == 10.09375


def test_the_fp32_master_with_bf16_moments_is_deepseek_v3_s_recipe_at_10_bytes():
    strategy = get_strategy("fp32_master_bf16_states")
    assert (strategy.name, strategy.moments, strategy.master_weights) == ("D-BF16", "low", True)
    assert (strategy.master_storage, strategy.weight_decay, strategy.adam_kernel) == ("remainder", "multiplicative", "reference")
    assert strategy.bytes_per_param(grad_reduce_in_fp32=False) == 10 == get_strategy("B").bytes_per_param()


def test_coat_bytes_per_param_is_master_plus_fp8_moments_plus_group_metadata():
    # 2 (BF16 param) + 4 (FP32 gradient) + 4 (FP32 master) + 2 x (1 B payload + 8 B per 128-group)
    assert get_strategy("coat").bytes_per_param() == 2 + 4 + 4 + 2 * (1 + 8 / 128)
    # without its master, coat's gradient is the parameter's BF16
    assert get_strategy("coat").without_master_weights().bytes_per_param() == 2 + 2 + 2 * (1 + 8 / 128)


@pytest.mark.parametrize(
    "alias, name",
    [("bf16", "A"), ("COLLAGE_LIGHT", "B"), ("collage_plus", "C"), ("c", "C"), ("fp32_master", "D"),
     ("fp32_states", "D-MW"), ("d-mw", "D-MW"), ("KAHAN", "kahan"), ("bf16_sr", "sr"), ("fp8_states", "coat"),
     ("bf16_sr_fp8_states", "sr8"),
     ("fp32_master_bf16_states", "D-BF16"), ("d-bf16", "D-BF16")],
)
def test_names_and_aliases_are_case_insensitive(alias, name):
    assert get_strategy(alias).name == name


def test_unknown_option_lists_the_valid_names():
    with pytest.raises(ValueError) as error:
        get_strategy("E")
    message = str(error.value)
    assert "'E'" in message
    for name in strategy_names():
        assert name in message


def test_every_registered_strategy_is_reachable_by_name():
    for strategy in available_strategies():
        assert get_strategy(strategy.name) is strategy


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(moments="fp16"), "moments='fp16'"),
        (dict(param_update="round"), "param_update='round'"),
        (dict(master_weights=True, param_update="mcf"), "master weights"),
        (dict(second_moment_mcf=True, moments="fp32"), "second_moment_mcf"),
        (dict(weight_decay="multiplicative"), "lost operation"),
        (dict(adam_kernel="apex"), "adam_kernel='apex'"),
        (dict(adam_kernel="torch_fused", moments="fp32"), "adam_kernel='torch_fused' updates an FP32 master"),
        (dict(master_storage="bf16"), "master_storage='bf16'"),
        (dict(master_storage="remainder"), "master_storage='remainder' stores an FP32 master"),
    ],
)
def test_inconsistent_strategies_are_rejected(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        PrecisionStrategy("X", "bad", **fields)


def test_a_strategy_without_master_runs_the_reference_kernel():
    """torch's fused AdamW kernel needs the FP32 master that master_weights=False drops."""
    assert get_strategy("D").adam_kernel == "torch_fused"
    assert get_strategy("D").without_master_weights().adam_kernel == "reference"
    assert get_strategy("D-BF16").without_master_weights().master_storage == "fp32"
