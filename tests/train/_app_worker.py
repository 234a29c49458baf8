"""One rank of the training-app checks: ``lowprec-train`` runs inside one process group (gloo, or NCCL
where CUDA is present: see ``tests.megatron.launch.init_process_group``).

Launched by ``test_app.py`` through ``tests/megatron/launch.run_ranks`` as
``python _app_worker.py RESULT_DIR JSON``, where JSON is a list of steps, each either
``{"overrides": [...]}`` (one ``train(compose(overrides))``) or ``{"copy_checkpoint": {"run_dir":
..., "iteration": N, "to": ...}}`` (rank 0 seeds a new run directory with that checkpoint, as a
user resuming from a copy would). Writes ``RESULT_DIR/rank<N>.json``: per training step, the
summary and (rank 0) the metrics rows.
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
from megatron_lowprec.train.checkpoint import LATEST_FILE, checkpoints_dir
from megatron_lowprec.train.loop import train
from tests.megatron.launch import init_process_group


def _copy_checkpoint(run_dir: str, iteration: int, to: str) -> None:
    if torch.distributed.get_rank() == 0:
        name = f"iter_{iteration:07d}"
        target = checkpoints_dir(Path(to))
        target.mkdir(parents=True)
        shutil.copytree(checkpoints_dir(Path(run_dir)) / name, target / name)
        (target / LATEST_FILE).write_text(name)
    torch.distributed.barrier()


def _metrics_rows(summary: dict) -> list[dict]:
    metrics = Path(summary["run_dir"]) / "metrics.jsonl"
    if torch.distributed.get_rank() != 0:
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def main(result_dir: Path, steps: list[dict]) -> None:
    results = []
    with cpu_bridge():
        init_process_group(timeout_seconds=300)
        try:
            for step in steps:
                if "copy_checkpoint" in step:
                    _copy_checkpoint(**step["copy_checkpoint"])
                    continue
                summary = train(compose(step["overrides"]))
                results.append({"summary": summary, "rows": _metrics_rows(summary)})
        finally:
            torch.distributed.destroy_process_group()
    (result_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
