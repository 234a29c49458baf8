"""Helper processes that survive the exit signal which asks for a checkpoint.

SLURM sends SIGTERM to every process of a job step at its time limit or on preemption, as
``kill -TERM -<group>`` and ``timeout`` send it to every process of a group; Megatron-LM's
``--exit-signal-handler`` and ``lowprec-train`` then save a checkpoint before they exit. The helper
processes of a rank get the signal too: megatron's ``dist_checkpointing`` writer service (a
``multiprocessing`` manager of the spawn context) and, in Megatron-LM, the data loader's forked
workers; killed, the save fails (``Connection refused``) or the run waits for them. Here they start
with the exit signals blocked (a blocked signal stays pending and never kills them) and still end
with the process that started them. This module imports only the standard library at the top, so
that a helper process starts without torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def signals_blocked(numbers: tuple[int, ...]) -> Iterator[None]:
    """Block the signals ``numbers`` in the calling thread while helper processes start: a child
    inherits the mask across fork and exec, from its first instruction on, where an initializer would
    block them only once the child's interpreter is up. A signal that reaches this process meanwhile
    is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def end_with_parent() -> None:
    """Initializer of a helper process started under :func:`signals_blocked`: end it once the process
    that started it is gone (so that a run killed with SIGKILL leaves no helper behind)."""
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, name="end-with-parent", daemon=True).start()


def start_writer_service(shielded: Iterable[int]) -> None:
    """Start the queue megatron's ``dist_checkpointing`` writer reports its results through (a
    ``multiprocessing`` manager process of the spawn context, which megatron-core otherwise starts at
    the first save) with the ``shielded`` signals blocked in that process from its start; it ends
    with this process (:func:`end_with_parent`). The resource tracker that the spawn context needs is
    started first: it ignores SIGINT and SIGTERM itself, but its own start unblocks them in this thread."""
    import multiprocessing
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # started already (or a megatron-core that keeps no such queue)
    resource_tracker.ensure_running()
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    with signals_blocked(tuple(int(number) for number in shielded)):
        manager.start(end_with_parent)
    filesystem_async._results_queue = manager.Queue()


_FORK_SHIELDED: set[int] = set()
"""The signals blocked in every process this one forks, once :func:`shield_forked_children` ran."""


def shield_forked_children(shielded: Iterable[int]) -> None:
    """Block the ``shielded`` signals in every process this one forks from now on (the data loader's
    workers, megatron's checkpoint writers): they end when their parent ends them or dies, not
    with the signal that asks the parent for a checkpoint. Idempotent."""
    if not _FORK_SHIELDED:
        os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, tuple(_FORK_SHIELDED)))
    _FORK_SHIELDED.update(int(number) for number in shielded)
