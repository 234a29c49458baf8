"""The plotting example turns metrics.jsonl files into a PNG of loss and EDQ per option."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plot_metrics.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def example(monkeypatch):
    """The example as a module (registered, as its dataclasses need, for the test's duration)."""
    spec = importlib.util.spec_from_file_location("plot_metrics", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def write_run(run_dir: Path, option: str, steps: int = 40, with_edq: bool = True) -> Path:
    """A metrics.jsonl as lowprec-train writes it: train lines every 5 steps, valid lines every 20."""
    run_dir.mkdir(parents=True)
    records = []
    for step in range(5, steps + 1, 5):
        record = {"step": step, "split": "train", "loss": 8.0 * math.exp(-step / 30) + 2.0, "lr": 3e-3,
                  "grad_norm": 1.0, "tokens_per_second": 1000.0, "option": option}
        if with_edq:
            record.update(edq=0.9 - 0.1 * math.exp(-step / 10), imprecision_percent=5.0)
        records.append(record)
        if step % 20 == 0:
            records.append({"step": step, "split": "valid", "loss": 8.2 * math.exp(-step / 30) + 2.1,
                            "perplexity": 20.0, "option": option})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def test_plots_loss_and_edq_of_several_options_into_a_png(tmp_path):
    import matplotlib.image

    runs = [write_run(tmp_path / f"run-{option}", option) for option in ("A", "C", "sr")]
    output = tmp_path / "plot.png"
    completed = subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, runs), "--output", str(output)],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert output.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(output)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_edq_panel_only_when_a_run_logged_edq(tmp_path, example):
    without = [example.load_run(write_run(tmp_path / "plain", "A", with_edq=False))]
    assert len(example.plot(without, tmp_path / "loss.png").axes) == 1
    with_edq = without + [example.load_run(write_run(tmp_path / "tracked", "C"))]
    assert len(example.plot(with_edq, tmp_path / "both.png").axes) == 2


def test_runs_sharing_an_option_are_told_apart_and_repeated_steps_keep_the_last(tmp_path, example):
    first = write_run(tmp_path / "beta2-0.95", "C")
    with (first / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 40, "split": "train", "loss": 1.5, "option": "C"}) + "\n")
    runs = [example.load_run(first), example.load_run(write_run(tmp_path / "beta2-0.999", "C"))]
    assert example.labels(runs) == ["C (beta2-0.95)", "C (beta2-0.999)"]
    assert runs[0].train_loss[40] == 1.5


def test_a_missing_or_malformed_metrics_file_is_reported(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metrics.jsonl").write_text('{"split": "train"}\n')
    for run, message in ((tmp_path / "absent", "no metrics file"), (tmp_path / "broken", "not a metrics record")):
        completed = subprocess.run(
            [sys.executable, str(EXAMPLE), str(run), "--output", str(tmp_path / "x.png")],
            capture_output=True, text=True, timeout=120,
        )
        assert completed.returncode == 2
        assert message in completed.stderr
