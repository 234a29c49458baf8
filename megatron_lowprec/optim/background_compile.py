"""Compiling the fused step in a child process while the first steps run it uncompiled.

Compiling a call of the fused step of a new kind (strategy, dtypes, which sizes are 0 or 1, ...)
costs Dynamo's trace, Inductor's code generation and a C++ compile (Triton on GPUs): tens of
seconds on a few CPU cores with an empty cache. Inductor keeps what it generates in its on-disk caches (the FX graph
cache under ``$TORCHINDUCTOR_CACHE_DIR``), keyed by the traced graph, its inputs' metadata and the
compile options, not by the process. So a child process that calls the same compiled function on
tensors of the same metadata fills the cache entry that the training process looks up later, and
the training process then compiles that kind of call from the cache: Dynamo's trace and a cache hit,
2 to 4 CPU-seconds instead of the whole compile.

With background compilation, the first call of a new kind runs the same function uncompiled (the
eager reference, which gives the compiled step's bits: the fused-vs-eager tests check every option
bit for bit) and is queued; at the end of the step (the optimizers call
:meth:`BackgroundCompiles.start`) one child process compiles every queued kind, and the calls of a
kind run uncompiled until that child has ended. Then they take the compiled function, which the
training process compiles at its next call of that kind, from the cache.

* Numerics: each call runs one of two functions that give the same bits, whichever it is.
* The child gets no tensor values: each call's arguments travel as a skeleton (:func:`skeleton`:
  every tensor as its storage's size, dtype, device, offset, sizes and strides, storages shared as
  in the call), and the child calls the compiled function on zero-filled tensors of that skeleton
  (:func:`materialize`). A compiled step never branches on tensor values (``fullgraph``), so the
  trace and the cache key are those of the live call. The child takes the parent's Inductor, Dynamo
  and AOT configs, grad mode and cache directory.
* Memory: the child allocates the call's storages on their device (the parent allocates nothing).
  On a GPU where they would take more than :data:`GPU_FREE_MEMORY_SHARE` of the free memory, the
  call compiles in the training process instead, as without background compilation.
* A child that fails (an error, or killed) leaves its kinds to compile in the training process at
  their next call, with a :class:`BackgroundCompileWarning` once per kind (the caller's
  ``on_failure``) giving the error or the child's last output lines.
* Unlike a compile thread, the child shares nothing with the training process: no interpreter lock
  and no process-wide patching while it traces (``torch.fx`` patches ``torch.nn.Module.__call__``
  while it traces, which broke concurrent forward passes in a thread). At the parent's exit a
  running child is killed, with the compile workers and compiler it started (its own process
  group); what it finished is in the cache for the next run.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from megatron_lowprec.numerics import inductor

GPU_FREE_MEMORY_SHARE = 0.5
"""On a GPU, the largest share of the free device memory that a call's storages may take in the
compile child; a call whose storages need more compiles in the training process."""

CHILD_OUTPUT_LINES = 20
"""The last lines of a failed child's output that its error message gives."""


class BackgroundCompileWarning(UserWarning):
    """A background compile failed: the training process compiles that kind of call itself."""


@dataclasses.dataclass(frozen=True)
class CompileRecipe:
    """How to get a compiled function in any process: ``factory(*arguments)``. ``factory`` must be a
    module-level function (pickled by its qualified name, e.g. a ``functools.cache``'d builder), so
    that the child process builds the same compiled function."""

    factory: Callable[..., Callable]
    arguments: tuple = ()

    def build(self) -> Callable:
        return self.factory(*self.arguments)


@dataclasses.dataclass(frozen=True)
class TensorSkeleton:
    """A tensor without its values: the size of its storage (shared by the skeletons of one storage,
    by ``storage`` index), its dtype, device, storage offset, sizes and strides, and whether it is a
    view of another tensor (Dynamo names a view's sizes apart from a base's, and Inductor's cache key
    holds those names: a base in the child would miss the entry of a view in the parent)."""

    storage: int
    storage_bytes: int
    dtype: torch.dtype
    device: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    view: bool = False


@dataclasses.dataclass(frozen=True)
class _Job:
    kind: Hashable
    recipe: CompileRecipe
    skeleton: Any
    grad_enabled: bool


@dataclasses.dataclass
class _Child:
    process: subprocess.Popen
    kinds: list[Hashable]
    directory: tempfile.TemporaryDirectory

    @property
    def results_path(self) -> Path:
        return Path(self.directory.name) / "results.pkl"

    @property
    def output_path(self) -> Path:
        return Path(self.directory.name) / "output.txt"


class BackgroundCompiles:
    """The compiles of this process that run in a child process, by kind of call (:func:`call_kind`).
    Used from the training thread only."""

    def __init__(self) -> None:
        self._queued: dict[Hashable, _Job] = {}
        self._child: _Child | None = None
        self._results: dict[Hashable, str | None] = {}
        self._warned: set[Hashable] = set()
        atexit.register(self._kill_child)

    def call(self, recipe: CompileRecipe, eager: Callable, args: tuple, on_failure: Callable[[str], None]) -> Any:
        """``recipe.build()(*args)`` where a child has compiled this kind of call (or failed to:
        then ``on_failure(error)`` the first time, and the training process compiles it), or where
        the call's storages are too large for a child on its GPU; otherwise ``eager(*args)``,
        queueing the compile of a kind not seen before (a child starts it at :meth:`start`)."""
        self._collect()
        kind = (recipe, call_kind(args))
        if kind not in self._results and kind not in self._queued and not self._in_child(kind):
            if _too_large_for_the_device(args):
                self._results[kind] = None
            else:
                self._queued[kind] = _Job(kind, recipe, skeleton(args), torch.is_grad_enabled())
        if kind not in self._results:
            return eager(*args)
        error = self._results[kind]
        if error is not None and kind not in self._warned:
            self._warned.add(kind)
            on_failure(error)
        return recipe.build()(*args)

    def start(self) -> None:
        """Start a child that compiles every queued kind, unless one runs already. The optimizers
        call it at the end of a step."""
        self._collect()
        if self._queued and self._child is None:
            jobs = list(self._queued.values())
            self._queued.clear()
            try:
                self._child = _start_child(jobs)
            except Exception as error:  # e.g. an argument that does not pickle: the training process compiles
                self._results.update((job.kind, f"no compile process started: {type(error).__name__}: {error}") for job in jobs)

    def wait(self) -> None:
        """Block until nothing is queued or compiling (children started as needed)."""
        while self.compiling():
            self.start()
            if self._child is not None:
                self._child.process.wait()

    def compiling(self) -> bool:
        """Whether a compile is queued or a child is compiling."""
        self._collect()
        return self._child is not None or bool(self._queued)

    def child_pid(self) -> int | None:
        """The process id of the running child, if any."""
        return None if self._child is None else self._child.process.pid

    def _in_child(self, kind: Hashable) -> bool:
        return self._child is not None and kind in self._child.kinds

    def _collect(self) -> None:
        """Take the results of a child that has ended."""
        child = self._child
        if child is None or child.process.poll() is None:
            return
        errors = _child_errors(child)
        self._results.update(zip(child.kinds, errors))
        child.directory.cleanup()
        self._child = None

    def _kill_child(self) -> None:
        """Kill a running child and what it started (Inductor's compile workers, the C++ compiler)."""
        if self._child is not None and self._child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._child.process.pid, signal.SIGKILL)
            self._child.process.wait()


def _start_child(jobs: list[_Job]) -> _Child:
    """A child process (``python -m megatron_lowprec.optim.background_compile``) compiling ``jobs``,
    with this process's compile configs, import path and Inductor cache directory."""
    directory = tempfile.TemporaryDirectory(prefix="megatron-lowprec-compile-")
    payload = {
        "jobs": [(job.recipe, job.skeleton, job.grad_enabled) for job in jobs],
        "configs": inductor.compile_configs(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    spec_path = Path(directory.name) / "jobs.pkl"
    spec_path.write_bytes(pickle.dumps(payload))
    environment = dict(os.environ)
    environment["TORCHINDUCTOR_CACHE_DIR"] = inductor.inductor_cache_dir()
    environment["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    child = _Child(None, [job.kind for job in jobs], directory)
    with open(child.output_path, "wb") as output:
        child.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(spec_path), str(child.results_path)],
            env=environment, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return child


def _child_errors(child: _Child) -> list[str | None]:
    """Per kind of an ended child: ``None`` (compiled) or why not."""
    if child.process.returncode == 0 and child.results_path.exists():
        return pickle.loads(child.results_path.read_bytes())
    lines = child.output_path.read_text(errors="replace").splitlines()[-CHILD_OUTPUT_LINES:]
    reason = f"the compile process ended with status {child.process.returncode}"
    return [reason + (": " + "\n".join(lines) if lines else "")] * len(child.kinds)


def compile_jobs(spec_path: Path, results_path: Path) -> None:
    """The child's work: take the parent's configs (setting only what differs: a setter can change
    the cache key even to the value it had), then call each job's compiled function on
    zero-filled tensors of its skeleton; write each job's error (``None``: compiled)."""
    payload = pickle.loads(Path(spec_path).read_bytes())
    inductor.load_compile_configs(payload["configs"])
    if torch.are_deterministic_algorithms_enabled() != payload["deterministic"]:
        torch.use_deterministic_algorithms(payload["deterministic"])
    if torch.get_float32_matmul_precision() != payload["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(payload["float32_matmul_precision"])
    errors = []
    for recipe, job_skeleton, grad_enabled in payload["jobs"]:
        try:
            with torch.set_grad_enabled(grad_enabled):
                recipe.build()(*materialize(job_skeleton))
            errors.append(None)
        except Exception as error:  # reported to the parent, which then compiles this kind itself
            errors.append(f"{type(error).__name__}: {error}")
    Path(results_path).write_bytes(pickle.dumps(errors))


def call_kind(args: Any) -> Hashable:
    """What a compiled function's guards (and Inductor's cache key) depend on in ``args``, as a
    hashable: the structure, the types and Python values, and of each tensor its dtype, device, rank,
    the sizes that are 0 or 1, which of its other sizes equal which (Dynamo gives equal sizes one
    symbol), contiguity, a zero storage offset, which tensors share a storage, and whether it is a
    view. Not the tensors' values or other sizes."""
    sizes: dict[int, int] = {}
    storages: dict[tuple, int] = {}

    def kind(value: Any) -> Hashable:
        if torch.is_tensor(value):
            dims = tuple(size if size < 2 else -1 - sizes.setdefault(size, len(sizes)) for size in value.shape)
            storage = storages.setdefault(_storage_key(value), len(storages))
            return (
                value.dtype, value.device, dims, value.is_contiguous(), value.storage_offset() == 0, storage,
                value._base is not None,
            )
        return _map_structure(
            value, kind, lambda original, items: (type(original), original if items is None else tuple(items))
        )

    return kind(args)


def skeleton(args: Any) -> Any:
    """``args`` with every tensor replaced by its :class:`TensorSkeleton` (tensors on one storage
    share its index); other values as they are."""
    storages: dict[tuple, int] = {}

    def strip(value: Any) -> Any:
        if torch.is_tensor(value):
            return TensorSkeleton(
                storages.setdefault(_storage_key(value), len(storages)), value.untyped_storage().nbytes(),
                value.dtype, str(value.device), value.storage_offset(), tuple(value.shape), tuple(value.stride()),
                value._base is not None,
            )
        return _map_structure(value, strip, _rebuild)

    return strip(args)


def materialize(value: Any) -> Any:
    """``value`` with every :class:`TensorSkeleton` replaced by a tensor of its dtype, offset, sizes
    and strides on a zero-filled storage (one per storage index): a view (``as_strided``) of a flat
    tensor over the whole storage where the skeleton's tensor was a view, else the storage's own."""
    storages: dict[int, torch.UntypedStorage] = {}

    def build(item: Any) -> Any:
        if isinstance(item, TensorSkeleton):
            if item.storage not in storages:
                storages[item.storage] = torch.zeros(item.storage_bytes, dtype=torch.uint8, device=item.device).untyped_storage()
            storage = storages[item.storage]
            if item.view:
                whole = (item.storage_bytes // item.dtype.itemsize,)
                base = torch.empty(0, dtype=item.dtype, device=item.device).set_(storage, 0, whole, (1,))
                return base.as_strided(item.shape, item.stride, item.offset)
            return torch.empty(0, dtype=item.dtype, device=item.device).set_(storage, item.offset, item.shape, item.stride)
        return _map_structure(item, build, _rebuild)

    return build(value)


def _map_structure(value: Any, function: Callable[[Any], Any], combine: Callable[[Any, list], Any]) -> Any:
    """``combine(original, [function(item) ...])`` over the items of a tuple, named tuple, list,
    dict (as (key, item) pairs) or dataclass instance (its fields); a leaf otherwise: ``(type, value)``
    where ``combine`` builds kinds, the value itself where it rebuilds."""
    if isinstance(value, (tuple, list)):
        return combine(value, [function(item) for item in value])
    if isinstance(value, dict):
        return combine(value, [(key, function(item)) for key, item in value.items()])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return combine(value, [(field.name, function(getattr(value, field.name))) for field in dataclasses.fields(value)])
    return combine(value, None)


def _rebuild(original: Any, items: list | None) -> Any:
    """``original`` with its items replaced (see :func:`_map_structure`); a leaf as it is."""
    if items is None:
        return original
    if isinstance(original, tuple) and hasattr(original, "_fields"):
        return type(original)(*items)
    if isinstance(original, (tuple, list)):
        return type(original)(items)
    if isinstance(original, dict):
        return dict(items)
    changes = dict(items)
    if all(changes[name] is getattr(original, name) for name in changes):
        return original
    return dataclasses.replace(original, **changes)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, through tuples, lists, dicts and dataclasses."""
    found: list[torch.Tensor] = []

    def visit(item: Any) -> Any:
        if torch.is_tensor(item):
            found.append(item)
        else:
            _map_structure(item, visit, lambda original, items: None)

    visit(value)
    return found


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else (id(tensor),)


def _too_large_for_the_device(args: Any) -> bool:
    """Whether the storages of ``args`` on a GPU would take more than :data:`GPU_FREE_MEMORY_SHARE`
    of its free memory in the compile child."""
    needed: dict[torch.device, int] = {}
    storages = {_storage_key(tensor): tensor for tensor in _tensors(args) if tensor.device.type == "cuda"}
    for tensor in storages.values():
        needed[tensor.device] = needed.get(tensor.device, 0) + tensor.untyped_storage().nbytes()
    return any(nbytes > GPU_FREE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0] for device, nbytes in needed.items())


BACKGROUND_COMPILES = BackgroundCompiles()
"""The background compiles of this process (the compiled functions are the process's too)."""


if __name__ == "__main__":
    # Run as the package's module, not as __main__, so that the skeletons unpickle as its classes.
    from megatron_lowprec.optim import background_compile

    background_compile.compile_jobs(Path(sys.argv[1]), Path(sys.argv[2]))
