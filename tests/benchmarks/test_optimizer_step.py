"""benchmarks/optimizer_step.py runs end to end: a row per option next to its paired baseline."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "optimizer_step.py"


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("optimizer_step", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_the_benchmark_measures_both_master_storages_from_the_state_tensors():
    """Whole and remainder masters side by side, bytes/param counted from the parameters, their BF16
    gradients and the optimizer's state tensors (plain PyTorch: a 16-bit gradient)."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sizes", "5000", "--options", "D", "D:remainder", "D-BF16", "D-BF16:fp32",
         "--warmup", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    rows = {line.split()[1]: float(line.split()[2]) for line in result.stdout.splitlines() if line.split()[:1] == ["5e+03"]}
    assert rows == {"torch32": 16.0, "D": 16.0, "D:remainder": 14.0, "D-BF16": 10.0, "D-BF16:fp32": 12.0}


def test_by_default_every_option_with_a_master_runs_in_both_storages():
    module = _benchmark_module()
    options = module.default_options()
    assert options[options.index("D") + 1] == "D:remainder"
    assert options[options.index("coat") + 1] == "coat:remainder"
    assert options[options.index("D-BF16") + 1] == "D-BF16:fp32"
    assert module.parse_option("coat:remainder").bytes_per_param(grad_reduce_in_fp32=False) == 8.125


@pytest.mark.parametrize("arguments,message", [
    (["--kernels", "--device", "cpu"], "--kernels lists GPU kernels and needs --device cuda; got --device cpu"),
    (["--pieces", "1024"], "--pieces sets the uncompiled step's pieces and needs --uncompiled"),
])
def test_options_that_need_another_are_refused_by_name(arguments, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARK), "--sizes", "5000", "--options", "A", *arguments])
    with pytest.raises(SystemExit) as exit_info:
        _benchmark_module().main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_uncompiled_step_runs_in_pieces_and_whole_in_the_same_run(capsys):
    """In this process (the uncompiled step compiles nothing): a row of pieces and a row of the whole
    call, each beside its paired baseline."""
    import torch

    _benchmark_module().run([5000], ["A"], warmup=1, repeats=1, device=torch.device("cpu"), path="uncompiled", pieces=1024)
    output = capsys.readouterr().out
    assert "path=uncompiled pieces=1024" in output
    rows = [line.split() for line in output.splitlines() if line.split()[:1] == ["5e+03"]]
    assert [row[1] for row in rows] == ["torch32", "A", "torch32", "A(whole)"]
    assert all(float(row[3]) > 0 for row in rows)


def test_the_elements_split_into_a_mix_of_four_or_into_a_models_many_weights():
    module = _benchmark_module()
    assert module.layout(1000) == [501, 247, 130, 122]
    many = module.layout(10_000, 300)
    assert len(many) == 300 and sum(many) == 10_000 and max(many) - min(many) <= 5
    with pytest.raises(ValueError, match="10 elements cannot be 300 tensors"):
        module.layout(10, 300)
