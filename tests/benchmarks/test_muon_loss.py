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
    command = [sys.executable, str(BENCHMARK), "--skip-loss", "--options", "A", "sr", "--time-layers", "1",
               "--time-warmup", "0", "--repeats", "1", "--json", str(results_file)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in finished.stdout.splitlines() if line.startswith("| ")]
    megatron_core = ["megatron-core's Muon"] if _megatron_core_muon_imports() else []
    assert [row[0] for row in rows] == ["optimizer", "muon A", "muon sr", "adamw D", *megatron_core]
    assert rows[3][2] == "1.00"
    times = json.loads(results_file.read_text())["step_seconds"]
    assert set(times) == {"muon A", "muon sr", "adamw D", *megatron_core} and all(seconds > 0 for seconds in times.values())
