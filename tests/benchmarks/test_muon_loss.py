"""benchmarks/muon_loss.py's step-time part runs end to end on CPU: a row per optimizer, AdamW D the
baseline, megatron-core's own Muon beside them where it imports (the venv of
.ci/megatron_newest.sh); the loss part trains lowprec-train runs, minutes each, and is not run here."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "muon_loss.py"


def _megatron_core_muon_imports() -> bool:
    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS
    except ImportError:
        return False
    return HAVE_EMERGING_OPTIMIZERS


def test_the_benchmark_times_each_muon_option_against_adamw_d(tmp_path):
    results_file = tmp_path / "results.json"
    command = [sys.executable, str(BENCHMARK), "--skip-loss", "--options", "A", "--time-layers", "1",
               "--time-warmup", "1", "--repeats", "1", "--muon-steps", "eager", "fused", "--json", str(results_file)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in finished.stdout.splitlines() if line.startswith("| ")]
    megatron_core = ["megatron-core's Muon"] if _megatron_core_muon_imports() else []
    assert [row[0] for row in rows] == ["optimizer", "muon A", "muon A fused", "adamw D", *megatron_core]
    times = json.loads(results_file.read_text())["step_seconds"]
    assert set(times) == {"muon A", "muon A fused", "adamw D", *megatron_core} and all(seconds > 0 for seconds in times.values())
    assert rows[3][2] == "1.00" and rows[1][3] == "" and rows[2][3] == f"{times['muon A fused'] / times['muon A']:.2f}"
