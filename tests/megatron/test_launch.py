"""The rank launcher (tests/megatron/launch.py): runs on the CPU bridge are not skipped on GPU machines."""

import pytest
import torch

from .launch import worker_environment


def test_cpu_runs_hide_the_gpus_and_run_on_a_machine_with_too_few(monkeypatch):
    """A one-GPU machine: four NCCL ranks are skipped, four ranks on the CPU bridge run, seeing no GPU
    (so that they take the bridge and gloo, as on a machine without CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert worker_environment(4, on_cpu=True)["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(pytest.skip.Exception, match="4 NCCL ranks need 4 GPUs"):
        worker_environment(4, on_cpu=False)
