"""benchmarks/optimizer_step.py runs end to end: a row per option next to its paired baseline."""

import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "optimizer_step.py"


def test_the_benchmark_reports_each_option_against_torch_fused_adamw():
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sizes", "5000", "--options", "A", "sr", "--warmup", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["5e+03"]]
    assert [row[1] for row in rows] == ["torch32", "A", "torch32", "sr"]
    for row in rows:
        assert float(row[3]) > 0 and float(row[6]) > 0
    assert [float(row[2]) for row in rows] == [16.0, 8.0, 16.0, 8.0]
