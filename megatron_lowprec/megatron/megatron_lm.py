"""Megatron-LM's ``pretrain_gpt.py`` with a precision option: ``--lowprec-option C``.

Either launch Megatron-LM's own script through this module (nothing in Megatron-LM changes)::

    torchrun --nproc-per-node 8 -m megatron_lowprec.megatron.megatron_lm /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron-LM's arguments> --bf16 --lowprec-option C

or add two lines at the top of a copy of ``pretrain_gpt.py``, before its megatron imports::

    from megatron_lowprec.megatron import megatron_lm
    megatron_lm.install()

:func:`install` changes these functions of ``megatron.training`` (megatron-core 0.16.1 to 0.19;
Megatron-LM's ``megatron/training`` ships in the megatron-core package from 0.17):

- ``parse_args`` also adds :func:`add_arguments` (the ``--lowprec-*`` group), whichever entry point
  asks for the arguments (``initialize_megatron`` until 0.17, ``parse_and_validate_args`` from 0.18)
  and whatever ``extra_args_provider`` the script passes, and prints the run's first line (rank 0):
  the option and the optimizer asked for (:func:`requested_optimizer`);
- ``get_megatron_optimizer`` and ``get_megatron_muon_optimizer``, the functions that
  ``setup_model_and_optimizer`` builds the optimizer with (from 0.18 the first for every
  ``--optimizer``; at 0.16 and 0.17 the second for ``--optimizer muon`` and ``dist_muon``, where it
  is megatron-core's Muon on NVIDIA's emerging-optimizers), build the precision option
  with :func:`~megatron_lowprec.megatron.optimizer.build_optimizer` from Megatron-LM's optimizer
  config, its ``config_overrides`` (weight-decay exemptions, ``--decoupled-lr``, muP) and the
  ``--lowprec-*`` settings; without ``--lowprec-option`` they are megatron's own. With ``--optimizer
  muon`` it is our Muon for the 2-D hidden weights chained with AdamW for the rest, both with the
  option (emerging-optimizers is not needed), taking Megatron-LM's ``--muon-momentum``,
  ``--muon-nesterov`` (``--muon-use-nesterov`` until 0.17), ``--muon-num-ns-steps``,
  ``--muon-scale-mode``, ``--muon-extra-scale-factor``, ``--muon-no-split-qkv``,
  ``--muon-coefficient-type`` (``quintic`` or ``simple``, from 0.17) and
  ``--muon-tp-mode`` (``blockwise`` or ``duplicated``), sharded by layer over the data-parallel ranks
  with ``--optimizer dist_muon`` or, from 0.18, ``--use-distributed-optimizer`` (megatron's layer-wise
  sharding for Muon, in its shard-aligned layout or with ``--no-use-layer-wise-param-layout``);
- ``setup_model_and_optimizer`` puts COAT's FP8 layers (``--lowprec-fp8-layers``, on with ``coat``)
  or the ExMy emulation (``--lowprec-emulate E8M5``) into each freshly built model chunk, before
  ``Float16Module`` and DDP wrap it; once the optimizer is built, before the first iteration, it
  prints the option and the optimizers in use (rank 0), or, where ``--lowprec-option`` asked for an
  option that some parameter is not stepped with (a Megatron-LM that builds its optimizer through a
  function not replaced here), stops the run with one line naming the megatron-core version, the
  path taken and what to do (:func:`~megatron_lowprec.megatron.option_check.optimizer_in_use`, which
  ``lowprec-train`` calls too); with ``--exit-signal-handler`` it starts megatron's checkpoint writer
  service, and every process forked later (the data loader's workers), with the exit signal
  blocked, so that the signal sent to every process of the job (SLURM, ``kill -TERM -<group>``) does
  not stop the save it asks for (:mod:`~megatron_lowprec.megatron.exit_signals`);
- ``load_checkpoint`` reads a ``torch_dist`` checkpoint of another option, or of megatron's own
  AdamW (with ``--use-distributed-optimizer`` in its per-parameter form), with that option's state
  keys and has the optimizer convert it with ``--lowprec-convert-checkpoint``
  (:func:`optimizer_template_for`): the plain or the distributed optimizer, or each optimizer of the
  Muon chain from its part of a chain's checkpoint; without the flag it stops with one line naming it
  (megatron's own optimizer given an option's checkpoint: naming ``lowprec-convert``), where
  Megatron-LM would stop on a missing key.

Muon with ``--use-distributed-optimizer`` before megatron-core 0.18: Megatron-LM's ``validate_args``
refuses the pair, and with ``--lowprec-option`` this module says so in one line that names the
alternative instead of letting its assertion fire. The check is kept, not lifted: there
``--use-distributed-optimizer`` has DDP reduce-scatter the gradients into shards without the
layer-wise layout (0.19's) that a sharded Muon needs, and Megatron-LM's checkpointing takes the
optimizer for its ``DistributedOptimizer`` (``save_parameter_state``). The alternative is ``--optimizer
dist_muon``, which these versions pass to ``get_megatron_muon_optimizer`` as
``layer_wise_distributed_optimizer``: the project's layer-wise distributed Muon (each matrix and its
state on one data-parallel rank, DDP all-reducing), as ``lowprec-train`` (``optimizer.use_distributed_optimizer``)
and ``build_optimizer`` (``use_layer_wise_distributed_optimizer``) offer it.

How each version is checked: at 0.19 (the newest job, ``.ci/megatron_newest.sh``), Megatron-LM's own
argument parsing, ``initialize_megatron``, ``setup_model_and_optimizer`` and ``pretrain`` with
``--optimizer adam`` and ``muon`` at DP=1 and TP=2 (``tests/megatron/test_megatron_lm.py``); 0.18
calls the same ``get_megatron_optimizer`` for Muon from the same place. At 0.16, whose wheel lacks
``megatron.training``, against that version's call pattern (``tests/megatron/test_megatron_lm_call_pattern.py``):
a stand-in ``megatron.training`` whose ``setup_model_and_optimizer`` calls ``get_megatron_muon_optimizer``
for ``'muon' in config.optimizer`` and ``get_megatron_optimizer`` otherwise, each looked up in its
``training`` module where Megatron-LM imports it, on megatron-core 0.16.1 itself, at DP=1 and TP=2;
0.17's ``setup_model_and_optimizer`` makes the same two calls.

Also, megatron's dataset ``compile_helpers`` no longer runs ``make`` where the installed megatron-core
already ships its C++ helpers built (a pip-installed megatron-core has no Makefile for them), and
otherwise compiles them for the running Python (:func:`compile_dataset_helpers`).

Everything else is Megatron-LM's: checkpoints (``--ckpt-format torch_dist``), the scheduler, logging,
``--use-distributed-optimizer`` with Adam. Without CUDA the module's launcher also activates the CPU bridge
(:func:`activate_cpu_trial`) so that a tiny GPT can be tried on a laptop with gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import runpy
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Optional

from packaging.version import Version

from megatron_lowprec.layers.emulation import ROUNDING_MODES
from megatron_lowprec.layers.settings import LayerPrecision, layer_precision_of
from megatron_lowprec.optim.compile_cache import keep_inductor_cache
from megatron_lowprec.optim.settings import (
    OptimizerPrecision, SettingError, field_docs, lowprec_field, plain_text, precision_of,
    spelled_fields,
)
from megatron_lowprec.optim.strategies import GROUPED_MOMENT_STORAGES, MASTER_STORAGES, get_strategy, strategy_names

_INSTALLED: list[tuple[Any, str, Any]] = []

PRECISION_FLAG_DEFAULTS = {"option": None, "seed": None}
"""The flags whose default is not :class:`OptimizerPrecision`'s: without ``--lowprec-option`` the
optimizer is megatron's own, and ``--lowprec-seed`` is ``--seed`` unless given."""


def _option_name(name: str) -> str:
    """The canonical name of a precision option given by any of its names, in any case."""
    try:
        return get_strategy(name).name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _emulation_format(spec: str) -> str:
    """An ExMy format name the emulation accepts (``E8M5``), checked while the arguments are parsed
    by :meth:`LayerPrecision.check <megatron_lowprec.layers.settings.LayerPrecision.check>`."""
    try:
        LayerPrecision(emulate=spec).check()
    except SettingError as error:
        raise argparse.ArgumentTypeError(error.reason) from None
    return spec


def _one_line_errors_for_our_flags(parser: argparse.ArgumentParser) -> None:
    """A bad value of a ``--lowprec-*`` flag stops with one line naming it and the valid choices, exit
    2, instead of argparse's usage of all of Megatron-LM's arguments (hundreds of lines) before it."""
    error = parser.error

    def error_without_usage(message: str) -> None:
        if message.startswith("argument --lowprec-"):
            parser.exit(2, f"{parser.prog}: error: {message}\n")
        error(message)

    parser.error = error_without_usage


class _EarlierSpelling(argparse.Action):
    """An earlier spelling of a flag, hidden from ``--help``: sets what the flag ``current`` sets, with a
    warning naming both."""

    def __init__(self, option_strings: list[str], dest: str, current: str, const: Any, **unused: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.current = current

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        warnings.warn(f"{option_string} is deprecated; use {self.current}", FutureWarning)
        setattr(namespace, self.dest, self.const)


RENAMED_FLAGS = {
    "--lowprec-no-shared-randomness": ("--no-lowprec-shared-randomness", "lowprec_shared_randomness", False),
    "--lowprec-emulate-no-clamp-outer-range": ("--no-lowprec-emulate-clamp-outer-range", "lowprec_emulate_clamp_outer_range", False),
    "--lowprec-emulate-no-clamp-inner-range": ("--no-lowprec-emulate-clamp-inner-range", "lowprec_emulate_clamp_inner_range", False),
}
"""Earlier spellings of flags: the current flag, the argument it sets and the value."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--lowprec-*`` arguments in their own group of Megatron-LM's parser (an ``extra_args_provider``).

    Each is ``--lowprec-`` and the key of ``lowprec-train``'s ``precision`` group (``--lowprec-master-storage``
    is ``precision.master_storage``); a switch is ``--lowprec-KEY`` and ``--no-lowprec-KEY``, as argparse
    and Megatron-LM spell a negation. The earlier spellings of :data:`RENAMED_FLAGS` work with a warning.
    """
    _one_line_errors_for_our_flags(parser)
    group = parser.add_argument_group(title="megatron-lowprec precision options")
    _add_flags(group, OptimizerPrecision)
    _add_flags(group, LayerPrecision)
    for earlier, (current, dest, value) in RENAMED_FLAGS.items():
        group.add_argument(earlier, dest=dest, action=_EarlierSpelling, current=current, const=value)
    return parser


FLAG_SPELLINGS = {
    "option": {"type": _option_name, "metavar": "OPTION"},
    "master_storage": {"choices": MASTER_STORAGES},
    "moment_storage": {"choices": GROUPED_MOMENT_STORAGES},
    "emulate": {"type": _emulation_format, "metavar": "EXMY"},
    "emulate_rounding": {"choices": ROUNDING_MODES},
    "layers_exclude": {"nargs": "*", "metavar": "MODULE"},
}
"""How the flags that are neither a switch nor a plain number take their value: a name checked as
it is parsed, one of a few names, or a list."""


def _flag(name: str) -> str:
    """The flag of a settings field: ``--lowprec-master-storage``."""
    return "--lowprec-" + name.replace("_", "-")


def _add_flags(group: argparse._ArgumentGroup, settings: type) -> None:
    """A flag per field of the ``settings`` dataclass (:class:`OptimizerPrecision`,
    :class:`LayerPrecision`), its help the field's docstring and its default the field's: a switch for
    a boolean, else as :data:`FLAG_SPELLINGS` says or the field's type."""
    hints, docs = typing.get_type_hints(settings), field_docs(settings)
    for field in dataclasses.fields(settings):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        spelling = {"help": plain_text(docs[field.name]).replace("%", "%%"), "default": PRECISION_FLAG_DEFAULTS.get(field.name, default)}
        if hints[field.name] in (bool, Optional[bool]):
            spelling["action"] = argparse.BooleanOptionalAction
        elif field.name in FLAG_SPELLINGS:
            spelling.update(FLAG_SPELLINGS[field.name])
        else:
            spelling["type"] = typing.get_args(hints[field.name])[0]
        if field.name == "option":
            spelling["help"] += f" One of {', '.join(strategy_names())}; without it megatron's own optimizer."
        group.add_argument(_flag(field.name), **spelling)


def _check_precision_flags(args: argparse.Namespace) -> None:
    """The ``--lowprec-*`` settings checked together, as the configs that build the optimizer and
    convert the layers will check them, before Megatron-LM builds anything: one line otherwise. The
    optimizer's only with ``--lowprec-option``; the layers' always (the emulation runs with
    megatron's own optimizer too)."""
    option = getattr(args, "lowprec_option", None)
    try:
        if option is not None:
            precision_of(args, lowprec_field).check()
        layer_precision_of(args, lowprec_field).check(option)
    except SettingError as error:
        _stop(f"megatron-lowprec: {error.spelled(_flag)}")


def _with_precision_arguments(parse_args):
    @functools.wraps(parse_args)
    def parse_args_with_precision(extra_args_provider=None, *args, **kwargs):
        def providers(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_arguments(parser)

        parsed = parse_args(providers, *args, **kwargs)
        _check_precision_flags(parsed)
        _refuse_muon_with_megatrons_distributed_optimizer(parsed)
        _print_rank_0(requested_optimizer(parsed))
        return parsed

    return parse_args_with_precision


MUON_WITH_DISTRIBUTED_OPTIMIZER = Version("0.18")
"""From this megatron-core, Megatron-LM takes ``--optimizer muon --use-distributed-optimizer`` (its
layer-wise distributed optimizer); before it, its ``validate_args`` refuses the pair."""


def _refuse_muon_with_megatrons_distributed_optimizer(args: argparse.Namespace) -> None:
    """One line instead of Megatron-LM 0.16/0.17's assertion on ``--optimizer muon
    --use-distributed-optimizer``, naming the precision option's alternative: ``--optimizer dist_muon``."""
    from megatron_lowprec.megatron import compat

    optimizer = getattr(args, "optimizer", "adam")
    if getattr(args, "lowprec_option", None) is None or "muon" not in optimizer or not getattr(args, "use_distributed_optimizer", False):
        return
    version = compat.megatron_core_version()
    if version < MUON_WITH_DISTRIBUTED_OPTIMIZER:
        _stop(
            f"megatron-lowprec: Megatron-LM at megatron-core {version} refuses --optimizer {optimizer} with "
            f"--use-distributed-optimizer; to shard option {args.lowprec_option}'s Muon over the data-parallel ranks use "
            "--optimizer dist_muon without --use-distributed-optimizer (the layer-wise distributed optimizer: each "
            f"matrix and its state on one rank), or megatron-core {MUON_WITH_DISTRIBUTED_OPTIMIZER}+"
        )


def requested_optimizer(args: argparse.Namespace) -> str:
    """The line that opens a run: the precision option and the optimizer its flags ask for."""
    optimizer = getattr(args, "optimizer", "adam")
    option = getattr(args, "lowprec_option", None)
    if option is None:
        return f"megatron-lowprec: no --lowprec-option; megatron's own optimizer (--optimizer {optimizer})"
    if "muon" in optimizer:
        sharded = ", sharded by layer over the data-parallel ranks" if optimizer.startswith("dist_") else ""
        return (f"megatron-lowprec: option {option} with --optimizer {optimizer}: the project's Muon for the 2-D hidden "
                f"weights chained with its AdamW for the rest, both with option {option}{sharded}")
    return f"megatron-lowprec: option {option} with --optimizer {optimizer}: the project's AdamW with option {option}"


def _rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


_PRINTED: set[str] = set()
"""The lines :func:`_print_rank_0` printed in this process (Megatron-LM 0.16's ``pretrain_gpt.py``
parses its arguments more than once)."""


def _print_rank_0(line: str) -> None:
    """``line`` printed once by the first rank only, as Megatron-LM's ``print_rank_0`` does."""
    if _rank() == 0 and line not in _PRINTED:
        _PRINTED.add(line)
        print(line, flush=True)


def _stop(line: str) -> None:
    """Every rank exits with status 1, the first printing ``line`` (one line, not one per rank)."""
    raise SystemExit(line if _rank() == 0 else 1)


def precision_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``lowprec_*`` fields of :class:`LowPrecisionOptimizerConfig` from Megatron-LM's ``args``."""
    settings = spelled_fields(precision_of(args, lowprec_field), lowprec_field)
    if settings["lowprec_seed"] is None:
        settings["lowprec_seed"] = args.seed
    return settings


TRAINING_MODULE = "megatron.training.training"

OPTIMIZER_BUILDERS = ("get_megatron_optimizer", "get_megatron_muon_optimizer")
"""The functions of megatron-core that Megatron-LM's ``setup_model_and_optimizer`` calls to build the
optimizer (bound by name in ``megatron.training.training``): ``get_megatron_optimizer`` for every
``--optimizer`` from 0.18, and until 0.17 for all but Muon, which ``get_megatron_muon_optimizer``
builds (``--optimizer muon``, or ``dist_muon`` for its layer-wise distributed optimizer)."""

_BUILT_THROUGH: list[str] = []
"""The :data:`OPTIMIZER_BUILDERS` whose replacement ran during the current ``setup_model_and_optimizer``."""


def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
    """Megatron-LM's ``get_megatron_optimizer``: the precision option when ``--lowprec-option`` is given."""
    from megatron_lowprec.megatron.optimizer import build_optimizer

    _BUILT_THROUGH.append("get_megatron_optimizer")
    precision_config = _precision_config(config)
    if precision_config is None:
        return _original(TRAINING_MODULE, "get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    return build_optimizer(precision_config, model_chunks, *args, **kwargs)


def get_megatron_muon_optimizer(
    config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
    layer_wise_distributed_optimizer=False, pg_collection=None,
):
    """Megatron-LM's ``get_megatron_muon_optimizer`` (megatron-core 0.16 and 0.17): with
    ``--lowprec-option``, the project's Muon for the 2-D hidden weights chained with its AdamW for the
    rest, both with the option (emerging-optimizers is not needed), sharded by layer with
    ``layer_wise_distributed_optimizer`` (``--optimizer dist_muon``); megatron-core's own otherwise."""
    from megatron_lowprec.megatron import compat
    from megatron_lowprec.megatron.optimizer import build_optimizer

    _BUILT_THROUGH.append("get_megatron_muon_optimizer")
    precision_config = _precision_config(config, **(compat.layer_wise_fields() if layer_wise_distributed_optimizer else {}))
    if precision_config is None:
        return _original(TRAINING_MODULE, "get_megatron_muon_optimizer")(
            config, model_chunks, config_overrides, use_gloo_process_groups, layer_wise_distributed_optimizer, pg_collection
        )
    return build_optimizer(
        precision_config, model_chunks, config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
    )


def _precision_config(config, **changes):
    """Megatron's optimizer ``config`` with the ``--lowprec-*`` settings and ``changes`` as a
    :class:`LowPrecisionOptimizerConfig`; None without ``--lowprec-option``."""
    from megatron.training import get_args

    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    settings = precision_settings(get_args())
    if settings["lowprec_option"] is None:
        return None
    return LowPrecisionOptimizerConfig.from_optimizer_config(config, **settings, **changes)


def saved_optimizer_option(common_state: dict) -> str | None:
    """The option a checkpoint's optimizer state was saved with, from its common state (what
    ``dist_checkpointing.load_common_state_dict`` returns, or one optimizer's part of a chain's):
    this package's ``lowprec`` record, :data:`~megatron_lowprec.optim.convert.STOCK` for
    megatron-core's own optimizers, ``None`` for anything else (a whole chain, none saved)."""
    from megatron_lowprec.megatron.torch_dist import DISTRIBUTED_FORM_KEY, STOCK_FORM_KEY
    from megatron_lowprec.optim.convert import STOCK

    saved = common_state.get("optimizer") if isinstance(common_state, dict) else None
    if not isinstance(saved, dict):
        return None
    if isinstance(saved.get("lowprec"), dict):
        return saved["lowprec"].get("option")
    return STOCK if STOCK_FORM_KEY in saved or DISTRIBUTED_FORM_KEY in saved else None


def optimizer_template_for(optimizer, template: dict, checkpoint_dir: str) -> dict:
    """The optimizer part of the sharded state dict that Megatron-LM loads ``checkpoint_dir`` with:
    ``template`` where the checkpoint holds the running optimizer's option, else (with
    ``--lowprec-convert-checkpoint``) the saved option's states
    (:func:`~megatron_lowprec.megatron.optimizer.saved_option_template`), which the optimizer's
    ``load_state_dict`` converts: the plain and the distributed optimizer, and each optimizer of the
    Muon chain from its part of a chain's checkpoint. Without the flag, into megatron's own
    optimizer, from megatron-core's own Muon, or between a chain and a single optimizer, one line
    that says what converts it."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    saved = common.get("optimizer") if isinstance(common, dict) else None
    chained = getattr(optimizer, "chained_optimizers", None)
    saved_chain = isinstance(saved, dict) and bool(saved) and all(isinstance(index, int) for index in saved)
    if chained is None or len(chained) == 1:
        if saved_chain:
            _stop(f"{checkpoint_dir} holds the state of a chain of optimizers (Muon and AdamW), this run has one optimizer: "
                  "resume with the optimizer it was saved with")
        return _member_template(next(iter(chained or []), optimizer), template, common, checkpoint_dir)
    if saved is None:
        return template
    if not saved_chain or sorted(saved) != list(range(len(chained))):
        _stop(f"{checkpoint_dir} holds the state of one optimizer, this run chains {len(chained)} (Muon and AdamW): "
              "resume with the optimizer it was saved with")
    if any(_project_strategy(member) is not None for member in chained) and not all(
        isinstance(saved[index], dict) and isinstance(saved[index].get("lowprec"), dict) for index in saved
    ):
        _stop(f"{checkpoint_dir} holds the state of megatron-core's own Muon, which the precision options' Muon does not "
              "convert (neither --lowprec-convert-checkpoint nor lowprec-convert): resume it with megatron's own Muon")
    return {
        index: _member_template(member, template[index], {**common, "optimizer": saved[index]}, checkpoint_dir)
        for index, member in enumerate(chained)
    }


def _project_strategy(optimizer):
    """The precision strategy of one of this package's optimizers; ``None`` for megatron's own."""
    return getattr(getattr(optimizer, "optimizer", None), "strategy", None)


def _member_template(optimizer, template: dict, common: dict, checkpoint_dir: str) -> dict:
    """:func:`optimizer_template_for` of one optimizer (alone, or of a chain) whose saved part of
    the common state is ``common["optimizer"]``."""
    from megatron_lowprec.megatron.optimizer import saved_option_template
    from megatron_lowprec.megatron.torch_dist import (
        DISTRIBUTED_MASTER_KEY, MODEL_SPACE_FORM, distributed_form, read_metadata, unread_distributed_form,
    )
    from megatron_lowprec.optim.convert import (
        STOCK, STOCK_MASTER_KEY, as_shaped_like, resolve_target, with_saved_exponent_storage,
    )
    from megatron_lowprec.optim.strategies import storage_difference, stores_other_exponents

    saved = saved_optimizer_option(common)
    strategy = _project_strategy(optimizer)
    running = None if strategy is None else strategy.name
    converts = getattr(optimizer, "convert_checkpoint", False)
    extra = (common["optimizer"]["lowprec"] or {}) if saved not in (None, STOCK) else {}
    other_storage = saved is not None and saved == running and stores_other_exponents(extra, strategy)
    if saved is None or (saved == (running or STOCK) and not other_storage):
        return template
    if other_storage and not converts:
        what, saved_storage, own_storage = storage_difference(extra, strategy)
        _stop(f"{checkpoint_dir} stores the {what} of --lowprec-option {running} in "
              f"{saved_storage}, this run in {own_storage}: "
              "--lowprec-convert-checkpoint converts its optimizer state (its FP8 moments quantized afresh)")
    if running is None:
        _stop(f"{checkpoint_dir} was saved with --lowprec-option {saved}; megatron's own optimizer cannot resume it: "
              f"resume with --lowprec-option {saved}, or convert it with `lowprec-convert SRC DST --to stock`")
    if not converts:
        saved_with = "megatron's own optimizer" if saved == STOCK else f"--lowprec-option {saved}"
        _stop(f"{checkpoint_dir} was saved with {saved_with}, this run has --lowprec-option {running}: "
              f"--lowprec-convert-checkpoint converts its optimizer state to {running}")
    form = distributed_form(common) if isinstance(common, dict) else None
    if form is not None and form != MODEL_SPACE_FORM:
        _stop(f"{checkpoint_dir}: {unread_distributed_form(form)}")
    master = DISTRIBUTED_MASTER_KEY if form == MODEL_SPACE_FORM else STOCK_MASTER_KEY
    if saved == STOCK and not any(key.startswith(f"optimizer.state.{master}.")
                                  for key in read_metadata(Path(checkpoint_dir)).state_dict_metadata):
        _stop(f"{checkpoint_dir} holds megatron's own optimizer state without per-parameter FP32 masters: "
              "--lowprec-convert-checkpoint converts megatron's own optimizer state by parameter")
    source = as_shaped_like(with_saved_exponent_storage(resolve_target(saved), extra), strategy)
    return saved_option_template(template, source, stock=saved == STOCK, stock_master_key=master)


def _converting_load_checkpoint(load_checkpoint):
    """Megatron-LM's ``load_checkpoint`` whose ``dist_checkpointing.load`` reads the optimizer state
    with :func:`optimizer_template_for`."""

    @functools.wraps(load_checkpoint)
    def load_checkpoint_converting(model, optimizer, *args, **kwargs):
        from megatron.core import dist_checkpointing

        load = dist_checkpointing.load

        def load_with_the_saved_options_states(sharded_state_dict, checkpoint_dir, *load_args, **load_kwargs):
            if optimizer is not None and isinstance(sharded_state_dict, dict) and "optimizer" in sharded_state_dict:
                sharded_state_dict["optimizer"] = optimizer_template_for(optimizer, sharded_state_dict["optimizer"], str(checkpoint_dir))
            return load(sharded_state_dict, checkpoint_dir, *load_args, **load_kwargs)

        dist_checkpointing.load = load_with_the_saved_options_states
        try:
            return load_checkpoint(model, optimizer, *args, **kwargs)
        finally:
            dist_checkpointing.load = load

    return load_checkpoint_converting


def _checked_after_building(setup_model_and_optimizer):
    """Megatron-LM's ``setup_model_and_optimizer`` that, once the optimizer is built and before the
    first iteration, prints the option and the optimizer in use (rank 0), or stops with one line
    where ``--lowprec-option`` asked for an option that does not step every parameter
    (:func:`~megatron_lowprec.megatron.option_check.optimizer_in_use`)."""

    @functools.wraps(setup_model_and_optimizer)
    def setup_and_check(*args, **kwargs):
        _BUILT_THROUGH.clear()
        model, optimizer, scheduler = setup_model_and_optimizer(*args, **kwargs)
        if optimizer is not None:
            _print_rank_0(_optimizer_in_use(model, optimizer))
        _shield_helpers_from_the_exit_signal()
        return model, optimizer, scheduler

    return setup_and_check


def _shield_helpers_from_the_exit_signal() -> None:
    """With ``--exit-signal-handler``, the data loader's workers (forked later) and the checkpoint
    writer service keep running when the exit signal reaches every process (SLURM, ``kill -TERM
    -<group>``), so that the save it asks for completes (:mod:`~megatron_lowprec.megatron.exit_signals`)."""
    import signal

    from megatron.training import get_args

    from megatron_lowprec.megatron import exit_signals

    args = get_args()
    if not getattr(args, "exit_signal_handler", False):
        return
    shielded = [int(getattr(args, "exit_signal", signal.SIGTERM))]
    exit_signals.shield_forked_children(shielded)
    if args.save:
        exit_signals.start_writer_service(shielded)


def _optimizer_in_use(model_chunks, optimizer) -> str:
    from megatron.training import get_args

    from megatron_lowprec.megatron import compat, option_check

    args = get_args()
    through = " and ".join(f"the plugin's {name}" for name in dict.fromkeys(_BUILT_THROUGH))
    path = (f"megatron-core {compat.megatron_core_version()}, Megatron-LM's setup_model_and_optimizer with --optimizer "
            f"{args.optimizer} through {through or 'none of ' + ', '.join(OPTIMIZER_BUILDERS)}")
    try:
        return option_check.optimizer_in_use(
            optimizer, model_chunks, args.lowprec_option, asked_by="--lowprec-option", path=path,
            remedy=(f"run megatron-core {compat.SUPPORTED_RANGE} with megatron_lm.install() called before pretrain "
                    "(python -m megatron_lowprec.megatron.megatron_lm SCRIPT calls it), or build the optimizer with "
                    "megatron_lowprec.megatron.optimizer.build_optimizer"),
        )
    except option_check.OptionNotInUse as error:
        _stop(str(error))


def layer_precision_hook(model_chunks) -> list[str]:
    """FP8 layers or ExMy emulation in ``model_chunks`` as Megatron-LM's ``args`` ask; converted names."""
    from megatron.training import get_args

    from megatron_lowprec.megatron.layers import apply_layer_precision

    args = get_args()
    return apply_layer_precision(model_chunks, layer_precision_of(args, lowprec_field), option=args.lowprec_option)


def _original(module_name: str, name: str):
    for owner, attribute, original in _INSTALLED:
        if owner.__name__ == module_name and attribute == name:
            return original
    return getattr(sys.modules[module_name], name)


def _replace(owner: Any, name: str, replacement: Any) -> None:
    _INSTALLED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, replacement)


def install() -> None:
    """Route Megatron-LM's argument parsing, optimizer construction and model building through the
    plugin (see the module docstring); idempotent. Call it before ``pretrain`` runs."""
    from megatron.training import training

    if training.get_megatron_optimizer is get_megatron_optimizer:
        return

    from megatron_lowprec.megatron import compat

    compat.check_supported_version()
    for module, name in compat.megatron_lm_argument_parsers():
        _replace(module, name, _with_precision_arguments(getattr(module, name)))
    _replace(training, "get_megatron_optimizer", get_megatron_optimizer)
    if hasattr(training, "get_megatron_muon_optimizer"):
        _replace(training, "get_megatron_muon_optimizer", get_megatron_muon_optimizer)
    if hasattr(training, "load_checkpoint"):  # a training module that loads no checkpoint has nothing to convert
        _replace(training, "load_checkpoint", _converting_load_checkpoint(training.load_checkpoint))
    _replace(training, "setup_model_and_optimizer",
             _checked_after_building(compat.add_model_hook(training.setup_model_and_optimizer, layer_precision_hook)))
    from megatron.core.datasets import utils as dataset_utils

    _replace(dataset_utils, "compile_helpers", _compile_helpers_unless_built(dataset_utils.compile_helpers))


def _compile_helpers_unless_built(compile_helpers):
    """megatron's ``compile_helpers``, except that nothing is compiled where the helpers are built
    already (an installed megatron-core 0.17+ ships them, and has no Makefile for them), and that
    they are compiled for the running Python (:func:`compile_dataset_helpers`)."""

    @functools.wraps(compile_helpers)
    def compile_unless_built():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_dataset_helpers()

    return compile_unless_built


def compile_dataset_helpers() -> None:
    """Build megatron's C++ dataset helpers (``helpers_cpp``, which ``--data-path`` needs) in its
    ``megatron/core/datasets`` for the running Python. megatron's Makefile takes its include paths and
    file suffix from the ``python3`` and ``python3-config`` found on ``PATH``, which may be another
    Python than the one training (in a Megatron-LM checkout, pyenv follows its ``.python-version``
    to 3.12); a C++ compiler, ``make`` and pybind11 are needed."""
    import subprocess
    import sysconfig

    from megatron.core import datasets

    try:
        import pybind11
    except ImportError:
        raise SystemExit(
            "megatron's dataset helpers need pybind11 to compile: pip install 'megatron-lowprec[megatron-lm]'"
        ) from None
    includes = f"-I{pybind11.get_include()} -I{sysconfig.get_paths()['include']}"
    command = ["make", "-C", os.path.dirname(datasets.__file__), f"CPPFLAGS={includes}",
               f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"]
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"megatron's dataset helpers did not compile: {' '.join(command)} failed")


def activate_cpu_trial() -> bool:
    """Without CUDA, what a CPU trial of Megatron-LM's training loop needs on top of the CPU bridge:
    ``initialize_megatron(allow_no_cuda=True)`` (which only drops its CUDA assert), one "device"
    per local rank (``torch.cuda.device_count``, which ``_initialize_distributed`` requires before it
    sets up model parallelism) whose ``set_device`` changes nothing, no loading of the CUDA fused
    kernels (``megatron.legacy.fused_kernels``, which Megatron-LM until 0.16 builds with nvcc at
    start-up), gloo as ``--distributed-backend`` unless given, ``--no-gradient-accumulation-fusion``, and
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set (Megatron-LM requires it with tensor parallelism on a
    device of compute capability below 10, which the bridge's 0.0 is). Returns whether it is active
    (never with CUDA)."""
    import torch

    from megatron_lowprec.megatron.cpu import activate_cpu_bridge

    if torch.cuda.is_available():
        return False
    activate_cpu_bridge()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.training import training

    _replace(training, "initialize_megatron", functools.partial(training.initialize_megatron, allow_no_cuda=True))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _replace(torch.cuda, "device_count", lambda: local_ranks)
    _replace(torch.cuda, "set_device", lambda device: None)
    if importlib.util.find_spec("megatron.legacy") is not None:
        from megatron.legacy import fused_kernels

        _replace(fused_kernels, "load", lambda args: None)
    for flag, value in (("--distributed-backend", "gloo"), ("--no-gradient-accumulation-fusion", None)):
        if flag not in sys.argv:
            sys.argv.extend([flag] if value is None else [flag, value])
    return True


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_lowprec.megatron.megatron_lm SCRIPT [ARGS...]``: run Megatron-LM's
    ``SCRIPT`` (``pretrain_gpt.py``) as ``__main__`` with :func:`install` in effect."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit(
            "usage: lowprec-megatron-lm PRETRAIN_SCRIPT [MEGATRON-LM ARGUMENTS] --lowprec-option OPTION\n"
            "   or: python -m megatron_lowprec.megatron.megatron_lm PRETRAIN_SCRIPT [...]\n"
            "under torchrun: torchrun [...] --no-python lowprec-megatron-lm pretrain_gpt.py [...]\n"
            "the --lowprec-* flags: docs/reference/megatron_lm_flags.md, or PRETRAIN_SCRIPT --help"
        )
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_lm: no script {script}")
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    keep_inductor_cache()
    activate_cpu_trial()
    install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
