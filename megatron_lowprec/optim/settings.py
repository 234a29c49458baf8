"""The settings of a precision option's optimizer: one dataclass that every way in builds.

``lowprec-train``'s ``precision`` group (these keys of it), Megatron-LM's ``--lowprec-*`` flags,
``LowPrecisionOptimizerConfig``'s ``lowprec_*`` fields (what Megatron-Bridge's config carries) and
``build_optimizer``'s keywords are spellings of :class:`OptimizerPrecision`'s fields. Each builds one,
and :meth:`OptimizerPrecision.check` validates it, so a setting is declared, documented and checked
once; a bad value is named in the spelling its caller used (:class:`SettingError`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Callable, Optional

from megatron_lowprec.optim.strategies import GROUPED_MOMENT_STORAGES, MASTER_STORAGES, PrecisionStrategy, get_strategy


class SettingError(ValueError):
    """A setting that cannot apply: ``field`` names it as the settings' dataclass does, the message
    says why and lists the valid choices."""

    def __init__(
        self,
        field: str,
        reason: str,
        choices: tuple[str, ...] = (),
        *,
        value: object = None,
        along_with: tuple[str, ...] = (),
    ) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason
        self.choices = choices
        self.value = value
        self.along_with = along_with

    def spelled(self, spelling: Callable[[str], str]) -> str:
        """One line naming the setting as the caller spells it: ``precision.master_storage: ...``; for
        a value not among its ``choices``, ``precision.master_storage='half' is not valid; ...``; for a
        ``value`` the reason is about, ``precision.emulate='E9M9': ...``; for settings that conflict
        (``along_with``), ``precision.emulate and precision.fp8_layers ...``."""
        if self.choices:
            return f"{spelling(self.field)}={self.reason}"
        if self.value is not None:
            return f"{spelling(self.field)}={self.value!r}: {self.reason}"
        if self.along_with:
            return " and ".join(spelling(name) for name in (self.field, *self.along_with)) + f" {self.reason}"
        return f"{spelling(self.field)}: {self.reason}"


@dataclasses.dataclass
class OptimizerPrecision:
    """A precision option and how its optimizer keeps and steps its state."""

    option: str = "A"
    """Precision option: a registered strategy's name or alias, in any case."""
    master_storage: Optional[str] = None
    """How an option with an FP32 master (D, coat, D-BF16, res8) stores it: ``fp32`` (whole, 4 bytes),
    ``remainder`` (the BF16 parameter is its upper half, an int16 remainder its lower half: 2 bytes,
    the same masters bit for bit) or ``residual8`` (the BF16 parameter plus an int8 residual: 1 byte,
    masters of 16 significant bits); unset: the option's own (``D-BF16``: remainder, ``res8``:
    residual8)."""
    moment_storage: Optional[str] = None
    """How an option with 8-bit moments (coat, sr8, res8) stores them: ``fp8`` (COAT's FP8 E4M3 groups
    of 128 with range expansion) or ``int8`` (companded INT8 on the same groups with a BF16 scale
    each, FlashOptim's codec: m softsign-companded, v square-rooted); unset: the option's own (fp8)."""
    convert_checkpoint: bool = False
    """Resume from a checkpoint written with another option, or with megatron-core's own optimizer:
    its optimizer state is carried by its meaning into this option's formats (exactly where they
    represent it, else correctly rounded; :mod:`megatron_lowprec.optim.convert`), one line per state
    kind saying its largest error. Off: such a checkpoint stops the run with one line."""
    fused: Optional[bool] = None
    """Fused (compiled) optimizer step; unset: where a compiler is available."""
    background_compile: bool = True
    """Run the fused step uncompiled (the same bits) until a child process has compiled it into
    Inductor's on-disk cache, so that the first steps do not wait for the compiler; the step then
    compiles from that cache (a few seconds). Off: the first step compiles it."""
    shared_randomness: bool = True
    """Stochastic rounding draws the same bits on every replica of a parameter (SR paper Alg. 1);
    off: each rank its own (the paper's ablation, whose replicas drift apart)."""
    track_update_quality: bool = False
    """Compute Collage's EDQ and imprecision % at every step (costs an extra pass over the state)."""
    seed: Optional[int] = None
    """Seed of stochastic rounding's random stream; unset: the run's seed (``trainer.seed``,
    Megatron-LM's ``--seed``; 0 where there is none)."""

    def strategy(self) -> PrecisionStrategy:
        """The option's strategy with :attr:`master_storage` and :attr:`moment_storage` applied;
        :class:`SettingError` where a setting cannot apply."""
        try:
            strategy = get_strategy(self.option)
        except ValueError as error:
            raise SettingError("option", str(error)) from None
        storages = (
            ("master_storage", MASTER_STORAGES, PrecisionStrategy.with_master_storage),
            ("moment_storage", GROUPED_MOMENT_STORAGES, PrecisionStrategy.with_moment_storage),
        )
        for name, choices, apply in storages:
            storage = getattr(self, name)
            if storage is None:
                continue
            if storage not in choices:
                raise SettingError(name, f"{storage!r} is not valid; choose one of: {', '.join(choices)}", choices)
            try:
                strategy = apply(strategy, storage)
            except ValueError as error:
                raise SettingError(name, str(error)) from None
        return strategy

    def check(self) -> None:
        """Every setting valid, or :class:`SettingError` naming the first that is not."""
        self.strategy()


def precision_fields() -> tuple[dataclasses.Field, ...]:
    """:class:`OptimizerPrecision`'s fields, in declaration order."""
    return dataclasses.fields(OptimizerPrecision)


def lowprec_field(name: str) -> str:
    """How megatron's configs and Megatron-LM's arguments spell a field: ``lowprec_option``
    (``LowPrecisionOptimizerConfig.lowprec_option``, ``args.lowprec_option`` of ``--lowprec-option``)."""
    return f"lowprec_{name}"


def precision_of(source: object, spelling: Callable[[str], str] = lambda name: name) -> OptimizerPrecision:
    """The :class:`OptimizerPrecision` whose fields ``source`` holds as attributes named
    ``spelling(field)`` (``lowprec_option`` on Megatron-LM's arguments and megatron's config)."""
    return OptimizerPrecision(**{field.name: getattr(source, spelling(field.name)) for field in precision_fields()})


def spelled_fields(precision: OptimizerPrecision, spelling: Callable[[str], str]) -> dict[str, object]:
    """``precision``'s fields by ``spelling(field)``: the keywords of ``LowPrecisionOptimizerConfig``
    with :func:`lowprec_field`; the inverse of :func:`precision_of`."""
    return {spelling(field.name): getattr(precision, field.name) for field in precision_fields()}


def field_docs(schema: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it derives from, read
    from their source, on one line (dataclass field docstrings are no runtime attributes)."""
    docs: dict[str, str] = {}
    for cls in reversed([base for base in inspect.getmro(schema) if dataclasses.is_dataclass(base)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


ROLE = re.compile(r":(?:func|meth|attr|class|data|mod|obj):`(~?)([^`]+)`")
"""A reStructuredText cross-reference role: ``:func:`~a.b``` (``~``: show only the last name)."""


def plain_text(text: str) -> str:
    """A docstring's reStructuredText as plain text for a terminal or ``--help``."""
    return ROLE.sub(lambda match: match[2].split(".")[-1] if match[1] else match[2], text).replace("``", "")
