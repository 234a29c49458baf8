"""What ``lowprec-train --help`` and ``--version`` print.

The help is built from what it describes, so that it cannot drift: the config groups and presets are
the files in the config directory (each summarised by the first sentence of its leading comment),
and the keys are fields of the schema :class:`~megatron_lowprec.train.config.TrainConfig` (each
described by the first sentence of its docstring, with its default). ``--help-config`` prints every
key (:func:`megatron_lowprec.train.reference.config_help_text`).
"""

from __future__ import annotations

import re
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from megatron_lowprec.optim.strategies import get_strategy
from megatron_lowprec.train.config import TrainConfig
from megatron_lowprec.optim.settings import field_docs

HELP_WIDTH = 100
HELP_LINES = 2
"""Lines of ``--help`` text per group member or key; longer descriptions end in "..."."""
USAGE = """\
usage: lowprec-train [GROUP=MEMBER ...] [KEY=VALUE ...] [+experiment=PRESET]
       torchrun --nproc-per-node N -m megatron_lowprec.train [...]  (N ranks; or launch/torchrun.sh)
       lowprec-train --help | --help-config | --version

Pretrain a megatron-core GPT with one low-precision optimizer option. Every argument is a Hydra
override of the typed config; a wrong key or value stops the run before any work (exit 2).
  lowprec-train precision=C trainer.max_steps=1000
  lowprec-train +experiment=collage_table5_gpt_125m precision=B trainer.dry_run=true"""
COMMON_KEYS = (
    "trainer.max_steps",
    "trainer.micro_batch_size",
    "trainer.global_batch_size",
    "trainer.tensor_model_parallel_size",
    "trainer.pipeline_model_parallel_size",
    "trainer.log_interval",
    "trainer.eval_interval",
    "trainer.save_interval",
    "trainer.exit_signal",
    "trainer.dry_run",
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.lr_warmup_steps",
    "optimizer.use_distributed_optimizer",
    "optimizer.override_opt_param_scheduler",
    "precision.track_update_quality",
    "model.attention_backend",
    "data.data_prefix",
    "logging.wandb",
    "run_dir",
    "resume",
    "resume_from",
)
"""The keys ``--help`` describes (every key: ``--help-config``)."""


def _first_sentence(text: str, clauses: bool = False) -> str:
    """Up to the first full stop that ends a sentence (one before a capitalised word: not ``e.g.``
    or ``App. E.2``) outside parentheses; with ``clauses`` up to the first such ``;`` too."""
    text = " ".join(text.split())
    depth = 0
    for index, character in enumerate(text):
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth:
            continue
        rest = text[index + 1:]
        if character == "." and (not rest or re.match(r"\s+[A-Z][a-z]", rest)):
            return text[:index]
        if clauses and character == ";":
            return text[:index]
    return text


def _key_help(key: str) -> tuple[str, str]:
    """``(default, first sentence of the docstring)`` of a dotted schema key."""
    *parents, name = key.split(".")
    default = TrainConfig()
    for parent in parents:
        default = getattr(default, parent)
    value = getattr(default, name)
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return shown, _first_sentence(field_docs(type(default))[name].replace("``", ""))


def _summary(path: Path) -> str:
    """The first sentence of a config file's leading comment (its one-line summary)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            lines.append(line.lstrip("#").strip())
    return _first_sentence(" ".join(lines), clauses=True)


def _member_summary(group: str, path: Path) -> str:
    """A group member's summary; a precision option's after its bytes per parameter as allocated."""
    if group != "precision":
        return _summary(path)
    return f"{get_strategy(path.stem).bytes_per_param():g} bytes/param; {_summary(path)}"


def _rows(rows: list[tuple[str, str]], indent: int, max_lines: int = HELP_LINES) -> list[str]:
    """Two columns, the second wrapped to :data:`HELP_WIDTH` under itself, ``max_lines`` at most."""
    width = max(len(name) for name, _ in rows)
    lines = []
    for name, text in rows:
        wrapped = textwrap.wrap(text, HELP_WIDTH - indent - width - 2) or [""]
        if len(wrapped) > max_lines:
            wrapped = textwrap.wrap(text, HELP_WIDTH - indent - width - 5)[:max_lines]
            wrapped[-1] += "..."
        lines.append(f"{' ' * indent}{name:<{width}}  {wrapped[0]}")
        lines += [f"{' ' * (indent + width + 2)}{more}" for more in wrapped[1:]]
    return lines


def help_text(directory: Path) -> str:
    """What ``lowprec-train --help`` prints: usage, the config groups in ``directory`` with their
    members and one-line summaries (a preset's: the paper table it reproduces), the most used keys
    with their defaults, and where every key and the training app are documented."""
    lines = [USAGE, "", f"config groups (GROUP=MEMBER; in {directory}):"]
    for group in ("precision", "baseline", "optimizer", "model", "data"):
        lines.append(f"  {group}=")
        lines += _rows([(path.stem, _member_summary(group, path)) for path in sorted((directory / group).glob("*.yaml"))], 4)
    lines.append("  +experiment=   (paper presets; every key stays overridable)")
    presets = sorted((directory / "experiment").glob("*.yaml"))
    lines += _rows([(path.stem, _summary(path).split(": ")[0]) for path in presets], 4, max_lines=1)
    lines += ["", "most used keys (KEY=VALUE; [default]):"]
    rows = []
    for key in COMMON_KEYS:
        default, sentence = _key_help(key)
        rows.append((key, f"{sentence} [{default}]"))
    lines += _rows(rows, 2)
    lines += [
        "",
        "Every key with its type, default and meaning: lowprec-train --help-config, and the documentation's",
        'reference page "lowprec-train config" (docs/reference/config.md). Runs, resuming, preemption and',
        'the run directory: its how-to "The training app" (docs/how-to/training-app.md).',
    ]
    return "\n".join(lines)


def version_text() -> str:
    """``lowprec-train --version``: this package's version, torch's and megatron-core's."""

    def version(distribution: str) -> str:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return "not installed"

    import torch

    return (
        f"megatron-lowprec {version('megatron-lowprec')} (torch {torch.__version__}, "
        f"megatron-core {version('megatron-core')}, Python {sys.version.split()[0]})"
    )
