"""Megatron-LM's ``--exit-signal-handler`` through the entry (``megatron_lowprec.megatron.megatron_lm``)
when SIGTERM reaches every process of the run's group, as SLURM sends it at a time limit or on
preemption and ``kill -TERM -<group>`` and ``timeout`` send it: the data loader's workers and the
checkpoint writer service, which an earlier save started, keep running, so the save the signal asks
for completes and the run exits 0. Needs ``megatron.training`` (in the megatron-core package from 0.17)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from .launch import REPOSITORY_ROOT, worker_environment
from .test_megatron_lm import TINY_GPT, UNCOMPILED, WORKER, requires_megatron_training


def _group_members(group: int) -> list[psutil.Process]:
    found = []
    for candidate in psutil.process_iter():
        try:
            if os.getpgid(candidate.pid) == group:
                found.append(candidate)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


@requires_megatron_training
def test_sigterm_to_the_process_group_saves_and_exits_0_with_no_process_left(tmp_path):
    """One rank of Megatron-LM's ``pretrain`` on mock data, saving every 2 iterations (``torch_dist``),
    with 2 data loader workers: SIGTERM to its whole process group after iteration 5 ends the run
    with Megatron-LM's exit line after a successful save of the iteration it reached, exit 0, and
    no process of the group is left."""
    save = tmp_path / "checkpoints"
    argv = [*TINY_GPT, *UNCOMPILED, "--global-batch-size", "2", "--mock-data", "--num-workers", "2",
            "--eval-iters", "1", "--eval-interval", "100000", "--log-interval", "1", "--save", str(save),
            "--save-interval", "2", "--ckpt-format", "torch_dist", "--exit-signal-handler"]
    argv[argv.index("--train-iters") + 1] = "100000"
    environment = {**worker_environment(1, on_cpu=True), "RANK": "0", "LOCAL_RANK": "0"}
    process = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), "pretrain_gpt", json.dumps({"argv": argv})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, cwd=REPOSITORY_ROOT,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 240
    while not any(re.search(r"\biteration\s+5/", line) for line in seen):
        try:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
        except queue.Empty:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"no iteration 5 within 240 s:\n{''.join(seen)[-3000:]}")
    helpers = [member for member in _group_members(process.pid) if member.pid != process.pid]
    assert len(helpers) >= 3, "expected the data loader's 2 workers and the checkpoint writer service"
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the run did not stop within 120 s of the signal:\n{''.join(seen)[-3000:]}")
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    assert process.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert "exiting program after receiving SIGTERM." in output, output[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 5 and f"successfully saved checkpoint from iteration {saved:>7} to {save}" in output, output[-3000:]
    assert (save / f"iter_{saved:07d}" / ".metadata").is_file()
    deadline = time.monotonic() + 10
    while _group_members(process.pid):
        if time.monotonic() > deadline:
            left = [(member.pid, member.cmdline()[:4]) for member in _group_members(process.pid)]
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"processes of the run's group left 10 s after it ended: {left}")
        time.sleep(0.1)
