"""Faults a cluster job meets, end to end on a tiny GPT: an exit signal reaching one rank of a DP=2
torchrun job, SIGTERM to every process of a run's group or of a torchrun job, damaged checkpoints (truncated, missing, half-written, bytes flipped), a changed
learning-rate schedule, model or batch geometry on resume, a diverging run, and Ctrl-C. On CPU with gloo (NCCL where CUDA is present)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import os
import queue
import re
import resource
import socket
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import xxhash

from megatron_lowprec.train.checkpoint import COMPLETE_FILE, checkpoint_problem, checkpoints_dir
from tests.megatron.launch import REPOSITORY_ROOT, run_ranks

WORKER = Path(__file__).with_name("_resume_worker.py")
LR, MIN_LR, WARMUP, DECAY = 3e-3, 3e-4, 1, 8

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="hydra-core is not installed"),
]


def _tiny(cache_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """A 2-layer, 32-wide GPT, 2 micro-batches of 2 per rank and step, a metrics row per step, no
    evaluation before the end, no wandb, the eager optimizer step (no compilation); the LR schedule
    decays over 8 steps whatever max_steps is."""
    return [
        "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32", "precision.fused=false",
        "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.log_interval=1",
        "trainer.eval_interval=1000", "trainer.eval_iters=1",
        f"optimizer.lr={LR}", f"optimizer.min_lr={MIN_LR}", f"optimizer.lr_warmup_steps={WARMUP}",
        f"optimizer.lr_decay_steps={DECAY}", "logging.wandb=false", f"data.cache_dir={cache_dir}",
        f"run_dir={run_dir}", *overrides,
    ]


def _environment() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPOSITORY_ROOT), os.environ.get("PYTHONPATH")))),
        "OMP_NUM_THREADS": "1",
    }


def _start(command: list[str]) -> tuple[subprocess.Popen, queue.Queue]:
    """A process in its own session, its output lines on a queue, with Ctrl-C's default action as a
    terminal's foreground job has it (pytest itself may run where SIGINT is ignored: a background
    job of a non-interactive shell, whose children would inherit that)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_environment(), start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    return process, lines


def _wait_for(process: subprocess.Popen, lines: queue.Queue, pattern: str, seen: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(pattern in line for line in seen):
        try:
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
        except queue.Empty:
            process.kill()
            pytest.fail(f"no line with {pattern!r} within {timeout} s:\n{''.join(seen)[-3000:]}")


def _finish(process: subprocess.Popen, lines: queue.Queue, seen: list[str], timeout: float) -> str:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the run did not stop within {timeout} s after the signal:\n{''.join(seen)[-3000:]}")
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    return "".join(seen)


def _cosine_lr(step: int, decay_steps: int) -> float:
    """The LR megatron's OptimizerParamScheduler sets after ``step`` steps: linear warmup to LR, then
    cosine decay to MIN_LR over ``decay_steps`` (Loshchilov & Hutter 2017), MIN_LR after."""
    if step <= WARMUP:
        return LR * step / WARMUP
    if step > decay_steps:
        return MIN_LR
    ratio = (step - WARMUP) / (decay_steps - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * ratio))


def test_sigterm_to_one_rank_saves_a_complete_checkpoint_and_damaged_ones_are_skipped(tmp_path, cache_dir):
    """A real SIGTERM reaches rank 1 of a DP=2 torchrun job and every helper process of both ranks
    (checkpoint writer service, compiler workers: SLURM signals every process of a job step), but not
    rank 0: both ranks stop after the same step, save, exit 0 with one line; resuming gives the
    straight run's parameters bit for bit. Then,
    on copies of the straight run: a truncated, a missing and a half-written file in the
    newest checkpoint, and 16 flipped bytes in its ``.metadata`` header or its tensor data, are each
    named in one line and the run resumes from the previous one (``latest`` pointed back at it), and
    a changed schedule stops the resume unless a key says which to take."""
    stopped = tmp_path / "stopped"
    process, lines = _start([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "megatron_lowprec.train", *_tiny(cache_dir, stopped, "trainer.max_steps=1000", "trainer.save_interval=1"),
    ])
    seen: list[str] = []
    _wait_for(process, lines, "step      2/1000", seen, timeout=240)
    workers = psutil.Process(process.pid).children()
    rank1 = next(worker for worker in workers if worker.environ().get("RANK") == "1")
    helpers = [helper for worker in workers for helper in worker.children(recursive=True)]
    assert helpers, "the ranks started no helper process (dist_checkpointing's writer service)"
    for receiver in (rank1, *helpers):
        with contextlib.suppress(ProcessLookupError):  # a save's short-lived writer may be gone
            os.kill(receiver.pid, signal.SIGTERM)
    output = _finish(process, lines, seen, timeout=120)
    assert process.returncode == 0, output[-3000:]
    stop_lines = [line for line in output.splitlines() if "received" in line]
    assert len(stop_lines) == 1 and "Traceback" not in output, output[-3000:]
    match = re.fullmatch(r"lowprec-train: SIGTERM received: stopped after step (\d+)/1000 and saved (\S+); "
                         r"a rerun with run_dir=(\S+) resumes from it", stop_lines[0])
    assert match, stop_lines[0]
    step = int(match.group(1))
    saved = checkpoints_dir(stopped) / f"iter_{step:07d}"
    assert match.group(2) == str(saved) and match.group(3) == str(stopped)
    assert checkpoint_problem(saved) is None
    marker = json.loads((saved / COMPLETE_FILE).read_text())
    assert marker["world_size"] == 2 and {"rank0.pt", "rank1.pt", "common.pt"} <= set(marker["files"])
    assert all(entry["xxh3_128"] == xxhash.xxh3_128((saved / name).read_bytes()).hexdigest()
               for name, entry in marker["files"].items())
    assert (checkpoints_dir(stopped) / "latest").read_text() == saved.name
    rows = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, step + 1))

    last = step + 2
    straight = tmp_path / "straight"
    newest = f"iter_{last:07d}"
    copies = {name: tmp_path / name for name in ("truncated", "missing", "half", "header", "flipped", "schedule", "kept",
                                                 "batch")}
    steps = [
        {"overrides": _tiny(cache_dir, stopped, f"trainer.max_steps={last}", "resume=true")},
        {"overrides": _tiny(cache_dir, straight, f"trainer.max_steps={last}", "trainer.save_interval=1")},
        *({"copy": [str(straight), str(copy)]} for copy in copies.values()),
        {"truncate": [str(checkpoints_dir(copies["truncated"]) / newest / "__0_0.distcp"), 100]},
        {"overrides": _tiny(cache_dir, copies["truncated"], f"trainer.max_steps={last}")},
        {"remove": str(checkpoints_dir(copies["missing"]) / newest / "common.pt")},
        {"overrides": _tiny(cache_dir, copies["missing"], f"trainer.max_steps={last - 1}")},
        {"remove": str(checkpoints_dir(copies["half"]) / newest / COMPLETE_FILE)},
        {"remove": str(checkpoints_dir(copies["half"]) / newest / "rank1.pt")},
        {"overrides": _tiny(cache_dir, copies["half"], f"trainer.max_steps={last}")},
        {"flip": str(checkpoints_dir(copies["header"]) / newest / ".metadata")},
        {"overrides": _tiny(cache_dir, copies["header"], f"trainer.max_steps={last - 1}")},
        {"flip": str(checkpoints_dir(copies["flipped"]) / newest / "__0_0.distcp")},
        {"overrides": _tiny(cache_dir, copies["flipped"], f"trainer.max_steps={last}")},
        {"overrides": _tiny(cache_dir, tmp_path / "vocabulary", "model.vocab_size=10", "trainer.max_steps=1")},
        # The case: heads 4 -> 8 and LayerNorm -> RMSNorm; then a larger global batch.
        {"overrides": _tiny(cache_dir, copies["batch"], f"trainer.max_steps={last}", "model.num_attention_heads=8",
                            "model.normalization=RMSNorm", "trainer.global_batch_size=16")},
        {"overrides": _tiny(cache_dir, copies["batch"], f"trainer.max_steps={last + 1}", "trainer.global_batch_size=16")},
        {"overrides": _tiny(cache_dir, copies["batch"], f"trainer.max_steps={last + 1}", "trainer.global_batch_size=16",
                            "resume_allow_changes=[trainer.global_batch_size]")},
        # The case: max_steps changed (the decay follows it) and, here, the peak LR too.
        {"overrides": _tiny(cache_dir, copies["schedule"], f"trainer.max_steps={last + 2}", "optimizer.lr_decay_steps=null",
                            "optimizer.lr=0.002")},
        {"overrides": _tiny(cache_dir, copies["schedule"], f"trainer.max_steps={last + 2}", "optimizer.lr_decay_steps=null",
                            "optimizer.override_opt_param_scheduler=true")},
        {"overrides": _tiny(cache_dir, copies["kept"], f"trainer.max_steps={last + 2}", "optimizer.lr_decay_steps=null",
                            "optimizer.use_checkpoint_opt_param_scheduler=true")},
    ]
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    (resumed, straight_run, truncated, missing, half, header, flipped, vocabulary, other_model, other_batch, batch_allowed,
     changed, overridden, kept) = run_ranks(
        WORKER, result_dir, 2, json.dumps(steps), timeout_seconds=400
    )[0]
    log = (result_dir / "rank0.log").read_text()
    digest = straight_run["summary"]["parameter_digest"]
    assert resumed["summary"]["parameter_digest"] == digest
    assert [row["loss"] for row in resumed["train_rows"]][-2:] == [row["loss"] for row in straight_run["train_rows"]][-2:]

    def skipped(run_dir: Path) -> str:
        found = [line for line in log.splitlines() if f"skipping checkpoint {checkpoints_dir(run_dir) / newest}:" in line]
        assert len(found) == 1, log[-3000:]
        return found[0]

    assert "__0_0.distcp has 100 bytes" in skipped(copies["truncated"])
    assert truncated["summary"]["parameter_digest"] == digest and truncated["latest"] == newest
    assert "common.pt is missing" in skipped(copies["missing"])
    assert missing["latest"] == f"iter_{last - 1:07d}"
    assert f"has no {COMPLETE_FILE}" in skipped(copies["half"])
    assert half["summary"]["parameter_digest"] == digest
    # Same size, other bytes: the checksums recorded at save time catch header and tensor data alike.
    assert ".metadata does not match its xxh3_128 checksum" in skipped(copies["header"])
    assert header["latest"] == f"iter_{last - 1:07d}"
    # Rank 1 checksums __0_0.distcp (the second of the sorted names) and tells rank 0.
    assert "__0_0.distcp does not match its xxh3_128 checksum" in skipped(copies["flipped"])
    assert flipped["summary"]["parameter_digest"] == digest and flipped["latest"] == newest
    assert vocabulary["error"].startswith("model.vocab_size=10 is below the tokenizer's ")
    newest_path = checkpoints_dir(copies["batch"]) / newest
    assert other_model["error"] == (
        f"{newest_path} was trained with another model, batch geometry or optimizer: model.num_attention_heads 8 here, "
        "4 in the checkpoint; model.normalization RMSNorm here, LayerNorm in the checkpoint; trainer.global_batch_size "
        "16 here, 8 in the checkpoint. model.num_attention_heads, model.normalization define the model's parameters or "
        "the optimizer's state: set them as the checkpoint has them, or resume=false to start over")
    assert other_batch["error"].endswith(
        "trainer.global_batch_size 16 here, 8 in the checkpoint. resume_allow_changes=[trainer.global_batch_size] "
        "resumes with the new values")
    assert [row["step"] for row in batch_allowed["train_rows"]][-1] == last + 1 and "error" not in batch_allowed

    assert "error" in changed and "summary" not in changed
    assert f"trainer.max_steps (the decay steps) {last + 2} here, {DECAY} in the checkpoint" in changed["error"]
    assert f"optimizer.lr 0.002 here, {LR} in the checkpoint" in changed["error"]
    assert "override_opt_param_scheduler" in changed["error"]
    # The row of step t holds the LR of that step, set after t - 1 steps.
    assert [row["step"] for row in overridden["train_rows"]][-2:] == [last + 1, last + 2]
    assert [row["lr"] for row in overridden["train_rows"]][-2:] == pytest.approx(
        [_cosine_lr(last, last + 2), _cosine_lr(last + 1, last + 2)], rel=1e-12)
    assert [row["lr"] for row in kept["train_rows"]][-2:] == pytest.approx(
        [_cosine_lr(last, DECAY), _cosine_lr(last + 1, DECAY)], rel=1e-12)


def test_ctrl_c_names_the_step_and_the_checkpoint_a_rerun_resumes_from(tmp_path, cache_dir):
    """SIGINT to the process group (what Ctrl-C does): exit 130, one line, no traceback; the summary
    an earlier run left in the directory is gone (the run removed it as it started) and none is written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2}))
    process, lines = _start([sys.executable, "-m", "megatron_lowprec.train",
                             *_tiny(cache_dir, run_dir, "trainer.max_steps=1000", "trainer.save_interval=1")])
    seen: list[str] = []
    _wait_for(process, lines, "step      3/1000", seen, timeout=240)
    os.killpg(process.pid, signal.SIGINT)
    output = _finish(process, lines, seen, timeout=120)
    assert process.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    last_line = output.splitlines()[-1]
    match = re.fullmatch(r"lowprec-train: interrupted after step (\d+)/1000; a rerun with run_dir=(\S+) resumes from (\S+)",
                         last_line)
    assert match, output[-3000:]
    assert int(match.group(1)) >= 3 and match.group(2) == str(run_dir)
    checkpoint = Path(match.group(3))
    assert checkpoint.parent == checkpoints_dir(run_dir) and checkpoint_problem(checkpoint) is None
    # A checkpoint is saved after every step (Ctrl-C during a save stops the run once it is written);
    # Ctrl-C between a step and its save leaves the previous one.
    assert checkpoint.name in (f"iter_{int(match.group(1)):07d}", f"iter_{int(match.group(1)) - 1:07d}")
    assert not (run_dir / "summary.json").exists()


def _strict_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, refusing ``NaN`` and ``Infinity`` (not JSON)."""
    def refuse(constant: str):
        raise ValueError(f"{constant} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_a_diverging_run_stops_keeps_its_last_good_checkpoint_and_writes_strict_json(tmp_path, cache_dir):
    """At lr=1e6 the loss turns NaN within a few steps: the run stops after 2 such steps in a row with
    one line and exit 3, saving no checkpoint after the last finite step; metrics.jsonl holds null for
    NaN, and a strict summary.json says ``diverged``, the last finite step, the steps that were not and
    the last good checkpoint. A rerun that trains on (max_nonfinite_steps=0) resumes from the last good
    checkpoint, saves none of its NaN steps and leaves one row per step and a strict summary.json
    (``finished``)."""
    run_dir = tmp_path / "run"
    diverging = _tiny(cache_dir, run_dir, "optimizer.lr=1e6", "optimizer.min_lr=0", "trainer.save_interval=1")
    first = subprocess.run([sys.executable, "-m", "megatron_lowprec.train", *diverging, "trainer.max_steps=8",
                            "trainer.max_nonfinite_steps=2"], capture_output=True, text=True, env=_environment(), timeout=300)
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    match = re.fullmatch(
        r"lowprec-train: diverged: the loss or the gradient norm was not finite for 2 steps in a row "
        r"\(steps (\d+)-(\d+); last: loss nan\); stopped without saving them; the last good checkpoint is (\S+) "
        r"\(a lower optimizer.lr, or trainer.max_nonfinite_steps=0 to train on\)", first.stderr.strip().splitlines()[-1])
    assert match, first.stderr[-3000:]
    first_nan, last_nan = int(match.group(1)), int(match.group(2))
    good = checkpoints_dir(run_dir) / f"iter_{first_nan - 1:07d}"
    assert last_nan == first_nan + 1 and match.group(3) == str(good)
    assert sorted(path.name for path in checkpoints_dir(run_dir).glob("iter_*"))[-1] == good.name
    assert checkpoint_problem(good) is None
    rows = _strict_rows(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, last_nan + 1))
    assert [row["loss"] for row in rows][-2:] == [None, None] and None not in [row["loss"] for row in rows][:-2]
    diverged = json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda constant: pytest.fail(constant))
    assert diverged["status"] == "diverged" and diverged["steps"] == last_nan
    assert diverged["last_finite_step"] == first_nan - 1 and diverged["nonfinite_steps"] == [first_nan, last_nan]
    assert diverged["final_train_loss"] == rows[-3]["loss"] and diverged["last_loss"] is None
    assert diverged["reason"].startswith("the loss or the gradient norm was not finite for 2 steps in a row "
                                         "(trainer.max_nonfinite_steps=2; last: loss nan")
    assert diverged["checkpoint"] == str(good) and diverged["run_dir"] == str(run_dir)
    assert diverged["option"] == "A" and diverged["parameters"] > 0 and diverged["tokens_per_second"] > 0

    second = subprocess.run([sys.executable, "-m", "megatron_lowprec.train", *diverging, f"trainer.max_steps={last_nan + 1}",
                             "trainer.max_nonfinite_steps=0"], capture_output=True, text=True, env=_environment(), timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rows = _strict_rows(run_dir / "metrics.jsonl")
    assert [(row["step"], row["split"]) for row in rows] == [
        *((step, "train") for step in range(1, last_nan + 2)), (last_nan + 1, "valid")]
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda constant: pytest.fail(constant))
    assert summary["final_train_loss"] is None and summary["steps"] == last_nan + 1 and summary["status"] == "finished"
    assert sorted(path.name for path in checkpoints_dir(run_dir).glob("iter_*"))[-1] == good.name


def test_one_job_per_run_dir_and_kill_9_of_the_launcher_during_a_save_leaves_no_process(tmp_path, cache_dir):
    """While a DP=2 torchrun job trains, a second job on its run directory stops with one line naming
    the holder's host and pid (exit 2). Then ``kill -9`` of the torchrun agent while a rank has a
    checkpoint writer running: within seconds no process of the job is left (ranks, writers, the
    writer service); the lock is free again. A rerun under a file-size quota that its checkpoint
    exceeds stops with one line (exit 1), the partial checkpoint removed, the last one intact."""
    run_dir = tmp_path / "run"
    process, lines = _start([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "megatron_lowprec.train", *_tiny(cache_dir, run_dir, "trainer.max_steps=1000", "trainer.save_interval=1"),
    ])
    seen: list[str] = []
    _wait_for(process, lines, "step      2/1000", seen, timeout=240)
    agent = psutil.Process(process.pid)
    rank0 = next(worker for worker in agent.children() if worker.environ().get("RANK") == "0")
    second = subprocess.run([sys.executable, "-m", "megatron_lowprec.train", *_tiny(cache_dir, run_dir, "trainer.max_steps=3")],
                            capture_output=True, text=True, env=_environment(), timeout=240)
    while not lines.empty():
        seen.append(lines.get())
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:] + "".join(seen)[-5000:]
    assert second.stderr.strip().splitlines()[-1] == (
        f"lowprec-train: config error: run_dir={str(run_dir)!r} is in use by another job (host {socket.gethostname()} "
        f"pid {rank0.pid}, which holds {run_dir / 'lock'}); wait for it to end, or choose another run_dir")

    deadline = time.monotonic() + 120
    while True:  # a rank with more than its writer service as children is writing a checkpoint
        job = agent.children(recursive=True)
        if any(len(worker.children()) > 1 for worker in agent.children()) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert time.monotonic() <= deadline, "no checkpoint writer seen within 120 s"
    os.kill(process.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(job, timeout=20)
    assert not alive, [(left.pid, left.cmdline()[:4]) for left in alive]
    # Writers forked after the snapshot carry the rank's command line.
    left = [found.pid for found in psutil.process_iter(["cmdline"]) if f"run_dir={run_dir}" in (found.info["cmdline"] or [])]
    assert not left, left
    with (run_dir / "lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def file_size_quota() -> None:
        """Writes past 500 kB fail in the file-system call (EFBIG), as on a full disk or quota."""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000))

    latest = checkpoints_dir(run_dir) / (checkpoints_dir(run_dir) / "latest").read_text()
    next_step = int(latest.name.removeprefix("iter_")) + 1
    quota = subprocess.run(
        [sys.executable, "-m", "megatron_lowprec.train", *_tiny(cache_dir, run_dir, f"trainer.max_steps={next_step}")],
        capture_output=True, text=True, env=_environment(), timeout=240, preexec_fn=file_size_quota)
    assert quota.returncode == 1 and "Traceback" not in quota.stderr, quota.stderr[-3000:]
    unwritten = checkpoints_dir(run_dir) / f"iter_{next_step:07d}"
    assert re.fullmatch(rf"lowprec-train: checkpoint {re.escape(str(unwritten))} could not be written \(.+\); its partial "
                        rf"files were removed, {re.escape(str(latest))} is intact", quota.stderr.strip().splitlines()[-1])
    assert not unwritten.exists() and not unwritten.with_name(unwritten.name + ".partial").exists()
    assert (checkpoints_dir(run_dir) / "latest").read_text() == latest.name and checkpoint_problem(latest) is None


def _group_members(groups: set[int]) -> list[psutil.Process]:
    """Every process whose process group is one of ``groups``."""
    found = []
    for candidate in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(candidate.pid) in groups:
                found.append(candidate)
    return found


def _assert_groups_empty(groups: set[int], timeout: float) -> None:
    """Within ``timeout`` seconds no process of ``groups`` is left (``killpg(group, 0)`` finds none)."""
    deadline = time.monotonic() + timeout
    for group in groups:
        while True:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                left = [(member.pid, member.cmdline()[:4]) for member in _group_members({group})]
                os.killpg(group, signal.SIGKILL)
                pytest.fail(f"processes of group {group} left {timeout} s after the run ended: {left}")
            time.sleep(0.1)


def _assert_stopped_and_saved(output: str, run_dir: Path, world_size: int) -> None:
    """One stop line naming a complete checkpoint of ``world_size`` ranks, which summary.json (status
    ``stopped by SIGTERM``) names too."""
    stop_lines = [line for line in output.splitlines() if "SIGTERM received" in line]
    assert len(stop_lines) == 1, output[-3000:]
    match = re.fullmatch(r"lowprec-train: SIGTERM received: stopped after step (\d+)/1000 and saved (\S+); "
                         r"a rerun with run_dir=(\S+) resumes from it", stop_lines[0])
    assert match, stop_lines[0]
    saved = checkpoints_dir(run_dir) / f"iter_{int(match.group(1)):07d}"
    assert match.group(2) == str(saved) and checkpoint_problem(saved) is None
    assert json.loads((saved / COMPLETE_FILE).read_text())["world_size"] == world_size
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=lambda constant: pytest.fail(constant))
    assert summary["status"] == "stopped by SIGTERM" and summary["checkpoint"] == str(saved)
    assert summary["steps"] == int(match.group(1))


def test_sigterm_to_the_process_group_saves_exits_0_and_leaves_no_process(tmp_path, cache_dir):
    """SIGTERM to every process of a single-process run's group (as ``kill -TERM -<group>``, ``timeout``
    and SLURM send it), its checkpoint writer service and resource tracker included: the run stops
    after a step, saves a complete checkpoint, exits 0 with one line, and no process of the group is
    left."""
    run_dir = tmp_path / "run"
    process, lines = _start([sys.executable, "-m", "megatron_lowprec.train",
                             *_tiny(cache_dir, run_dir, "trainer.max_steps=1000")])
    seen: list[str] = []
    _wait_for(process, lines, "step      3/1000", seen, timeout=240)
    helpers = [member for member in _group_members({process.pid}) if member.pid != process.pid]
    assert helpers, "the run started no helper process (dist_checkpointing's writer service)"
    os.killpg(process.pid, signal.SIGTERM)
    output = _finish(process, lines, seen, timeout=120)
    assert process.returncode == 0 and "Traceback" not in output, output[-3000:]
    _assert_stopped_and_saved(output, run_dir, world_size=1)
    _assert_groups_empty({process.pid}, timeout=10)


def test_sigterm_to_every_process_of_a_torchrun_job_saves_and_leaves_no_process(tmp_path, cache_dir):
    """SIGTERM to every process group of a DP=2 torchrun job (the agent's and each rank's, which
    torchrun starts in its own session; under SLURM every process of the step gets it) and again from
    the agent, which forwards it to each rank's group: both ranks stop after the same step and save a
    complete checkpoint with one line and no traceback of theirs, and no process of the job is left.
    The agent itself exits 1 with torch's ``SignalException``: torchrun's own status for a signal."""
    run_dir = tmp_path / "run"
    process, lines = _start([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "megatron_lowprec.train", *_tiny(cache_dir, run_dir, "trainer.max_steps=1000"),
    ])
    seen: list[str] = []
    _wait_for(process, lines, "step      3/1000", seen, timeout=240)
    job = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    groups = {os.getpgid(member.pid) for member in job}
    assert len(groups) == 3 and len(job) > 3, [(member.pid, member.cmdline()[:4]) for member in job]
    for group in groups:
        os.killpg(group, signal.SIGTERM)
    output = _finish(process, lines, seen, timeout=120)
    assert process.returncode == 1, output[-3000:]
    assert output.count("Traceback") == 1, output[-3000:]
    assert re.search(rf"SignalException: Process {process.pid} got signal: {int(signal.SIGTERM)}\s*$", output), output[-3000:]
    _assert_stopped_and_saved(output, run_dir, world_size=2)
    _assert_groups_empty(groups, timeout=10)
