"""Compiling the fused step in a background thread while the first steps run it uncompiled.

Compiling a call of the fused step of a new kind (strategy, dtypes, which sizes are 0 or 1, ...)
costs Dynamo's trace, Inductor's code generation and a C++ compile (Triton on GPUs): 15 to 70 s on
2 CPU cores with an empty cache, a few seconds with a warm one. With background compilation such a
call, and every call of the same kind until its compile is done, runs the same function uncompiled
(the eager reference, which gives the compiled step's bits: the fused-vs-eager tests check every
option bit for bit), while one thread compiles it by calling the compiled function on scratch
copies of that call's tensors, never on the live state. Once no compile is running, the calls of
every compiled kind take the compiled function; a kind that failed to compile stays uncompiled
(:class:`~megatron_lowprec.optim.fused.EagerFallbackWarning`, once).

* Numerics: each call runs one of two functions that give the same bits, whichever it is.
* The scratch copies: each storage that the call's tensors view, copied once, with the tensors'
  offsets, sizes and strides, so that the compile sees what the live call shows Dynamo (aliasing
  included) and its guards hold for the live calls of its kind. They take that much memory until
  the compile ends; on a GPU where they would take more than half of the free memory, the call
  compiles in the foreground instead, as without background compilation.
* The thread: one at a time, started at the end of the step that queued a compile (the optimizers
  call :meth:`BackgroundCompiles.start`), so that the step's own uncompiled calls do not share the
  CPU with it, and ending when no compile is queued (none is alive once compiling is done). It runs with the calling thread's grad mode and torch
  function modes (Dynamo guards on both), on the call's GPU, and no collective, so every rank
  compiles on its own.
  Inductor keeps what it built in its on-disk cache, so a compile cut short by the end of the
  process is not lost: Python waits for the running compile at exit, and drops the queued ones.
* torch's ``torch.compiler.is_compiling()`` is one flag per process: while the thread compiles,
  code in the training thread that asks it sees ``True``. This package's own branches on it give
  the same bits either way (correctly rounded division and square root on every path).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack

THREAD_NAME = "megatron-lowprec-compile"
"""The name of the background compile thread."""

GPU_FREE_MEMORY_SHARE = 0.5
"""On a GPU, the largest share of the free device memory that a call's scratch copies may take;
a call whose copies need more compiles in the foreground."""


class BackgroundCompiles:
    """The compiles of this process that run in the background, by kind of call (:func:`call_kind`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._queued: set[Hashable] = set()
        self._results: dict[Hashable, BaseException | None] = {}
        self._warned: set[Hashable] = set()
        self._thread: threading.Thread | None = None

    def call(
        self, compiled: Callable, eager: Callable, args: tuple, on_failure: Callable[[BaseException], None]
    ) -> Any:
        """``compiled(*args)`` where the compile of this kind of call is done and none is running or
        queued; otherwise ``eager(*args)``, queueing the compile of a kind not seen before (it starts
        at :meth:`start`). A kind whose compile failed runs ``eager`` and calls ``on_failure(error)``
        the first time."""
        kind = (compiled, call_kind(args))
        with self._lock:
            new = kind not in self._results and kind not in self._queued
            foreground = new and _too_large_for_the_device(args)
            if foreground:
                self._results[kind] = None
            elif new:
                self._queued.add(kind)
                self._queue.append((kind, compiled, _scratch_copy_on_device(args), torch.is_grad_enabled(), _get_current_function_mode_stack()))
            compiling = self._thread is not None or bool(self._queue)
            done = kind in self._results
            error = self._results.get(kind)
            warn = error is not None and kind not in self._warned
            self._warned.update([kind] if warn else [])
        if warn:
            on_failure(error)
        if foreground:
            return compiled(*args)
        if compiling or not done or error is not None:
            return eager(*args)
        return compiled(*args)

    def start(self) -> None:
        """Start compiling what is queued, unless the thread runs already. The optimizers call it at
        the end of a step, so that the step's uncompiled calls do not share the CPU with the compile."""
        with self._lock:
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._compile_queued, name=THREAD_NAME)
                self._thread.start()

    def wait(self) -> None:
        """Start what is queued and block until no compile is running or queued (the thread has ended)."""
        self.start()
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def compiling(self) -> bool:
        """Whether a compile is running or queued."""
        with self._lock:
            return self._thread is not None or bool(self._queue)

    def _compile_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue or not threading.main_thread().is_alive():
                    self._queue.clear()
                    self._queued.clear()
                    self._thread = None
                    return
                kind, compiled, (scratch, device), grad_enabled, modes = self._queue.popleft()
            error = None
            try:
                with torch.set_grad_enabled(grad_enabled), contextlib.ExitStack() as entered:
                    if device is not None:
                        entered.enter_context(torch.cuda.device(device))
                    for mode in modes:
                        entered.enter_context(mode)
                    compiled(*scratch)
            except Exception as caught:  # reported by the next call of this kind, in the caller's thread
                error = caught
            del scratch
            with self._lock:
                self._queued.discard(kind)
                self._results[kind] = error


def call_kind(args: Any) -> Hashable:
    """What a compiled function's guards depend on in ``args``, as a hashable: the structure, the
    types and Python values, and of each tensor its dtype, device, rank, the sizes that are 0 or 1,
    which of its other sizes equal which (Dynamo gives equal sizes one symbol), contiguity, a zero
    storage offset, and which tensors share a storage. Not the tensors' values or other sizes."""
    sizes: dict[int, int] = {}
    storages: dict[tuple, int] = {}

    def kind(value: Any) -> Hashable:
        if torch.is_tensor(value):
            dims = tuple(size if size < 2 else -1 - sizes.setdefault(size, len(sizes)) for size in value.shape)
            storage = storages.setdefault(_storage_key(value), len(storages))
            return (value.dtype, value.device, dims, value.is_contiguous(), value.storage_offset() == 0, storage)
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(kind(item) for item in value))
        if isinstance(value, dict):
            return (dict, tuple((key, kind(item)) for key, item in value.items()))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return (type(value), tuple(kind(getattr(value, field.name)) for field in dataclasses.fields(value)))
        return (type(value), value)

    return kind(args)


def scratch_copy(args: Any) -> Any:
    """``args`` with every tensor replaced by a tensor of the same dtype, offset, sizes and strides
    on a copy of its storage (one copy per storage, so that aliasing is kept); other values as they are."""
    copies: dict[tuple, torch.UntypedStorage] = {}

    def copy(value: Any) -> Any:
        if torch.is_tensor(value):
            key = _storage_key(value)
            if key not in copies:
                copies[key] = value.untyped_storage().clone()
            return value.new_empty(0).set_(copies[key], value.storage_offset(), value.shape, value.stride())
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(copy(item) for item in value))
        if isinstance(value, (tuple, list)):
            return type(value)(copy(item) for item in value)
        if isinstance(value, dict):
            return {key: copy(item) for key, item in value.items()}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {field.name: copy(getattr(value, field.name)) for field in dataclasses.fields(value)}
            if all(changes[name] is getattr(value, name) for name in changes):
                return value
            return dataclasses.replace(value, **changes)
        return value

    return copy(args)


def _scratch_copy_on_device(args: Any) -> tuple[Any, torch.device | None]:
    """:func:`scratch_copy` of ``args`` and the GPU they are on (``None`` on the CPU), the copies
    complete before they are handed to another thread (which runs on that GPU's default stream)."""
    scratch = scratch_copy(args)
    devices = [value.device for value in _tensors(args) if value.device.type == "cuda"]
    if devices:
        torch.cuda.current_stream(devices[0]).synchronize()
    return scratch, devices[0] if devices else None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, through tuples, lists, dicts and dataclasses."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [tensor for field in dataclasses.fields(value) for tensor in _tensors(getattr(value, field.name))]
    return []


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else (id(tensor),)


def _too_large_for_the_device(args: Any) -> bool:
    """Whether the scratch copies of ``args`` on a GPU would take more than
    :data:`GPU_FREE_MEMORY_SHARE` of its free memory."""
    needed: dict[torch.device, int] = {}
    storages = {_storage_key(tensor): tensor for tensor in _tensors(args) if tensor.device.type == "cuda"}
    for tensor in storages.values():
        needed[tensor.device] = needed.get(tensor.device, 0) + tensor.untyped_storage().nbytes()
    return any(nbytes > GPU_FREE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0] for device, nbytes in needed.items())


BACKGROUND_COMPILES = BackgroundCompiles()
"""The background compiles of this process (the compiled functions are the process's too)."""
