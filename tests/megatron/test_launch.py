"""The rank launcher (tests/megatron/launch.py): runs on the CPU bridge are not skipped on GPU machines,
a rank without CUDA is forked from the rank server and runs as ``python WORKER`` would, and a launch
whose rendezvous port was taken is repeated."""

import contextlib
import json
import os
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


FORKED_WORKER = """
import atexit, json, multiprocessing, os, sys
from pathlib import Path
preloaded = "torch" in sys.modules
start_method = multiprocessing.get_start_method(allow_none=True)
atexit.register(lambda: Path(sys.argv[1], "exit-handler-ran").write_text("yes"))
print("to the log")
Path(sys.argv[1], "result.json").write_text(json.dumps({
    "name": __name__, "argv": sys.argv[2:], "path0": sys.path[0], "preloaded": preloaded,
    "variable": os.environ.get("FORKED_RANK_VARIABLE"), "start_method": start_method,
}))
sys.exit(int(sys.argv[2]))
"""


def test_a_rank_without_cuda_is_forked_with_torch_imported_and_runs_as_python_worker_would(tmp_path, monkeypatch):
    """Forked from the rank server (torch already imported): the worker runs as ``__main__`` with its
    arguments, its folder first on ``sys.path``, its own environment, its output in its log and its
    exit handlers; its exit status is the rank's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    worker = tmp_path / "worker.py"
    worker.write_text(FORKED_WORKER)
    log = tmp_path / "rank0.log"
    with contextlib.ExitStack() as logs:
        rank = launch._start_rank(worker, (str(tmp_path), "3"), {**os.environ, "FORKED_RANK_VARIABLE": "seen"}, log, logs)
        assert rank.wait() == 3 and rank.poll() == 3
    assert isinstance(rank, launch._ForkedRank)
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "name": "__main__", "argv": ["3"], "path0": str(tmp_path), "preloaded": True, "variable": "seen",
        "start_method": None,
    }
    assert "to the log" in log.read_text()
    assert (tmp_path / "exit-handler-ran").read_text() == "yes"
