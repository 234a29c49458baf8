"""Result files of the benchmarks: a Markdown table stamped with when, where and from what it was measured.

Every benchmark's ``--markdown PATH`` writes its table through :func:`write_result`: a heading line,
the stamp line (:func:`stamp_line`: UTC date, device, Python, torch, triton and megatron-core
versions, the git commit with ``+dirty`` when the tree has uncommitted changes), the table, optional
notes, and optionally a plot saved beside the file as PNG (matplotlib, the ``[plot]`` extra, imported
only then). The documentation includes these files, so each figure is written once, by the script
that measured it.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

STAMP_PREFIX = "Measured: "
STAMP_SEPARATOR = " · "
STAMP_FIELDS = ("date", "device", "python", "torch", "triton", "megatron-core", "commit")
"""The stamp's fields, in the order the stamp line lists them."""

REPOSITORY = Path(__file__).resolve().parents[1]


def package_version(distribution: str) -> str:
    """The installed version of ``distribution``, or "not installed"."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (the machine's architecture where it has none) and
    the cores this process may run on."""
    model = platform.machine() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def device_name(device=None) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device, else the CPU's model and core count."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_name()


def threads() -> str:
    """The threads torch computes with on the CPU, as words: "1 thread", "2 threads"."""
    import torch

    count = torch.get_num_threads()
    return f"{count} thread" + ("s" if count != 1 else "")


def git_commit(repository: Path = REPOSITORY) -> str:
    """The short hash of ``HEAD``, with ``+dirty`` when tracked files differ from it; "unknown"
    outside a git checkout."""
    def git(*arguments: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repository), *arguments], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def stamp(device=None) -> dict[str, str]:
    """Every field of :data:`STAMP_FIELDS` for a measurement taken now on ``device``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "triton": package_version("triton"),
        "megatron-core": package_version("megatron-core"),
        "commit": git_commit(),
    }


def stamp_line(fields: dict[str, str]) -> str:
    """``Measured: date: ... · device: ... · ...`` with every field of :data:`STAMP_FIELDS`."""
    missing = [name for name in STAMP_FIELDS if name not in fields]
    if missing:
        raise ValueError(f"stamp lacks {', '.join(missing)}; a stamp has {', '.join(STAMP_FIELDS)}")
    return STAMP_PREFIX + STAMP_SEPARATOR.join(f"{name}: {fields[name]}" for name in STAMP_FIELDS)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; every row has one cell per header column."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)} has {len(row)} cells; the header has {len(header)}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(
    path: Path | str, title: str, header: Sequence[str], rows: Sequence[Sequence[object]], notes: Sequence[str] = (),
    device=None, plot: Callable | None = None, fields: dict[str, str] | None = None,
) -> Path:
    """Write ``path``: ``### title``, the stamp line, the table, then each note as a paragraph.

    ``plot(figure)`` draws on a matplotlib figure that is saved beside ``path`` as PNG (same name).
    ``fields`` replaces the stamp of this machine and moment (:func:`stamp` of ``device``).
    Returns ``path``.
    """
    path = Path(path)
    sections = [f"### {title}", stamp_line(fields or stamp(device)), markdown_table(header, rows), *notes]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(sections) + "\n")
    if plot is not None:
        save_plot(plot, path.with_suffix(".png"))
    return path


def save_plot(plot: Callable, path: Path) -> Path:
    """Draw ``plot(figure)`` on a new matplotlib figure (non-interactive backend) and save it as ``path``."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install -e '.[plot]'") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure = pyplot.figure(figsize=(7, 4), layout="constrained")
    try:
        plot(figure)
        figure.savefig(path, dpi=120)
    finally:
        pyplot.close(figure)
    return path


def parse_stamp(line: str) -> dict[str, str]:
    """The fields of a stamp line written by :func:`stamp_line`."""
    if not line.startswith(STAMP_PREFIX):
        raise ValueError(f"not a stamp line (it starts with {STAMP_PREFIX!r}): {line!r}")
    return dict(item.split(": ", 1) for item in line[len(STAMP_PREFIX):].split(STAMP_SEPARATOR))
