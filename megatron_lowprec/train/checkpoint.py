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
size or ``optimizer.use_distributed_optimizer`` setting. The common part also records the model's architecture
and batch geometry (:func:`~megatron_lowprec.train.config.run_shape`); a resume with other values
stops, but for the keys ``resume_allow_changes`` names.

A checkpoint counts only once every rank has finished writing it: it is written under
``iter_<N>.partial``; after a barrier each rank checksums its share of the files (XXH3-128, while
they are in the page cache) and rank 0 writes the completion marker ``complete.json`` last (every
file of the checkpoint with its size and checksum, written to a temporary name and renamed), renames
the directory and points ``checkpoints/latest`` at it, so an interrupted save leaves the previous
checkpoint in charge. On resume every rank checksums its share of the files again; a checkpoint
without the marker, with a file missing, of another size or another checksum than the marker says,
or one that fails to load (any exception of the checkpoint library, ``BaseException`` subclasses
included) is named in one line with the file and the previous one is tried (``resume_from=<checkpoint>`` insists on one checkpoint and stops instead); ``latest`` is
pointed back at the first intact one before it is loaded. A checkpoint written with another option
(or megatron-core's own AdamW) is read with that option's state keys and converted by meaning
into this run's, AdamW's or Muon's (each optimizer of the chain), where ``precision.convert_checkpoint`` asks for it
(:func:`~megatron_lowprec.megatron.conversion.convert_loaded_state_`). A checkpoint written with
another option without that setting, or with another learning-rate schedule unless ``optimizer.override_opt_param_scheduler`` or
``optimizer.use_checkpoint_opt_param_scheduler`` says which to take (Megatron-LM's flags), stops the
run with :class:`ResumeError`.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import random
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy
import torch

from megatron_lowprec.megatron.torch_dist import (
    DISTRIBUTED_FORM_KEY, DISTRIBUTED_MASTER_KEY, MODEL_SPACE_FORM, STOCK_FORM_KEY, distributed_form, stock_step,
    unread_distributed_form,
)
from megatron_lowprec.optim.convert import STOCK, STOCK_MASTER_KEY, as_shaped_like, with_saved_exponent_storage
from megatron_lowprec.optim.strategies import get_strategy, storage_difference, stores_other_exponents
from megatron_lowprec.train.config import (
    RESUME_CHANGEABLE, STOCK_OPTIMIZER_LABEL, ConfigError, option_label, run_shape,
)

LATEST_FILE = "latest"
COMPLETE_FILE = "complete.json"
CHECKPOINT_NAME = re.compile(r"iter_(\d+)")
CHECKSUM_KEY = "xxh3_128"


class ResumeError(RuntimeError):
    """A checkpoint the run cannot resume from: written with another option or schedule, or damaged
    where the run insists on it (``resume_from``), or no intact one left."""


class DamagedCheckpoint(RuntimeError):
    """A checkpoint that fails to load on some rank."""


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, iteration: int) -> Path:
    """Where the checkpoint of ``iteration`` lives once complete."""
    return checkpoints_dir(run_dir) / f"iter_{iteration:07d}"


def file_checksum(path: Path) -> str:
    """Hex XXH3-128 of a file's bytes (xxHash: about 5 GB/s on one core, against 0.3 GB/s for SHA-256
    and 0.8 GB/s for zlib's CRC-32), hashed through a memory map of the file (2-3 times faster than
    reading it in chunks)."""
    import xxhash

    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_128(mapped).hexdigest()


def _share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` of ``world_size`` checksums: every ``world_size``-th, from its own index."""
    return names[rank::world_size]


def checkpoint_problem(path: Path, share: tuple[int, int] | None = None) -> str | None:
    """Why ``path`` is not a complete checkpoint (no completion marker, a file the marker lists missing
    or of another size), or None. With ``share=(rank, world_size)`` the files of that rank's share
    (:func:`_share`) are also checksummed against the marker, so that all ranks together read every
    file once."""
    if not path.is_dir():
        return "does not exist"
    marker = path / COMPLETE_FILE
    if not marker.is_file():
        return f"has no {COMPLETE_FILE} (its save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
        entries = {name: entry if isinstance(entry, dict) else {"size": entry} for name, entry in files.items()}
        sizes = {name: int(entry["size"]) for name, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"its {COMPLETE_FILE} is unreadable ({type(error).__name__})"
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size:,} bytes, {size:,} were written"
    if share is None:
        return None
    for name in _share(sorted(entries), *share):
        expected = entries[name].get(CHECKSUM_KEY)
        if expected is None:
            continue  # a checkpoint written before checksums were recorded: sizes only
        try:
            found = file_checksum(path / name)
        except OSError as error:
            return f"{name} cannot be read ({error.strerror or error})"
        if found != expected:
            return f"{name} does not match its {CHECKSUM_KEY} checksum (its content changed after it was written)"
    return None


def _iteration(path: Path) -> int | None:
    match = CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints a resume tries, in order: the one ``latest`` names, then the older ones, newest
    first (all of them, newest first, without ``latest``)."""
    directory = checkpoints_dir(run_dir)
    numbered = sorted(
        ((_iteration(path), path) for path in directory.glob("iter_*") if _iteration(path) is not None),
        reverse=True,
    )
    latest = directory / LATEST_FILE
    if not latest.is_file():
        return [path for _, path in numbered]
    named = directory / latest.read_text().strip()
    limit = _iteration(named)
    return [named, *(path for iteration, path in numbered if limit is None or iteration < limit)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume of the run starts from: the first intact one of :func:`resume_candidates`."""
    return next((path for path in resume_candidates(run_dir) if checkpoint_problem(path) is None), None)


LOCK_FILE = "lock"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``<run_dir>/lock`` (``fcntl.flock``, taken by rank 0 for the job, which the kernel releases
    when the process ends however it ends) while the run lives: a second job on the same run
    directory stops with :class:`ConfigError` naming the host and pid of the holder (collective)."""
    import fcntl
    import socket

    holder = [""]
    handle = None
    if torch.distributed.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = (run_dir / LOCK_FILE).open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder[0] = handle.read().strip() or "another process"
            handle.close()
            handle = None
        else:
            handle.truncate(0)
            handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
            handle.flush()
    torch.distributed.broadcast_object_list(holder, src=0)
    if holder[0]:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is in use by another job ({holder[0]}, which holds {run_dir / LOCK_FILE}); "
            "wait for it to end, or choose another run_dir"
        )
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C while a checkpoint is written raises ``KeyboardInterrupt`` once it is complete. The
    writer processes megatron forks for a save inherit the handler: interrupted, they would leave
    the save waiting for them forever."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, flush it to disk and rename it over ``path``."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


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


OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""What the optimizer's ``sharded_state_dict`` is told: megatron-core's own DistributedOptimizer
(``baseline=megatron`` with ``optimizer.use_distributed_optimizer``) saves its state per parameter,
as Megatron-LM's ``--dist-ckpt-optim-fully-reshardable`` does (its default form elsewhere, by model
space, cannot be saved by megatron-core; its bucket form reloads only at the same layout and
``lowprec-convert`` cannot read it). This package's optimizers save per parameter whatever it says."""


def _sharded_state(run, is_loading: bool) -> dict:
    model_state = run.model.module.sharded_state_dict()
    state = {
        "model": model_state,
        "iteration": run.iteration,
        "scheduler": run.scheduler.state_dict(),
        "option": option_label(run.config.precision),
        "shape": run_shape(run.config),
        "layout": _layout(),
        "optimizer": run.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA),
    }
    return state


def checkpoint_files(directory: Path) -> list[str]:
    """Every file under ``directory``, by its path relative to it, sorted."""
    return sorted(str(file.relative_to(directory)) for file in directory.rglob("*") if file.is_file())


def file_entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """``complete.json``'s entry of each file of ``names`` under ``directory``: its size and checksum."""
    return {name: {"size": (directory / name).stat().st_size, CHECKSUM_KEY: file_checksum(directory / name)} for name in names}


def _checksummed_files(directory: Path, rank: int, world_size: int) -> dict[str, dict]:
    """Every file of the just written checkpoint ``directory`` with its size and checksum (collective):
    each rank checksums its share while the bytes are still in the page cache, rank 0 gathers them."""
    share = file_entries(directory, _share(checkpoint_files(directory), rank, world_size))
    gathered: list[dict[str, dict] | None] = [None] * world_size
    torch.distributed.all_gather_object(gathered, share)
    return dict(sorted((name, entry) for part in gathered for name, entry in part.items()))


def save(run) -> Path:
    """Write the checkpoint of ``run.iteration``, mark it complete and point ``latest`` at it
    (collective); Ctrl-C meanwhile stops the run once the checkpoint is complete. A failure on any
    rank (a full disk, a read-only directory) removes the partial checkpoint and raises
    :class:`SaveError` on every rank, the previous checkpoint untouched."""
    with _ctrl_c_deferred():
        return _save(run)


def _failure_text(error: BaseException) -> str:
    """One line for an exception: the first ``OSError`` in it (through torch.distributed.checkpoint's
    per-rank ``failures`` and the exception chain) as its message and file, else its type and first line."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return f"{current.strerror}: {current.filename}" if current.filename else current.strerror
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending.extend(failure[0] if isinstance(failure, tuple) else failure for failure in failures.values())
        pending.extend((current.__cause__, current.__context__))
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return _failure_text(inner[0] if isinstance(inner, tuple) else inner)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}".rstrip(": ")


def _on_every_rank(action) -> str:
    """``action()`` on every rank; then, on all of them, the failure (:func:`_failure_text`) of the
    first rank whose action raised (any exception but Ctrl-C and ``sys.exit``), or "" (collective)."""
    try:
        action()
        failure = ""
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - a save that fails anywhere fails everywhere
        failure = _failure_text(error)
    failures: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failure)
    return next((found for found in failures if found), "")


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only directory...); its partial
    directory is removed and the previous checkpoint is left as it was."""


def _save(run) -> Path:
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    final = checkpoint_path(run.run_dir, run.iteration)
    partial = final.with_name(f"{final.name}.partial")

    def fresh_directory() -> None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)

    def write_shards() -> None:
        dist_checkpointing.save(_sharded_state(run, is_loading=False), str(partial))
        torch.save({"rng": _rng_states(), "layout": _layout()}, partial / f"rank{rank}.pt")

    files: dict[str, dict] = {}

    def complete() -> None:
        if rank == 0:
            marker = {"iteration": run.iteration, "world_size": torch.distributed.get_world_size(), "files": files}
            _write_atomically(partial / COMPLETE_FILE, json.dumps(marker, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            _write_atomically(checkpoints_dir(run.run_dir) / LATEST_FILE, final.name)

    def checksum() -> None:
        files.update(_checksummed_files(partial, rank, torch.distributed.get_world_size()))

    for action in (fresh_directory, write_shards, checksum, complete):
        failure = _on_every_rank(action)
        if failure:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            torch.distributed.barrier()
            previous = latest_checkpoint(run.run_dir)
            kept = f"{previous} is intact" if previous is not None else "no earlier checkpoint exists"
            raise SaveError(f"checkpoint {final} could not be written ({failure}); its partial files were removed, {kept}")
    return final


SCHEDULE_FIELDS = (
    ("max_lr", "optimizer.lr"),
    ("min_lr", "optimizer.min_lr"),
    ("lr_warmup_steps", "optimizer.lr_warmup_steps"),
    ("lr_decay_steps", "optimizer.lr_decay_steps"),
    ("lr_decay_style", "optimizer.lr_decay_style"),
    ("start_wd", "optimizer.weight_decay"),
)
"""Fields of megatron's ``OptimizerParamScheduler`` state, and the config key that sets each."""


def _check_schedule(run, path: Path, saved: dict) -> None:
    """The config's schedule is the checkpoint's, or a key says which to take (Megatron-LM refuses a
    mismatch unless told to override it or to use the checkpoint's)."""
    optimizer = run.config.optimizer
    if optimizer.override_opt_param_scheduler or optimizer.use_checkpoint_opt_param_scheduler:
        return
    current = run.scheduler.state_dict()
    differences = []
    for field, key in SCHEDULE_FIELDS:
        if field in saved and saved[field] != current[field]:
            if field == "lr_decay_steps" and optimizer.lr_decay_steps is None:
                key = "trainer.max_steps (the decay steps)"
            differences.append(f"{key} {current[field]} here, {saved[field]} in the checkpoint")
    if differences:
        raise ResumeError(
            f"{path} was trained on another learning-rate schedule: {'; '.join(differences)}. "
            f"Set optimizer.override_opt_param_scheduler=true to continue from its step "
            f"{saved.get('num_steps')} on this config's schedule, or optimizer.use_checkpoint_opt_param_scheduler=true "
            "to keep the checkpoint's"
        )


def _check_shape(run, path: Path, saved: dict | None) -> None:
    """The config's architecture and batch geometry are the checkpoint's (one written before they
    were recorded is not checked), but for the keys ``resume_allow_changes`` lets differ."""
    if saved is None:
        return
    current = run_shape(run.config)
    changed = [key for key in current if key in saved and saved[key] != current[key]]
    refused = [key for key in changed if key not in run.config.resume_allow_changes]
    if not refused:
        return
    differences = "; ".join(f"{key} {current[key]} here, {saved[key]} in the checkpoint" for key in refused)
    fixed = [key for key in refused if key not in RESUME_CHANGEABLE]
    if fixed:
        advice = (
            f"{', '.join(fixed)} define the model's parameters or the optimizer's state: set them as the checkpoint "
            "has them, or resume=false to start over"
        )
    else:
        advice = f"resume_allow_changes=[{','.join(refused)}] resumes with the new values"
    raise ResumeError(f"{path} was trained with another model, batch geometry or optimizer: {differences}. {advice}")


def _read_on_every_rank(path: Path, read):
    """``read()``, where a failure on any rank is a :class:`DamagedCheckpoint` on all of them. Any
    exception counts, ``BaseException`` subclasses too (torch.distributed.checkpoint's
    ``CheckpointException`` is one), except Ctrl-C and ``sys.exit``."""
    try:
        value, failure = read(), ""
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - any failure to read means the checkpoint is damaged
        value, failure = None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    failed = torch.tensor([1 if failure else 0], dtype=torch.int32, device=torch.cuda.current_device())
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if failed.item():
        raise DamagedCheckpoint(f"fails to load ({failure or 'on another rank'})")
    return value


def load(run, path: Path) -> None:
    """Load ``path`` into ``run``: model, optimizer, scheduler, iteration; RNG at the same layout.

    Everything is read (and the option and schedule checked) before anything is applied, so a
    :class:`DamagedCheckpoint` leaves the optimizer, scheduler and iteration as they were."""
    from megatron.core import dist_checkpointing

    common = _read_on_every_rank(path, lambda: dist_checkpointing.load_common_state_dict(str(path)))
    option = option_label(run.config.precision)
    sources = None
    if common["option"] != option:
        if not run.config.precision.convert_checkpoint:
            raise ResumeError(
                f"{path} was trained with option {common['option']!r}, not {option!r}; "
                "precision.convert_checkpoint=true converts its optimizer state to this option"
            )
        sources = _conversion_sources(run, path, common["option"], common)
    elif _other_exponent_storages(run, common):
        if not run.config.precision.convert_checkpoint:
            what, saved, own = min(_other_exponent_storages(run, common))
            raise ResumeError(
                f"{path} stores the {what} of option {option!r} in {saved}, this run in {own}; "
                "precision.convert_checkpoint=true converts its optimizer state (its FP8 moments quantized afresh)"
            )
        sources = _conversion_sources(run, path, common["option"], common)
    _check_shape(run, path, common.get("shape"))
    _check_schedule(run, path, common["scheduler"])
    template = _sharded_state(run, is_loading=True)
    from_stock = common["option"] == STOCK_OPTIMIZER_LABEL
    if sources is not None:
        from megatron_lowprec.megatron.optimizer import saved_option_template

        master = _stock_master_key(path, common) if from_stock else STOCK_MASTER_KEY
        for _, index, source in sources:
            if index is None:
                template["optimizer"] = saved_option_template(
                    template["optimizer"], source, stock=from_stock, stock_master_key=master,
                )
            else:
                template["optimizer"][index] = saved_option_template(template["optimizer"][index], source)
    loaded = _read_on_every_rank(path, lambda: dist_checkpointing.load(template, str(path)))
    same_layout = loaded["layout"] == _layout()
    rank_file = path / f"rank{torch.distributed.get_rank()}.pt"
    per_rank = _read_on_every_rank(path, lambda: load_rank_file(rank_file) if same_layout else None)
    run.model.module.load_state_dict(loaded["model"])
    if sources is not None:
        from megatron_lowprec.megatron.conversion import convert_loaded_state_

        if from_stock:
            _as_project_state_(run, loaded["optimizer"])
        reports = [
            convert_loaded_state_(
                loaded["optimizer"] if index is None else loaded["optimizer"][index], optimizer.get_parameters(),
                source, optimizer.optimizer.strategy, source_label=STOCK if from_stock else None,
            )
            for optimizer, index, source in sources
        ]
        for line in _agreed_lines(_merged(reports)):
            _say(line)
    run.optimizer.load_state_dict(loaded["optimizer"])
    run.scheduler.load_state_dict(loaded["scheduler"])
    run.iteration = loaded["iteration"]
    if per_rank is not None:
        _set_rng_states(per_rank["rng"])


def _stock_master_key(path: Path, common: dict) -> str:
    """Where a checkpoint of megatron-core's own optimizer keeps each FP32 master: under
    ``fp32_param`` (its optimizer without the distributed one), or, for its ``DistributedOptimizer``,
    under ``param`` in the per-parameter form this app saves it in; a :class:`ResumeError` for a
    form without per-parameter states (another trainer's save by gradient bucket)."""
    form = distributed_form(common)
    if form is None:
        return STOCK_MASTER_KEY
    if form != MODEL_SPACE_FORM:
        raise ResumeError(f"{path}: {unread_distributed_form(form)}")
    return DISTRIBUTED_MASTER_KEY


def _converted_optimizers(run) -> list[tuple[object, int | None]]:
    """The project's optimizers of ``run`` whose state a conversion fills, with their index in a
    chain (``None``: the run's one optimizer); empty for megatron-core's own."""
    chained = getattr(run.optimizer, "chained_optimizers", None)
    found = [(run.optimizer, None)] if chained is None else list(zip(chained, range(len(chained))))
    return [(optimizer, index) for optimizer, index in found
            if getattr(getattr(optimizer, "optimizer", None), "strategy", None) is not None]


def _merged(reports):
    """One report of several optimizers' conversions (a chain's): per kind the elements summed, the largest error."""
    merged = reports[0]
    for report in reports[1:]:
        for kind, kind_report in report.kinds.items():
            if kind in merged.kinds:
                merged.kinds[kind].elements += kind_report.elements
                merged.kinds[kind].largest_error = max(merged.kinds[kind].largest_error, kind_report.largest_error)
            else:
                merged.kinds[kind] = kind_report
    return merged


def _as_project_state_(run, optimizer_state: dict) -> None:
    """What ``dist_checkpointing`` loaded from a checkpoint of megatron-core's own optimizer (its
    common part under ``optimizer``: the shared step, its parameter groups) in the form of the run's
    optimizer: the step as an int under ``common_step``, the run's own parameter groups (their
    learning rates are the scheduler's) and ``lowprec`` section."""
    stock = optimizer_state.pop(STOCK_FORM_KEY)
    optimizer_state.pop(DISTRIBUTED_FORM_KEY, None)
    optimizer_state["state"]["common_step"] = stock_step(stock)
    optimizer_state["param_groups"] = [
        {**{key: value for key, value in group.items() if key != "params"}, "params": loaded["params"]}
        for group, loaded in zip(run.optimizer.param_groups, optimizer_state["param_groups"])
    ]
    optimizer_state["lowprec"] = {
        "skipped_steps": 0, "seed": run.optimizer.optimizer.seed - getattr(run.optimizer, "seed_offset", 0),
        "generator_state": None,
    }


def _saved_sections(run, common: dict) -> list[tuple[object, int | None, dict]]:
    """Per optimizer of the run whose state a conversion fills: it, its index in the chain, and the
    ``lowprec`` section its checkpoint's common state holds (empty where it holds none: megatron-core's
    own optimizer)."""
    saved = common.get("optimizer")
    sections = []
    for optimizer, index in _converted_optimizers(run):
        own = saved if index is None else (saved or {}).get(index)
        extra = own.get("lowprec") if isinstance(own, dict) else None
        sections.append((optimizer, index, extra if isinstance(extra, dict) else {}))
    return sections


def _other_exponent_storages(run, common: dict) -> set[tuple[str, str, str]]:
    """(what, saved, the run's) storage of the 8-bit moments of each optimizer of the run whose
    section in ``common`` records another storage than it keeps (a res8 checkpoint written while
    its exponents were FP32, INT8 moments against FP8: :func:`storage_difference`)."""
    return {
        storage_difference(extra, optimizer.optimizer.strategy)
        for optimizer, _, extra in _saved_sections(run, common)
        if extra and stores_other_exponents(extra, optimizer.optimizer.strategy)
    }


def _conversion_sources(run, path: Path, saved_option: str, common: dict) -> list[tuple[object, int | None, object]]:
    """Per optimizer of the run whose state the conversion fills (:func:`_converted_optimizers`): it,
    its index in the chain, and the strategy that wrote ``path`` (``saved_option``, with the FP8
    exponent storage its section records; megatron-core's own optimizer: option D's formats) as that
    optimizer keeps it (AdamW's moments, or Muon's); a :class:`ResumeError` where the conversion
    cannot be made (megatron-core's own optimizer on either side of Muon)."""
    optimizers = _converted_optimizers(run)
    try:
        saved = get_strategy("D" if saved_option == STOCK_OPTIMIZER_LABEL else saved_option)
    except ValueError:
        saved = None
    muon_from_stock = run.config.optimizer.name == "muon" and saved_option == STOCK_OPTIMIZER_LABEL
    if not optimizers or saved is None or muon_from_stock:
        raise ResumeError(
            f"{path} was trained with option {saved_option!r}; precision.convert_checkpoint converts the state of "
            f"this package's AdamW and Muon between its options and from megatron-core's own AdamW, and this run "
            f"(optimizer {run.config.optimizer.name}, option {option_label(run.config.precision)}) or that checkpoint "
            "is not one: resume with the option it was trained with"
        )
    return [
        (optimizer, index, as_shaped_like(with_saved_exponent_storage(saved, extra), optimizer.optimizer.strategy))
        for optimizer, index, extra in _saved_sections(run, common)
    ]


def _agreed_lines(report) -> list[str]:
    """The report's lines (rank 0's elements) with each kind's largest error over every rank (collective)."""
    errors = {kind: report.largest_error for kind, report in report.kinds.items()}
    gathered: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, errors)
    for kind, kind_report in report.kinds.items():
        kind_report.largest_error = max(found.get(kind, 0.0) for found in gathered)
    return report.lines()


def _problem_on_any_rank(path: Path) -> str | None:
    """:func:`checkpoint_problem` as every rank agrees on it (each looks at the file system itself and
    checksums its share of the files); the first rank's problem, or None."""
    problem = checkpoint_problem(path, share=(torch.distributed.get_rank(), torch.distributed.get_world_size()))
    problems: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)
    return next((found for found in problems if found is not None), None)


def _say(message: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(f"lowprec-train: {message}", flush=True)


def resume_if_present(run) -> int | None:
    """Resume from ``resume_from``, else (unless ``resume=false``) from the newest intact checkpoint of
    the run directory, naming each damaged one on the way; the step resumed from, or None
    (``lowprec-train`` has already refused ``resume=true`` without a checkpoint)."""
    config = run.config
    if config.resume_from is not None:
        path = Path(config.resume_from).absolute()
        try:
            problem = _problem_on_any_rank(path)
            if problem is None:
                load(run, path)
                return run.iteration
        except DamagedCheckpoint as error:
            problem = str(error)
        raise ResumeError(f"resume_from={config.resume_from} cannot be resumed from: {problem}")
    if config.resume is False:
        return None
    skipped = []
    for path in resume_candidates(run.run_dir):
        problem = _problem_on_any_rank(path)
        if problem is None:
            if skipped and torch.distributed.get_rank() == 0:
                _write_atomically(checkpoints_dir(run.run_dir) / LATEST_FILE, path.name)
            try:
                load(run, path)
            except DamagedCheckpoint as error:
                problem = str(error)
        if problem is None:
            return run.iteration
        skipped.append(path.name)
        _say(f"skipping checkpoint {path}: {problem}")
    if skipped:
        raise ResumeError(
            f"no intact checkpoint in {checkpoints_dir(run.run_dir)} (skipped {', '.join(skipped)}); "
            "resume=false starts the run over"
        )
    return None
