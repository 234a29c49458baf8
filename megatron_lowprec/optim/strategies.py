"""Precision strategies: declarative descriptions of where AdamW keeps each tensor and how it rounds.

A strategy is data. The eager reference step (``adamw.py``) reads these fields and nothing else,
so adding a strategy is one :func:`register_strategy` call plus a row in the test matrix.

Names follow Collage (Table 2): ``A`` pure BF16, ``B`` Collage-light, ``C`` Collage-plus,
``D`` BF16 + FP32 master weights and states, ``D-MW`` BF16 + FP32 states; plus Kahan summation
(Collage App. C), stochastic rounding (SR paper, Alg. 1), COAT FP8 optimizer states (COAT §4) and
``D-BF16``, an FP32 master with BF16 moments (DeepSeek-V3 report, "Low-Precision Optimizer States").
The lean options put these together: ``sr8``, stochastically rounded BF16 parameters with COAT's
FP8 moments (in COAT's groups of 128), and ``res8``, the same moments with FlashOptim's 8-bit master
residual below the BF16 parameter (arXiv 2602.23349).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The byte sizes and NON_NEGATIVE_MOMENTS live with the codecs; importers of this module read them here too.
from megatron_lowprec.optim.codecs import (  # noqa: F401
    EXPANSION_EXPONENT_BYTES,
    FP8_BYTES,
    FP8_SCALE_BYTES,
    FP32_BYTES,
    INT8_SCALE_BYTES,
    LOW_PRECISION_BYTES,
    NON_NEGATIVE_MOMENTS,
    MomentCodec,
    ParamCodec,
    moment_codec,
    param_codec,
)

MOMENT_STORAGES = ("low", "fp32", "fp8", "int8")
GROUPED_MOMENT_STORAGES = ("fp8", "int8")
"""The 8-bit moment storages: per element one byte, per group of ``fp8_group_size`` a scale (and for FP8 an exponent)."""
PARAM_UPDATES = ("nearest", "mcf", "kahan", "stochastic")
WEIGHT_DECAY_PLACEMENTS = ("in_update", "multiplicative")
ADAM_KERNELS = ("reference", "torch_fused")
MASTER_STORAGES = ("fp32", "remainder", "residual8")
FP8_EXPONENT_STORAGES = ("fp32", "bf16")
ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field_name}={value!r} is not valid; choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class PrecisionStrategy:
    """Which tensor of AdamW lives in which format, and how the update is rounded."""

    name: str
    """Canonical name, e.g. ``"C"``; looked up case-insensitively."""

    summary: str
    """One line for tables and error messages."""

    aliases: tuple[str, ...] = ()
    """Other accepted names, e.g. ``("collage_plus",)``."""

    moments: str = "low"
    """Storage of m and v: ``"low"`` (the parameter's own 16-bit dtype), ``"fp32"``, ``"fp8"``
    (per-group FP8 with dynamic range expansion, COAT §4), or ``"int8"`` (companded INT8 on the same
    groups with a BF16 scale each, FlashOptim's spec per state: m signed and softsign-companded, v
    square-rooted and unsigned; :func:`~megatron_lowprec.numerics.quant.quantize_int8_into`)."""

    master_weights: bool = False
    """Keep an FP32 master copy that AdamW updates; the 16-bit parameter is its nearest rounding
    (Collage option D, COAT)."""

    master_storage: str = "fp32"
    """How the FP32 master (``master_weights``) is stored: ``"fp32"``, a whole FP32 tensor beside the
    16-bit parameter (4 bytes), or ``"remainder"``: the BF16 parameter is the master's upper half and
    an int16 remainder its lower half (2 bytes; :func:`~megatron_lowprec.numerics.formats.split_bf16_remainder`).
    The masters are the same bits either way; the BF16 parameter then rounds the master to nearest
    with ties away from zero, where the whole form rounds ties to even (one master pattern in
    131,072 differs); or ``"residual8"``: the BF16 parameter plus an int8 residual, its rounding error
    in 1/128 units of half a BF16 ULP (1 byte; FlashOptim, arXiv 2602.23349;
    :func:`~megatron_lowprec.numerics.formats.split_bf16_residual8`): a master of 16 significant bits,
    to which every stored value is rounded to nearest. Both need BF16 parameters."""

    param_update: str = "nearest"
    """How the FP32 update Δθ reaches the stored parameter: ``"nearest"`` (θ + Δθ rounded to nearest),
    ``"mcf"`` (Grow into the expansion (θ, δθ), Collage Alg. 1), ``"kahan"`` (Kahan-compensated sum,
    Collage App. C), ``"stochastic"`` (θ + Δθ stochastically rounded, SR paper Alg. 1)."""

    second_moment_mcf: bool = False
    """Keep v as an expansion (v, δv) and beta2 as an expansion, updated with Mul and Grow
    (Collage Alg. 2, line 9)."""

    weight_decay: str = "in_update"
    """``"in_update"``: Δθ = -lr (m̂ / (√v̂ + ε) + λθ) (Collage App. D; required when θ is 16-bit,
    since θ(1 - lr·λ) is a lost operation in BF16). ``"multiplicative"``: θ ← θ(1 - lr·λ) then the
    Adam step, operation for operation as ``torch.optim.AdamW`` (exact enough in an FP32 master)."""

    adam_kernel: str = "reference"
    """Which kernel computes the Adam update. ``"reference"``: this package's specification
    (``kernel.adamw_kernel_``: every operation one correctly rounded FP32 operation; compiled once per
    bucket on the fused path). ``"torch_fused"``: torch's own fused AdamW kernel
    (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs) updates the FP32 master and
    moments, bit-identically to torch on the same device (option D); it needs ``master_weights``,
    ``moments="fp32"`` and ``weight_decay="multiplicative"``."""

    fp8_layers: bool = False
    """The option comes with COAT's FP8 layer flow (COAT §5.2: FP8 linears, norms and activations)
    unless the user turns it off: the one place that decides it for ``lowprec-train``'s
    ``precision.fp8_layers`` and Megatron-LM's ``--lowprec-fp8-layers``. The optimizer never reads it."""

    fp8_format: str = "e4m3"
    """FP8 format of both moments when ``moments == "fp8"``."""

    fp8_group_size: int = 128
    """Elements per quantization group of 8-bit moments, FP8 or INT8 (1 x G along the flattened state, COAT §4)."""

    fp8_expand: bool = True
    """Apply COAT's dynamic range expansion before FP8 quantization (COAT §4.2)."""

    fp8_exponent_storage: str = "fp32"
    """How each FP8 group stores its expansion exponent k (COAT §4.2, ``fp8_expand``): ``"fp32"``, or
    ``"bf16"``, 2 bytes instead of 4 per group. A BF16 k is the FP32 k rounded toward zero (its low 16
    bits cleared), and the expansion uses that k, so dequantizing with the stored k inverts what was
    quantized. Rounded toward zero, k stretches the group slightly less than COAT's k would: a
    group's smallest element lands at or above the format's smallest subnormal and never underflows
    (:func:`~megatron_lowprec.numerics.quant.quantize_fp8_into`)."""

    moment_names: tuple[str, ...] = ADAMW_MOMENTS
    """The optimizer's moments, each stored as ``moments`` says: AdamW's m and v (the registered
    strategies), or Muon's one momentum (:func:`~megatron_lowprec.optim.muon.muon_strategy`)."""

    def __post_init__(self) -> None:
        _check_choice("moments", self.moments, MOMENT_STORAGES)
        _check_choice("param_update", self.param_update, PARAM_UPDATES)
        _check_choice("weight_decay", self.weight_decay, WEIGHT_DECAY_PLACEMENTS)
        _check_choice("adam_kernel", self.adam_kernel, ADAM_KERNELS)
        _check_choice("master_storage", self.master_storage, MASTER_STORAGES)
        _check_choice("fp8_exponent_storage", self.fp8_exponent_storage, FP8_EXPONENT_STORAGES)
        if self.master_storage != "fp32" and not self.master_weights:
            raise ValueError(
                f"strategy {self.name!r}: master_storage={self.master_storage!r} stores an FP32 master, "
                "which needs master_weights=True"
            )
        if self.master_weights and self.param_update != "nearest":
            raise ValueError(
                f"strategy {self.name!r}: master weights are rounded to the parameter by nearest; "
                f"param_update={self.param_update!r} needs master_weights=False"
            )
        if self.second_moment_mcf and self.moments != "low":
            raise ValueError(f"strategy {self.name!r}: second_moment_mcf needs moments='low', got {self.moments!r}")
        if self.weight_decay == "multiplicative" and not self.master_weights:
            raise ValueError(
                f"strategy {self.name!r}: multiplicative weight decay is a lost operation on 16-bit "
                "parameters (Collage App. D); use weight_decay='in_update'"
            )
        torch_layout = (self.master_weights, self.moments, self.weight_decay)
        if self.adam_kernel == "torch_fused" and torch_layout != (True, "fp32", "multiplicative"):
            raise ValueError(
                f"strategy {self.name!r}: adam_kernel='torch_fused' updates an FP32 master and FP32 moments "
                "with multiplicative weight decay (master_weights=True, moments='fp32', "
                f"weight_decay='multiplicative'); got master_weights={self.master_weights}, "
                f"moments={self.moments!r}, weight_decay={self.weight_decay!r}"
            )
        if self.fp8_group_size < 1:
            raise ValueError(f"fp8_group_size must be >= 1, got {self.fp8_group_size}")
        codec = moment_codec(self.moments, self.fp8_format, self.fp8_group_size, self.fp8_expand, self.fp8_exponent_storage)
        object.__setattr__(self, "_moment_codec", codec)
        object.__setattr__(self, "_param_codec", param_codec(self.param_update, self.master_weights, self.master_storage))

    @property
    def moment_codec(self) -> MomentCodec:
        """The storage format of every moment (:mod:`~megatron_lowprec.optim.codecs`), from
        ``moments`` and the 8-bit formats' fields (derived, not a field: the strategy stays the registry's data)."""
        return self._moment_codec

    @property
    def param_codec(self) -> ParamCodec:
        """What the optimizer keeps of θ besides the 16-bit parameter and how an update reaches it
        (:mod:`~megatron_lowprec.optim.codecs`): the master's codec (``master_storage``) with
        ``master_weights``, else ``param_update``'s."""
        return self._param_codec

    @property
    def grouped_moments(self) -> bool:
        """The moments are stored in 8 bits per element with per-group metadata (FP8 or INT8), in
        groups of ``fp8_group_size`` tied to the same offsets of the buffers."""
        return self.moment_codec.grouped

    def with_moment_storage(self, moment_storage: str) -> PrecisionStrategy:
        """The same strategy with its 8-bit moments stored as ``moment_storage`` (``"fp8"`` or
        ``"int8"``, :data:`GROUPED_MOMENT_STORAGES`); the name stays, and a state dict records the
        storage (:func:`exponent_storage_record`). ``ValueError`` for a strategy whose moments are
        not 8-bit, naming those that are, or for another storage."""
        if not self.grouped_moments:
            eight_bit = ", ".join(s.name for s in _CANONICAL if s.grouped_moments)
            raise ValueError(
                f"option {self.name!r} keeps {self.moments} moments, so moment_storage={moment_storage!r} cannot apply; "
                f"options with 8-bit moments: {eight_bit}"
            )
        _check_choice("moment_storage", moment_storage, GROUPED_MOMENT_STORAGES)
        return replace(self, moments=moment_storage)

    @property
    def keeps_param_low_component(self) -> bool:
        """The parameter is an MCF expansion (θ, δθ)."""
        return self.param_update == "mcf"

    def without_master_weights(self) -> PrecisionStrategy:
        """The same strategy with the 16-bit parameter as the only copy (e.g. COAT with a BF16 master);
        the Adam update is then the reference kernel's, as torch's fused kernel needs an FP32 master."""
        if not self.master_weights:
            return self
        return replace(
            self, name=f"{self.name}-no-master", aliases=(), master_weights=False, master_storage="fp32",
            weight_decay="in_update", adam_kernel="reference",
        )

    def with_master_storage(self, master_storage: str) -> PrecisionStrategy:
        """The same strategy with its FP32 master stored as ``master_storage`` (see the field); the
        name stays, so that checkpoints of either storage load into the other. ``ValueError`` for a
        strategy without a master, naming those that have one."""
        if not self.master_weights:
            with_master = ", ".join(s.name for s in _CANONICAL if s.master_weights)
            raise ValueError(
                f"option {self.name!r} keeps no FP32 master, so master_storage={master_storage!r} cannot apply; "
                f"options with one: {with_master}"
            )
        _check_choice("master_storage", master_storage, MASTER_STORAGES)
        return replace(self, master_storage=master_storage)

    @property
    def master_bytes(self) -> int:
        """Bytes per element of the stored master: 4 (FP32), 2 (remainder below the BF16 parameter), 1
        (residual below the BF16 parameter) or 0."""
        return self.param_codec.state_bytes if self.master_weights else 0

    def moment_bytes(self, numel: int) -> float:
        """Bytes of one moment (e.g. m or v) of a tensor with ``numel`` elements, FP8 metadata included."""
        return self.moment_codec.bytes(numel)

    @property
    def fp8_group_metadata_bytes(self) -> int:
        """Bytes each 8-bit group stores besides its payload: an INT8 group its BF16 scale (2); an FP8
        group its FP32 scale, and under range expansion its exponent k as ``fp8_exponent_storage``
        says (8 with an FP32 k, 6 with a BF16 one)."""
        return self.moment_codec.group_metadata_bytes

    def state_bytes(self, numel: int) -> float:
        """Bytes of optimizer state for a tensor with ``numel`` elements (no parameter, no gradient)."""
        return (
            len(self.moment_names) * self.moment_bytes(numel)
            + self.param_codec.state_bytes * numel
            + LOW_PRECISION_BYTES * numel * self.second_moment_mcf
        )

    @property
    def default_grad_reduce_in_fp32(self) -> bool:
        """Whether megatron-core's DDP keeps this option's gradients in FP32 unless told otherwise: the
        one place that decides it for ``lowprec-train``'s ``precision.grad_reduce_in_fp32`` and the
        figures it reports. FP32 for options with an FP32 master, whose update then reads the gradient
        as megatron-core's own mixed-precision optimizer does; the parameter's 16-bit format for the
        others, and for a master stored as an 8-bit residual (16 significant bits, not FP32's),
        whose 7 bytes per parameter with a BF16 gradient are the point of it.
        (Megatron-LM's ``--bf16`` reduces in FP32 for every option unless
        ``--grad-reduce-in-bf16``.)"""
        return self.master_weights and self.master_storage != "residual8"

    def grad_bytes(self, grad_reduce_in_fp32: bool | None = None) -> int:
        """Bytes per element of the gradient buffer: 4 where gradients are reduced in FP32, else 2 (the
        16-bit parameter's format); ``None``: :attr:`default_grad_reduce_in_fp32`."""
        if grad_reduce_in_fp32 is None:
            grad_reduce_in_fp32 = self.default_grad_reduce_in_fp32
        return FP32_BYTES if grad_reduce_in_fp32 else LOW_PRECISION_BYTES

    def bytes_per_param(
        self, numel: int | None = None, grad_reduce_in_fp32: bool | None = None, state_shards: int = 1
    ) -> float:
        """Bytes per parameter as megatron-core allocates them: the 16-bit parameter, the gradient
        buffer (:meth:`grad_bytes`; ``None``: the option's default) and the optimizer state divided
        over ``state_shards`` data-parallel ranks (megatron's distributed optimizer shards moments and
        masters; parameter and gradient buffers stay whole on every rank).

        ``grad_reduce_in_fp32=False`` counts a 16-bit gradient: Collage Table 2's figure, and plain
        PyTorch's, where a parameter's gradient has its dtype. With ``numel`` given, the FP8 group
        metadata of a tensor of that size is counted exactly; without it, groups are taken as full.
        """
        if state_shards < 1:
            raise ValueError(f"state_shards={state_shards} must be a positive number of data-parallel ranks")
        count = self.fp8_group_size if numel is None else numel
        whole = LOW_PRECISION_BYTES + self.grad_bytes(grad_reduce_in_fp32)
        return whole + self.state_bytes(count) / count / state_shards


EXPONENT_STORAGE_RECORD = "fp8_exponent_storage"
"""The key under which a state dict's ``lowprec`` section records an ``fp8_exponent_storage`` other
than ``"fp32"``. Absent, the storage is ``"fp32"``: coat's state dicts hold no such key, and a
state dict without it holds FP32 exponents."""
MOMENT_STORAGE_RECORD = "moment_storage"
"""The key under which a state dict's ``lowprec`` section records moments stored as companded INT8
(:meth:`PrecisionStrategy.with_moment_storage`). Absent, they are stored as the option registers them."""
STORAGE_RECORDS = (EXPONENT_STORAGE_RECORD, MOMENT_STORAGE_RECORD)
"""Every key of :func:`exponent_storage_record`: a converted state drops the source's before recording its own."""


def exponent_storage_record(strategy: PrecisionStrategy) -> dict[str, str]:
    """What a state dict of ``strategy`` records of its 8-bit moments' storage: INT8 moments
    (:data:`MOMENT_STORAGE_RECORD`), or an FP8 exponent storage other than FP32 (:data:`EXPONENT_STORAGE_RECORD`)."""
    if strategy.moments == "int8":
        return {MOMENT_STORAGE_RECORD: strategy.moments}
    if strategy.moments != "fp8" or strategy.fp8_exponent_storage == "fp32":
        return {}
    return {EXPONENT_STORAGE_RECORD: strategy.fp8_exponent_storage}


def saved_exponent_storage(extra: dict) -> str:
    """The FP8 exponent storage a state dict's ``lowprec`` section ``extra`` records (``"fp32"`` if none)."""
    return extra.get(EXPONENT_STORAGE_RECORD, "fp32")


def saved_int8_moments(extra: dict) -> bool:
    """Whether a state dict's ``lowprec`` section ``extra`` records companded INT8 moments."""
    return extra.get(MOMENT_STORAGE_RECORD) == "int8"


def stores_other_exponents(extra: dict, strategy: PrecisionStrategy) -> bool:
    """Whether a state dict whose ``lowprec`` section is ``extra`` holds its 8-bit moments in another
    form than ``strategy`` stores them: INT8 against FP8, or FP8 expansion exponents in another
    format (a res8 state saved while they were FP32)."""
    if strategy.grouped_moments and saved_int8_moments(extra) != (strategy.moments == "int8"):
        return True
    return strategy.moments == "fp8" and saved_exponent_storage(extra) != strategy.fp8_exponent_storage


def storage_difference(extra: dict, strategy: PrecisionStrategy) -> tuple[str, str, str]:
    """(what differs, as saved, as ``strategy`` stores it) for a state dict whose ``lowprec`` section
    ``extra`` :func:`stores_other_exponents`: ``("moments", "int8", "fp8")`` or the reverse, or
    ``("FP8 expansion exponents", saved, own)``."""
    saved_int8 = saved_int8_moments(extra)
    if strategy.grouped_moments and saved_int8 != (strategy.moments == "int8"):
        return ("moments", "int8", "fp8") if saved_int8 else ("moments", "fp8", "int8")
    return "FP8 expansion exponents", saved_exponent_storage(extra), strategy.fp8_exponent_storage


def check_exponent_storage(extra: dict, strategy: PrecisionStrategy, remedy: str) -> None:
    """``ValueError`` in one line, ending with ``remedy``, where a state dict whose ``lowprec`` section
    is ``extra`` stores its 8-bit moments in another form than ``strategy`` does (INT8 against FP8, or
    a res8 state saved while its exponents were FP32): loading it as it is would decode each payload
    with another codec, or pair it with another k, than it was quantized with."""
    if stores_other_exponents(extra, strategy):
        what, saved, own = storage_difference(extra, strategy)
        raise ValueError(
            f"the optimizer state of option {strategy.name!r} was saved with its {what} in {saved}, "
            f"this optimizer stores them in {own}; {remedy}"
        )


_REGISTRY: dict[str, PrecisionStrategy] = {}
_CANONICAL: list[PrecisionStrategy] = []


def register_strategy(strategy: PrecisionStrategy) -> PrecisionStrategy:
    """Register ``strategy`` under its name and aliases (case-insensitive)."""
    keys = [key.lower() for key in (strategy.name, *strategy.aliases)]
    taken = [key for key in keys if key in _REGISTRY]
    if taken:
        raise ValueError(f"strategy names already registered: {', '.join(taken)}")
    for key in keys:
        _REGISTRY[key] = strategy
    _CANONICAL.append(strategy)
    return strategy


def available_strategies() -> list[PrecisionStrategy]:
    """All registered strategies in registration order."""
    return list(_CANONICAL)


def strategy_names() -> list[str]:
    """Every accepted name, canonical names first within each strategy."""
    return [name for s in _CANONICAL for name in (s.name, *s.aliases)]


def get_strategy(name: str | PrecisionStrategy) -> PrecisionStrategy:
    """Look a strategy up by name or alias, case-insensitively; unknown names raise ``ValueError``."""
    if isinstance(name, PrecisionStrategy):
        return name
    strategy = _REGISTRY.get(str(name).lower())
    if strategy is None:
        raise ValueError(f"unknown precision option {name!r}; valid options: {', '.join(strategy_names())}")
    return strategy


def resolve_option(
    option: str | PrecisionStrategy,
    master_weights: bool | None = None,
    master_storage: str | None = None,
    moment_storage: str | None = None,
) -> PrecisionStrategy:
    """The strategy an optimizer runs for ``option``: ``master_weights=False`` drops the FP32 master
    of a strategy that has one, ``master_storage`` stores it as ``"fp32"``, ``"remainder"`` or ``"residual8"``,
    ``moment_storage`` stores 8-bit moments as ``"fp8"`` or ``"int8"`` (``None`` keeps each as the
    strategy has it). ``ValueError`` where they cannot apply."""
    strategy = get_strategy(option)
    if master_weights is False:
        if master_storage is not None:
            raise ValueError(f"master_weights=False drops the master, so master_storage={master_storage!r} cannot apply")
        strategy = strategy.without_master_weights()
    elif master_weights and not strategy.master_weights:
        with_master = ", ".join(repr(s.name) for s in _CANONICAL if s.master_weights)
        raise ValueError(f"option {strategy.name!r} has no FP32 master weights to keep; options with one: {with_master}")
    if master_storage is not None:
        strategy = strategy.with_master_storage(master_storage)
    if moment_storage is not None:
        strategy = strategy.with_moment_storage(moment_storage)
    return strategy


register_strategy(PrecisionStrategy("A", "pure BF16 AdamW", aliases=("bf16",)))
register_strategy(
    PrecisionStrategy("B", "Collage-light: MCF parameters (θ, δθ)", aliases=("collage_light",), param_update="mcf")
)
register_strategy(
    PrecisionStrategy(
        "C",
        "Collage-plus: MCF parameters and MCF second moment, beta2 as an expansion",
        aliases=("collage_plus",),
        param_update="mcf",
        second_moment_mcf=True,
    )
)
register_strategy(
    PrecisionStrategy(
        "D",
        "BF16 model + FP32 master weights + FP32 states",
        aliases=("fp32_master",),
        moments="fp32",
        master_weights=True,
        weight_decay="multiplicative",
        adam_kernel="torch_fused",
    )
)
register_strategy(PrecisionStrategy("D-MW", "BF16 parameters + FP32 states", aliases=("fp32_states",), moments="fp32"))
register_strategy(PrecisionStrategy("kahan", "BF16 AdamW with Kahan-compensated updates", param_update="kahan"))
register_strategy(
    PrecisionStrategy("sr", "BF16 AdamW with stochastically rounded updates", aliases=("bf16_sr",), param_update="stochastic")
)
register_strategy(
    PrecisionStrategy(
        "coat",
        "COAT: FP8 E4M3 moments, per-group 1x128 with dynamic range expansion, FP32 master weights",
        aliases=("fp8_states",),
        moments="fp8",
        master_weights=True,
        weight_decay="multiplicative",
        fp8_layers=True,
    )
)
register_strategy(
    PrecisionStrategy(
        "D-BF16",
        "BF16 model + FP32 master weights (BF16 parameter + 16-bit remainder) + BF16 states (DeepSeek-V3)",
        aliases=("fp32_master_bf16_states",),
        master_weights=True,
        master_storage="remainder",
        weight_decay="multiplicative",
    )
)
register_strategy(
    PrecisionStrategy(
        "sr8",
        "BF16 AdamW with stochastically rounded updates + FP8 E4M3 moments, per-group 1x128 with a BF16 k",
        aliases=("bf16_sr_fp8_states",),
        moments="fp8",
        param_update="stochastic",
        fp8_exponent_storage="bf16",
    )
)
register_strategy(
    PrecisionStrategy(
        "res8",
        "BF16 model + master as an 8-bit residual below it (FlashOptim) + FP8 E4M3 moments, per-group 1x128 with a BF16 k",
        aliases=("bf16_residual8_fp8_states",),
        moments="fp8",
        master_weights=True,
        master_storage="residual8",
        weight_decay="multiplicative",
        fp8_exponent_storage="bf16",
    )
)
