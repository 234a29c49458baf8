"""What the checkpoint checksums cost: the XXH3-128 of every file at save and its verification at
resume, against the save and the load themselves, in one process.

The run is built as ``lowprec-train`` builds it (the model preset, option A, one rank), then, for
``--repeats`` rounds: ``checkpoint.save`` timed whole (its checksums included) and the checksums
alone (each file hashed again, as the save does, right after it is written); the resume's
verification (sizes and checksums, :func:`checkpoint_problem` with the rank's share) and
``checkpoint.load``. The figures are medians; the ratio is checksum time over save (or load) time.

    python benchmarks/checkpoint_checksum.py                      # the embedded default (tiny)
    python benchmarks/checkpoint_checksum.py --models tiny gpt_125m
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def measure(model: str, repeats: int) -> tuple[int, float, dict[str, float]]:
    """The checkpoint's bytes, the model's layers and the median seconds of the save, its checksums,
    the load and its verification over ``repeats`` rounds."""
    from megatron_lowprec.train import checkpoint
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import build_run, distributed_environment

    with tempfile.TemporaryDirectory() as directory:
        run_dir = Path(directory) / "run"
        config = compose([f"model={model}", "logging.wandb=false", f"run_dir={run_dir}", "precision.fused=false",
                          f"data.cache_dir={Path(directory) / 'cache'}"])
        with distributed_environment(config):
            run = build_run(config, run_dir)
            rows = {"save": [], "save checksums": [], "load": [], "load verification": []}
            for round_ in range(repeats):
                run.iteration = round_ + 1
                path = checkpoint.checkpoint_path(run_dir, run.iteration)
                rows["save"].append(_timed(lambda: checkpoint.save(run)))
                rows["save checksums"].append(_timed(lambda: checkpoint._checksummed_files(path, 0, 1)))
                rows["load verification"].append(_timed(lambda: checkpoint.checkpoint_problem(path, share=(0, 1))))
                rows["load"].append(_timed(lambda: checkpoint.load(run, path)))
            size = sum(file.stat().st_size for file in path.iterdir())
    return size, run.model.module.config.num_layers, {name: statistics.median(values) for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", "--model", nargs="+", default=["tiny"], help="model presets (configs/model/)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    arguments = parser.parse_args()
    table = []
    for model in arguments.models:
        size, layers, median = measure(model, arguments.repeats)
        print(f"model {model}: {layers} layers, checkpoint {size / 2**20:.1f} MiB, median of {arguments.repeats}")
        for name, seconds in median.items():
            print(f"  {name:<18} {seconds * 1e3:9.1f} ms")
        print(f"  checksums / save   {median['save checksums'] / median['save']:.1%}")
        print(f"  verification / load {median['load verification'] / median['load']:.1%}", flush=True)
        table.append([model, f"{size / 2**20:.1f}", f"{median['save'] * 1e3:.1f}", f"{median['save checksums'] * 1e3:.1f}",
                      f"{median['save checksums'] / median['save']:.1%}", f"{median['load'] * 1e3:.1f}",
                      f"{median['load verification'] * 1e3:.1f}", f"{median['load verification'] / median['load']:.1%}"])
    if arguments.markdown is not None:
        import report

        report.write_result(
            arguments.markdown, "Checkpoint checksums: their share of a save and a load",
            ["model", "checkpoint MiB", "save ms", "checksums ms", "checksums / save", "load ms", "verification ms",
             "verification / load"],
            table,
            [f"`python benchmarks/checkpoint_checksum.py --models {' '.join(arguments.models)} --repeats {arguments.repeats}`: "
             "one process, option A, medians. The save's time includes its checksums (XXH3-128 of every file); the "
             "verification (sizes and checksums at resume) is timed apart from the load.", *arguments.note],
        )


if __name__ == "__main__":
    main()
