"""Plot training loss, validation loss and Collage's EDQ per precision option from lowprec-train runs.

    python examples/plot_metrics.py runs/table6-A runs/table6-C --output table6.png

Each argument is a run directory holding ``metrics.jsonl`` (or the file itself), as ``lowprec-train``
writes it: one JSON object per line with ``step``, ``split`` (``train``/``valid``), ``loss`` and
``option``, and, on train lines of runs with ``precision.track_update_quality=true``, ``edq``. The
loss panel draws every run's training loss (solid) and validation loss (dots); an EDQ panel is added
when any run logged EDQ. A resumed run may log a step twice: its last record counts.
Needs matplotlib (``pip install 'megatron-lowprec[plot]'``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


@dataclass
class Run:
    """One run's curves, each a step -> value mapping."""

    path: Path
    option: str
    train_loss: dict[int, float] = field(default_factory=dict)
    valid_loss: dict[int, float] = field(default_factory=dict)
    edq: dict[int, float] = field(default_factory=dict)


def metrics_path(run: Path) -> Path:
    path = run / METRICS_FILE if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (expected a run directory holding {METRICS_FILE})")
    return path


def load_run(run: Path) -> Run:
    path = metrics_path(run)
    loaded = Run(path=path, option="?")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, split = int(record["step"]), record["split"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a metrics record ({error})") from None
        loaded.option = str(record.get("option", loaded.option))
        if split == "train":
            loaded.train_loss[step] = record["loss"]
            if record.get("edq") is not None:
                loaded.edq[step] = record["edq"]
        elif split == "valid":
            loaded.valid_loss[step] = record["loss"]
    if not loaded.train_loss and not loaded.valid_loss:
        raise ValueError(f"{path}: no train or valid records")
    return loaded


def labels(runs: list[Run]) -> list[str]:
    """The option of each run, with the run's directory name where several runs share an option."""
    options = [run.option for run in runs]
    return [
        run.option if options.count(run.option) == 1 else f"{run.option} ({run.path.parent.name})" for run in runs
    ]


def plot(runs: list[Run], output: Path):
    """Write the figure to ``output`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_edq = any(run.edq for run in runs)
    figure, axes = plt.subplots(1, 2 if with_edq else 1, figsize=(12 if with_edq else 6.5, 4.5), squeeze=False)
    loss_axes = axes[0][0]
    colors = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for run, label, color in zip(runs, labels(runs), colors):
        steps = sorted(run.train_loss)
        loss_axes.plot(steps, [run.train_loss[step] for step in steps], color=color, label=f"{label} train")
        steps = sorted(run.valid_loss)
        loss_axes.plot(steps, [run.valid_loss[step] for step in steps], "o", color=color, label=f"{label} valid")
        if with_edq and run.edq:
            steps = sorted(run.edq)
            axes[0][1].plot(steps, [run.edq[step] for step in steps], color=color, label=label)
    loss_axes.set(xlabel="step", ylabel="loss", title="Loss")
    loss_axes.legend()
    if with_edq:
        axes[0][1].set(xlabel="step", ylabel="EDQ", title="Effective descent quality (Collage)")
        axes[0][1].legend()
    figure.tight_layout()
    figure.savefig(output, format="png", dpi=120)
    plt.close(figure)
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help=f"run directories (holding {METRICS_FILE}) or metrics files")
    parser.add_argument("--output", type=Path, default=Path("metrics.png"), help="PNG to write (default: metrics.png)")
    arguments = parser.parse_args(argv)
    try:
        runs = [load_run(run) for run in arguments.runs]
    except (FileNotFoundError, ValueError) as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 2
    plot(runs, arguments.output)
    print(f"wrote {arguments.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
