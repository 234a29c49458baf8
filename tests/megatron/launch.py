"""Launch a worker script once per rank on localhost, bounded in time, and collect its results.

Each worker gets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (the
repository root on ``PYTHONPATH``), is called as ``python WORKER RESULT_DIR *ARGS``, creates its process
group with :func:`init_process_group` and writes ``RESULT_DIR/rank<N>.json``. Without CUDA the ranks
talk over gloo (the workers run megatron through the CUDA→CPU bridge); with CUDA over NCCL, one GPU
per rank, and a run needing more GPUs than the machine has is skipped. A run ``on_cpu`` hides the GPUs
from its workers: they take the CPU bridge and gloo on every machine, GPU machines included.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_process_group(timeout_seconds: float) -> None:
    """A worker's process group, as Megatron-LM creates it: NCCL on GPU ``LOCAL_RANK`` where CUDA is
    present, gloo otherwise."""
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))


def run_scenario(scenarios: dict[str, Callable[..., dict]]) -> None:
    """A scenario worker's entry point, called as ``python WORKER RESULT_DIR SCENARIO ARGUMENTS``
    (JSON keyword arguments): runs ``scenarios[SCENARIO]`` under the CUDA→CPU bridge in this rank's
    process group and writes its result to ``RESULT_DIR/rank<N>.json``."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron import cpu as cpu_bridge

    result_dir, scenario, arguments = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    with cpu_bridge.cpu_bridge() as bridged:
        if bridged and cpu_bridge.active_check() is None:
            raise RuntimeError(f"a worker on the CPU bridge without the strict placement check: ${cpu_bridge.CHECK_ENV_VARIABLE} is unset")
        init_process_group(timeout_seconds=120)
        try:
            result = scenarios[scenario](**arguments)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    (result_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result, default=str))


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)


def worker_environment(world_size: int, on_cpu: bool) -> dict[str, str]:
    """The environment of every rank (without ``RANK`` and ``LOCAL_RANK``); skips a GPU run that needs
    more GPUs than the machine has. ``on_cpu``: no GPU visible to the workers."""
    if not on_cpu and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPOSITORY_ROOT), os.environ.get("PYTHONPATH")))),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    if on_cpu:
        environment["CUDA_VISIBLE_DEVICES"] = ""
    return environment


PORT_ATTEMPTS = 3
"""Launches of one run: the free port :func:`_free_port` finds is free only until rank 0 binds it, and
another process (a parallel test run, an outgoing connection) can take it in between."""


def _port_taken(logs: list[Path]) -> bool:
    return any("EADDRINUSE" in log.read_text(errors="replace") for log in logs if log.exists())


def _wait(workers: list[subprocess.Popen], logs: list[Path], deadline: float, timeout_seconds: float) -> bool:
    """Wait for every worker; ``False`` as soon as one has exited because the rendezvous port was taken
    (the others are killed), ``pytest.fail`` after ``timeout_seconds``."""
    while any(worker_process.poll() is None for worker_process in workers):
        if any(worker_process.returncode not in (None, 0) for worker_process in workers) and _port_taken(logs):
            return False
        if time.monotonic() > deadline:
            pytest.fail(f"the ranks did not finish within {timeout_seconds} s:\n{_tails(logs)}")
        time.sleep(0.2)
    return not _port_taken(logs)


def run_ranks(
    worker: Path, result_dir: Path, world_size: int, *args: str, timeout_seconds: float = 240, on_cpu: bool = False
) -> list[dict]:
    """Launch one ``worker`` per rank, wait (bounded) and return each rank's results (``on_cpu``: see
    :func:`worker_environment`); a launch whose rendezvous port was taken is repeated on another port."""
    logs = [result_dir / f"rank{rank}.log" for rank in range(world_size)]
    deadline = time.monotonic() + timeout_seconds
    for _ in range(PORT_ATTEMPTS):
        environment = worker_environment(world_size, on_cpu)
        with contextlib.ExitStack() as open_logs:
            workers = [
                subprocess.Popen(
                    [sys.executable, str(worker), str(result_dir), *args],
                    env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=open_logs.enter_context(log.open("w")),
                    stderr=subprocess.STDOUT,
                )
                for rank, log in enumerate(logs)
            ]
            try:
                launched = _wait(workers, logs, deadline, timeout_seconds)
            finally:
                for worker_process in workers:
                    if worker_process.poll() is None:
                        worker_process.kill()
                        worker_process.wait()
        if launched:
            break
    result_files = [result_dir / f"rank{rank}.json" for rank in range(world_size)]
    if not all(result_file.exists() for result_file in result_files):
        pytest.fail(f"a rank wrote no results:\n{_tails(logs)}")
    return [json.loads(result_file.read_text()) for result_file in result_files]


def scenario_results(ranks: list[dict], name: str) -> list[dict]:
    """One scenario's result on every rank, failing with the worker's traceback if it raised."""
    results = [rank_results.get(name) for rank_results in ranks]
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not reach {name} (an earlier scenario failed)"
        assert result["ok"], f"{name} failed on rank {rank}:\n{result.get('error')}"
    return results
