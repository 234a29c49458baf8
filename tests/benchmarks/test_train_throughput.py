"""benchmarks/train_throughput.py runs end to end on CPU: a row per run next to stock megatron-core."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"


def test_the_benchmark_reports_each_run_against_stock_megatron_core(tmp_path):
    results_file = tmp_path / "results.json"
    command = [
        sys.executable, str(BENCHMARK), "--runs", "A", "A:model.attention_backend=unfused", "--steps", "2",
        "--warmup", "1", "--micro-batch", "2", "--global-batch", "4", "--json", str(results_file),
        "--set", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32",
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in finished.stdout.splitlines() if line.startswith("| ")]
    assert [cells[0].strip() for cells in rows] == ["run", "megatron", "A", "A:model.attention_backend=unfused"]
    assert [cell.strip() for cell in rows[1][-2:]] == ["1.00", "1.00"]
    results = json.loads(results_file.read_text())
    for result in results.values():
        assert result["tokens_per_second"] > 0 and result["tflops_per_gpu"] > 0 and result["peak_gib"] > 0
        assert math.isfinite(result["final_train_loss"]) and "mfu" not in result
