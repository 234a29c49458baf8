"""benchmarks/quality.py: the gap to D is paired by seed (checked against a hand-computed example), and
the benchmark runs end to end on CPU: one lowprec-train process per cell, a stamped table, finished
runs reused rather than trained again."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "quality.py"


def _quality():
    spec = importlib.util.spec_from_file_location("quality", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_gap_to_d_pairs_each_seed_with_d_on_the_same_seed():
    losses = {
        ("D", 0.001, 1): 5.20, ("D", 0.001, 2): 5.30, ("D", 0.001, 3): 4.90,
        ("A", 0.001, 1): 5.35, ("A", 0.001, 2): 5.41, ("A", 0.001, 3): 5.10,
        ("sr", 0.001, 1): 5.22, ("sr", 0.001, 3): 4.93,   # seed 2 did not finish: it pairs nothing
        ("B", 0.003, 1): 5.00,                              # D did not run at 0.003: no gap
    }
    gaps = _quality().paired_gaps(losses, "D")
    assert set(gaps) == {("D", 0.001), ("A", 0.001), ("sr", 0.001)}
    a = gaps["A", 0.001]
    assert a.seeds == (1, 2, 3)
    # gaps 0.15, 0.11, 0.20: mean 0.46 / 3; deviations -0.00333, -0.04333, +0.04667; their squares sum
    # to 0.004067, / (3 - 1) = 0.0020333, square root 0.045092
    assert a.gaps == pytest.approx((0.15, 0.11, 0.20))
    assert a.mean == pytest.approx(0.153333, abs=1e-6) and a.spread == pytest.approx(0.045092, abs=1e-6)
    sr = gaps["sr", 0.001]
    assert sr.seeds == (1, 3) and sr.mean == pytest.approx(0.025) and sr.spread == pytest.approx(0.005 * math.sqrt(2))
    assert gaps["D", 0.001].gaps == (0.0, 0.0, 0.0)
    one_seed = _quality().paired_gaps({("D", 0.001, 1): 5.2, ("A", 0.001, 1): 5.3}, "D")["A", 0.001]
    assert one_seed.mean == pytest.approx(0.1) and one_seed.spread is None


def test_the_mean_over_steps_weights_each_logged_interval_by_its_steps():
    rows = [{"step": 3, "edq": 1.0}, {"step": 4, "edq": 5.0}, {"step": 6, "edq": None}, {"step": 10, "edq": 2.0}]
    assert _quality().step_weighted_mean(rows, "edq") == pytest.approx((3 * 1.0 + 1 * 5.0 + 4 * 2.0) / 8)
    assert _quality().step_weighted_mean(rows, "imprecision_percent") is None


def test_the_benchmark_trains_each_cell_once_and_writes_a_stamped_table(tmp_path):
    out, markdown = tmp_path / "runs", tmp_path / "quality.md"
    command = [
        sys.executable, str(BENCHMARK), "--options", "A", "--seeds", "1", "2", "--lrs", "1e-3", "--steps", "2",
        "--log-interval", "1", "--eval-iters", "1", "--jobs", "2", "--out", str(out), "--markdown", str(markdown),
        "--set", "model.num_layers=1", "model.hidden_size=32", "model.seq_length=32", "precision.fused=false",
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    run_dirs = sorted(path.name for path in out.iterdir())
    assert run_dirs == [f"adamw-{option}-lr0.001-seed{seed}-steps2" for option in ("A", "D") for seed in (1, 2)]
    rows = [[cell.strip() for cell in line[1:-1].split("|")] for line in markdown.read_text().splitlines() if line.startswith("| ")]
    assert rows[0] == ["lr", "option", "bytes/param", "seed 1", "seed 2", "mean loss", "gap to D (mean)", "gap sd",
                       "paired seeds", "imprecision %", "EDQ"]
    assert [row[:2] for row in rows[1:]] == [["0.001", "D"], ["0.001", "A"]]
    d, a = rows[1], rows[2]
    assert d[6] == "+0.0000" and d[8] == a[8] == "2"
    gaps = [float(a_loss) - float(d_loss) for a_loss, d_loss in zip(a[3:5], d[3:5])]
    assert float(a[6]) == pytest.approx(sum(gaps) / 2, abs=1e-4)
    assert float(a[2]) < float(d[2]) and float(d[9]) == 0.0 and float(a[9]) > 0.0
    assert "Measured: " in markdown.read_text()

    summaries = {path: (path / "summary.json").stat().st_mtime_ns for path in out.iterdir()}
    for extra in (["--report-only"], []):
        again = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and again.stdout == finished.stdout
    assert {path: (path / "summary.json").stat().st_mtime_ns for path in out.iterdir()} == summaries  # none trained again
