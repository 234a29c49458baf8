"""benchmarks/gpu_check.py runs end to end (on CPU here: the tiny model) and reports failures."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)
    spec.loader.exec_module(module)
    return module


CHECKED_OPTIONS = {"A": "8", "D-BF16": "12"}
"""Two options whose steps compile in seconds, one with a master stored below the parameter (a state
the script's fused-vs-eager check compares beside the moments). Every option's fused step is checked
against the eager one bit for bit in tests/optim/test_fused.py and the contract matrix; here the
script's own check and table are under test (on a GPU the script checks every option)."""


def test_the_check_trains_each_option_and_finds_fused_and_eager_identical(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--options", *CHECKED_OPTIONS, "--steps", "3", "--window", "2",
         "--check-steps", "4", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()[:1] in [[o] for o in CHECKED_OPTIONS]}
    for option, bytes_per_param in CHECKED_OPTIONS.items():
        _, printed_bytes, tokens_per_second, peak, loss, mismatches, verdict = rows[option]
        assert (printed_bytes, mismatches, verdict) == (bytes_per_param, "0", "ok")
        assert float(tokens_per_second.replace(",", "")) > 0 and float(peak) > 0 and 0 < float(loss) < 20
        assert (tmp_path / option / "metrics.jsonl").is_file()


def test_each_option_runs_in_a_process_of_its_own_and_a_crash_fails_its_row_only(tmp_path, monkeypatch):
    gpu_check = _gpu_check_module()
    launched = []

    def crash(command, **kwargs):
        launched.append(command)
        return subprocess.CompletedProcess(command, -9)

    monkeypatch.setattr(gpu_check.subprocess, "run", crash)
    args = gpu_check.argparse.Namespace(model="tiny", seq_length=64, micro_batch=4, steps=3, window=2, check_steps=4)
    result = gpu_check.check_option_in_subprocess(args, "C", tmp_path)
    assert (result.option, result.passed, result.error) == ("C", False, "process exited with -9")
    assert launched[0][:2] == [sys.executable, gpu_check.__file__] and "--child" in launched[0]


def test_mismatches_and_errors_fail_the_check():
    gpu_check = _gpu_check_module()
    results = [
        gpu_check.OptionResult("A", 8, mismatches=0, tokens_per_second=10.0, peak_gib=1.0, final_loss=5.0),
        gpu_check.OptionResult("B", 10, mismatches=3, tokens_per_second=10.0, peak_gib=1.0, final_loss=5.0),
        gpu_check.OptionResult("sr", 8, mismatches=0, error="BackendCompilerFailed: Cannot bitcast"),
    ]
    assert [result.passed for result in results] == [True, False, False]
    table = gpu_check.format_table(results, torch.device("cpu")).splitlines()
    assert table[2].endswith("ok") and table[3].endswith("MISMATCH")
    assert table[4].endswith("BackendCompilerFailed: Cannot bitcast")


def test_tokens_per_second_is_total_tokens_over_total_time_of_the_last_steps():
    gpu_check = _gpu_check_module()
    rows = [{"split": "train", "tokens_per_second": rate} for rate in (1.0, 100.0, 50.0)] + [{"split": "valid"}]
    assert gpu_check.tokens_per_second_over(rows, window=2, tokens_per_step=100) == pytest.approx(200 / 3)
