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
    for _, _, tensors, fp32_ms, exact_ms, ratio in rows:
        assert tensors == "1" and float(fp32_ms) > 0 and float(exact_ms) > 0 and float(ratio) > 0


def test_the_gradients_are_split_into_tensors_or_views_of_one_buffer():
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("grad_norm", BENCHMARK)
    grad_norm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grad_norm)
    separate = grad_norm.gradients(1000, torch.bfloat16, 3, False, torch.device("cpu"))
    views = grad_norm.gradients(1000, torch.bfloat16, 3, True, torch.device("cpu"))
    assert [g.numel() for g in separate] == [334, 333, 333] and all(torch.equal(a, b) for a, b in zip(separate, views))
    assert len({g.untyped_storage().data_ptr() for g in separate}) == 3
    assert len({g.untyped_storage().data_ptr() for g in views}) == 1
