"""Time to the first optimizer step: ``lowprec-train`` on the embedded default, per option, cold and warm.

Each run is a fresh process, ``lowprec-train precision=OPTION`` on the Hydra app's default (the
0.7M-parameter GPT on the shipped Shakespeare corpus, one process, CPU unless CUDA is there): the
time from starting the process to the end of its first optimizer step (``train_step`` returning),
and to the end of the first step that ran the compiled kernel (the fused step is compiled in the
background while the first steps run it uncompiled, ``precision.background_compile=true``, which
this benchmark sets unless given ``--no-background-compile``; for an option
that compiles nothing, the second step), after which the process exits. Cold: an empty Inductor cache (a new ``TORCHINDUCTOR_CACHE_DIR``), what
a new user and CI have. Warm: the same directory again, what the user's next run has. The baseline
is ``precision=megatron``, megatron-core's own optimizer, which on CPU is plain ``torch.optim.AdamW``
(nothing compiled), timed just before each cold and each warm run of an option. Before any timing one untimed baseline run prepares the
corpus cache, so that no run pays for it. Runs go one after another; on a shared machine compare
the ratios of one run, not absolute seconds across runs.

    python benchmarks/first_step.py
    python benchmarks/first_step.py --options coat sr --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "megatron"
"""The app's precision member for megatron-core's own optimizer (``torch.optim.AdamW`` on CPU)."""

FIRST_STEP_MARK = "FIRST_STEP_END"
COMPILED_STEP_MARK = "COMPILED_STEP_END"

CHILD = f"""
import os, sys, time
from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES
from megatron_lowprec.train import loop

train_step = loop.train_step
steps = []


def until_a_compiled_step_then_exit(run):
    compiled = bool(steps) and not BACKGROUND_COMPILES.compiling()
    result = train_step(run)
    steps.append(time.time())
    if len(steps) == 1:
        print("{FIRST_STEP_MARK}", steps[0], flush=True)
    if compiled:
        print("{COMPILED_STEP_MARK}", steps[-1], flush=True)
        os._exit(0)
    return result


loop.train_step = until_a_compiled_step_then_exit
from megatron_lowprec.train.app import main

sys.exit(main(sys.argv[1:]))
"""


def first_step_seconds(option: str, cache_dir: Path, run_dir: Path, background_compile: bool = True) -> tuple[float, float]:
    """Seconds from starting ``lowprec-train precision=option`` to the end of its first step, and to
    the end of its first step with the compiled kernel (every step's, for an option that compiles nothing)."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    started = time.time()
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, f"precision={option}", f"run_dir={run_dir}",
         f"precision.background_compile={str(background_compile).lower()}"],
        env=environment, capture_output=True, text=True,
    )
    marks = dict(line.split()[:2] for line in completed.stdout.splitlines() if line.startswith((FIRST_STEP_MARK, COMPILED_STEP_MARK)))
    if set(marks) != {FIRST_STEP_MARK, COMPILED_STEP_MARK}:
        raise RuntimeError(f"precision={option} ended without a compiled step:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return float(marks[FIRST_STEP_MARK]) - started, float(marks[COMPILED_STEP_MARK]) - started


def main() -> None:
    from megatron_lowprec.optim import available_strategies

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", nargs="+", default=[strategy.name for strategy in available_strategies()])
    parser.add_argument("--repeats", type=int, default=1, help="cold and warm runs per option (median)")
    parser.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="precision.background_compile of the option's runs (default: on)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first_step_") as scratch:
        root = Path(scratch)
        first_step_seconds(BASELINE, root / "cache-prepare", root / "prepare")
        rows = []
        for option in args.options:
            runs = {key: [] for key in ("baseline cold", "cold", "baseline warm", "warm")}
            for repeat in range(args.repeats):
                caches = {BASELINE: root / f"cache-{option}-baseline-{repeat}", option: root / f"cache-{option}-{repeat}"}
                for key, which in (("baseline cold", BASELINE), ("cold", option), ("baseline warm", BASELINE), ("warm", option)):
                    runs[key].append(first_step_seconds(
                        which, caches[which], root / f"{option}-{key}-{repeat}".replace(" ", "-"), args.background_compile
                    ))
            row = {key: [statistics.median(times[which] for times in values) for which in (0, 1)] for key, values in runs.items()}
            rows.append((option, row))
            print(f"{option}: " + ", ".join(f"{key} {first:.1f} s / {compiled:.1f} s" for key, (first, compiled) in row.items()),
                  file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs, {args.repeats} run(s) per cell (median); baseline: {BASELINE} = torch.optim.AdamW, "
          "run just before each option's run")
    print("| option | first step, cold (s) | AdamW, cold (s) | cold / AdamW | first step, warm (s) | AdamW, warm (s) "
          "| warm / AdamW | first compiled step, cold (s) | first compiled step, warm (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for option, row in rows:
        (cold, cold_compiled), (warm, warm_compiled) = row["cold"], row["warm"]
        base_cold, base_warm = row["baseline cold"][0], row["baseline warm"][0]
        print(f"| {option} | {cold:.1f} | {base_cold:.1f} | {cold / base_cold:.2f} | {warm:.1f} | {base_warm:.1f} "
              f"| {warm / base_warm:.2f} | {cold_compiled:.1f} | {warm_compiled:.1f} |")

if __name__ == "__main__":
    main()
