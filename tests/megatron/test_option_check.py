"""``option_check.optimizer_in_use`` on optimizers built by hand: the line naming the option and the
optimizers in use, and one line naming what is wrong where a trainable parameter is not stepped by
the project's optimizer with the option asked for (another option, torch's optimizer, a parameter
left out); frozen parameters do not count."""

from __future__ import annotations

import pytest
import torch

from megatron_lowprec.megatron.option_check import OptionNotInUse, optimizer_in_use
from megatron_lowprec.optim import AdamW


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)


def _in_use(optimizer, model, option):
    return optimizer_in_use(optimizer, model, option, asked_by="--lowprec-option", path="by hand", remedy="build it again")


def test_every_parameter_stepped_with_the_option_names_it_in_one_line():
    model = _model()
    line = _in_use(AdamW(model.parameters(), option="collage_light"), model, "B")
    assert line == ("megatron-lowprec: option B, optimizer AdamW[AdamW with option B], every one of the 4 trainable "
                    "parameters stepped with B (by hand)")


def test_without_an_option_the_line_names_the_optimizer():
    model = _model()
    line = _in_use(torch.optim.AdamW(model.parameters()), model, None)
    assert line == "megatron-lowprec: no precision option; megatron's optimizer AdamW[torch.optim.adamw.AdamW] (by hand)"


@pytest.mark.parametrize("build, stepped_by, missing", [
    (lambda model: AdamW(model.parameters(), option="C"), "AdamW with option C", 4),
    (lambda model: torch.optim.AdamW(model.parameters()), "torch.optim.adamw.AdamW", 4),
    (lambda model: AdamW(model[0].parameters(), option="B"), "AdamW with option B", 2),
], ids=["another-option", "torch", "left-out"])
def test_a_parameter_not_stepped_with_the_option_stops_in_one_line(build, stepped_by, missing):
    model = _model()
    with pytest.raises(OptionNotInUse) as stopped:
        _in_use(build(model), model, "B")
    assert str(stopped.value) == (
        f"megatron-lowprec: --lowprec-option asked for option B, but {missing} of the 4 trainable parameters are not "
        f"stepped by the project's optimizer with it: the optimizer is {type(build(model)).__name__}[{stepped_by}] "
        "(by hand); build it again"
    )


def test_frozen_parameters_do_not_count_and_the_error_class_is_the_callers():
    model = _model()
    model[1].requires_grad_(False)
    assert "every one of the 2 trainable parameters" in _in_use(AdamW(model[0].parameters(), option="B"), model, "B")
    with pytest.raises(ValueError, match="1 of the 2 trainable parameters"):
        optimizer_in_use(AdamW([model[0].weight], option="B"), model, "B", asked_by="precision.option", path="app",
                         remedy="report it", error=ValueError)
