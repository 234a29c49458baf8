"""``lowprec-train`` with device-placement bugs put back, under the strict CPU bridge (one rank).

Launched by ``test_device_placement.py`` as ``python _device_placement_worker.py RESULT_DIR JSON``
(JSON: the overrides of a tiny run). Runs the app once as it is, then once per entry of
:data:`REINTRODUCED`, each a bug that stopped the first GPU runs, and writes ``RESULT_DIR/rank0.json``:
per run, ``null`` if it trained or the strict bridge's error message.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from megatron_lowprec.megatron.cpu import cpu_bridge
from megatron_lowprec.train import loop, metrics
from megatron_lowprec.train.app import compose
from megatron_lowprec.train.data import BATCH_KEYS
from tests.strict_bridge import HostPlacementError, StrictPlacementCheck


class _TorchWithoutDevices:
    """The ``torch`` module as a module sees it, with ``device=`` dropped from ``zeros`` and ``tensor``:
    the tensors its code creates for collectives land on the CPU, as before the fix."""

    def __getattr__(self, name):
        attribute = getattr(torch, name)
        if name not in ("zeros", "tensor"):
            return attribute

        def without_device(*args, **kwargs):
            kwargs.pop("device", None)
            return attribute(*args, **kwargs)

        return without_device


def _batches_left_on_the_cpu():
    """``train/data.py batches`` as it was: the stacked micro-batches stay where the samples are."""

    def batches(dataset, config, first_sample, num_microbatches):
        micro = config.trainer.micro_batch_size
        result = []
        for microbatch in range(num_microbatches):
            start = first_sample + microbatch * micro
            samples = [dataset[index % len(dataset)] for index in range(start, start + micro)]
            result.append({key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]) for key in BATCH_KEYS})
        return result

    return mock.patch.object(loop, "batches", batches)


REINTRODUCED = {
    "parameter_count_on_cpu": lambda: mock.patch.object(metrics, "torch", _TorchWithoutDevices()),
    "loss_totals_on_cpu": lambda: mock.patch.object(loop, "torch", _TorchWithoutDevices()),
    "batches_on_cpu": _batches_left_on_the_cpu,
    "model_not_moved": lambda: mock.patch.object(torch.nn.Module, "cuda", lambda module, device=None: module),
}
"""Failures 3 (``parameter_count``, ``_mean_loss``: CPU tensors in ``all_reduce``), 4 (micro-batches left
on the CPU) and 5 (the model never moved to the GPU) of the GPU-first issue."""


def main(result_dir: Path, overrides: list[str]) -> None:
    results = {}
    runs = {"unchanged": contextlib.nullcontext, **REINTRODUCED}
    with cpu_bridge(check=StrictPlacementCheck()):
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        try:
            for name, reintroduce in runs.items():
                try:
                    with reintroduce():
                        loop.train(compose([*overrides, f"run_dir={result_dir / name}"]))
                    results[name] = None
                except HostPlacementError as error:
                    results[name] = str(error)
        finally:
            torch.distributed.destroy_process_group()
    (result_dir / "rank0.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
