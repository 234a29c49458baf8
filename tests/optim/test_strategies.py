import re
from pathlib import Path

import pytest

from megatron_lowprec.optim import PrecisionStrategy, available_strategies, get_strategy, strategy_names

# Collage Table 2 (A-D), D-MW (NOTES.md), Kahan and SR from their component counts (issue table).
PAPER_BYTES_PER_PARAM = {"A": 8, "B": 10, "C": 12, "D": 16, "D-MW": 12, "kahan": 10, "sr": 8}
# An FP32 master as the BF16 parameter plus a 2-byte remainder (issue 21's table).
REMAINDER_BYTES_PER_PARAM = {"D": 14, "coat": 2 + 2 + 2 + 2 * (1 + 8 / 128), "D-BF16": 10}


@pytest.mark.parametrize("name, expected", sorted(PAPER_BYTES_PER_PARAM.items()))
def test_bytes_per_param_matches_the_papers(name, expected):
    assert get_strategy(name).bytes_per_param() == expected


@pytest.mark.parametrize("name, expected", sorted(REMAINDER_BYTES_PER_PARAM.items()))
def test_a_remainder_master_takes_two_bytes_instead_of_four(name, expected):
    strategy = get_strategy(name)
    assert strategy.with_master_storage("remainder").bytes_per_param() == expected
    assert strategy.with_master_storage("fp32").bytes_per_param() == expected + 2
    assert strategy.with_master_storage("remainder").name == name


def test_the_fp32_master_with_bf16_moments_is_deepseek_v3_s_recipe_at_10_bytes():
    strategy = get_strategy("fp32_master_bf16_states")
    assert (strategy.name, strategy.moments, strategy.master_weights) == ("D-BF16", "low", True)
    assert (strategy.master_storage, strategy.weight_decay, strategy.adam_kernel) == ("remainder", "multiplicative", "reference")
    assert strategy.bytes_per_param() == 10 == get_strategy("B").bytes_per_param()


def test_coat_bytes_per_param_is_master_plus_fp8_moments_plus_group_metadata():
    # 2 (BF16 param) + 2 (BF16 grad) + 4 (FP32 master) + 2 x (1 B payload + 8 B per 128-group)
    assert get_strategy("coat").bytes_per_param() == 2 + 2 + 4 + 2 * (1 + 8 / 128)
    assert get_strategy("coat").without_master_weights().bytes_per_param() == 2 + 2 + 2 * (1 + 8 / 128)


@pytest.mark.parametrize(
    "alias, name",
    [("bf16", "A"), ("COLLAGE_LIGHT", "B"), ("collage_plus", "C"), ("c", "C"), ("fp32_master", "D"),
     ("fp32_states", "D-MW"), ("d-mw", "D-MW"), ("KAHAN", "kahan"), ("bf16_sr", "sr"), ("fp8_states", "coat"),
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


def _readme_option_rows():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in readme.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            names = re.findall(r"`([^`]+)`", cells[0])
            rows[names[0]] = (names[1:], float(cells[4]))
    return rows


def test_readme_option_table_is_computed_from_the_registry():
    rows = _readme_option_rows()
    assert sorted(rows) == sorted(s.name for s in available_strategies())
    for name, (aliases, bytes_per_param) in rows.items():
        strategy = get_strategy(name)
        assert list(strategy.aliases) == aliases
        assert strategy.bytes_per_param() == bytes_per_param
