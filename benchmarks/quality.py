"""Precision options' training quality on the embedded default: final validation loss, paired by seed
against option D, with the share of updates lost to rounding and Collage's EDQ.

Each run is one ``lowprec-train`` process (``python -m megatron_lowprec.train``) on the default model
and data (the 0.72M-parameter GPT on the shipped corpus) with Hydra overrides for the optimizer, the
option, the seed (``trainer.seed``: initialisation and data order) and the peak learning rate (the
cosine decays to a tenth of it after the app's warmup), in a run directory of its own under
``--out``; the script reads the run's ``summary.json`` (``final_valid_loss``: the validation loss
after the last step) and ``metrics.jsonl``. A run whose finished summary is already there is not run
again, so a long measurement continues where it stopped and ``--report-only`` tabulates what is
there; ``--jobs`` runs that many trainings at once (each with ``OMP_NUM_THREADS`` = cores / jobs unless
the environment sets it).

Across seeds the embedded default's final validation loss moves far more than the options differ,
so each option is compared with option D **on the same seed** (same initialisation, same batches):
the gap is ``loss(option, seed) - loss(D, seed)``, its mean and sample standard deviation taken over
the seeds where both ran (:func:`paired_gaps`). With ``--optimizer muon`` the baseline is Muon with
option D. AdamW runs track update quality (``precision.track_update_quality``): the imprecision
percentage (Collage §3: elements meant to move whose represented value stayed put) and EDQ (Collage
Def. 3.3, eq. 3: the effective update projected on the intended one's direction, which is the
intended update's norm when nothing is lost), each the mean over the run's steps; Muon measures
neither. The small default learning rate (1e-3) puts most updates under half a BF16 ulp of their
weight, where nearest rounding loses them.

    python benchmarks/quality.py --jobs 2                               # AdamW: D, sr, A, 3 seeds, 2 lrs
    python benchmarks/quality.py --optimizer muon --options D sr --jobs 2
    python benchmarks/quality.py --report-only --markdown docs/results/quality_adamw.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

BASELINE_OPTION = "D"
DEFAULT_OPTIONS = ("D", "sr", "A")
DEFAULT_SEEDS = (1234, 1235, 1236)
DEFAULT_LRS = (3e-3, 1e-3)
"""The app's default peak learning rate and a small one where updates fall under the BF16 ulp."""
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Run:
    """One training: optimizer, precision option, peak learning rate, seed and steps."""

    optimizer: str
    option: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        """The run directory's name under ``--out``."""
        return f"{self.optimizer}-{self.option}-lr{self.lr:g}-seed{self.seed}-steps{self.steps}"


@dataclass(frozen=True)
class Outcome:
    """What a run left: its final validation loss (None unless it finished) and the means over its
    steps of the imprecision percentage and EDQ (None where not tracked)."""

    status: str
    valid_loss: float | None
    bytes_per_param: float | None
    imprecision_percent: float | None
    edq: float | None


FAILED = Outcome("failed", None, None, None, None)
"""The outcome of a run whose process failed before it wrote a summary."""


@dataclass(frozen=True)
class PairedGap:
    """An option's final validation losses against the baseline's on the same seeds."""

    seeds: tuple[int, ...]
    """The seeds both the option and the baseline finished, in order."""
    gaps: tuple[float, ...]
    """loss(option, seed) - loss(baseline, seed), one per seed of :attr:`seeds`."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.gaps)

    @property
    def spread(self) -> float | None:
        """The gaps' sample standard deviation (n - 1); None with fewer than two seeds."""
        return statistics.stdev(self.gaps) if len(self.gaps) > 1 else None


def paired_gaps(losses: Mapping[tuple[str, float, int], float], baseline: str = BASELINE_OPTION) -> dict[tuple[str, float], PairedGap]:
    """Each (option, lr)'s gap to ``baseline`` paired by seed, from final validation losses keyed by
    (option, lr, seed); only the seeds where both finished pair, and an (option, lr) with none has no
    entry. The baseline's own gaps are zeros."""
    seeds_of: dict[tuple[str, float], list[int]] = {}
    for option, lr, seed in losses:
        if (baseline, lr, seed) in losses:
            seeds_of.setdefault((option, lr), []).append(seed)
    return {
        key: PairedGap(tuple(sorted(seeds)), tuple(losses[(*key, seed)] - losses[(baseline, key[1], seed)] for seed in sorted(seeds)))
        for key, seeds in seeds_of.items()
    }


def train_command(run: Run, run_dir: Path, arguments: argparse.Namespace) -> list[str]:
    """The ``lowprec-train`` command line of ``run``."""
    tracking = ["precision.track_update_quality=true"] if run.optimizer == "adamw" else []
    return [
        sys.executable, "-m", "megatron_lowprec.train", f"optimizer={run.optimizer}", f"precision={run.option}",
        f"optimizer.lr={run.lr}", f"optimizer.min_lr={run.lr / 10}", f"trainer.seed={run.seed}",
        f"trainer.max_steps={run.steps}", f"trainer.eval_interval={run.steps}", f"trainer.log_interval={arguments.log_interval}",
        f"trainer.eval_iters={arguments.eval_iters}", "trainer.save_interval=0", "logging.wandb=false",
        *tracking, f"run_dir={run_dir}", *arguments.set,
    ]


def read_outcome(run_dir: Path) -> Outcome | None:
    """The outcome of the run in ``run_dir``, None where it left no summary."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    rows = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [row for row in rows if row["split"] == "train"]
    return Outcome(
        status=summary["status"],
        valid_loss=summary.get("final_valid_loss") if summary["status"] == "finished" else None,
        bytes_per_param=summary.get("bytes_per_param"),
        imprecision_percent=step_weighted_mean(train, "imprecision_percent"),
        edq=step_weighted_mean(train, "edq"),
    )


def step_weighted_mean(rows: Sequence[dict], key: str) -> float | None:
    """The mean over steps of ``key`` from logged rows that each hold the mean over their interval (the
    steps since the previous row); None where no row holds a finite value."""
    total = weight = 0.0
    previous = 0
    for row in rows:
        steps, previous = row["step"] - previous, row["step"]
        value = row.get(key)
        if value is not None and math.isfinite(value):
            total += steps * value
            weight += steps
    return total / weight if weight else None


def run_one(run: Run, arguments: argparse.Namespace, environment: dict[str, str]) -> tuple[Run, Outcome | None, str]:
    """Train ``run`` unless its directory holds a finished summary; returns its outcome and, for a
    failed process, the end of its output."""
    run_dir = arguments.out / run.name
    outcome = read_outcome(run_dir)
    if outcome is not None and outcome.status == "finished":
        return run, outcome, ""
    try:
        finished = subprocess.run(
            train_command(run, run_dir, arguments), capture_output=True, text=True, env=environment, timeout=arguments.timeout
        )
    except subprocess.TimeoutExpired:
        return run, FAILED, f"outlasted --timeout {arguments.timeout:g} s"
    if finished.returncode != 0:
        return run, read_outcome(run_dir) or FAILED, f"exit {finished.returncode}:\n{finished.stdout[-2000:]}{finished.stderr[-2000:]}"
    return run, read_outcome(run_dir), ""


def planned_runs(arguments: argparse.Namespace) -> list[Run]:
    """Every (option, lr, seed) run, seed by seed so that paired cells fill first."""
    return [
        Run(arguments.optimizer, option, lr, seed, arguments.steps)
        for seed in arguments.seeds for lr in arguments.lrs for option in arguments.options
    ]


def format_value(value: float | None, digits: int) -> str:
    return NOT_MEASURED if value is None else f"{value:.{digits}f}"


def table(arguments: argparse.Namespace, outcomes: Mapping[Run, Outcome]) -> tuple[list[str], list[list[str]]]:
    """One row per (lr, option): bytes/param, the loss of each seed, their mean, the paired gap to the
    baseline (mean, standard deviation, seeds paired), imprecision % and EDQ (means over seeds)."""
    losses = {(run.option, run.lr, run.seed): outcome.valid_loss for run, outcome in outcomes.items() if outcome.valid_loss is not None}
    gaps = paired_gaps(losses, BASELINE_OPTION)
    header = ["lr", "option", "bytes/param", *(f"seed {seed}" for seed in arguments.seeds), "mean loss",
              f"gap to {BASELINE_OPTION} (mean)", "gap sd", "paired seeds", "imprecision %", "EDQ"]
    rows = []
    for lr in arguments.lrs:
        for option in arguments.options:
            runs = [outcomes.get(Run(arguments.optimizer, option, lr, seed, arguments.steps)) for seed in arguments.seeds]
            finished = [outcome for outcome in runs if outcome is not None and outcome.valid_loss is not None]
            seed_cells = [
                NOT_MEASURED if outcome is None else outcome.status if outcome.valid_loss is None else f"{outcome.valid_loss:.4f}"
                for outcome in runs
            ]
            gap = gaps.get((option, lr))
            tracked = [outcome for outcome in finished if outcome.imprecision_percent is not None]
            rows.append([
                f"{lr:g}", option,
                format_value(finished[0].bytes_per_param if finished else None, 2),
                *seed_cells,
                format_value(statistics.fmean(o.valid_loss for o in finished) if finished else None, 4),
                NOT_MEASURED if gap is None else f"{gap.mean:+.4f}",
                NOT_MEASURED if gap is None else "one seed" if gap.spread is None else f"{gap.spread:.4f}",
                "0" if gap is None else str(len(gap.seeds)),
                format_value(statistics.fmean(o.imprecision_percent for o in tracked) if tracked else None, 2),
                NOT_MEASURED if not tracked else f"{statistics.fmean(o.edq for o in tracked):.3e}",
            ])
    return header, rows


def description(arguments: argparse.Namespace) -> str:
    """The Markdown file's paragraph: the command and what each column means."""
    options = " ".join(arguments.options)
    command = (f"`python benchmarks/quality.py --optimizer {arguments.optimizer} --options {options} --seeds "
               f"{' '.join(map(str, arguments.seeds))} --lrs {' '.join(f'{lr:g}' for lr in arguments.lrs)} --steps "
               f"{arguments.steps}" + (f" --set {' '.join(arguments.set)}" if arguments.set else "") + "`")
    optimizer = "AdamW" if arguments.optimizer == "adamw" else "Muon (Moonshot's preset) for the hidden weights and AdamW for the rest"
    quality = ("imprecision % and EDQ: means over the run's steps, then over the seeds (EDQ is the intended update's "
               "norm when nothing is lost, so compare it across options at one lr)" if arguments.optimizer == "adamw"
               else "Muon measures no update quality, so imprecision % and EDQ are not measured")
    return (
        f"{command}: final validation loss of one `lowprec-train` run per cell on the embedded default (the 0.72M-parameter "
        f"GPT on the shipped corpus), {optimizer}, {arguments.steps} steps (warmup of the app's default, cosine decay to "
        f"a tenth of the peak lr), validation on {arguments.eval_iters} batches after the last step. Gap to "
        f"{BASELINE_OPTION}: the option's loss minus {BASELINE_OPTION}'s **on the same seed**, mean and sample standard "
        f"deviation over the paired seeds (negative: below {BASELINE_OPTION}); the seeds move the loss far more than the "
        f"options do, so unpaired means would hide the differences. Mean loss: over the seeds the option finished. "
        f"bytes/param: as allocated, from the run's summary (parameter, gradient buffer, states and master); {quality}. "
        f"A cell nobody ran says \"{NOT_MEASURED}\"."
    )


def print_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--options", nargs="+", default=list(DEFAULT_OPTIONS),
                        help=f"precision options; {BASELINE_OPTION} (the baseline) is added when missing")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    parser.add_argument("--lrs", nargs="+", type=float, default=list(DEFAULT_LRS), help="peak learning rates")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-iters", type=int, default=4)
    parser.add_argument("--log-interval", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1, help="trainings run at once")
    parser.add_argument("--out", type=Path, default=Path("quality_runs"), help="run directories (reused: finished runs are skipped)")
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run (use a fresh --out when changing them)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--report-only", action="store_true", help="run nothing; tabulate the runs finished under --out")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    arguments = parser.parse_args(argv)
    if arguments.jobs < 1 or arguments.steps < 1:
        parser.error(f"--jobs {arguments.jobs} and --steps {arguments.steps} must be >= 1")
    if BASELINE_OPTION not in arguments.options:
        arguments.options.insert(0, BASELINE_OPTION)
    arguments.out.mkdir(parents=True, exist_ok=True)

    runs = planned_runs(arguments)
    outcomes: dict[Run, Outcome] = {}
    failures = []
    if arguments.report_only:
        for run in runs:
            outcome = read_outcome(arguments.out / run.name)
            if outcome is not None:
                outcomes[run] = outcome
    else:
        environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
        environment.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // arguments.jobs)))
        with ThreadPoolExecutor(arguments.jobs) as pool:
            for future in as_completed([pool.submit(run_one, run, arguments, environment) for run in runs]):
                run, outcome, error = future.result()
                if outcome is not None:
                    outcomes[run] = outcome
                if error:
                    failures.append(run)
                    print(f"{run.name} failed:\n{error}", file=sys.stderr)
                loss = NOT_MEASURED if outcome is None else outcome.status if outcome.valid_loss is None else f"{outcome.valid_loss:.4f}"
                print(f"  {run.name}: validation loss {loss}", file=sys.stderr, flush=True)

    header, rows = table(arguments, outcomes)
    print(description(arguments))
    print_table(header, rows)
    if arguments.markdown is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import report

        optimizer = "AdamW" if arguments.optimizer == "adamw" else "Muon"
        report.write_result(
            arguments.markdown, f"{optimizer}: validation loss paired by seed against option {BASELINE_OPTION}",
            header, rows, [description(arguments), *arguments.note],
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
