"""Checkpoints of a run: megatron ``dist_checkpointing`` for the model and optimizer, plus per-rank RNG.

``<run_dir>/checkpoints/iter_<N>/`` holds the sharded model and optimizer state (each state tensor
sharded like its parameter, so ``dist_checkpointing`` reshards it for another TP/PP layout), and in
its common part the iteration (which is also the data position, see
:mod:`megatron_lowprec.train.data`), the LR scheduler, the option and the parallel layout.
``rank<R>.pt`` beside them keeps each rank's RNG states (torch, megatron's tracker streams, Python,
NumPy), restored when the layout is unchanged; it holds tensors and plain containers only and is
read with ``weights_only=True``. Every option, ``coat`` included (its FP8 states are saved per
element, :mod:`megatron_lowprec.megatron.checkpoint_state`), and the distributed optimizer save the
same model-space optimizer state, so a checkpoint resumes at another TP/PP layout, data-parallel
size or ``optimizer.distributed`` setting. A checkpoint is written under ``iter_<N>.partial`` and renamed when every rank is done;
``checkpoints/latest`` names the newest complete one, so an interrupted save leaves the previous
checkpoint in charge.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path

import numpy
import torch

from megatron_lowprec.train.config import option_label

LATEST_FILE = "latest"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run, if any."""
    latest = checkpoints_dir(run_dir) / LATEST_FILE
    if not latest.is_file():
        return None
    path = checkpoints_dir(run_dir) / latest.read_text().strip()
    return path if path.is_dir() else None


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }


def _rng_states() -> dict:
    """Every RNG state as tensors and plain containers only (NumPy's key as an int64 tensor), so
    that the per-rank file loads with ``torch.load(weights_only=True)``."""
    from megatron.core import tensor_parallel

    name, key, position, has_gauss, cached_gaussian = numpy.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(numpy.int64)), position, has_gauss, cached_gaussian),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    random.setstate(states["python"])
    name, key, position, has_gauss, cached_gaussian = states["numpy"]
    numpy.random.set_state((name, key.numpy().astype(numpy.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def load_rank_file(path: Path) -> dict:
    """A per-rank file (``rank<R>.pt``), unpickled with ``weights_only=True``: tensors and plain
    containers only. A file that holds anything else (a tampered checkpoint that would run code
    when unpickled) is refused with ``ValueError``."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        reason = lines[0].strip() if lines else type(error).__name__
        raise ValueError(
            f"refusing to load {str(path)!r}: it holds objects other than tensors and plain containers "
            f"(a checkpoint of this project never does; it may have been tampered with): {reason}"
        ) from None


def _sharded_state(run, is_loading: bool) -> dict:
    model_state = run.model.module.sharded_state_dict()
    state = {
        "model": model_state,
        "iteration": run.iteration,
        "scheduler": run.scheduler.state_dict(),
        "option": option_label(run.config.precision),
        "layout": _layout(),
        "optimizer": run.optimizer.sharded_state_dict(model_state, is_loading=is_loading),
    }
    return state


def save(run) -> Path:
    """Write the checkpoint of ``run.iteration`` and point ``latest`` at it (collective)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    name = f"iter_{run.iteration:07d}"
    final = checkpoints_dir(run.run_dir) / name
    partial = final.with_name(f"{name}.partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state(run, is_loading=False), str(partial))
    per_rank = {"rng": _rng_states(), "layout": _layout()}
    torch.save(per_rank, partial / f"rank{rank}.pt")
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        latest = checkpoints_dir(run.run_dir) / LATEST_FILE
        latest.with_suffix(".partial").write_text(name)
        os.replace(latest.with_suffix(".partial"), latest)
    torch.distributed.barrier()
    return final


def load(run, path: Path) -> None:
    """Load ``path`` into ``run``: model, optimizer, scheduler, iteration; RNG at the same layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(run, is_loading=True), str(path))
    option = option_label(run.config.precision)
    if loaded["option"] != option:
        raise ValueError(f"checkpoint {str(path)!r} was trained with option {loaded['option']!r}, not {option!r}")
    same_layout = loaded["layout"] == _layout()
    run.model.module.load_state_dict(loaded["model"])
    per_rank = load_rank_file(path / f"rank{torch.distributed.get_rank()}.pt") if same_layout else None
    run.optimizer.load_state_dict(loaded["optimizer"])
    run.scheduler.load_state_dict(loaded["scheduler"])
    run.iteration = loaded["iteration"]
    if per_rank is not None:
        _set_rng_states(per_rank["rng"])


def resume_if_present(run, resume: bool | None) -> int | None:
    """Resume from the run directory's latest checkpoint unless ``resume`` is False; the step resumed
    from, or None (``lowprec-train`` has already refused ``resume=true`` without a checkpoint)."""
    path = None if resume is False else latest_checkpoint(run.run_dir)
    if path is None:
        return None
    load(run, path)
    return run.iteration
