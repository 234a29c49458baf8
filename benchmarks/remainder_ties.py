"""How often a remainder master's BF16 copy differs from the whole form's copy, on a real run.

A master stored as the BF16 parameter plus an int16 remainder (``master_storage="remainder"``)
needs the parameter to be the master rounded to nearest with ties away from zero; the whole form's
parameter is the master rounded to nearest even. The two differ only on the exact ties below an even
BF16 value. This trains ``lowprec-train``'s embedded default (the tiny GPT on the bundled corpus,
one process) with an option whose master is stored as a remainder and counts, after every step,
the parameters whose copy differs (:func:`~megatron_lowprec.optim.master.copies_off_nearest_even`).

    python benchmarks/remainder_ties.py --options D-BF16 --steps 300
    python benchmarks/remainder_ties.py --options D coat --steps 300 optimizer.adam_beta2=0.999
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from megatron_lowprec.optim.master import copies_off_nearest_even, stored_master
from megatron_lowprec.train.app import compose
from megatron_lowprec.train.config import validate
from megatron_lowprec.train.loop import build_run, distributed_environment, train_step


def count_ties(option: str, steps: int, overrides: list[str]) -> dict:
    """Per step, the parameters whose BF16 copy is off the master's nearest-even rounding."""
    config = compose([
        f"precision={option}", "precision.master_storage=remainder", f"trainer.max_steps={steps}",
        "trainer.save=false", "logging.wandb=false", *overrides,
    ])
    validate(config, 1)
    per_step = []
    with distributed_environment(config), tempfile.TemporaryDirectory() as run_dir:
        run = build_run(config, Path(run_dir))
        adamw = run.optimizer.optimizer
        params = [param for group in adamw.param_groups for param in group["params"]]
        for _ in range(steps):
            train_step(run)
            off = sum(copies_off_nearest_even(param.detach(), stored_master(adamw.state[param])) for param in params)
            per_step.append(int(off))
    numel = sum(param.numel() for param in params)
    return {"option": option, "overrides": overrides, "steps": steps, "parameters": numel, "per_step": per_step}


def summary_row(result: dict) -> list[str]:
    """Option, parameters, steps, copies off nearest-even (in all, as a share, per step min/median/max)."""
    per_step, numel, steps = result["per_step"], result["parameters"], result["steps"]
    total = sum(per_step)
    return [
        result["option"], f"{numel:,}", str(steps), f"{total:,}",
        f"{total / (numel * steps):.2e}" + (f" (1 in {numel * steps // total:,})" if total else ""),
        f"{min(per_step)} / {sorted(per_step)[len(per_step) // 2]} / {max(per_step)}",
    ]


HEADER = ["option", "parameters", "steps", "copies off nearest-even", "share of parameter-steps", "per step min / median / max"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", "--option", nargs="+", default=["D-BF16"],
                        help="options with an FP32 master: D, coat or D-BF16")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    parser.add_argument("overrides", nargs="*", help="more lowprec-train overrides (optimizer.adam_beta2=0.999)")
    arguments = parser.parse_args()
    rows = []
    for option in arguments.options:
        rows.append(summary_row(count_ties(option, arguments.steps, arguments.overrides)))
        print(" | ".join(rows[-1]), flush=True)
    if arguments.markdown is not None:
        import report

        command = (f"`python benchmarks/remainder_ties.py --options {' '.join(arguments.options)} --steps {arguments.steps}"
                   + "".join(f" {override}" for override in arguments.overrides) + "`")
        report.write_result(arguments.markdown, "Remainder masters: BF16 copies off the nearest-even rounding", HEADER, rows, [
            f"{command}: `lowprec-train`'s embedded default (the tiny GPT on the bundled corpus, one process) with the "
            "master stored as a remainder. After every step it counts the parameters whose BF16 copy (the master "
            "rounded to nearest, ties away from zero) differs from the whole master's copy (nearest even): the exact "
            "ties below an even BF16 value, each one BF16 step from the whole form's copy over the same master.",
            *arguments.note,
        ])


if __name__ == "__main__":
    main()
