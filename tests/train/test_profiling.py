"""The step profiler's window (``train/profiling.py``), on a stand-in step; ``lowprec-train`` profiling
a run end to end is in ``tests/train/test_app.py`` (the torchrun test)."""

from __future__ import annotations

import torch

from megatron_lowprec.train.profiling import OPTIMIZER_STEP, StepProfiler


def _steps(profiler: StepProfiler, first: int, last: int, device: str = "cpu") -> None:
    """Steps ``first`` to ``last`` as the log numbers them, each a labelled matrix product on ``device``."""
    for iteration in range(first - 1, last):
        profiler.before_step(iteration)
        with torch.profiler.record_function(OPTIMIZER_STEP):
            torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
        profiler.after_step(iteration + 1)


def test_profiles_the_window_megatron_lm_names_and_writes_a_trace_and_a_table(tmp_path, capsys, device):
    """profile_step_start=2, profile_step_end=4: steps 3 and 4 as the log numbers them (on a GPU the
    table is sorted by GPU time)."""
    profiler = StepProfiler(True, 2, 4, [0], 0, tmp_path)
    _steps(profiler, 1, 6, device.type)
    assert profiler.steps == [3, 4]
    table = (tmp_path / "profile" / "rank0.txt").read_text()
    row = next(line for line in table.splitlines() if line.strip().startswith(OPTIMIZER_STEP))
    assert row.split()[-1] == "2", row
    assert (tmp_path / "profile" / "rank0.pt.trace.json").stat().st_size > 0
    assert f"profile of steps 3-4 (rank 0): {tmp_path / 'profile' / 'rank0.txt'}" in capsys.readouterr().out


def test_a_run_resumed_inside_the_window_profiles_its_rest_and_one_ending_inside_writes_at_close(tmp_path, capsys):
    resumed = StepProfiler(True, 2, 6, [0], 0, tmp_path / "resumed")
    _steps(resumed, 5, 8)
    assert resumed.steps == [5, 6]
    ended = StepProfiler(True, 2, 6, [0], 0, tmp_path / "ended")
    _steps(ended, 1, 4)
    assert not (tmp_path / "ended" / "profile").exists()
    assert ended.close() == tmp_path / "ended" / "profile" / "rank0.txt" and ended.steps == [3, 4]
    assert ended.close() is None


def test_ranks_outside_profile_ranks_and_a_disabled_profiler_write_nothing(tmp_path):
    for profiler in (StepProfiler(True, 0, 2, [1], 0, tmp_path), StepProfiler(False, 0, 2, [0], 0, tmp_path)):
        _steps(profiler, 1, 3)
        assert profiler.close() is None and profiler.steps == []
    assert not (tmp_path / "profile").exists()
