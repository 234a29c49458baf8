"""benchmarks/train_throughput.py runs end to end on CPU: a row per run next to stock megatron-core."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"


def test_the_benchmark_reports_each_run_against_stock_megatron_core(tmp_path):
    """Every run gets its row; one that fails (here a bad override) is reported in its row, the
    others still run, and the exit status says so; ``--profile`` leaves each run's profile of its
    untimed last steps. Uncompiled (``precision.fused=false``): what is tested is the table, the
    failure report and the profiles, whichever step runs; a compiled step would cost each run a
    compile."""
    results_file = tmp_path / "results.json"
    profiles = tmp_path / "profiles"
    command = [
        sys.executable, str(BENCHMARK), "--runs", "A", "A:trainer.no_such_setting=1", "A:model.attention_backend=unfused",
        "--steps", "2", "--warmup", "1", "--micro-batch", "2", "--global-batch", "4", "--json", str(results_file),
        "--profile", str(profiles),
        "--set", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32",
        "precision.fused=false",
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 1, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "1 run(s) failed: A:trainer.no_such_setting=1" in finished.stderr
    rows = [line.split("|")[1:-1] for line in finished.stdout.splitlines() if line.startswith("| ")]
    assert [cells[0].strip() for cells in rows] == [
        "run", "megatron", "A", "A:model.attention_backend=unfused", "A:trainer.no_such_setting=1",
    ]
    assert [cell.strip() for cell in rows[1][-2:]] == ["1.00", "1.00"]
    assert rows[4][1].strip().startswith("failed: exit")
    results = json.loads(results_file.read_text())
    assert results.pop("A:trainer.no_such_setting=1")["failed"].startswith("exit")
    for result in results.values():
        assert result["tokens_per_second"] > 0 and result["tflops_per_gpu"] > 0 and result["peak_gib"] > 0
        assert math.isfinite(result["final_train_loss"]) and "mfu" not in result
    for name in ("megatron", "A", "A_model.attention_backend-unfused"):
        assert "lowprec.optimizer_step" in (profiles / f"{name}.txt").read_text()
        assert (profiles / f"{name}.pt.trace.json").stat().st_size > 0


def test_the_timed_steps_leave_out_the_profiled_ones():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_throughput", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"split": "train", "step": step, "tokens_per_second": 100.0 if step <= 3 else 1.0} for step in range(1, 6)]
    summary = {"flops_per_token": 1.0, "final_train_loss": 1.0}
    for row in rows:
        row["peak_rss_gib"] = 1.0
    assert module.measure(rows, summary, warmup=1, steps=2, world_size=1)["tokens_per_second"] == 100.0


def test_a_run_that_outlasts_its_timeout_is_a_failed_run(tmp_path):
    import argparse
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("train_throughput", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    arguments = argparse.Namespace(nproc=1, model="tiny", micro_batch=2, global_batch=2, warmup=1, steps=1, set=[], timeout=0.2)
    with pytest.raises(module.RunFailed, match="outlasted --timeout 0.2 s"):
        module.run_once(arguments, "A", ["precision=A"], tmp_path)
