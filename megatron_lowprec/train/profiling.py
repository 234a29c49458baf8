"""torch.profiler over a window of training steps, as Megatron-LM's ``--profile --use-pytorch-profiler``.

``trainer.profile=true`` profiles the steps that start at iteration ``trainer.profile_step_start`` and
end before ``trainer.profile_step_end`` (the steps the log numbers start + 1 to end, Megatron-LM's
window) on the ranks of ``trainer.profile_ranks``, and writes for each of them, under
``<run_dir>/profile/``:

* ``rank<R>.pt.trace.json``: the Chrome trace (Perfetto, ``chrome://tracing``, TensorBoard's profiler
  plugin pointed at the directory);
* ``rank<R>.txt``: the operators by their own time (GPU time where CUDA ran, else CPU time), the
  step's phases among them: ``lowprec.forward_backward`` (every micro-batch of the step),
  ``lowprec.optimizer_step`` (gradient norm, clipping and the update; the exact norm alone is
  ``lowprec.grad_norm``, labelled by the megatron optimizer, so also in Megatron-LM's own profiles)
  and ``lowprec.update_quality``.
"""

from __future__ import annotations

from pathlib import Path

import torch

FORWARD_BACKWARD = "lowprec.forward_backward"
OPTIMIZER_STEP = "lowprec.optimizer_step"
UPDATE_QUALITY = "lowprec.update_quality"
"""``torch.profiler.record_function`` labels of a training step's phases."""

SUMMARY_ROWS = 40
NAME_WIDTH = 90
"""Rows and name width of the summary table."""


class StepProfiler:
    """Starts torch.profiler before the first step of the window and, after its last one (or when the
    loop ends inside it), writes the trace and the summary and prints where."""

    def __init__(self, enabled: bool, step_start: int, step_end: int, ranks: list[int], rank: int, run_dir: Path) -> None:
        self.window = (step_start, step_end) if enabled and rank in ranks else None
        self.rank = rank
        self.directory = run_dir / "profile"
        self.profiler: torch.profiler.profile | None = None
        self.steps: list[int] = []
        """The numbers (as the log gives them) of the steps profiled so far."""

    def before_step(self, iteration: int) -> None:
        """Start profiling when ``iteration`` (steps done so far) is inside the window and no profile
        was taken yet: at the window's start, or at the first step of a run resumed inside it."""
        if self.window is not None and not self.steps and self.profiler is None and self.window[0] <= iteration < self.window[1]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def after_step(self, iteration: int) -> Path | None:
        """Count the step just done; write the profile when ``iteration`` (steps done) closes the
        window. The summary's path, once written."""
        if self.profiler is None:
            return None
        self.steps.append(iteration)
        return self.close() if iteration >= self.window[1] else None

    def close(self) -> Path | None:
        """Stop a running profile and write it (also when the loop ended inside the window); the
        summary's path."""
        if self.profiler is None:
            return None
        profiler, self.profiler = self.profiler, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.directory / f"rank{self.rank}.pt.trace.json"))
        device = torch.profiler.ProfilerActivity.CUDA in profiler.activities
        sort_by = "self_device_time_total" if device else "self_cpu_time_total"
        summary = self.directory / f"rank{self.rank}.txt"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=SUMMARY_ROWS, max_name_column_width=NAME_WIDTH)
        summary.write_text(table + "\n")
        steps = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no complete step"
        print(f"profile of {steps} (rank {self.rank}): {summary}", flush=True)
        return summary
