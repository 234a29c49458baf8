"""``lowprec-train``: compose the Hydra config from command-line overrides, validate it, train.

    lowprec-train                                    # tiny GPT on the shipped corpus, option A
    lowprec-train precision=C trainer.max_steps=100  # Collage-plus
    torchrun --nproc-per-node 8 -m megatron_lowprec.train model=gpt_125m precision=sr

The config is composed with Hydra's compose API from ``configs/`` (or ``$LOWPREC_CONFIG_DIR``) on
top of the typed schema :class:`~megatron_lowprec.train.config.TrainConfig`; every rank composes the
same config. Errors in the config (an unknown option or key, a layout that does not fit the world
size) are reported in one line, before any process group, dataset or model is created (exit 2), as
is a checkpoint that cannot be resumed from. ``--help`` lists the config groups and the most used
keys, ``--help-config`` every key; ``--version`` the versions of this package, torch and megatron-core. Ctrl-C stops with one
line naming the step reached and the checkpoint a rerun resumes from (exit 130); a diverged run (loss or
gradient norm not finite for ``trainer.max_nonfinite_steps`` steps in a row) with one line (exit 3).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from megatron_lowprec.train.config import (
    ConfigError, TrainConfig, adopt_renamed_spellings, model_parallel_size, to_yaml, validate,
)
from megatron_lowprec.train.reference import config_help_text
from megatron_lowprec.train.usage import help_text, version_text

CONFIG_DIR_VARIABLE = "LOWPREC_CONFIG_DIR"
SCHEMA_NAME = "train_schema"
HELP_FLAGS = ("-h", "--help")
HELP_CONFIG_FLAGS = ("--help-config",)
VERSION_FLAGS = ("-V", "--version")
def config_dir() -> Path:
    """``$LOWPREC_CONFIG_DIR``, else the ``configs/`` folder of the source tree this package is in."""
    configured = os.environ.get(CONFIG_DIR_VARIABLE)
    directory = Path(configured) if configured else Path(__file__).resolve().parents[2] / "configs"
    if not (directory / "train.yaml").is_file():
        raise ConfigError(
            f"no train.yaml in {str(directory)!r}; set {CONFIG_DIR_VARIABLE} to the project's configs/ folder"
        )
    return directory


def compose(overrides: Sequence[str] = ()) -> TrainConfig:
    """The typed config of ``train.yaml`` with Hydra ``overrides`` applied.

    Hydra's own errors (an unknown group member such as ``precision=Z``, which lists the
    available ones, or a key the schema does not have) become :class:`ConfigError`. Earlier
    spellings (``precision=megatron``, :data:`~megatron_lowprec.train.config.RENAMED_KEYS`) work with
    a warning naming the current one.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
    directory = config_dir()
    overrides = [_canonical_precision(override, directory) for override in overrides]
    try:
        with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
            composed = hydra_compose(config_name="train", overrides=overrides)
        _reject_unknown_keys(OmegaConf.to_container(composed), TrainConfig, "")
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_explain(error)) from None
    _refuse_a_precision_the_baseline_replaces(config, overrides)
    return adopt_renamed_spellings(config)


def _canonical_precision(override: str, directory: Path) -> str:
    """``precision=<name>`` with ``<name>`` in any case or an alias of an option (``precision=c``,
    ``precision=collage_plus``) as the name of its file in ``precision/``; ``precision=<baseline>``,
    the earlier spelling of ``baseline=<baseline>`` (``megatron``, ``te_fp8``), as that, with a
    warning; other overrides as they are."""
    from megatron_lowprec.optim.strategies import get_strategy

    key, separator, value = override.partition("=")
    if key != "precision" or not separator:
        return override
    files = {path.stem.lower(): path.stem for path in (directory / "precision").glob("*.yaml")}
    if value.lower() in files:
        return f"precision={files[value.lower()]}"
    baselines = {path.stem.lower(): path.stem for path in (directory / "baseline").glob("*.yaml")}
    if value.lower() in baselines:
        warnings.warn(f"precision={value} is deprecated; use baseline={baselines[value.lower()]}", FutureWarning, stacklevel=3)
        return f"baseline={baselines[value.lower()]}"
    try:
        name = get_strategy(value).name
    except ValueError:
        return override  # Hydra names the choices
    return f"precision={files.get(name.lower(), value)}"


def _refuse_a_precision_the_baseline_replaces(config: TrainConfig, overrides: Sequence[str]) -> None:
    """A ``baseline=`` member sets ``precision.option`` over the ``precision`` group's: a ``precision=``
    override naming another option would be dropped without a word; stop instead."""
    chosen = dict(override.split("=", 1) for override in overrides if override.startswith(("precision=", "baseline=")))
    baseline, option = chosen.get("baseline", "null"), chosen.get("precision")
    if baseline != "null" and option is not None and option != config.precision.option:
        raise ConfigError(
            f"baseline={baseline} trains option {config.precision.option}; precision={option} contradicts it, drop one"
        )


def _reject_unknown_keys(values: dict, schema: type, prefix: str) -> None:
    """Hydra lets ``+key=value`` append keys that the schema does not have; refuse them."""
    fields = {field.name: field for field in dataclasses.fields(schema)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {prefix + key!r}; valid keys: {', '.join(fields)}")
        if isinstance(value, dict) and isinstance(fields[key].default_factory, type):
            _reject_unknown_keys(value, fields[key].default_factory, f"{prefix}{key}.")


def _explain(error: BaseException) -> str:
    """One line out of Hydra's and OmegaConf's chained errors, with the valid choices."""
    options = getattr(error, "options", None)
    if options:
        return f"{str(error).splitlines()[0]}; choose one of: {', '.join(options)}"
    lines = []
    while error is not None:
        line = str(error).splitlines()[0] if str(error) else ""
        if "$VALUE" not in line and line not in lines:
            lines.append(line)
        node_type = getattr(error, "object_type", None)
        if node_type is not None and dataclasses.is_dataclass(node_type) and "not in" in line:
            lines.append(f"valid keys: {', '.join(f.name for f in dataclasses.fields(node_type))}")
            break
        error = error.__cause__
    return " ".join(lines)


def _check_resumable(config: TrainConfig) -> None:
    """``resume_from`` names an intact checkpoint, and ``resume=true`` needs one in ``run_dir``: say so
    before any work."""
    from megatron_lowprec.train.checkpoint import checkpoint_problem, checkpoints_dir, latest_checkpoint, resume_candidates

    if config.resume_from is not None:
        problem = checkpoint_problem(Path(config.resume_from))
        if problem is not None:
            raise ConfigError(f"resume_from={config.resume_from!r} cannot be resumed from: {problem}")
    elif config.resume and latest_checkpoint(Path(config.run_dir)) is None:
        damaged = [f"{path.name} {checkpoint_problem(path)}" for path in resume_candidates(Path(config.run_dir))]
        found = f" (damaged: {'; '.join(damaged)})" if damaged else ""
        raise ConfigError(
            f"resume=true, but {str(checkpoints_dir(Path(config.run_dir)))!r} holds no intact checkpoint{found}"
        )


def _check_run_dir(config: TrainConfig) -> None:
    """The run directory (or ``runs/``, where a fresh one is made) exists or can be made, and is
    writable: say so now rather than in a rank's traceback after start-up."""
    directory = Path(config.run_dir if config.run_dir is not None else "runs")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"run_dir={str(directory)!r} cannot be created: {error.strerror or error}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir={str(directory)!r} is not writable")


def _compose_saying_earlier_spellings(arguments: Sequence[str]) -> TrainConfig:
    """:func:`compose`, each earlier spelling's warning printed as one line by rank 0; other warnings as
    Python shows them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        config = compose(arguments)
    for warning in caught:
        if issubclass(warning.category, FutureWarning) and "is deprecated; use" in str(warning.message):
            _print_rank_zero(f"lowprec-train: warning: {warning.message}")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    return config


def _planned_world_size(config: TrainConfig, launched: bool) -> tuple[int, str]:
    """The world size to validate and plan for, and the note a dry run prints about it."""
    if launched:
        return int(os.environ["WORLD_SIZE"]), ""
    if not config.trainer.dry_run:
        return 1, ""
    ranks = model_parallel_size(config)
    return ranks, f"WORLD_SIZE is unset: planned for the {ranks} rank(s) of one model replica; WORLD_SIZE=N plans for N"


def _print_rank_zero(message: str) -> None:
    """Print on global rank 0 only (every rank of a run stops with the same message)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``lowprec-train``: Hydra overrides in, exit status out (0 done or stopped by an
    exit signal with a checkpoint, 1 a checkpoint that could not be written, 2 config or resume error,
    3 diverged, 130 Ctrl-C)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _print_rank_zero("lowprec-train: interrupted during start-up, before any training step")
        return 130


def _main(argv: Optional[Sequence[str]]) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    help_config = any(argument in HELP_CONFIG_FLAGS for argument in arguments)
    if help_config or any(argument in HELP_FLAGS for argument in arguments):
        try:
            print(config_help_text() if help_config else help_text(config_dir()), flush=True)
        except BrokenPipeError:  # lowprec-train --help | head
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if any(argument in VERSION_FLAGS for argument in arguments):
        print(version_text())
        return 0
    from megatron_lowprec.megatron.notices import quiet_library_notices
    from megatron_lowprec.optim.compile_cache import keep_inductor_cache

    quiet_library_notices()
    keep_inductor_cache()
    try:
        options = [argument for argument in arguments if argument.startswith("-")]
        if options:
            raise ConfigError(
                f"unknown option {options[0]!r}: lowprec-train takes Hydra overrides (key=value, group=member) "
                f"and {', '.join(HELP_FLAGS + HELP_CONFIG_FLAGS + VERSION_FLAGS)}"
            )
        config = _compose_saying_earlier_spellings(arguments)
        world_size, world_size_note = _planned_world_size(config, launched="WORLD_SIZE" in os.environ)
        validate(config, world_size)
        _check_resumable(config)
        if not config.trainer.dry_run:
            _check_run_dir(config)
    except ConfigError as error:
        print(f"lowprec-train: config error: {error}", file=sys.stderr)
        return 2
    if config.trainer.dry_run:
        from megatron_lowprec.train.plan import describe

        print(to_yaml(config))
        print(describe(config, world_size, world_size_note))
        return 0
    return _train(config)


def _train(config: TrainConfig) -> int:
    """Train, turning a config error found once the data is loaded (a vocabulary smaller than the
    tokenizer's), a checkpoint that cannot be resumed or written, a diverged run and Ctrl-C into one
    line each."""
    from megatron_lowprec.train.checkpoint import ResumeError, SaveError
    from megatron_lowprec.train.loop import DIVERGED_EXIT_CODE, Diverged, Interrupted, train

    try:
        train(config)
    except ConfigError as error:
        _print_rank_zero(f"lowprec-train: config error: {error}")
        return 2
    except ResumeError as error:
        _print_rank_zero(f"lowprec-train: cannot resume: {error}")
        return 2
    except SaveError as error:
        _print_rank_zero(f"lowprec-train: {error}")
        return 1
    except Diverged as diverged:
        _print_rank_zero(f"lowprec-train: {diverged.report()}")
        return DIVERGED_EXIT_CODE
    except Interrupted as interrupted:
        _print_rank_zero(f"lowprec-train: {interrupted.report()}")
        return 130
    return 0
