"""Muon's precision options on the embedded default: final validation loss beside AdamW, and the
optimizer-step time of each.

Loss: each run is a ``lowprec-train`` process on the default model and data (the tiny GPT on the
shipped corpus), ``optimizer=muon`` (Moonshot's preset: update RMS matched to AdamW's) with each
option, and AdamW with option D beside them, at each learning rate of ``--lrs`` (peak; the cosine
decays to a tenth of it after a warmup of ``--warmup`` steps). The small default learning rate puts
Muon's updates (RMS about 0.2·lr) below half a BF16 ulp of the typical weight, where nearest
rounding loses them and the other options should not. The validation loss is measured once, after
the last step, on ``--eval-iters`` batches; ``--markdown PATH`` writes the tables stamped
(``report.py``) with every run's training loss per step plotted beside them.

Step time: in this process, one optimizer step over BF16 parameters shaped as the default model's
hidden weights (``--time-layers`` layers of QKV, projection, fc1 and fc2; Muon's share of the model)
with fixed random gradients, for Muon with each option, eager and fused (``--muon-steps``), and
AdamW D (eager); each time is the median of ``--repeats`` steps after ``--time-warmup`` (which
should cover the fused step's compilation), all optimizers stepping in turn (so that all see the
same machine load), the ratio over AdamW D's and, for a fused step, over the same option's eager
one. megatron-core's own Muon (``TensorParallelMuon``, the optimizer inside megatron's FP32-master
wrapper, on FP32 copies of the same weights and FP32 gradients, at its default BF16 Newton-Schulz,
``coefficient_type="simple"`` as ours) steps in the same rotation where it imports: it needs NVIDIA's
``emerging-optimizers``, which declares Python >= 3.12; ``.ci/megatron_newest.sh`` builds a venv
where it runs on 3.11 (megatron-core 0.19.2 and emerging-optimizers 0.3.0), and the script run with
that venv's python times it.

    python benchmarks/muon_loss.py                       # the whole table (CPU: minutes per run)
    python benchmarks/muon_loss.py --options A D --lrs 3e-3 --steps 5 --skip-timing
    OMP_NUM_THREADS=1 ~/.cache/megatron-lowprec/megatron-core-0.19.2-py3.11/bin/python \
        benchmarks/muon_loss.py --skip-loss --repeats 20   # megatron-core's Muon too; one thread
                                                           # keeps a shared machine's contention out
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_OPTIONS = ("A", "D", "B", "kahan", "sr", "coat")
BASELINE = ("adamw", "D")


def train_command(arguments: argparse.Namespace, optimizer: str, option: str, lr: float, run_dir: Path) -> list[str]:
    """The ``lowprec-train`` command line of one run."""
    return [
        sys.executable, "-m", "megatron_lowprec.train", f"optimizer={optimizer}", f"precision={option}",
        f"optimizer.lr={lr}", f"optimizer.min_lr={lr / 10}", f"optimizer.lr_warmup_steps={arguments.warmup}",
        f"trainer.max_steps={arguments.steps}", f"trainer.micro_batch_size={arguments.micro_batch}",
        f"trainer.global_batch_size={arguments.global_batch}", f"trainer.eval_interval={arguments.steps}",
        f"trainer.eval_iters={arguments.eval_iters}", "trainer.log_interval=1",
        "trainer.save=false", "logging.wandb=false", f"run_dir={run_dir}", *arguments.set,
    ]


def final_losses(arguments: argparse.Namespace, work_dir: Path) -> dict[tuple[str, str, float], dict]:
    """(optimizer, option, lr) → the run's summary (``final_valid_loss``, ``final_train_loss``, ...) and
    its training loss per step (``train_losses``: (step, loss) pairs from ``metrics.jsonl``)."""
    runs = [("muon", option) for option in arguments.options] + [BASELINE]
    summaries = {}
    for lr in arguments.lrs:
        for optimizer, option in runs:
            run_dir = work_dir / f"{optimizer}-{option}-{lr:g}"
            finished = subprocess.run(
                train_command(arguments, optimizer, option, lr, run_dir), capture_output=True, text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=arguments.timeout,
            )
            if finished.returncode != 0:
                raise RuntimeError(f"{optimizer} {option} lr {lr:g} failed:\n{finished.stdout[-3000:]}{finished.stderr[-3000:]}")
            summaries[optimizer, option, lr] = json.loads((run_dir / "summary.json").read_text())
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            summaries[optimizer, option, lr]["train_losses"] = [(row["step"], row["loss"]) for row in rows if row["split"] == "train"]
            print(f"  {optimizer} {option} lr {lr:g}: validation loss {summaries[optimizer, option, lr]['final_valid_loss']:.4f}",
                  file=sys.stderr, flush=True)
    return summaries


def hidden_weight_shapes(layers: int, hidden: int = 64, ffn: int = 256) -> list[tuple[int, int]]:
    """The 2-D hidden weights of ``layers`` megatron GPT layers (QKV, projection, fc1, fc2)."""
    return [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers


def step_times(options: list[str], layers: int, warmup: int, repeats: int, muon_steps: list[str]) -> dict[str, float]:
    """Median seconds of one step of each optimizer on the same shapes, their steps alternating: Muon
    with each option, eager (``muon A``) and fused (``muon A fused``) as ``muon_steps`` asks."""
    from megatron_lowprec.optim import AdamW, Muon

    generator = torch.Generator().manual_seed(0)
    shapes = hidden_weight_shapes(layers)
    gradients = [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]

    def parameters():
        params = [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).bfloat16()) for shape in shapes]
        for param, gradient in zip(params, gradients):
            param.grad = gradient.clone()
        return params

    optimizers = {
        f"muon {option}{' fused' if step == 'fused' else ''}": Muon(parameters(), lr=1e-3, option=option, fused=step == "fused")
        for option in options for step in muon_steps
    }
    optimizers["adamw D"] = AdamW(parameters(), lr=1e-3, option="D", fused=False)
    megatron_muon = megatron_core_muon()
    if megatron_muon is not None:
        fp32_params = [torch.nn.Parameter(param.detach().float()) for param in parameters()]
        for param, gradient in zip(fp32_params, gradients):
            param.grad = gradient.float()
        optimizers[MEGATRON_CORE_MUON] = megatron_muon(fp32_params, lr=1e-3, coefficient_type="simple")
    times = {name: [] for name in optimizers}
    for repeat in range(warmup + repeats):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            if repeat >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


MEGATRON_CORE_MUON = "megatron-core's Muon"


def megatron_core_muon():
    """megatron-core's ``TensorParallelMuon`` class where it imports (with emerging-optimizers), else None."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("emerging_optimizers") is None:
        return None
    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS, TensorParallelMuon
    except ImportError:
        return None
    return TensorParallelMuon if HAVE_EMERGING_OPTIMIZERS else None


def megatron_core_muon_note() -> str:
    """Which megatron-core's Muon is in the step-time table, or why it is not."""
    if megatron_core_muon() is None:
        return ("megatron-core's Muon (TensorParallelMuon) not timed: it needs megatron-core 0.17+ and NVIDIA's "
                "emerging-optimizers (Python >= 3.12, or the venv of .ci/megatron_newest.sh)")
    from importlib.metadata import version

    return (f"megatron-core's Muon: TensorParallelMuon of megatron-core {version('megatron-core')} with emerging-optimizers "
            f"{version('emerging-optimizers')}, FP32 weights, BF16 Newton-Schulz")


def write_markdown(arguments: argparse.Namespace, summaries: dict, times: dict) -> None:
    """The validation-loss table and the step-time table, those measured, as a stamped result file
    (``report.py``), with each run's training loss per step plotted beside it, one panel per lr."""
    import report

    runs = [("muon", option) for option in arguments.options] + [BASELINE]
    tables = []
    if summaries:
        command = (f"`python benchmarks/muon_loss.py --options {' '.join(arguments.options)} --lrs "
                   f"{' '.join(f'{lr:g}' for lr in arguments.lrs)} --steps {arguments.steps} --warmup {arguments.warmup} "
                   f"--micro-batch {arguments.micro_batch} --global-batch {arguments.global_batch} "
                   f"--eval-iters {arguments.eval_iters}" + (f" --set {' '.join(arguments.set)}" if arguments.set else "") + "`")
        tables.append((
            ["run", *(f"lr {lr:g}" for lr in arguments.lrs)],
            [[f"{optimizer} {option}", *(f"{summaries[optimizer, option, lr]['final_valid_loss']:.4f}" for lr in arguments.lrs)]
             for optimizer, option in runs],
            f"{command}: final validation loss of one `lowprec-train` run per cell on the embedded default (the tiny "
            "GPT on the shipped corpus), `optimizer=muon` with each option (Moonshot's preset: update RMS matched to "
            f"AdamW's) and AdamW D beside them; {arguments.steps} steps (learning-rate warmup {arguments.warmup}, cosine "
            f"decay to a tenth of the peak), batch {arguments.global_batch} x 64 tokens, validation on "
            f"{arguments.eval_iters} batches after the last step (a uniform prediction over the 4096 tokens scores "
            "8.32). One seed: differences of a few 1e-4 are within what another seed could move.",
        ))
    if times:
        fused = "fused" in arguments.muon_steps
        tables.append((
            ["optimizer", "ms", "vs AdamW D", *(["vs eager"] if fused else [])],
            [[name, f"{1e3 * seconds:.2f}", f"{seconds / times['adamw D']:.2f}",
              *([f"{seconds / times[name.removesuffix(' fused')]:.2f}" if name.endswith(" fused") else ""] if fused else [])]
             for name, seconds in times.items()],
            f"One optimizer step over BF16 parameters shaped as {arguments.time_layers} layers' hidden weights "
            f"({sum(r * c for r, c in hidden_weight_shapes(arguments.time_layers)):,} parameters), the optimizers stepping "
            f"in turn, median of {arguments.repeats} after {arguments.time_warmup} (`--time-layers {arguments.time_layers} "
            f"--repeats {arguments.repeats} --muon-steps {' '.join(arguments.muon_steps)}`), {report.threads()}; "
            f"{megatron_core_muon_note()}.",
        ))
    (header, rows, description), *more = tables
    notes = [description, *arguments.note]
    for more_header, more_rows, more_description in more:
        notes += [more_description, report.markdown_table(more_header, more_rows)]

    def loss_curves(figure) -> None:
        panels = figure.subplots(1, len(arguments.lrs), sharey=True, squeeze=False)[0]
        for axes, lr in zip(panels, arguments.lrs):
            for optimizer, option in runs:
                steps, losses = zip(*summaries[optimizer, option, lr]["train_losses"])
                axes.plot(steps, losses, label=f"{optimizer} {option}", linewidth=1)
            axes.set_title(f"training loss, peak lr {lr:g}", fontsize=9)
            axes.set_xlabel("step")
        panels[-1].legend(fontsize=7)

    report.write_result(arguments.markdown, "Muon's options: validation loss and step time", header, rows, notes,
                        plot=loss_curves if summaries else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", nargs="+", default=list(DEFAULT_OPTIONS), help="Muon's precision options")
    parser.add_argument("--lrs", nargs="+", type=float, default=[3e-3, 1e-4], help="peak learning rates")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="learning-rate warmup steps")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--eval-iters", type=int, default=4)
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run")
    parser.add_argument("--time-layers", type=int, default=4)
    parser.add_argument("--time-warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--muon-steps", nargs="+", choices=("eager", "fused"), default=["eager", "fused"],
                        help="Muon's steps to time: eager (fused=False) and fused (compiled; the first steps compile)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the tables as a stamped Markdown file, with the loss curves beside it as PNG")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    arguments = parser.parse_args()
    if arguments.markdown is not None and arguments.skip_loss and arguments.skip_timing:
        parser.error("--markdown writes the loss table or the step-time table; --skip-loss with --skip-timing leaves neither")
    results: dict = {}
    summaries: dict = {}
    times: dict = {}
    if not arguments.skip_loss:
        with tempfile.TemporaryDirectory(prefix="muon_loss_") as work:
            summaries = final_losses(arguments, Path(work))
        print(f"final validation loss after {arguments.steps} steps (warmup {arguments.warmup}, batch "
              f"{arguments.global_batch} x 64 tokens, {arguments.eval_iters} validation batches); overrides "
              f"{' '.join(arguments.set) or 'none'}")
        header = ["run", *(f"lr {lr:g}" for lr in arguments.lrs)]
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for optimizer, option in [("muon", option) for option in arguments.options] + [BASELINE]:
            cells = [f"{summaries[optimizer, option, lr]['final_valid_loss']:.4f}" for lr in arguments.lrs]
            print(f"| {optimizer} {option} | " + " | ".join(cells) + " |")
        results["valid_loss"] = {f"{o} {p} {lr:g}": s["final_valid_loss"] for (o, p, lr), s in summaries.items()}
    if not arguments.skip_timing:
        times = step_times(arguments.options, arguments.time_layers, arguments.time_warmup, arguments.repeats, arguments.muon_steps)
        baseline = times["adamw D"]
        print(f"\noptimizer step on {arguments.time_layers} layers' hidden weights "
              f"({sum(r * c for r, c in hidden_weight_shapes(arguments.time_layers)):,} BF16 parameters), "
              f"median of {arguments.repeats}, device cpu, {torch.get_num_threads()} threads")
        print("| optimizer | ms | vs AdamW D | vs eager |\n|---|---|---|---|")
        for name, seconds in times.items():
            eager = times.get(name.removesuffix(" fused")) if name.endswith(" fused") else None
            print(f"| {name} | {1e3 * seconds:.2f} | {seconds / baseline:.2f} | {'' if eager is None else f'{seconds / eager:.2f}'} |")
        print(megatron_core_muon_note())
        results["step_seconds"] = times
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(results, indent=1))
    if arguments.markdown is not None:
        write_markdown(arguments, summaries, times)
    if not all(math.isfinite(loss) for loss in results.get("valid_loss", {}).values()):
        raise SystemExit("a run ended with a non-finite validation loss")


if __name__ == "__main__":
    main()
