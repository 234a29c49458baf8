"""The reference pages of the documentation, written from the code so that they cannot drift.

- ``options.md``: every registered precision option (:mod:`megatron_lowprec.optim.strategies`): its
  names, what it stores in which format, and its bytes per parameter as megatron-core and the
  optimizer allocate them (:meth:`~megatron_lowprec.optim.strategies.PrecisionStrategy.bytes_per_param`).
- ``config.md``: every key of ``lowprec-train``'s config (the dataclasses of
  :mod:`megatron_lowprec.train.config`) with its type, default and the docstring under its field.
- ``megatron_lm_flags.md``: every ``--lowprec-*`` flag that the Megatron-LM entry adds
  (:func:`megatron_lowprec.megatron.megatron_lm.add_arguments`) with its type, default and help.

Written by ``python -m megatron_lowprec.train.reference docs/reference``; ``lowprec-train
--help-config`` prints the config keys from the same rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import NamedTuple

from megatron_lowprec.optim.muon import muon_strategy
from megatron_lowprec.optim.settings import ROLE, field_docs, plain_text
from megatron_lowprec.optim.strategies import LOW_PRECISION_BYTES, MASTER_STORAGES, PrecisionStrategy, available_strategies
from megatron_lowprec.train.config import TrainConfig

GENERATOR = "python -m megatron_lowprec.train.reference docs/reference"
GENERATED_NOTE = f"<!-- Written by `{GENERATOR}` from the code; edit the code, not this page. -->"
DISTRIBUTED_DP = 8
"""The data-parallel size of the distributed-optimizer column of ``options.md``."""
HELP_WIDTH = 100


class ConfigKey(NamedTuple):
    """One key of ``lowprec-train``'s config."""

    key: str
    """Dotted, as an override names it: ``precision.option``."""
    type: str
    default: str
    """As YAML writes it: ``null``, ``true``, ``[output_layer]``."""
    doc: str
    """The field's docstring on one line, reStructuredText roles and literals as written."""


def _type_name(annotation: object) -> str:
    """``Optional[int]`` as ``int or null``, ``list[str]`` as ``list[str]``."""
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        named = [_type_name(argument) for argument in arguments if argument is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in arguments else "")
    if typing.get_origin(annotation) is list:
        return f"list[{_type_name(arguments[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def _yaml(value: object) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    return str(value)


def config_groups(schema: type = TrainConfig) -> list[tuple[str, type]]:
    """``(prefix, dataclass)`` of every config dataclass under ``schema``, ``schema`` first (prefix ``""``)."""
    groups = [("", schema)]
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[field.name]):
            groups += [(f"{field.name}.{prefix}" if prefix else field.name, group) for prefix, group in config_groups(hints[field.name])]
    return groups


def config_keys(schema: type = TrainConfig) -> list[ConfigKey]:
    """Every leaf key of the config: the fields of each config dataclass that are not dataclasses."""
    keys = []
    for prefix, group in config_groups(schema):
        hints, docs, default = typing.get_type_hints(group), field_docs(group), group()
        for field in dataclasses.fields(group):
            if dataclasses.is_dataclass(hints[field.name]):
                continue
            key = f"{prefix}.{field.name}" if prefix else field.name
            keys.append(ConfigKey(key, _type_name(hints[field.name]), _yaml(getattr(default, field.name)), docs.get(field.name, "")))
    return keys


def _markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown for a table cell: roles and ````literals```` as code
    spans, ``<`` and ``>`` outside them escaped, ``|`` escaped."""
    text = ROLE.sub(lambda match: "``" + (match[2].split(".")[-1] if match[1] else match[2]) + "``", text)
    pieces = text.split("``")
    for index in range(0, len(pieces), 2):
        pieces[index] = pieces[index].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(pieces).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in rows)]


def _number(value: float) -> str:
    """Up to twelve decimals (every byte count here, a multiple of 2^-12, exactly), without trailing
    zeros: 8, 12.125, 6.765625, 4.2578125."""
    return f"{value:.12f}".rstrip("0").rstrip(".")


def _aliases(strategy: PrecisionStrategy) -> str:
    return ", ".join(f"`{alias}`" for alias in strategy.aliases) or "—"


def _moments(strategy: PrecisionStrategy) -> str:
    if strategy.moments == "low":
        return "BF16"
    if strategy.moments == "fp32":
        return "FP32"
    if strategy.moments == "int8":
        return (f"INT8 in 1x{strategy.fp8_group_size} groups, each with a BF16 scale: m softsign-companded (int8), "
                "v as its square root (uint8)")
    exponent = strategy.fp8_exponent_storage.upper()
    expansion = f" and its range-expansion exponent in {exponent}" if strategy.fp8_expand else ""
    return f"FP8 {strategy.fp8_format.upper()} in 1x{strategy.fp8_group_size} groups, each with an FP32 scale{expansion}"


def _master(strategy: PrecisionStrategy) -> str:
    if not strategy.master_weights:
        return "—"
    if strategy.master_storage == "remainder":
        return "FP32, as the BF16 parameter and an int16 remainder below it"
    if strategy.master_storage == "residual8":
        return "16 significant bits, as the BF16 parameter and an int8 residual below it"
    return "FP32"


def _corrections(strategy: PrecisionStrategy) -> str:
    parts = []
    if strategy.keeps_param_low_component:
        parts.append("δθ of the parameter (BF16)")
    if strategy.second_moment_mcf:
        parts.append("δv of the second moment (BF16)")
    if strategy.param_update == "kahan":
        parts.append("Kahan compensation (BF16)")
    return ", ".join(parts) or "—"


UPDATES = {
    "nearest": "rounded to nearest",
    "mcf": "Grow into (θ, δθ) (Collage Alg. 1)",
    "kahan": "Kahan-compensated sum (Collage App. C)",
    "stochastic": "stochastically rounded (SR paper Alg. 1)",
}


def _gradient(strategy: PrecisionStrategy) -> str:
    return "FP32" if strategy.default_grad_reduce_in_fp32 else "BF16"


def _storages(strategy: PrecisionStrategy) -> list[PrecisionStrategy]:
    """The option as registered, then with each other master storage it can take."""
    if not strategy.master_weights:
        return [strategy]
    return [strategy, *(strategy.with_master_storage(storage) for storage in MASTER_STORAGES if storage != strategy.master_storage)]


def options_page() -> str:
    """``options.md``."""
    strategies = available_strategies()
    lines = [
        GENERATED_NOTE,
        "",
        "# Options",
        "",
        "An option decides where the optimizer keeps each tensor and how it rounds the update. Names",
        "are case-insensitive, and an alias is accepted wherever an option is named: `precision=` and",
        "`precision.option` of `lowprec-train`, `--lowprec-option` of the Megatron-LM entry, the",
        "`option` of `AdamW`, `Muon` and `build_optimizer`.",
        "",
        "## Names",
        "",
        *_table(["option", "aliases", "summary"], [[f"`{s.name}`", _aliases(s), s.summary] for s in strategies]),
        "",
        "## What each option stores",
        "",
        "Every option keeps the model's parameters θ in BF16. The gradient buffer is megatron-core's",
        "DDP buffer, in the format `lowprec-train` gives it by default (`precision.grad_reduce_in_fp32`).",
        "",
        *_table(
            ["option", "gradient buffer", "moments m, v", "master", "corrections", "parameter update"],
            [
                [f"`{s.name}`", _gradient(s), _moments(s), _master(s), _corrections(s),
                 UPDATES[s.param_update] if not s.master_weights else "master updated in FP32, θ its nearest BF16"]
                for s in strategies
            ],
        ),
        "",
        "## Bytes per parameter",
        "",
        "As megatron-core and the optimizer allocate them on each rank: the 2-byte parameter, the",
        "gradient buffer (4 bytes where gradients are reduced in FP32, 2 in BF16) and the optimizer",
        "state (moments and corrections, master; COAT's FP8 groups count their FP32 scale and their",
        "exponent, 8 bytes per 128 elements with an FP32 exponent, 6 with `res8`'s BF16 one). `lowprec-train` reduces gradients in FP32 for the options with an FP32",
        "master and in BF16 for the others (`precision.grad_reduce_in_fp32` changes it); Megatron-LM's",
        "`--bf16` reduces them in FP32 for every option unless `--grad-reduce-in-bf16`. Megatron's",
        "distributed optimizer (`optimizer.use_distributed_optimizer`, `--use-distributed-optimizer`)",
        f"divides the optimizer state over the data-parallel ranks, shown at DP={DISTRIBUTED_DP}; parameter",
        "and gradient buffers stay whole on every rank. An option with an FP32 master stores it whole",
        "(`fp32`) or as a remainder below the BF16 parameter (`remainder`, the same masters in 2 bytes:",
        "`precision.master_storage`, `--lowprec-master-storage`); the first row is the option's own.",
        "Muon's column is for the 2-D hidden weights it updates (one momentum instead of m and v);",
        "AdamW's columns hold for the rest.",
        "",
    ]
    rows = []
    for strategy in strategies:
        for variant in _storages(strategy):
            group = variant.fp8_group_size
            rows.append([
                f"`{variant.name}`",
                f"`{variant.master_storage}`" if variant.master_weights else "—",
                _number(LOW_PRECISION_BYTES),
                f"{variant.grad_bytes()} ({_gradient(variant)})",
                _number(variant.state_bytes(group) / group - variant.master_bytes),
                _number(variant.master_bytes),
                _number(variant.bytes_per_param()),
                _number(variant.bytes_per_param(state_shards=DISTRIBUTED_DP)),
                _number(variant.bytes_per_param(grad_reduce_in_fp32=True)),
                _number(variant.bytes_per_param(grad_reduce_in_fp32=False)),
                _number(muon_strategy(variant).bytes_per_param()),
            ])
    lines += _table(
        ["option", "master storage", "parameter", "gradient", "moments, corrections", "master", "bytes/param",
         f"distributed, DP={DISTRIBUTED_DP}", "FP32 gradients (Megatron-LM `--bf16`)", "BF16 gradients (Collage Table 2)",
         "Muon (hidden weights)"],
        rows,
    )
    lines += [
        "",
        "The options with 8-bit moments store them as companded INT8 instead of FP8 with",
        "`precision.moment_storage=int8` (`--lowprec-moment-storage int8`): the same groups, one byte",
        "per element and a BF16 scale per group ([INT8 moments](../explanation/lean-options.md#int8-moments)).",
        "",
    ]
    int8_rows = [
        [
            f"`{variant.name}`",
            _moments(variant),
            _number(variant.bytes_per_param()),
            _number(variant.bytes_per_param(state_shards=DISTRIBUTED_DP)),
            _number(muon_strategy(variant).bytes_per_param()),
        ]
        for variant in (strategy.with_moment_storage("int8") for strategy in strategies if strategy.grouped_moments)
    ]
    lines += _table(["option", "moments", "bytes/param", f"distributed, DP={DISTRIBUTED_DP}", "Muon (hidden weights)"], int8_rows)
    return "\n".join(lines) + "\n"


def config_page() -> str:
    """``config.md``."""
    lines = [
        GENERATED_NOTE,
        "",
        "# lowprec-train config",
        "",
        "Every key of `lowprec-train`'s config, set on the command line as `KEY=VALUE` (a Hydra",
        "override: `trainer.max_steps=1000`). A group file sets several at once (`precision=C`,",
        "`model=gpt_125m`); `null` is Python's `None`. `lowprec-train --help-config` prints this list.",
    ]
    keys = config_keys()
    for prefix, group in config_groups():
        rows = [
            [f"`{key.key}`", _markdown(key.type), f"`{key.default}`", _markdown(key.doc)]
            for key in keys
            if key.key.rpartition(".")[0] == prefix
        ]
        if not rows:
            continue
        title = f"`{prefix}`" if prefix else "Top-level keys"
        lines += ["", f"## {title}", "", _markdown(" ".join(inspect.getdoc(group).split())), "", *_table(["key", "type", "default", "meaning"], rows)]
    return "\n".join(lines) + "\n"


def config_help_text() -> str:
    """``lowprec-train --help-config``: every key with its type, default and meaning."""
    lines = ["lowprec-train config keys (KEY=VALUE; type, default):"]
    for key in config_keys():
        lines.append(f"  {key.key} ({key.type}, default {key.default})")
        lines += textwrap.wrap(plain_text(key.doc), HELP_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _flag_type(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        shown = " or ".join(f"`{choice}`" for choice in action.choices)
    elif action.metavar is not None:
        shown = f"`{action.metavar}`"
    else:
        shown = getattr(action.type, "__name__", "str")
    return f"{shown} ..." if action.nargs in ("*", "+") else shown


def _flag_default(action: argparse.Action) -> str:
    if action.default is None:
        return "unset"
    if isinstance(action.default, list):
        return " ".join(f"`{item}`" for item in action.default) or "none"
    return f"`{_yaml(action.default)}`"


def megatron_lm_flags_page() -> str:
    """``megatron_lm_flags.md``."""
    from megatron_lowprec.megatron.megatron_lm import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    actions = [action for action in parser._actions if any(flag.startswith("--lowprec-") for flag in action.option_strings)]
    shown = [action for action in actions if action.help != argparse.SUPPRESS]
    kept = [flag for action in actions if action.help == argparse.SUPPRESS for flag in action.option_strings]
    rows = [
        [", ".join(f"`{flag}`" for flag in action.option_strings), _flag_type(action), _flag_default(action),
         _markdown(action.help.replace("%%", "%") if action.help else "—")]
        for action in shown
    ]
    lines = [
        GENERATED_NOTE,
        "",
        "# Megatron-LM flags",
        "",
        "The `--lowprec-*` flags that the Megatron-LM entry adds to Megatron-LM's own arguments",
        "(`torchrun --no-python ... lowprec-megatron-lm pretrain_gpt.py ... --lowprec-option C`, or",
        "`torchrun ... -m megatron_lowprec.megatron.megatron_lm pretrain_gpt.py ...`). Without",
        "`--lowprec-option` the optimizer is megatron's own. Megatron-LM's `--bf16` reduces gradients",
        "in FP32, a 4-byte gradient buffer, for every option unless `--grad-reduce-in-bf16` (bytes per",
        "option: [Options](options.md)).",
        "",
        *_table(["flag", "type", "default", "meaning"], rows),
    ]
    if kept:
        lines += ["", "Earlier spellings, still accepted: " + ", ".join(f"`{flag}`" for flag in kept) + "."]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """Every reference page by file name."""
    return {"options.md": options_page(), "config.md": config_page(), "megatron_lm_flags.md": megatron_lm_flags_page()}


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_lowprec.train.reference DIRECTORY``: write :func:`pages` into ``DIRECTORY``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: {GENERATOR.replace('docs/reference', 'DIRECTORY')}", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (directory / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
