"""Time to the first optimizer step: ``lowprec-train`` on the embedded default, per option, cold and warm.

Each run is a fresh process, ``lowprec-train precision=OPTION`` on the Hydra app's default (the
0.7M-parameter GPT on the shipped Shakespeare corpus, one process, CPU unless CUDA is there): the
time from starting the process to the end of its first optimizer step (``train_step`` returning),
and to the end of the first step that ran the compiled kernel (the fused step is compiled in the
background while the first steps run it uncompiled, ``precision.background_compile=true``, which
this benchmark sets unless given ``--no-background-compile``; for an option
that compiles nothing, the second step), after which the process exits. Cold: an empty Inductor cache (a new ``TORCHINDUCTOR_CACHE_DIR``), what
a new user and CI have. Warm: the same directory again, what the user's next run has. The baseline
is ``baseline=megatron``, megatron-core's own optimizer, which on CPU is plain ``torch.optim.AdamW``
(nothing compiled), timed just before each cold and each warm run of an option. Before any timing one untimed baseline run prepares the
corpus cache, so that no run pays for it. Runs go one after another; on a shared machine compare
the ratios of one run, not absolute seconds across runs.

With ``--megatron-lm CHECKOUT`` it times Megatron-LM's own ``pretrain_gpt.py`` instead (a checkout
of Megatron-LM; this package's entry, ``torchrun -m megatron_lowprec.megatron.megatron_lm``, one
process, a 2-layer GPT on mock data): the first iteration's time as Megatron-LM logs it (``elapsed
time per iteration`` at iteration 1), per option with background compilation (the entry's default)
and without it, beside Megatron's own optimizer, each run on an empty Inductor cache.

    python benchmarks/first_step.py
    python benchmarks/first_step.py --options coat sr --repeats 2
    python benchmarks/first_step.py --megatron-lm ~/Megatron-LM --options C sr coat
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "megatron"
"""The app's ``baseline`` member for megatron-core's own optimizer (``torch.optim.AdamW`` on CPU)."""

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
        [sys.executable, "-c", CHILD, f"{'baseline' if option == BASELINE else 'precision'}={option}", f"run_dir={run_dir}",
         f"precision.background_compile={str(background_compile).lower()}"],
        env=environment, capture_output=True, text=True,
    )
    marks = dict(line.split()[:2] for line in completed.stdout.splitlines() if line.startswith((FIRST_STEP_MARK, COMPILED_STEP_MARK)))
    if set(marks) != {FIRST_STEP_MARK, COMPILED_STEP_MARK}:
        raise RuntimeError(f"precision={option} ended without a compiled step:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}")
    return float(marks[FIRST_STEP_MARK]) - started, float(marks[COMPILED_STEP_MARK]) - started


MEGATRON_LM_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--bf16", "--seed", "7", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "1000", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--transformer-impl", "local",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
]
"""A 2-layer GPT for Megatron-LM's ``pretrain_gpt.py`` on mock data, with the flags a CPU run needs (and
a GPU without apex: no gradient-accumulation fusion)."""

FIRST_ITERATION = re.compile(r"iteration\s+1/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)")


def megatron_lm_first_iteration_seconds(checkout: Path, option_flags: list[str], cache_dir: Path) -> float:
    """Megatron-LM's logged time of iteration 1 of ``pretrain_gpt.py`` in ``checkout`` with ``option_flags``."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "megatron_lowprec.megatron.megatron_lm", "pretrain_gpt.py", *MEGATRON_LM_GPT, *option_flags]
    completed = subprocess.run(command, cwd=checkout, env=environment, capture_output=True, text=True)
    found = FIRST_ITERATION.search(completed.stdout + completed.stderr)
    if completed.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(option_flags) or 'megatron'} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    return float(found.group(1)) / 1000


MEGATRON_LM_HEADER = ["option", "first iteration (s)", "without background compile (s)", "Megatron's optimizer (s)", "ratio",
                      "ratio without"]


def megatron_lm_table(checkout: Path, options: list[str], root: Path) -> list[list[str]]:
    """Print Megatron-LM's first iteration per option, with and without background compilation,
    beside Megatron's own optimizer run just before each option; return the rows."""
    print("| " + " | ".join(MEGATRON_LM_HEADER) + " |\n|" + "---|" * len(MEGATRON_LM_HEADER))
    rows = []
    for option in options:
        stock = megatron_lm_first_iteration_seconds(checkout, [], root / f"mlm-{option}-stock")
        background, foreground = (
            megatron_lm_first_iteration_seconds(checkout, ["--lowprec-option", option, *flags], root / f"mlm-{option}-{name}")
            for name, flags in (("background", []), ("foreground", ["--no-lowprec-background-compile"]))
        )
        rows.append([option, f"{background:.2f}", f"{foreground:.2f}", f"{stock:.2f}", f"{background / stock:.2f}",
                     f"{foreground / stock:.2f}"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return rows


HEADER = ["option", "first step, cold (s)", "AdamW, cold (s)", "cold / AdamW", "first step, warm (s)", "AdamW, warm (s)",
          "warm / AdamW", "first compiled step, cold (s)", "first compiled step, warm (s)"]


def main() -> None:
    from megatron_lowprec.optim import available_strategies

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", nargs="+", default=[strategy.name for strategy in available_strategies()])
    parser.add_argument("--repeats", type=int, default=1, help="cold and warm runs per option (median)")
    parser.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="precision.background_compile of the option's runs (default: on)")
    parser.add_argument("--megatron-lm", type=Path, metavar="CHECKOUT",
                        help="time Megatron-LM's pretrain_gpt.py of this checkout instead of lowprec-train")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    args = parser.parse_args()
    device = "cuda" if _cuda_available() else "cpu"
    if args.megatron_lm is not None:
        with tempfile.TemporaryDirectory(prefix="first_iteration_") as scratch:
            rows = megatron_lm_table(args.megatron_lm.resolve(), args.options, Path(scratch))
        if args.markdown is not None:
            import report

            report.write_result(args.markdown, "Megatron-LM's first iteration, per option", MEGATRON_LM_HEADER, rows, [
                f"`python benchmarks/first_step.py --megatron-lm CHECKOUT --options {' '.join(args.options)}`: Megatron-LM's "
                "`pretrain_gpt.py` through `torchrun -m megatron_lowprec.megatron.megatron_lm`, one process, a 2-layer "
                "64-wide GPT on mock data, an empty Inductor cache per run; the first iteration's time as Megatron-LM "
                "logs it, with background compilation (the entry's default) and without, beside Megatron's own "
                "optimizer run just before.", *args.note,
            ], device=device)
        return
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
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
    cells = []
    for option, row in rows:
        (cold, cold_compiled), (warm, warm_compiled) = row["cold"], row["warm"]
        base_cold, base_warm = row["baseline cold"][0], row["baseline warm"][0]
        cells.append([option, f"{cold:.1f}", f"{base_cold:.1f}", f"{cold / base_cold:.2f}", f"{warm:.1f}", f"{base_warm:.1f}",
                      f"{warm / base_warm:.2f}", f"{cold_compiled:.1f}", f"{warm_compiled:.1f}"])
        print("| " + " | ".join(cells[-1]) + " |")
    if args.markdown is not None:
        import report

        background = "" if args.background_compile else " --no-background-compile"
        report.write_result(args.markdown, "Time to the first optimizer step, per option", HEADER, cells, [
            f"`python benchmarks/first_step.py --options {' '.join(args.options)} --repeats {args.repeats}{background}`: "
            "`lowprec-train precision=OPTION` on the embedded default, a fresh process per run, from its start to the "
            "end of its first optimizer step and of its first step with the compiled kernel; cold: an empty Inductor "
            f"cache, warm: the same cache again. Baseline: `baseline={BASELINE}` (megatron-core's own optimizer, "
            "plain `torch.optim.AdamW` on CPU), run just before each. Compare each row's ratios, not seconds across "
            "rows.", *args.note,
        ], device=device)


def _cuda_available() -> bool:
    """Whether the runs, which pick CUDA where it is there, train on a GPU."""
    import torch

    return torch.cuda.is_available()

if __name__ == "__main__":
    main()
