"""Storage formats of the optimizer's states: codecs between what a state stores and its FP32 value.

A :class:`~megatron_lowprec.optim.strategies.PrecisionStrategy` is a choice of codecs: one
:class:`MomentCodec` for every moment (m and v of AdamW, Muon's momentum) and one
:class:`ParamCodec` for the parameter's full-precision value. The update rule
(:mod:`~megatron_lowprec.optim.kernel`) is plain FP32 arithmetic between a decode and an encode, as
FlashOptim's per-state specs (arXiv 2602.23349) and torchao's quantized optimizer states keep it.

A moment codec names the flat state tensors it keeps (key suffixes after the moment's name, in a
fixed order: checkpoints hold them under these keys), their dtype and how many elements of the
parameter each stored value covers (1, or a group of ``group_size`` consecutive elements of the
bucket: groups are tied to absolute offsets of the buffer, so a shard of it decodes alone). It
decodes them to FP32 and encodes FP32 values into them in place, through
:mod:`~megatron_lowprec.numerics.quant` for the 8-bit formats:

* :class:`ParamDtypeMoment`: the parameter's own 16-bit dtype, rounded to nearest (Collage's
  options A, B, C, and D-BF16);
* :class:`FP32Moment`: FP32 (options D, D-MW);
* :class:`FP8GroupMoment`: FP8 payloads with a scale per group and, under COAT's dynamic range
  expansion, an exponent k per group in FP32 or BF16 (COAT §4);
* :class:`Int8GroupMoment`: companded INT8 with a BF16 scale per group (FlashOptim).

A parameter codec says what the optimizer holds of θ besides the 16-bit parameter, and how an FP32
update Δθ reaches it:

* :class:`BareParameter`: nothing; θ + Δθ rounded to nearest;
* :class:`StochasticParameter`: nothing; θ + Δθ stochastically rounded (SR paper, Alg. 1), with the
  random words of the caller's source;
* :class:`MCFPair`: the expansion (θ, δθ), updated with Grow (Collage Alg. 1 and 2, line 13);
* :class:`KahanCompensation`: a compensation c, updated with Fast2Sum (Collage App. C);
* master forms (:class:`MasterCodec`): an FP32 master whole (:class:`WholeMaster`), or below the
  BF16 parameter as an int16 remainder (:class:`RemainderMaster`) or an int8 residual
  (:class:`Residual8Master`), of which the 16-bit parameter is a rounding.

Codecs are frozen dataclasses of Python constants: a compiled step sees them as constants, like the
strategy they come from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatron_lowprec.numerics.formats import (
    float_format,
    join_bf16_remainder,
    join_bf16_residual8,
    round_to_16bit_on_device,
    split_bf16_remainder,
    split_bf16_residual8,
)
from megatron_lowprec.numerics.mcf import fast2sum, grow
from megatron_lowprec.numerics.quant import (
    QuantizedTensor,
    dequantize_fp8,
    dequantize_int8,
    fp8_dtype_of,
    int8_zeros,
    quantize_fp8_into,
    quantize_int8_into,
    quantized_zeros,
)
from megatron_lowprec.numerics.rounding import stochastic_round

LOW_PRECISION_BYTES = 2
"""Bytes of a value in the 16-bit parameter's dtype."""
FP32_BYTES = 4
FP8_BYTES = 1
FP8_SCALE_BYTES = 4
"""Per FP8 group: its FP32 scale (COAT §3)."""
INT8_SCALE_BYTES = 2
"""Per companded INT8 group: its BF16 scale (:mod:`~megatron_lowprec.numerics.quant`)."""
EXPANSION_EXPONENT_BYTES = {"fp32": 4, "bf16": 2}
"""Per FP8 group under range expansion: its exponent k (COAT §4.2), by exponent storage."""
NON_NEGATIVE_MOMENTS = ("exp_avg_sq",)
"""Moments that are never negative: an INT8 codec stores their square root, unsigned (FlashOptim)."""
PER_GROUP_PARTS = ("_scale", "_expansion_exponent")
"""Suffixes of the grouped codecs' state parts that hold one value per group, not per element."""


def dtype_word(dtype: torch.dtype) -> str:
    """The name of a float dtype in words: BF16, FP16, FP32."""
    return {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}.get(dtype, str(dtype))


def rounded_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``values`` rounded to nearest-even in the 16-bit ``dtype`` (in a form that no compiler
    drops: :func:`~megatron_lowprec.numerics.formats.round_to_16bit_on_device`), as a ``dtype``
    tensor (an exact conversion, which no compiler pass can make inexact)."""
    return round_to_16bit_on_device(values, dtype).to(dtype)


@dataclass(frozen=True)
class MomentCodec:
    """The storage of one moment: its state parts, their bytes, and decode/encode to and from FP32."""

    suffixes: ClassVar[tuple[str, ...]] = ("",)
    """The key of each stored part: the moment's name followed by the suffix."""

    @property
    def group_size(self) -> int:
        """Elements of the parameter per stored value of a per-group part (1: none is per group)."""
        return 1

    grouped: ClassVar[bool] = False
    """Whether the codec keeps per-group parts, whose groups a bucket must not let straddle entries."""

    def keys(self, moment: str) -> tuple[str, ...]:
        """The state keys of ``moment``, in storage order."""
        return tuple(moment + suffix for suffix in self.suffixes)

    def elements_per_value(self, key: str) -> int:
        """Elements of the parameter per stored value of state ``key``."""
        return self.group_size if key.endswith(PER_GROUP_PARTS) else 1

    @property
    def group_metadata_bytes(self) -> int:
        """Bytes each group stores besides its payload (0 for a codec without groups)."""
        return 0

    @property
    def payload_bytes(self) -> int:
        """Bytes per element of the per-element part."""
        raise NotImplementedError

    def bytes(self, numel: int) -> float:
        """Bytes of one moment of a tensor with ``numel`` elements, group metadata included."""
        groups = math.ceil(numel / self.group_size) if self.group_metadata_bytes else 0
        return self.payload_bytes * numel + self.group_metadata_bytes * groups

    def zeros(self, moment: str, numel: int, like: torch.Tensor, groups: int | None = None) -> dict[str, torch.Tensor]:
        """Zero state of ``moment`` for ``numel`` elements of 16-bit parameters like ``like``, on its
        device (``groups``: per-group parts' length, default ``numel`` cut into consecutive groups)."""
        raise NotImplementedError

    def describe(self, moment: str, param_dtype: torch.dtype) -> str:
        """How ``moment`` is stored, in words (a conversion's report)."""
        raise NotImplementedError

    def decode(self, state: Mapping[str, Any], moment: str, shape: torch.Size) -> torch.Tensor:
        """The stored ``moment`` as an FP32 tensor of ``shape``: the stored tensor itself when it is
        FP32 (updated in place), else a new one."""
        return state[moment].float()

    def encode_(self, state: Mapping[str, Any], moment: str, values: torch.Tensor, check_finite: bool) -> None:
        """Store FP32 ``values`` as ``moment``, in place. ``check_finite``: refuse non-finite values
        where the format needs finite ones (a host synchronisation)."""
        if values is not state[moment]:
            state[moment].copy_(values)


@dataclass(frozen=True)
class ParamDtypeMoment(MomentCodec):
    """The moment in the 16-bit parameter's own dtype, rounded to nearest when stored."""

    payload_bytes: ClassVar[int] = LOW_PRECISION_BYTES

    def zeros(self, moment, numel, like, groups=None):
        return {moment: like.new_zeros(numel, dtype=like.dtype)}

    def describe(self, moment, param_dtype):
        return dtype_word(param_dtype)


@dataclass(frozen=True)
class FP32Moment(MomentCodec):
    """The moment in FP32."""

    payload_bytes: ClassVar[int] = FP32_BYTES

    def zeros(self, moment, numel, like, groups=None):
        return {moment: like.new_zeros(numel, dtype=torch.float32)}

    def describe(self, moment, param_dtype):
        return "FP32"


@dataclass(frozen=True)
class FP8GroupMoment(MomentCodec):
    """FP8 payloads in groups of ``size`` consecutive elements, each with an FP32 scale and, under
    COAT's dynamic range expansion, an exponent k (COAT §4; :func:`~megatron_lowprec.numerics.quant.quantize_fp8_into`)."""

    fp8_format: str
    size: int
    expand: bool
    exponent_storage: str

    payload_bytes: ClassVar[int] = FP8_BYTES

    @property
    def suffixes(self) -> tuple[str, ...]:
        return ("_payload", "_scale", "_expansion_exponent") if self.expand else ("_payload", "_scale")

    grouped: ClassVar[bool] = True

    @property
    def group_size(self) -> int:
        return self.size

    @property
    def fp8_dtype(self) -> torch.dtype:
        return fp8_dtype_of(self.fp8_format)

    @property
    def group_metadata_bytes(self) -> int:
        """The FP32 scale, and under range expansion the exponent k in its storage (8 bytes with an
        FP32 k, 6 with a BF16 one)."""
        return FP8_SCALE_BYTES + (EXPANSION_EXPONENT_BYTES[self.exponent_storage] if self.expand else 0)

    def quantized(self, state: Mapping[str, Any], moment: str, shape: torch.Size) -> QuantizedTensor:
        """The stored parts of ``moment`` as one :class:`~megatron_lowprec.numerics.quant.QuantizedTensor`."""
        return QuantizedTensor(
            payload=state[f"{moment}_payload"],
            scale=state[f"{moment}_scale"],
            expansion_exponent=state[f"{moment}_expansion_exponent"] if self.expand else None,
            group_size=self.size,
            shape=shape,
            fp8_dtype=self.fp8_dtype,
        )

    def zeros(self, moment, numel, like, groups=None):
        zeros = quantized_zeros(numel, self.fp8_format, self.size, self.expand, like.device, groups, self.exponent_storage)
        parts = (zeros.payload, zeros.scale, zeros.expansion_exponent)
        return {moment + suffix: part for suffix, part in zip(self.suffixes, parts)}

    def describe(self, moment, param_dtype):
        expansion = f" with range expansion (k in {self.exponent_storage.upper()})" if self.expand else ""
        return f"FP8 {self.fp8_format} 1x{self.size} groups{expansion}"

    def decode(self, state, moment, shape):
        return dequantize_fp8(self.quantized(state, moment, shape))

    def encode_(self, state, moment, values, check_finite):
        stored = self.quantized(state, moment, values.shape)
        quantize_fp8_into(
            values, stored.payload, stored.scale, stored.expansion_exponent, self.size,
            check_finite=check_finite, fp8_dtype=stored.fp8_dtype,
        )


@dataclass(frozen=True)
class Int8GroupMoment(MomentCodec):
    """Companded INT8 codes in groups of ``size`` consecutive elements with a BF16 scale each:
    signed moments softsign-companded (int8), :data:`NON_NEGATIVE_MOMENTS` as their square root
    (uint8) (FlashOptim; :func:`~megatron_lowprec.numerics.quant.quantize_int8_into`)."""

    size: int

    suffixes: ClassVar[tuple[str, ...]] = ("_payload", "_scale")
    payload_bytes: ClassVar[int] = FP8_BYTES
    group_metadata_bytes: ClassVar[int] = INT8_SCALE_BYTES

    grouped: ClassVar[bool] = True

    @property
    def group_size(self) -> int:
        return self.size

    @staticmethod
    def code_dtype(moment: str) -> torch.dtype:
        """The dtype of ``moment``'s codes: uint8 for a square-rooted non-negative moment, else int8."""
        return torch.uint8 if moment in NON_NEGATIVE_MOMENTS else torch.int8

    def zeros(self, moment, numel, like, groups=None):
        payload, scale = int8_zeros(numel, self.size, self.code_dtype(moment) == torch.int8, like.device, groups)
        return {f"{moment}_payload": payload, f"{moment}_scale": scale}

    def describe(self, moment, param_dtype):
        companding = "square root, unsigned" if self.code_dtype(moment) == torch.uint8 else "companded, signed"
        return f"INT8 ({companding}) 1x{self.size} groups with a BF16 scale"

    def decode(self, state, moment, shape):
        return dequantize_int8(state[f"{moment}_payload"], state[f"{moment}_scale"], self.size, shape)

    def encode_(self, state, moment, values, check_finite):
        quantize_int8_into(values, state[f"{moment}_payload"], state[f"{moment}_scale"], self.size, check_finite)


def moment_codec(
    storage: str, fp8_format: str = "e4m3", group_size: int = 128, expand: bool = True, exponent_storage: str = "fp32"
) -> MomentCodec:
    """The codec of moments stored as ``storage`` (a strategy's ``moments``: ``"low"``, ``"fp32"``,
    ``"fp8"``, ``"int8"``), with the 8-bit formats' group size and FP8 settings."""
    if storage == "low":
        return ParamDtypeMoment()
    if storage == "fp32":
        return FP32Moment()
    if storage == "fp8":
        return FP8GroupMoment(fp8_format, group_size, expand, exponent_storage)
    if storage == "int8":
        return Int8GroupMoment(group_size)
    raise ValueError(f"moments={storage!r} is not valid; choose one of low, fp32, fp8, int8")


@dataclass(frozen=True)
class ParamCodec:
    """What the optimizer holds of θ besides the 16-bit parameter, and how an FP32 update reaches it."""

    key: ClassVar[str | None] = None
    """The state key of the tensor it keeps (``None``: none)."""
    state_bytes: ClassVar[int] = 0
    """Bytes per element of that tensor."""

    def state_dtype(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of the kept tensor for parameters of ``param_dtype`` (``None``: no tensor)."""
        return None

    def describe(self, param_dtype: torch.dtype) -> str:
        """How the parameter's full-precision value is stored, in words (a conversion's report)."""
        return dtype_word(param_dtype)

    def value(self, param: torch.Tensor, state: Mapping[str, Any]) -> torch.Tensor:
        """The represented θ in FP32 (weight decay shrinks it: Collage App. D)."""
        return param.float()

    def represented(self, param: torch.Tensor, state: Mapping[str, Any]) -> torch.Tensor:
        """The exact value held for ``param``, in FP64 (the update quality's "after" and "before")."""
        return param.double()

    def apply_update_(self, param: torch.Tensor, state: Mapping[str, Any], update: torch.Tensor, random_source: Any) -> None:
        """θ ← θ + Δθ (FP32 ``update``), in place, as the codec rounds it."""
        param.copy_(param.float() + update)


@dataclass(frozen=True)
class BareParameter(ParamCodec):
    """The 16-bit parameter alone: θ + Δθ rounded to nearest."""


@dataclass(frozen=True)
class StochasticParameter(ParamCodec):
    """The 16-bit parameter alone: θ ← SR(θ + Δθ) (SR paper, Alg. 1). ``random_source``: 32-bit words
    of the parameter's shape, a stream with a ``words(like)`` method, or ``None``."""

    def apply_update_(self, param, state, update, random_source):
        exact = param.float() + update
        words = random_source if random_source is None or isinstance(random_source, torch.Tensor) else random_source.words(exact)
        param.copy_(stochastic_round(exact, float_format(param.dtype), words))


@dataclass(frozen=True)
class MCFPair(ParamCodec):
    """θ as the expansion (θ, δθ) of two 16-bit values (Collage §3), δθ under ``"param_lo"``."""

    key: ClassVar[str] = "param_lo"
    state_bytes: ClassVar[int] = LOW_PRECISION_BYTES

    def state_dtype(self, param_dtype):
        return param_dtype

    def describe(self, param_dtype):
        return f"{dtype_word(param_dtype)} pair (θ, δθ)"

    def value(self, param, state):
        return param.float() + state[self.key].float()

    def represented(self, param, state):
        return param.double() + state[self.key].double()

    def apply_update_(self, param, state, update, random_source):
        """(θ, δθ) ← Grow((θ, δθ), Δθ) (Collage Alg. 2, line 13)."""
        hi, lo = grow(param, state[self.key], rounded_to(update, param.dtype))
        param.copy_(hi)
        state[self.key].copy_(lo)


@dataclass(frozen=True)
class KahanCompensation(ParamCodec):
    """The 16-bit parameter and a 16-bit Kahan compensation c (Collage App. C); θ alone is the value."""

    key: ClassVar[str] = "kahan_compensation"
    state_bytes: ClassVar[int] = LOW_PRECISION_BYTES

    def state_dtype(self, param_dtype):
        return param_dtype

    def describe(self, param_dtype):
        return f"{dtype_word(param_dtype)} + Kahan compensation"

    def apply_update_(self, param, state, update, random_source):
        """Δ' = Δθ + c; θ ← θ + Δ'; c ← Δ' - (θ_new - θ) (Collage App. C), i.e. Fast2Sum(θ, Δ')."""
        compensated = rounded_to(update + state[self.key].float(), param.dtype)
        new_param, compensation = fast2sum(param, compensated)
        param.copy_(new_param)
        state[self.key].copy_(compensation)


@dataclass(frozen=True)
class MasterCodec(ParamCodec):
    """An FP32 master of the parameter (whose 16-bit parameter is a rounding of it), stored under
    :attr:`key` in :attr:`dtype`; the update is applied to the master, then stored (:meth:`store_`)."""

    storage: ClassVar[str]
    """Its name as a strategy's ``master_storage`` spells it."""
    dtype: ClassVar[torch.dtype]
    """The stored tensor's dtype: the forms are told apart by it."""
    below_bf16: ClassVar[bool] = True
    """The stored tensor completes the BF16 parameter (which must then be BF16)."""

    def state_dtype(self, param_dtype):
        return self.dtype

    def describe(self, param_dtype):
        return f"FP32 master ({self.storage})"

    def join(self, param: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """The FP32 master of ``param`` and its stored tensor."""
        raise NotImplementedError

    def split(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 masters ``value`` as (BF16 parameter, stored tensor)."""
        raise NotImplementedError

    def store_tensor_(self, param: torch.Tensor, stored: torch.Tensor, value: torch.Tensor) -> None:
        """Make FP32 ``value`` the master of ``param``: split into the parameter and ``stored``."""
        upper, low = self.split(value)
        param.copy_(upper)
        stored.copy_(low)

    def reset_(self, param: torch.Tensor, stored: torch.Tensor) -> None:
        """Restart the master from the 16-bit ``param``: a zero remainder or residual (a BF16 value is
        its own upper half)."""
        stored.zero_()

    def value(self, param, state):
        return self.join(param, state[self.key])

    def represented(self, param, state):
        return self.value(param, state).double()

    def store_(self, param: torch.Tensor, state: Mapping[str, Any], value: torch.Tensor) -> None:
        """Make FP32 ``value`` the master of ``param`` (:meth:`store_tensor_`)."""
        self.store_tensor_(param, state[self.key], value)

    def apply_update_(self, param, state, update, random_source):
        """master ← master + Δθ, the parameter its rounding."""
        self.store_(param, state, self.value(param, state) + update)


@dataclass(frozen=True)
class WholeMaster(MasterCodec):
    """The FP32 master whole (4 bytes); the 16-bit parameter is its nearest rounding (a cast)."""

    storage: ClassVar[str] = "fp32"
    key: ClassVar[str] = "master"
    dtype: ClassVar[torch.dtype] = torch.float32
    state_bytes: ClassVar[int] = FP32_BYTES
    below_bf16: ClassVar[bool] = False

    def join(self, param, stored):
        return stored

    def store_tensor_(self, param, stored, value):
        """The master stores ``value`` and the parameter rounds it to nearest (a cast)."""
        if value is not stored:
            stored.copy_(value)
        param.copy_(stored)

    def reset_(self, param, stored):
        stored.copy_(param)


@dataclass(frozen=True)
class RemainderMaster(MasterCodec):
    """The BF16 parameter as the master's upper half and an int16 remainder its lower half (2 bytes;
    :func:`~megatron_lowprec.numerics.formats.split_bf16_remainder`)."""

    storage: ClassVar[str] = "remainder"
    key: ClassVar[str] = "master_remainder"
    dtype: ClassVar[torch.dtype] = torch.int16
    state_bytes: ClassVar[int] = 2

    def join(self, param, stored):
        return join_bf16_remainder(param, stored)

    def split(self, value):
        return split_bf16_remainder(value)


@dataclass(frozen=True)
class Residual8Master(MasterCodec):
    """The BF16 parameter plus an int8 residual, its rounding error in 1/128 units of half a BF16 ULP
    (1 byte; FlashOptim, :func:`~megatron_lowprec.numerics.formats.split_bf16_residual8`): a master
    of 16 significant bits."""

    storage: ClassVar[str] = "residual8"
    key: ClassVar[str] = "master_residual8"
    dtype: ClassVar[torch.dtype] = torch.int8
    state_bytes: ClassVar[int] = 1

    def join(self, param, stored):
        return join_bf16_residual8(param, stored)

    def split(self, value):
        return split_bf16_residual8(value)


MASTER_CODECS: dict[str, MasterCodec] = {codec.storage: codec for codec in (WholeMaster(), RemainderMaster(), Residual8Master())}
"""Each master storage's codec, by its name (a strategy's ``master_storage``)."""


def master_codec_of(stored: torch.Tensor | torch.dtype) -> MasterCodec:
    """The master codec whose stored tensor has ``stored``'s dtype."""
    dtype = stored if isinstance(stored, torch.dtype) else stored.dtype
    for codec in MASTER_CODECS.values():
        if codec.dtype == dtype:
            return codec
    valid = ", ".join(str(codec.dtype) for codec in MASTER_CODECS.values())
    raise ValueError(f"a stored master of dtype {dtype} has no codec; valid dtypes: {valid}")


PARAM_UPDATE_CODECS: dict[str, ParamCodec] = {
    "nearest": BareParameter(),
    "stochastic": StochasticParameter(),
    "mcf": MCFPair(),
    "kahan": KahanCompensation(),
}
"""The parameter codec of a strategy without a master, by its ``param_update``."""


def param_codec(param_update: str, master_weights: bool, master_storage: str) -> ParamCodec:
    """The parameter codec of a strategy: its master's (``master_weights``), else its update's."""
    if master_weights:
        return MASTER_CODECS[master_storage]
    return PARAM_UPDATE_CODECS[param_update]
