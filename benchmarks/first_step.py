"""Time to the first optimizer step: ``lowprec-train`` on the embedded default, per option, cold and warm.

Each run is a fresh process, ``lowprec-train precision=OPTION`` on the Hydra app's default (the
0.7M-parameter GPT on the shipped Shakespeare corpus, one process, CPU unless CUDA is there): the
time from starting the process to the end of its first optimizer step (``train_step`` returning),
after which the process exits. Cold: an empty Inductor cache (a new ``TORCHINDUCTOR_CACHE_DIR``), what
a new user and CI have. Warm: the same directory again, what the user's next run has. The baseline
is ``precision=megatron``, megatron-core's own optimizer, which on CPU is plain ``torch.optim.AdamW``
(nothing compiled), timed in the same run. Before any timing one untimed baseline run prepares the
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

CHILD = f"""
import os, sys, time
from megatron_lowprec.train import loop

train_step = loop.train_step


def first_step_then_exit(run):
    result = train_step(run)
    print("{FIRST_STEP_MARK}", time.time(), flush=True)
    os._exit(0)


loop.train_step = first_step_then_exit
from megatron_lowprec.train.app import main

sys.exit(main(sys.argv[1:]))
"""


def first_step_seconds(option: str, cache_dir: Path, run_dir: Path) -> float:
    """Seconds from starting ``lowprec-train precision=option`` to the end of its first step."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    started = time.time()
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, f"precision={option}", f"run_dir={run_dir}"],
        env=environment, capture_output=True, text=True,
    )
    marks = [line.split()[1] for line in completed.stdout.splitlines() if line.startswith(FIRST_STEP_MARK)]
    if not marks:
        raise RuntimeError(f"precision={option} ended without a first step:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return float(marks[0]) - started


def main() -> None:
    from megatron_lowprec.optim import available_strategies

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", nargs="+", default=[strategy.name for strategy in available_strategies()])
    parser.add_argument("--repeats", type=int, default=1, help="cold and warm runs per option (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first_step_") as scratch:
        root = Path(scratch)
        first_step_seconds(BASELINE, root / "cache-prepare", root / "prepare")
        rows = []
        for option in [BASELINE, *args.options]:
            cold, warm = [], []
            for repeat in range(args.repeats):
                cache = root / f"cache-{option}-{repeat}"
                cold.append(first_step_seconds(option, cache, root / f"{option}-cold-{repeat}"))
                warm.append(first_step_seconds(option, cache, root / f"{option}-warm-{repeat}"))
            rows.append((option, statistics.median(cold), statistics.median(warm)))
            print(f"{option}: cold {rows[-1][1]:.1f} s, warm {rows[-1][2]:.1f} s", file=sys.stderr, flush=True)
    base_cold, base_warm = rows[0][1], rows[0][2]
    print(f"{os.cpu_count()} CPUs, {args.repeats} run(s) per cell (median); baseline: {BASELINE} = torch.optim.AdamW")
    print("| option | cold (s) | warm (s) | cold / AdamW | warm / AdamW |")
    print("|---|---|---|---|---|")
    for option, cold, warm in rows:
        label = f"{BASELINE} (torch.optim.AdamW)" if option == BASELINE else option
        print(f"| {label} | {cold:.1f} | {warm:.1f} | {cold / base_cold:.2f} | {warm / base_warm:.2f} |")


if __name__ == "__main__":
    main()
