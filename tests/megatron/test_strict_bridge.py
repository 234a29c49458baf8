"""The bridge's strict placement check: tensors placed on the CPU explicitly fail where they would on a GPU.

These tests activate the bridge in this pytest process (``cpu_bridge`` restores everything on exit);
the app-level checks, which reintroduce real placement bugs into ``lowprec-train``, are in
``tests/train/test_device_placement.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import numpy
import pytest
import torch

from megatron_lowprec.megatron import cpu

from .. import strict_bridge
from ..strict_bridge import HostPlacementError, StrictPlacementCheck, host_site

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge is active only without CUDA"),
]


def _previous_line() -> str:
    """``file:line`` of the caller's previous line."""
    caller = inspect.currentframe().f_back
    return f"{caller.f_code.co_filename}:{caller.f_lineno - 1}"


@pytest.fixture
def strict():
    with cpu.cpu_bridge(check=StrictPlacementCheck()) as active:
        assert active and isinstance(cpu.active_check(), StrictPlacementCheck)
        yield


def test_factories_without_a_device_place_on_the_host_and_cuda_clears_it(strict):
    on_host = torch.zeros(3)
    placed_at = _previous_line()
    explicit = torch.ones(3, device="cpu")
    on_device = torch.zeros(3, device=torch.cuda.current_device())
    assert host_site(on_host) == placed_at
    assert host_site(explicit) is not None
    assert host_site(on_device) is None
    assert host_site(on_host + 1) == host_site(on_host), "a result of host tensors alone is on the host"
    assert host_site(on_device.to(torch.float64).cpu()) is None, ".cpu() returns the tensor itself here"
    assert host_site(on_device.to("cpu", torch.float64)) is not None, "a copy to the CPU is on the host"
    assert host_site(on_host.cuda()) is None
    assert host_site(torch.zeros_like(on_device)) is None
    assert host_site(torch.from_numpy(numpy.zeros(2))) is not None, "datasets hand out host tensors"


def test_a_host_tensor_meeting_the_device_names_both_places(strict):
    index = torch.tensor([0, 2])
    placed_at = _previous_line()
    table = torch.randn(4, 3, device=torch.cuda.current_device())
    expected = rf"embedding at .*test_strict_bridge.py:\d+ mixes a tensor placed on the CPU at {re.escape(placed_at)} "
    with pytest.raises(HostPlacementError, match=expected):
        torch.nn.functional.embedding(index, table)


def test_moves_and_scalars_are_legitimate(strict):
    on_device = torch.zeros(3, device=torch.cuda.current_device())
    on_device.copy_(torch.ones(3))
    assert (on_device * torch.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]
    on_device[torch.tensor([0])] = 5.0
    assert on_device.to(torch.ones(1)).shape == (3,)


def test_parameters_keep_their_data_s_placement_until_moved(strict):
    layer = torch.nn.Linear(4, 2)
    inputs = torch.randn(3, 4, device=torch.cuda.current_device())
    assert host_site(layer.weight) is not None
    with pytest.raises(HostPlacementError, match="linear"):
        layer(inputs)
    layer.cuda(torch.cuda.current_device())
    assert host_site(layer.weight) is None
    assert layer(inputs).shape == (3, 2)
    layer.weight.data = torch.zeros(2, 4)
    assert host_site(layer.weight) is not None, "p.data = x takes x's placement"


def test_collectives_refuse_host_tensors_except_on_explicit_gloo_groups(strict):
    def all_reduce(tensor, group=None):
        return "reduced"

    checked = strict_bridge._checked_collective("all_reduce", all_reduce)
    assert checked(torch.zeros(2, device=torch.cuda.current_device())) == "reduced"
    with pytest.raises(HostPlacementError, match=r"torch.distributed.all_reduce at .* got a tensor placed on the CPU"):
        checked(torch.zeros(2))
    gloo_group = object.__new__(type("GlooGroup", (), {}))
    strict_bridge._EXPLICIT_GLOO_GROUPS[id(gloo_group)] = gloo_group
    assert checked(torch.zeros(2), group=gloo_group) == "reduced"


def test_the_check_is_off_unless_asked_and_everything_is_restored(monkeypatch):
    monkeypatch.delenv(cpu.CHECK_ENV_VARIABLE, raising=False)
    collective, parameter_new = torch.distributed.all_reduce, torch.nn.Parameter.__new__
    with cpu.cpu_bridge():
        assert cpu.active_check() is None
        torch.nn.functional.embedding(torch.tensor([0]), torch.randn(2, 2, device=torch.cuda.current_device()))
    monkeypatch.setenv(cpu.CHECK_ENV_VARIABLE, strict_bridge.CHECK_SPEC)
    with cpu.cpu_bridge():
        assert isinstance(cpu.active_check(), StrictPlacementCheck) and torch.distributed.all_reduce is not collective
    assert torch.distributed.all_reduce is collective and torch.nn.Parameter.__new__ is parameter_new
    assert host_site(torch.nn.Parameter(torch.zeros(1))) is None


def test_a_malformed_check_variable_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu.CHECK_ENV_VARIABLE, "tests.strict_bridge")
    with pytest.raises(ValueError, match=r"MEGATRON_LOWPREC_BRIDGE_CHECK='tests.strict_bridge': expected 'module:callable'"):
        cpu.activate_cpu_bridge()
    assert not cpu.is_cpu_bridge_active()
