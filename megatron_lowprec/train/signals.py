"""Exit signals: every rank finishes its step, saves a checkpoint and exits 0 (preemption, time limits).

As Megatron-LM's ``--exit-signal-handler`` (its ``DistributedSignalHandler``): the handler only
records the signal; after every step the ranks agree on it with a one-element all-reduce (MAX of the
signal numbers), so a signal that reached one rank only, or reached the ranks during different
steps, stops all of them after the same step. SLURM sends SIGTERM to every process of a job step
before killing it at its time limit or on preemption, and ``--signal=<SIG>@<seconds>`` sends the
signal of one's choice earlier; under ``torchrun`` both the agent (which forwards SIGTERM) and the
workers receive it. The same signal arriving twice (directly and forwarded) is one request.

SLURM signals the helper processes of a rank as well, as ``kill -TERM -<group>`` and ``timeout`` signal
every process of the group; the checkpoint writer service that the save the signal asks for needs
starts with the signal blocked (:mod:`megatron_lowprec.megatron.exit_signals`).
:func:`end_with_launcher` makes a rank and the processes it forks (megatron's checkpoint writers) die
with their parent, so that ``kill -9`` of the launcher leaves no process behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from types import FrameType


class ExitSignals:
    """Context manager that records SIGTERM and ``extra`` (a signal name, or None) while training.

    Outside the main thread (a trainer embedding the loop in a thread) Python cannot install signal
    handlers; nothing is recorded there and the signals keep their previous handlers.
    """

    def __init__(self, extra: str | None) -> None:
        names = ["SIGTERM"] + ([extra] if extra and extra != "SIGTERM" else [])
        self.signals = [signal.Signals[name] for name in names]
        self.received_number = 0
        self.previous: dict[signal.Signals, object] = {}

    def _record(self, number: int, frame: FrameType | None) -> None:
        self.received_number = number

    def __enter__(self) -> "ExitSignals":
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self.previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous.clear()

    def received(self) -> str | None:
        """The signal any rank has received so far (its name), or None; collective."""
        import torch

        flag = torch.tensor([self.received_number], dtype=torch.int32, device=torch.cuda.current_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        number = int(flag.item())
        return signal.Signals(number).name if number else None


PR_SET_PDEATHSIG = 1
"""``prctl`` option of Linux: the signal a process gets when the thread that started it exits."""


def _kill_when_parent_dies(parent: int) -> None:
    """SIGKILL this process once ``parent`` is gone (Linux ``PR_SET_PDEATHSIG``); if it is gone
    already (it died before the call), exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)


def end_with_launcher(launched: bool) -> None:
    """Make every process this one forks from now on (megatron's checkpoint writers, ``multiprocessing``
    workers) die when this one does, and, where ``launched`` by torchrun, this one die with its agent:
    each a parent-death signal (Linux; a no-op elsewhere). A plain ``lowprec-train`` keeps its own
    lifetime, so that a run started with ``nohup`` outlives its shell."""
    if not sys.platform.startswith("linux"):
        return
    if launched:
        _kill_when_parent_dies(os.getppid())
    if not _FORKER:
        _FORKER.append(os.getpid())
        os.register_at_fork(
            before=lambda: _FORKER.__setitem__(0, os.getpid()),
            after_in_child=lambda: _kill_when_parent_dies(_FORKER[0]),
        )


_FORKER: list[int] = []
"""The process that forks (set just before each fork); empty until :func:`end_with_launcher` runs."""
