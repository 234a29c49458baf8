"""The settings of the layers' precision: one dataclass that every way in builds.

``lowprec-train``'s ``precision`` group (these keys of it), Megatron-LM's ``--lowprec-*`` layer flags
and :func:`~megatron_lowprec.megatron.layers.apply_layer_precision` (a model converter, which
Megatron-Bridge runs as a pre-wrap hook) are spellings of :class:`LayerPrecision`'s fields. Each
builds one, and :meth:`LayerPrecision.check` validates it, so a setting is declared, documented and
checked once; a bad value is named in the spelling its caller used
(:class:`~megatron_lowprec.optim.settings.SettingError`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megatron_lowprec.layers.emulation import ROUNDING_MODES, EmulationConfig
from megatron_lowprec.numerics.formats import float_format
from megatron_lowprec.optim.settings import SettingError
from megatron_lowprec.optim.strategies import get_strategy


@dataclasses.dataclass
class LayerPrecision:
    """Which precision flow the model's layers run: COAT's FP8 layers or an ExMy emulation, and where."""

    fp8_layers: Optional[bool] = None
    """COAT's FP8 layer flow (§5.2): E4M3 linears with E5M2 output gradients, norms and activations
    that save their input in FP8 with 1x16 groups; unset: the option's own (on with ``coat``; off
    with megatron's own optimizer)."""
    emulate: Optional[str] = None
    """Emulate an ExMy format (e.g. ``E8M5``) on the inputs, weights, outputs and gradients of the
    linear layers' matmuls, accumulating in FP32 ("To FP8 and Back Again" §3.2)."""
    emulate_rounding: str = "nearest"
    """Rounding of the emulation: ``nearest`` or ``stochastic``."""
    emulate_clamp_outer_range: bool = True
    """Emulation saturates magnitudes above the format's largest value (the paper's outer range)."""
    emulate_clamp_inner_range: bool = True
    """Emulation flushes magnitudes below the format's subnormals (the paper's inner range)."""
    layers_exclude: list[str] = dataclasses.field(default_factory=lambda: ["output_layer"])
    """Modules (dotted name parts, e.g. ``output_layer``, ``decoder.layers.0``) that the FP8 flow and
    the emulation leave in BF16; the LM head by default. None (``[]``): every linear is converted."""

    def uses_fp8_layers(self, option: Optional[str]) -> bool:
        """Whether the layers run COAT's FP8 flow: :attr:`fp8_layers` if set, else the precision
        ``option``'s own (:attr:`~megatron_lowprec.optim.strategies.PrecisionStrategy.fp8_layers`;
        off without an option, with megatron's own optimizer)."""
        if self.fp8_layers is not None:
            return self.fp8_layers
        return option is not None and get_strategy(option).fp8_layers

    def emulation(self) -> Optional[EmulationConfig]:
        """The emulation these settings ask for, or ``None`` without :attr:`emulate`."""
        if self.emulate is None:
            return None
        return EmulationConfig.parse({
            "format": self.emulate,
            "rounding": self.emulate_rounding,
            "clamp_outer_range": self.emulate_clamp_outer_range,
            "clamp_inner_range": self.emulate_clamp_inner_range,
        })

    def check(self, option: Optional[str] = None) -> None:
        """Every setting valid with the precision ``option`` (which decides an unset
        :attr:`fp8_layers`), or :class:`~megatron_lowprec.optim.settings.SettingError` naming the first
        that is not."""
        if self.emulate_rounding not in ROUNDING_MODES:
            raise SettingError(
                "emulate_rounding",
                f"{self.emulate_rounding!r} is not valid; choose one of: {', '.join(ROUNDING_MODES)}",
                ROUNDING_MODES,
            )
        if self.emulate is None:
            return
        try:
            float_format(self.emulate)
        except ValueError as error:
            raise SettingError("emulate", str(error), value=self.emulate) from None
        if self.uses_fp8_layers(option):
            raise SettingError("emulate", "replace the same matmuls; choose one", along_with=("fp8_layers",))


def layer_fields() -> tuple[dataclasses.Field, ...]:
    """:class:`LayerPrecision`'s fields, in declaration order."""
    return dataclasses.fields(LayerPrecision)


def layer_precision_of(source: object, spelling: Callable[[str], str] = lambda name: name) -> LayerPrecision:
    """The :class:`LayerPrecision` whose fields ``source`` holds as attributes named
    ``spelling(field)`` (``lowprec_emulate`` on Megatron-LM's arguments; the fields themselves on
    ``lowprec-train``'s ``precision`` config, which derives from :class:`LayerPrecision`)."""
    return LayerPrecision(**{field.name: getattr(source, spelling(field.name)) for field in layer_fields()})
