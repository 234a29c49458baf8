"""benchmarks/grad_norm.py runs end to end: a row per size and dtype, with the ratio of its two times."""

import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "grad_norm.py"


def test_the_benchmark_reports_the_exact_norm_against_the_fp32_norm():
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sizes", "5000", "--dtypes", "float32", "bfloat16", "--repeats", "1",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["5e+03"]]
    assert [row[1] for row in rows] == ["float32", "bfloat16"]
    for _, _, fp32_ms, exact_ms, ratio in rows:
        assert float(fp32_ms) > 0 and float(exact_ms) > 0 and float(ratio) > 0
