"""benchmarks/shard_step.py runs end to end: a row per option, its shard laid out in place, next to
the plain buckets of the same elements."""

import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "shard_step.py"


def test_the_benchmark_reports_the_shard_step_against_plain_buckets():
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sizes", "20000", "--options", "D", "--tensors", "6", "--warmup", "1",
         "--repeats", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in result.stdout.splitlines() if line.startswith("| D ")]
    assert len(rows) == 1
    option, elements, layout, plain_ms, shard_ms, ratio = rows[0]
    assert layout == "in place" and int(elements) > 0
    assert float(plain_ms) > 0 and float(shard_ms) > 0 and float(ratio) > 0


def test_the_layout_is_megatron_s():
    """Parameters of sizes that are multiples of 128, each start padded to 64 elements, the bucket to 128."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shard_step", BENCHMARK)
    shard_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shard_step)
    sizes, starts, total = shard_step.megatron_layout(3000, 4)
    assert all(size % 128 == 0 for size in sizes) and all(start % 64 == 0 for start in starts)
    assert starts == [sum(sizes[:index]) for index in range(4)] and total % 128 == 0 and total >= starts[-1] + sizes[-1]
