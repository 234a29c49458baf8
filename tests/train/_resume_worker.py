"""One rank of the fault-handling checks: trainings, checkpoint damage and resumes in one process group.

Launched by ``test_fault_handling.py`` through ``tests/megatron/launch.run_ranks`` as
``python _resume_worker.py RESULT_DIR JSON``, where JSON is a list of steps, run in order:

- ``{"overrides": [...]}``: one ``train(compose(overrides))``; records its result (the summary) or,
  where it raises :class:`~megatron_lowprec.train.checkpoint.ResumeError` or
  :class:`~megatron_lowprec.train.config.ConfigError`, the error's message, and
  (rank 0) the run's train metrics rows and what ``checkpoints/latest`` names afterwards;
- ``{"copy": [FROM, TO]}``: rank 0 copies a run directory;
- ``{"convert": [CHECKPOINT, TO, OPTION]}``: rank 0 converts a checkpoint (``lowprec-convert``);
- ``{"truncate": [FILE, BYTES]}``, ``{"remove": FILE}``, ``{"flip": FILE}`` (invert 16 bytes in its
  middle): rank 0 damages a checkpoint file, as a
  full disk, a lost file or a bad block would.

Writes ``RESULT_DIR/rank<N>.json``: one entry per ``overrides`` step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_lowprec.megatron.cpu import cpu_bridge
from megatron_lowprec.train.app import compose
from megatron_lowprec.train.checkpoint import LATEST_FILE, ResumeError, checkpoints_dir
from megatron_lowprec.train.config import ConfigError
from megatron_lowprec.train.loop import train
from tests.megatron.launch import init_process_group


def _damage(step: dict) -> None:
    if "copy" in step:
        shutil.copytree(*step["copy"])
    elif "convert" in step:
        from megatron_lowprec.train.convert import convert_checkpoint

        Path(step["convert"][1]).parent.mkdir(parents=True, exist_ok=True)
        for line in convert_checkpoint(*step["convert"]):
            print(f"lowprec-convert: {line}", flush=True)
    elif "truncate" in step:
        os.truncate(*step["truncate"])
    elif "remove" in step:
        os.remove(step["remove"])
    elif "flip" in step:
        data = bytearray(Path(step["flip"]).read_bytes())
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(byte ^ 0xFF for byte in data[middle:middle + 16])
        Path(step["flip"]).write_bytes(bytes(data))


def _train(overrides: list[str]) -> dict:
    config = compose(overrides)
    try:
        result = {"summary": train(config)}
    except (ResumeError, ConfigError) as error:
        result = {"error": str(error)}
    run_dir = Path(config.run_dir)
    if torch.distributed.get_rank() == 0:
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        result["train_rows"] = [row for row in rows if row["split"] == "train"]
        latest = checkpoints_dir(run_dir) / LATEST_FILE
        result["latest"] = latest.read_text() if latest.is_file() else None
    return result


def main(result_dir: Path, steps: list[dict]) -> None:
    results = []
    with cpu_bridge():
        init_process_group(timeout_seconds=300)
        try:
            for step in steps:
                if "overrides" in step:
                    results.append(_train(step["overrides"]))
                    continue
                if torch.distributed.get_rank() == 0:
                    _damage(step)
                torch.distributed.barrier()
        finally:
            torch.distributed.destroy_process_group()
    (result_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
