"""Launch a worker script once per rank on localhost, bounded in time, and collect its results.

Each worker gets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (the
repository root on ``PYTHONPATH``), is called as ``python WORKER RESULT_DIR *ARGS``, creates its process
group with :func:`init_process_group` and writes ``RESULT_DIR/rank<N>.json``. Without CUDA the ranks
talk over gloo (the workers run megatron through the CUDA→CPU bridge); with CUDA over NCCL, one GPU
per rank, and a run needing more GPUs than the machine has is skipped. A run ``on_cpu`` hides the GPUs
from its workers: they take the CPU bridge and gloo on every machine, GPU machines included.

Without CUDA, each rank is forked from a server process that has already imported torch, megatron-core
and the package (:data:`PRELOADED`; Python's ``forkserver``): a fresh interpreter spends about 4 CPU
seconds on those imports, and the suite starts hundreds of ranks on CI's two cores. The rank then runs
its worker as ``python WORKER ...`` would (``__main__``, its folder first on ``sys.path``, its own
environment, output to its log, exit handlers at the end). With CUDA every rank is a new interpreter:
a process forked after CUDA's initialization cannot use it, and which GPUs a rank sees is read then.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import importlib.util
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

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


PRELOADED = (
    "torch",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.training",
    "megatron_lowprec.megatron",
    "megatron_lowprec.optim",
    "tests.megatron.launch",
)
"""What the rank server imports before it forks ranks; a module that does not import is left out
(``megatron.training``, Megatron-LM's loop, ships with megatron-core 0.17+ only)."""


@functools.cache
def _rank_server() -> multiprocessing.context.BaseContext:
    """Python's ``forkserver``, started once per test process with :data:`PRELOADED` imported and the
    threading and warning settings every rank gets (:func:`worker_environment`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([name for name in PRELOADED if importlib.util.find_spec(name.split(".")[0])])
    from multiprocessing import forkserver

    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}):
        forkserver.ensure_running()
    return context


def _run_forked_rank(worker: str, args: list[str], environment: dict[str, str], log: str) -> None:
    """In a rank forked from the server: run ``worker`` as ``python WORKER *ARGS`` with ``environment``
    and its output in ``log``. Its multiprocessing start method is unset, as in a new interpreter (a
    process that the forkserver starts inherits "forkserver", and a DataLoader's workers, which
    Megatron-LM gives a local ``worker_init_fn``, cannot be pickled for it)."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    os.environ.clear()
    os.environ.update(environment)
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [worker, *args]
    sys.path.insert(0, os.path.dirname(worker))
    try:
        runpy.run_path(worker, run_name="__main__")
    finally:
        atexit._run_exitfuncs()


class _ForkedRank:
    """A rank forked from the server, with the part of ``subprocess.Popen`` that :func:`run_ranks` uses."""

    def __init__(self, worker: Path, args: tuple[str, ...], environment: dict[str, str], log: Path) -> None:
        self.process = _rank_server().Process(target=_run_forked_rank, args=(str(worker), list(args), environment, str(log)))
        self.process.start()

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode


def _start_rank(worker: Path, args: tuple[str, ...], environment: dict[str, str], log: Path, open_logs: contextlib.ExitStack):
    """One rank: forked from the rank server without CUDA, a new interpreter with it."""
    if not torch.cuda.is_available():
        return _ForkedRank(worker, args, environment, log)
    return subprocess.Popen(
        [sys.executable, str(worker), *args], env=environment,
        stdout=open_logs.enter_context(log.open("w")), stderr=subprocess.STDOUT,
    )


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
                _start_rank(worker, (str(result_dir), *args), {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            log, open_logs)
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
