"""The rank launcher (tests/megatron/launch.py): runs on the CPU bridge are not skipped on GPU machines,
and a launch whose rendezvous port was taken is repeated."""

import socket

import pytest
import torch

from . import launch
from .launch import worker_environment


def test_cpu_runs_hide_the_gpus_and_run_on_a_machine_with_too_few(monkeypatch):
    """A one-GPU machine: four NCCL ranks are skipped, four ranks on the CPU bridge run, seeing no GPU
    (so that they take the bridge and gloo, as on a machine without CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert worker_environment(4, on_cpu=True)["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(pytest.skip.Exception, match="4 NCCL ranks need 4 GPUs"):
        worker_environment(4, on_cpu=False)


RENDEZVOUS_WORKER = """
import json, os, sys
from pathlib import Path
from tests.megatron.launch import init_process_group
import torch
init_process_group(timeout_seconds=60)
total = torch.ones(1)
torch.distributed.all_reduce(total)
(Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"total": total.item()}))
torch.distributed.destroy_process_group()
"""


def test_a_launch_whose_rendezvous_port_was_taken_is_repeated_on_another(tmp_path, monkeypatch):
    """The port found free is taken (here: held by a listening socket) before rank 0 binds it: the
    ranks fail with EADDRINUSE, and the run is launched again on a fresh port."""
    worker = tmp_path / "worker.py"
    worker.write_text(RENDEZVOUS_WORKER)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        free_port = launch._free_port
        monkeypatch.setattr(launch, "_free_port", lambda: next(ports, None) or free_port())
        results = launch.run_ranks(worker, tmp_path, 2, timeout_seconds=120, on_cpu=True)
    assert results == [{"total": 2.0}, {"total": 2.0}]
