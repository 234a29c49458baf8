"""The CUDA→CPU bridge: megatron-core 0.16.1 on a CPU-only torch with gloo, two ranks.

The multi-process scenarios run once per module in two worker processes
(:mod:`tests.megatron._cpu_bridge_worker`), so the bridge never patches this pytest process; each test
below checks one scenario of that run. The in-process tests touch no megatron code. Where CUDA is
present the bridge stays off and the same scenarios run on two GPUs with NCCL; the checks of the bridge
itself are then skipped.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from megatron_lowprec.megatron import cpu

from ._cpu_bridge_worker import RealCudaCallError, real_cuda_forbidden
from .launch import run_ranks, scenario_results

WORKER = Path(__file__).with_name("_cpu_bridge_worker.py")
WORLD_SIZE = 2
RUN_TIMEOUT_SECONDS = 180

requires_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"
)
requires_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the bridge is active only without CUDA"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("cpu_bridge"), WORLD_SIZE, timeout_seconds=RUN_TIMEOUT_SECONDS)


@requires_megatron
class TestMegatronOnCpu:
    @requires_no_cuda
    def test_bridge_activates_and_deactivates_cleanly(self, ranks):
        for rank_results in ranks:
            assert rank_results["activation"]["active"]
            assert {
                "function mode stack",
                "torch.autograd._engine_run_backward",
                "torch.cuda.current_device",
                "torch.cuda.current_stream",
                "torch.cuda.Event",
                "torch.cuda.get_rng_state",
                "tensor_parallel.random.CudaRNGStatesTracker",
            } <= set(rank_results["activation"]["changed"])
            assert rank_results["deactivation"]["not_restored"] == []

    def test_tensor_parallel_gpt_step(self, ranks):
        results = scenario_results(ranks, "tensor_parallel_step")
        assert [result["tensor_parallel_size"] for result in results] == [2, 2]
        assert sorted(result["tensor_parallel_rank"] for result in results) == [0, 1]
        losses = results[0]["losses"]
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
        assert results[1]["losses"] == losses, "the tensor-parallel ranks disagree on the loss"
        for result in results:
            assert result["grads_finite"]
            assert result["recomputed_losses"] == losses
            assert result["recompute_grads_equal"], "activation recompute replayed other dropout masks"

    def test_rng_tracker_forks_are_reproducible_and_tensor_parallel_aware(self, ranks):
        tracker_class = "CudaRNGStatesTracker" if torch.cuda.is_available() else "CpuRNGStatesTracker"
        for result in scenario_results(ranks, "rng_tracker"):
            assert result["tracker_class"] == tracker_class
            assert result["reproducible"], "the same seed gave other dropout masks"
            assert result["model_parallel_differs_across_tp"]
            assert result["data_parallel_same_across_tp"]
            assert result["default_same_across_tp"]
            assert result["fork_restores_default_stream"]

    def test_ddp_all_reduces_gradients(self, ranks):
        results = scenario_results(ranks, "data_parallel_ddp")
        assert results[0]["losses"] != results[1]["losses"], "the ranks did not see different data"
        for result in results:
            assert result["data_parallel_size"] == 2
            assert all(math.isfinite(loss) for loss in result["losses"])
            assert result["local_grads_differ"]
            assert result["grads_nonzero"]
            assert result["synced_grads_equal"]
            assert result["synced_grads_are_mean"]
            assert result["optimizer"] == "Float16OptimizerWithFloat16Params"
            assert result["update_successful"] and result["grad_norm_finite"]
            assert result["params_equal_after_step"]

    def test_distributed_optimizer_step(self, ranks):
        for result in scenario_results(ranks, "distributed_optimizer"):
            assert result["optimizer"] == "DistributedOptimizer"
            assert result["update_successful"] and result["grad_norm_finite"]
            assert result["params_changed"]
            assert result["params_equal_after_step"]

    def test_pipeline_parallel_gpt_step(self, ranks):
        first_stage, last_stage = sorted(
            scenario_results(ranks, "pipeline_parallel_step"), key=lambda result: result["pipeline_rank"]
        )
        assert first_stage["losses"] == []
        assert len(last_stage["losses"]) == 2
        assert all(math.isfinite(loss) for loss in last_stage["losses"])
        assert first_stage["grads_finite"] and last_stage["grads_finite"]

    @requires_no_cuda
    def test_no_megatron_call_reaches_real_cuda(self, ranks):
        """Fails, naming the call site, when a megatron-core version needs more bridging."""
        for rank, rank_results in enumerate(ranks):
            tripwire = rank_results["cuda_tripwire"]
            reached = "\n".join(tripwire["reached"])
            assert not reached, f"rank {rank} reached real CUDA from:\n{reached}"
            deferred = "\n".join(tripwire["deferred"])
            assert not deferred, f"rank {rank} had CUDA calls silently dropped:\n{deferred}"
            assert not tripwire["cuda_initialized"]


@requires_no_cuda
def test_tripwire_names_the_call_and_restores_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_lazy_seed_tracker", type(torch.cuda._lazy_seed_tracker)())
    original_lazy_init = torch.cuda._lazy_init
    with real_cuda_forbidden() as report:
        with pytest.raises(RealCudaCallError, match=r"test_cpu_bridge\.py:\d+ .*current_device"):
            torch.cuda.current_device()
        with pytest.raises(RealCudaCallError, match=r"test_cpu_bridge\.py"):
            torch.zeros(1, device="cuda")
        torch.cuda.manual_seed(1)
    assert len(report["reached"]) == 2
    assert "torch.cuda.manual_seed(1)" in report["deferred"][0]
    assert torch.cuda._lazy_init is original_lazy_init
    assert torch.cuda.random._lazy_init is original_lazy_init


def test_mode_redirects_cuda_device_requests_to_cpu():
    with cpu.CudaToCpuMode():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=0).device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2).to(0).device.type == "cpu"
        assert torch.ones(2).to("cuda:0", torch.bfloat16).dtype == torch.bfloat16
        assert torch.zeros(2).new_zeros(3, device="cuda:0").device.type == "cpu"
        assert torch.zeros(2, device="meta").device.type == "meta"
        tensor = torch.zeros(2, dtype=torch.bfloat16)
        assert tensor.cuda() is tensor
        assert tensor.type() == "torch.cuda.BFloat16Tensor"
        assert tensor.type(torch.float32).dtype == torch.float32
    assert torch.zeros(2).type() == "torch.FloatTensor"


def test_activation_is_a_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    torch_attributes = {
        name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "manual_seed")
    }
    run_backward = torch.autograd._engine_run_backward
    modes = torch.overrides._get_current_function_mode_stack()
    megatron_imported = "megatron.core" in sys.modules
    assert cpu.activate_cpu_bridge() is False
    with cpu.cpu_bridge() as active:
        assert active is False
    assert not cpu.is_cpu_bridge_active()
    assert {name: getattr(torch.cuda, name) for name in torch_attributes} == torch_attributes
    assert torch.autograd._engine_run_backward is run_backward
    assert torch.overrides._get_current_function_mode_stack() == modes
    assert ("megatron.core" in sys.modules) == megatron_imported


@requires_no_cuda
def test_streams_events_and_rng_state_have_cpu_meanings():
    """megatron-core 0.17+ waits on streams and events at every gradient sync and saves the device's
    RNG state with each checkpoint; on the CPU these are program-order no-ops and the CPU generator."""
    before = {name: getattr(torch.cuda, name) for name in ("current_stream", "Event", "get_rng_state")}
    with cpu.cpu_bridge(check=None):
        stream = torch.cuda.current_stream()
        assert stream is torch.cuda.default_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stream.wait_event(start)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            side.wait_stream(stream)
            total = torch.ones(3).sum()
        end.record(side)
        assert start.query() and end.query() and total.item() == 3.0
        assert start.elapsed_time(end) >= 0.0
        torch.manual_seed(5)
        saved = torch.cuda.get_rng_state()
        first = torch.rand(4)
        torch.cuda.set_rng_state(saved)
        assert torch.equal(torch.rand(4), first)
    assert {name: getattr(torch.cuda, name) for name in before} == before


def test_every_bridged_call_is_documented():
    undocumented = [bridged.call for bridged in cpu.BRIDGED_CALLS if bridged.call not in cpu.__doc__]
    assert undocumented == []


@requires_no_cuda
def test_megatron_sees_the_host_as_a_device_without_cuda_capability_and_torch_sees_no_device():
    """Megatron-LM's ``validate_args`` asks for the device's compute capability (``get_device_arch_version``
    with tensor parallelism, ``get_device_capability`` with grouped GEMMs): the host, capability 0.0.
    Callers outside megatron (Inductor's cache key) keep torch's error without CUDA."""
    import os

    megatron_module = {"__name__": "megatron.training.utils", "torch": torch}
    exec(
        "def describe():\n"
        "    properties = torch.cuda.get_device_properties(torch.device('cuda:0'))\n"
        "    return properties, torch.cuda.get_device_capability(), torch.cuda.get_device_name(0)\n",
        megatron_module,
    )
    before = {name: getattr(torch.cuda, name) for name in ("get_device_properties", "get_device_capability")}
    with cpu.cpu_bridge(check=None):
        properties, capability, name = megatron_module["describe"]()
        assert (properties.major, properties.minor) == (0, 0) == capability
        assert properties.total_memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert properties.multi_processor_count == os.cpu_count()
        assert name == properties.name
        with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
            torch.cuda.get_device_properties(0)
        if importlib.util.find_spec("megatron.training") is not None:
            from megatron.training import utils as training_utils

            assert training_utils.get_device_arch_version() == 0
    assert {name: getattr(torch.cuda, name) for name in before} == before
