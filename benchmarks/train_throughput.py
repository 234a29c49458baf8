"""Training throughput of precision options against stock megatron-core, on the same model in one invocation.

Each run is a ``lowprec-train`` process (``torchrun`` with ``--nproc`` > 1) on the same model, data,
batch and layout, differing only in the precision config; stock megatron-core (``baseline=megatron``:
its own ``get_megatron_optimizer``, BF16 parameters, FP32 master weights) is always among them and is
the baseline of the ratios. Runs go one after another, ``--rounds`` times in turn (so that a machine
whose speed drifts slows every run alike), and each figure is the median over the rounds. Each run
prints a line as it ends; a run that fails or outlasts ``--timeout`` gets a row saying so, the others
still run, and the exit status is 1.

Per run, from the run's ``metrics.jsonl`` (one row per step): tokens/s over the steps after
``--warmup`` (total tokens / total step time; evaluation and checkpoints are not timed; the fused
step is compiled at the first step, ``precision.background_compile=false``, so that the timed steps
are the steady state), model
TFLOP/s per GPU and MFU as the app computes them (:mod:`megatron_lowprec.train.throughput`; MFU only
on GPUs whose dense BF16 peak is known), and the peak memory of the whole run on the largest rank:
``torch.cuda.max_memory_allocated`` on GPUs, the resident set size on CPUs (which also holds
the Python process, its libraries and the data). Ratios: tokens/s and peak memory over stock's.

With ``--profile DIR`` each run of the first round trains :data:`PROFILED_STEPS` more steps after
the timed ones under torch.profiler (``trainer.profile``; they are not timed) and its table of
operators by time and its Chrome trace are copied to ``DIR/<run>.txt`` and ``DIR/<run>.pt.trace.json``:
where a run spends the time that stock does not.

A run is ``NAME`` or ``NAME:OVERRIDE,OVERRIDE``, with NAME a member of ``configs/precision`` and
Hydra overrides for that run alone, e.g. ``A:model.attention_backend=unfused``. ``--set`` gives
overrides for every run.

    # CPU (CI machine): the tiny model
    python benchmarks/train_throughput.py --runs A B C D sr coat --steps 20
    # one GPU: GPT-125M (micro-batch 8) and GPT-1.3B (micro-batch 2), sequence length 2048
    python benchmarks/train_throughput.py --model gpt_125m --micro-batch 8 --global-batch 8 \\
        --runs A B C D sr coat --steps 30 --warmup 5
    python benchmarks/train_throughput.py --model gpt_1.3b --micro-batch 2 --global-batch 2 \\
        --runs A B C D sr coat --steps 30 --warmup 5 --profile profiles/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STOCK = "megatron"
BASELINES = (STOCK, "te_fp8")
"""Run names that are members of the app's ``baseline`` group (stock megatron-core, Transformer
Engine's FP8) rather than precision options."""
PROFILED_STEPS = 2
"""Steps profiled after the timed ones with ``--profile``."""
DEFAULT_RUNS = ("A", "B", "C", "D", "D-MW", "kahan", "sr", "coat")


def parse_run(text: str) -> tuple[str, list[str]]:
    """``NAME[:OVERRIDE,...]`` → the label and the run's Hydra overrides (``NAME``: an option or one of
    :data:`BASELINES`)."""
    name, _, extra = text.partition(":")
    group = "baseline" if name in BASELINES else "precision"
    return text, [f"{group}={name}", *(override for override in extra.split(",") if override)]


def train_command(arguments: argparse.Namespace, overrides: list[str], run_dir: Path, profile: bool = False) -> list[str]:
    """The ``lowprec-train`` command line of one run (``profile``: :data:`PROFILED_STEPS` more steps,
    profiled)."""
    timed_end = arguments.warmup + arguments.steps
    profiling = [
        "trainer.profile=true", f"trainer.profile_step_start={timed_end}", f"trainer.profile_step_end={timed_end + PROFILED_STEPS}",
    ] if profile else []
    launcher = [sys.executable]
    if arguments.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={arguments.nproc}"]
    settings = [
        f"model={arguments.model}",
        f"trainer.micro_batch_size={arguments.micro_batch}",
        f"trainer.global_batch_size={arguments.global_batch}",
        f"trainer.max_steps={timed_end + (PROFILED_STEPS if profile else 0)}",
        "trainer.log_interval=1",
        f"trainer.eval_interval={10**9}",
        "trainer.eval_iters=1",
        "trainer.save=false",
        "logging.wandb=false",
        "precision.background_compile=false",
        f"run_dir={run_dir}",
        *profiling,
    ]
    return [*launcher, "-m", "megatron_lowprec.train", *settings, *arguments.set, *overrides]


def measure(rows: list[dict], summary: dict, warmup: int, steps: int, world_size: int) -> dict:
    """Throughput over the ``steps`` steps after the warmup ones and the run's peak memory, from its
    metrics rows and summary."""
    timed = [row for row in rows if row["split"] == "train" and warmup < row["step"] <= warmup + steps]
    if not timed:
        raise ValueError("no timed steps: --steps must be at least 1")
    tokens_per_second = len(timed) / sum(1.0 / row["tokens_per_second"] for row in timed)
    per_gpu = summary["flops_per_token"] * tokens_per_second / world_size
    last = timed[-1]
    result = {
        "tokens_per_second": tokens_per_second,
        "tflops_per_gpu": per_gpu / 1e12,
        "peak_gib": last.get("peak_allocated_gib", last.get("peak_rss_gib")),
        "final_train_loss": summary["final_train_loss"],
    }
    if "peak_bf16_tflops" in summary:
        result["mfu"] = per_gpu / (summary["peak_bf16_tflops"] * 1e12)
    if "peak_reserved_gib" in last:
        result["peak_reserved_gib"] = last["peak_reserved_gib"]
    return result


class RunFailed(RuntimeError):
    """A run that exited with an error or outlasted ``--timeout``; its first line says which."""


def run_once(arguments: argparse.Namespace, label: str, overrides: list[str], work_dir: Path, profile_dir: Path | None = None) -> dict:
    """One run's figures; with ``profile_dir``, its profile copied there as ``<run>.txt`` and
    ``<run>.pt.trace.json``."""
    name = label.replace("/", "_").replace(":", "_").replace(",", "_").replace("=", "-")
    run_dir = work_dir / name
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        finished = subprocess.run(
            train_command(arguments, overrides, run_dir, profile_dir is not None), capture_output=True, text=True,
            env=environment,
            timeout=arguments.timeout,
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or b""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        raise RunFailed(f"outlasted --timeout {arguments.timeout:g} s\n{output[-3000:]}") from None
    if finished.returncode != 0:
        raise RunFailed(f"exit {finished.returncode}\n{finished.stdout[-3000:]}{finished.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        for suffix in (".txt", ".pt.trace.json"):
            shutil.copyfile(run_dir / "profile" / f"rank0{suffix}", profile_dir / f"{name}{suffix}")
    return measure(rows, summary, arguments.warmup, arguments.steps, arguments.nproc)


def median_results(rounds: list[dict]) -> dict:
    return {key: statistics.median(result[key] for result in rounds) for key in rounds[0]}


def table_rows(results: dict[str, dict], failures: dict[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """The header and one row per run in the order of ``results`` (stock first); a failed run's
    row names its failure, and without stock's figures the ratios are left out."""
    failures = failures or {}
    stock = results.get(STOCK)
    mfu = any("mfu" in result for result in results.values())
    header = ["run", "tokens/s", "TFLOP/s/GPU", *(["MFU"] if mfu else []), "peak GiB", "tokens/s vs stock", "peak vs stock"]
    rows = []
    for label in [*results, *failures]:
        if label in failures:
            cells = [label, f"failed: {failures[label]}", *["-"] * (len(header) - 2)]
        else:
            result = results[label]
            cells = [
                label,
                f"{result['tokens_per_second']:,.0f}",
                f"{result['tflops_per_gpu']:.3g}",
                *([f"{100 * result['mfu']:.1f}%" if "mfu" in result else "-"] if mfu else []),
                f"{result['peak_gib']:.2f}",
                f"{result['tokens_per_second'] / stock['tokens_per_second']:.2f}" if stock else "-",
                f"{result['peak_gib'] / stock['peak_gib']:.2f}" if stock else "-",
            ]
        rows.append(cells)
    return header, rows


def table(results: dict[str, dict], failures: dict[str, str] | None = None) -> str:
    """:func:`table_rows` as a Markdown table."""
    header, rows = table_rows(results, failures)
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="NAME or NAME:OVERRIDE,... (stock is added)")
    parser.add_argument("--model", default="tiny", help="a member of configs/model")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the runs; figures are medians")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run, through torchrun")
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help=f"profile {PROFILED_STEPS} untimed steps after the timed ones of each run's first round into DIR")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    arguments = parser.parse_args()
    runs = dict(parse_run(text) for text in [STOCK, *(run for run in arguments.runs if run != STOCK)])
    measured: dict[str, list[dict]] = {label: [] for label in runs}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="train_throughput_") as work:
        for round_index in range(arguments.rounds):
            for label, overrides in runs.items():
                if label in failures:
                    continue
                try:
                    result = run_once(
                        arguments, label, overrides, Path(work) / f"round{round_index}", arguments.profile if round_index == 0 else None
                    )
                except RunFailed as error:
                    failures[label] = str(error).splitlines()[0]
                    print(f"run {label!r} failed: {error}", file=sys.stderr, flush=True)
                    continue
                measured[label].append(result)
                print(f"round {round_index + 1}, {label}: {result['tokens_per_second']:,.0f} tokens/s, "
                      f"peak {result['peak_gib']:.2f} GiB", flush=True)
    results = {label: median_results(rounds) for label, rounds in measured.items() if label not in failures}
    settings = (
        f"model {arguments.model}, micro-batch {arguments.micro_batch}, global batch {arguments.global_batch}, "
        f"{arguments.nproc} process(es), {arguments.steps} timed steps after {arguments.warmup}, "
        f"median of {arguments.rounds} round(s); overrides {' '.join(arguments.set) or 'none'}"
    )
    print(settings)
    print(table(results, failures))
    if arguments.markdown is not None:
        import report
        import torch

        header, rows = table_rows(results, failures)
        report.write_result(arguments.markdown, f"Training throughput against stock megatron-core ({arguments.model})",
                            header, rows, [
            f"`python benchmarks/train_throughput.py --runs {' '.join(arguments.runs)}`, {settings}: one `lowprec-train` "
            "process per run, stock megatron-core (`baseline=megatron`) the baseline of the ratios; tokens/s over the "
            "timed steps (the fused step compiled at the first step); peak memory of the run on the largest rank "
            "(allocated on GPUs, the resident set on CPUs).", *arguments.note,
        ], device="cuda" if torch.cuda.is_available() else "cpu")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({**results, **{label: {"failed": why} for label, why in failures.items()}}, indent=1))
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed: {', '.join(failures)}")
    if not all(math.isfinite(result["final_train_loss"]) for result in results.values()):
        raise SystemExit("a run ended with a non-finite loss")


if __name__ == "__main__":
    main()
