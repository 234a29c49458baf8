"""Optimizer state carried from one precision option to another by its meaning, not its bytes.

Every option stores, per parameter, the same quantities in its own formats: the parameter's
full-precision value and the moments. :func:`decode` reads them in FP64 from a state of option S:

* the value: an FP32 master (whole, or the BF16 parameter joined with its remainder:
  :func:`~megatron_lowprec.optim.master.master_value`), the MCF pair θ + δθ (Collage Alg. 1), the
  Kahan sum θ + c (Collage App. C: c is the part of the updates θ has not taken yet), or θ alone;
* each moment: FP32, the parameter's 16-bit format, the MCF pair v + δv (Collage Alg. 2, line 9),
  or FP8 groups with their scales and expansion exponents (COAT §4, dequantized as the optimizer
  reads them: :func:`~megatron_lowprec.numerics.quant.dequantize_fp8`).

:func:`encode` writes those values into option T's formats through the same codecs: an FP32 master
is the FP64 value rounded to FP32 and stored by :func:`~megatron_lowprec.optim.master.store_master_`
(so any master storage the strategies declare slots in); a pair (θ, δθ), (θ, c) or (v, δv) is the
value rounded to nearest even and the rounded rest; a 16-bit value is rounded to nearest even
(correctly, from FP64: :func:`round_to`); an FP8 moment is quantized by COAT's own rule
(:func:`~megatron_lowprec.numerics.quant.quantize_fp8`), or copied code for code when S stores it
in the same FP8 format, groups and exponent storage (coat's FP32 k and res8's BF16 one quantize afresh). Where T represents S's values the conversion is exact: D, D with a remainder
master and megatron-core's own FP32-master Adam (:data:`STOCK`) convert into each other bit for
bit, and every option converts exactly into a richer one; into a leaner one each value is
correctly rounded. :func:`convert_state_dict` does this for an optimizer's whole state dict and says,
per state kind, what it converted and the largest error against the source in FP64.

States come in either form an option has: the optimizer's (per-group FP8 scales, a master stored as
its storage says) or the checkpoint's (:mod:`~megatron_lowprec.megatron.checkpoint_state`: per-element
FP8 parts, FP8 codes as uint8, the master as FP32 under ``master``); :func:`encode` writes the
optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_lowprec.numerics.quant import (
    QuantizedTensor,
    dequantize_fp8,
    dequantize_int8,
    fp8_dtype_of,
    num_groups,
    quantize_fp8,
)
from megatron_lowprec.optim.codecs import Int8GroupMoment, dtype_word
from megatron_lowprec.optim.master import master_value, new_master, store_master_, stored_master
from megatron_lowprec.optim.strategies import (
    STORAGE_RECORDS,
    PrecisionStrategy,
    exponent_storage_record,
    get_strategy,
    resolve_option,
    saved_exponent_storage,
    saved_int8_moments,
    strategy_names,
)

STOCK = "stock"
"""The name that stands for megatron-core's own optimizer state: an FP32 master under
:data:`STOCK_MASTER_KEY` and FP32 ``exp_avg`` and ``exp_avg_sq`` (option D's formats)."""

STOCK_MASTER_KEY = "fp32_param"
"""The key of megatron-core's FP32 master in its optimizer's sharded state dict."""

STOCK_STRATEGY_NAME = "D"
"""The registered option whose formats are megatron-core's own (its keys but the master's)."""

PAIRED_LOW = {"param_lo": "value", "kahan_compensation": "value", "exp_avg_sq_lo": "exp_avg_sq"}
"""The 16-bit low components and the quantity each completes into a pair."""

VALUE = "value"
"""The kind name of the parameter's full-precision value in reports."""


def resolve_target(name: str | PrecisionStrategy, master_storage: str | None = None) -> PrecisionStrategy:
    """The strategy of a registered option or of :data:`STOCK`; ``ValueError`` naming the valid ones."""
    if isinstance(name, str) and name.lower() == STOCK:
        return get_strategy(STOCK_STRATEGY_NAME)
    try:
        return resolve_option(name, master_storage=master_storage)
    except ValueError:
        raise ValueError(f"unknown precision option {name!r}; valid: {', '.join([*strategy_names(), STOCK])}") from None


def as_shaped_like(source: PrecisionStrategy, target: PrecisionStrategy) -> PrecisionStrategy:
    """``source`` with ``target``'s moments (AdamW's m and v, or Muon's momentum): the state an
    optimizer like ``target`` (AdamW or Muon) kept when it ran ``source``."""
    return replace(
        source,
        moment_names=target.moment_names,
        second_moment_mcf=source.second_moment_mcf and "exp_avg_sq" in target.moment_names,
    )


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP64 ``values`` correctly rounded (to nearest, ties to even) to ``dtype``: FP32 by the cast
    (one rounding), a 16-bit format through FP32 rounded to odd (its 24 bits are at least the 16-bit
    format's precision plus 2, so the second rounding to nearest even is the correct one: Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd")."""
    if dtype in (torch.float32, torch.float64):
        return values.to(dtype)
    nearest = values.float()
    inexact = nearest.double() != values
    toward_zero = torch.where(
        inexact & (nearest.double().abs() > values.abs()), torch.nextafter(nearest, torch.zeros_like(nearest)), nearest
    )
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(inexact & toward_zero.isfinite(), odd, toward_zero).to(dtype)


def value_format(strategy: PrecisionStrategy, param_dtype: torch.dtype) -> str:
    """How ``strategy`` stores the parameter's full-precision value, in words (its parameter codec's)."""
    return strategy.param_codec.describe(param_dtype)


def moment_format(strategy: PrecisionStrategy, moment: str, param_dtype: torch.dtype) -> str:
    """How ``strategy`` stores ``moment``, in words (its moment codec's; Collage-plus' v as a pair)."""
    if moment == "exp_avg_sq" and strategy.second_moment_mcf:
        return f"{dtype_word(param_dtype)} pair (v, δv)"
    return strategy.moment_codec.describe(moment, param_dtype)


def _low_key(strategy: PrecisionStrategy, kind: str) -> str | None:
    """The state key of the low component that ``strategy`` pairs with ``kind``, if it keeps one."""
    if kind == VALUE and not strategy.master_weights:
        return strategy.param_codec.key
    if kind == "exp_avg_sq" and strategy.second_moment_mcf:
        return "exp_avg_sq_lo"
    return None


def _master_of(state: dict[str, Any]) -> torch.Tensor | None:
    stored = stored_master(state)
    return state.get(STOCK_MASTER_KEY) if stored is None else stored


def _fp8_group_size(strategy: PrecisionStrategy, scale: torch.Tensor, numel: int) -> int:
    """The elements per stored scale: 1 in checkpoint form (one per element), else the strategy's groups."""
    if scale.numel() == numel:
        return 1
    if scale.numel() != num_groups(numel, strategy.fp8_group_size):
        raise ValueError(
            f"an FP8 scale of {scale.numel()} values fits neither {numel} elements nor their "
            f"{num_groups(numel, strategy.fp8_group_size)} groups of {strategy.fp8_group_size}"
        )
    return strategy.fp8_group_size


def _fp8_moment(strategy: PrecisionStrategy, moment: str, state: dict[str, Any], numel: int) -> QuantizedTensor:
    scale = state[f"{moment}_scale"].reshape(-1)
    exponent = state.get(f"{moment}_expansion_exponent")
    return QuantizedTensor(
        payload=state[f"{moment}_payload"].reshape(-1),
        scale=scale,
        expansion_exponent=None if exponent is None else exponent.reshape(-1),
        group_size=_fp8_group_size(strategy, scale, numel),
        shape=torch.Size([numel]),
        fp8_dtype=fp8_dtype_of(strategy.fp8_format),
    )


def decode(strategy: PrecisionStrategy, param: torch.Tensor, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The FP64 meaning of ``param``'s ``state`` under ``strategy`` (flat, one value per element):
    :data:`VALUE`, the parameter's full-precision value, and each of ``strategy.moment_names``."""
    flat_param = param.detach().reshape(-1)
    numel = flat_param.numel()
    meaning: dict[str, torch.Tensor] = {}
    if strategy.master_weights:
        stored = _master_of(state)
        if stored is None:
            raise ValueError(f"option {strategy.name!r} keeps an FP32 master, but the state holds none ({sorted(state)})")
        meaning[VALUE] = master_value(flat_param, stored.reshape(-1)).double()
    else:
        meaning[VALUE] = flat_param.double()
    for moment in strategy.moment_names:
        if strategy.moments == "fp8":
            meaning[moment] = dequantize_fp8(_fp8_moment(strategy, moment, state, numel)).double()
        elif strategy.moments == "int8":
            scale = state[f"{moment}_scale"].reshape(-1)
            payload = state[f"{moment}_payload"].reshape(-1).view(Int8GroupMoment.code_dtype(moment))
            group_size = _fp8_group_size(strategy, scale, numel)
            meaning[moment] = dequantize_int8(payload, scale, group_size, torch.Size([numel])).double()
        else:
            meaning[moment] = state[moment].reshape(-1).double()
    for kind in (VALUE, *strategy.moment_names):
        low = _low_key(strategy, kind)
        if low is not None:
            meaning[kind] = meaning[kind] + state[low].reshape(-1).double()
    return meaning


def _same_fp8(source: PrecisionStrategy, target: PrecisionStrategy) -> bool:
    fields = ("moments", "fp8_format", "fp8_group_size", "fp8_expand", "fp8_exponent_storage")
    return target.moments == "fp8" and all(getattr(source, field) == getattr(target, field) for field in fields)


def _fp8_groups_of(source: PrecisionStrategy, moment: str, state: dict[str, Any], numel: int) -> dict[str, torch.Tensor] | None:
    """The stored FP8 parts of ``moment`` in per-group form (a checkpoint's per-element parts taken
    once per group where every element of a group holds its group's), or ``None`` where they are not."""
    quantized = _fp8_moment(source, moment, state, numel)
    payload = quantized.payload
    if payload.dtype == torch.uint8:
        payload = payload.view(quantized.fp8_dtype)
    parts = {"payload": payload.clone(), "scale": quantized.scale, "expansion_exponent": quantized.expansion_exponent}
    if quantized.group_size != 1:
        return {key: value.clone() for key, value in parts.items() if value is not None}
    size = source.fp8_group_size
    grouped = {}
    for key in ("scale", "expansion_exponent"):
        values = parts[key]
        if values is None:
            continue
        padded = torch.cat([values, values[-1:].expand(-numel % size)]).view(-1, size)
        if not bool((padded == padded[:, :1]).all()):
            return None
        grouped[key] = padded[:, 0].clone()
    return {"payload": parts["payload"], **grouped}


def encode(
    strategy: PrecisionStrategy,
    meaning: dict[str, torch.Tensor],
    param_dtype: torch.dtype,
    fp8_parts: dict[str, dict[str, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the flat 16-bit parameter, its state in the optimizer's form, flat) that ``strategy``
    stores for the FP64 ``meaning`` (:func:`decode`). ``fp8_parts``: per moment, FP8 parts stored in
    ``strategy``'s own FP8 format, taken as they are."""
    value = meaning[VALUE]
    state: dict[str, torch.Tensor] = {}
    if strategy.master_weights:
        param = torch.empty(value.shape, dtype=param_dtype, device=value.device)
        stored = new_master(strategy, value.numel(), param)
        store_master_(param, stored, value.float())
        state[strategy.param_codec.key] = stored
    else:
        param = round_to(value, param_dtype)
    for moment in strategy.moment_names:
        if strategy.moments == "fp8":
            parts = (fp8_parts or {}).get(moment)
            if parts is None:
                quantized = quantize_fp8(
                    meaning[moment].float(), strategy.fp8_format, strategy.fp8_group_size, strategy.fp8_expand,
                    strategy.fp8_exponent_storage,
                )
                parts = {"payload": quantized.payload, "scale": quantized.scale}
                if quantized.expansion_exponent is not None:
                    parts["expansion_exponent"] = quantized.expansion_exponent
            state.update({f"{moment}_{part}": tensor for part, tensor in parts.items()})
        elif strategy.moments == "int8":
            parts = strategy.moment_codec.zeros(moment, value.numel(), value)
            strategy.moment_codec.encode_(parts, moment, meaning[moment].float(), check_finite=True)
            state.update(parts)
        else:
            state[moment] = round_to(meaning[moment], torch.float32 if strategy.moments == "fp32" else param_dtype)
    for kind in (VALUE, *strategy.moment_names):
        low = _low_key(strategy, kind)
        if low is not None:
            high = param if kind == VALUE else state[kind]
            state[low] = round_to(meaning[kind] - high.double(), param_dtype)
    return param, state


@dataclass
class KindReport:
    """What one state kind became, and the largest error of the conversion against the source."""

    kind: str
    source_format: str
    target_format: str
    elements: int = 0
    largest_error: float = 0.0

    def line(self) -> str:
        error = "exact" if self.largest_error == 0 else f"largest error {self.largest_error:.3g} (FP64)"
        return f"{self.kind}: {self.source_format} -> {self.target_format}, {self.elements} elements, {error}"


class ConversionReport:
    """Per state kind, over every converted parameter, the formats and the largest error."""

    def __init__(
        self, source: PrecisionStrategy, target: PrecisionStrategy, source_label: str | None = None,
        target_label: str | None = None,
    ) -> None:
        self.source = source
        self.target = target
        self.source_label = source.name if source_label is None else source_label
        self.target_label = target.name if target_label is None else target_label
        self.kinds: dict[str, KindReport] = {}

    def add(self, param: torch.Tensor, errors: dict[str, float]) -> None:
        for kind, error in errors.items():
            formats = [
                value_format(strategy, param.dtype) if kind == VALUE else moment_format(strategy, kind, param.dtype)
                for strategy in (self.source, self.target)
            ]
            report = self.kinds.setdefault(kind, KindReport(kind, *formats))
            report.elements += param.numel()
            report.largest_error = max(report.largest_error, error)

    def lines(self) -> list[str]:
        """One line per state kind: what was converted and its largest error against the source."""
        return [f"converted {self.source_label} -> {self.target_label}: {kind.line()}" for kind in self.kinds.values()]


def convert_entry(
    source: PrecisionStrategy, target: PrecisionStrategy, param: torch.Tensor, state: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any], dict[str, float]]:
    """``param`` (16-bit) and its ``state`` of ``source`` as ``target`` keeps them: (the new
    parameter in ``param``'s shape, the state in the optimizer's form with per-element states in
    ``param``'s shape and non-tensor entries such as ``step`` kept, the largest FP64 error of each
    kind against the source's meaning)."""
    numel = param.numel()
    meaning = decode(source, param, state)
    fp8_parts = {}
    if _same_fp8(source, target):
        for moment in target.moment_names:
            parts = _fp8_groups_of(source, moment, state, numel)
            if parts is not None:
                fp8_parts[moment] = parts
    new_param, new_state = encode(target, meaning, param.dtype, fp8_parts)
    converted = decode(target, new_param, new_state)
    errors = {kind: float((converted[kind] - meaning[kind]).abs().max()) if numel else 0.0 for kind in meaning}
    shaped = {
        key: value if key.endswith(("_payload", "_scale", "_expansion_exponent")) else value.view(param.shape)
        for key, value in new_state.items()
    }
    kept = {key: value for key, value in state.items() if not torch.is_tensor(value)}
    return new_param.view(param.shape), {**kept, **shaped}, errors


def saved_strategy(state_dict: dict[str, Any], like: PrecisionStrategy) -> PrecisionStrategy:
    """The strategy a state dict of an optimizer like ``like`` (AdamW or Muon) was saved with: its
    ``lowprec`` section's option, master storage and FP8 exponent storage (a res8 state saved with
    FP32 exponents is res8 with ``fp8_exponent_storage="fp32"``), or megatron-core's own
    (:data:`STOCK`) without one."""
    extra = state_dict.get("lowprec")
    if extra is None:
        return as_shaped_like(resolve_target(STOCK), like)
    strategy = get_strategy(extra["option"])
    if strategy.master_weights and extra.get("master_storage") is not None:
        strategy = strategy.with_master_storage(extra["master_storage"])
    return as_shaped_like(with_saved_exponent_storage(strategy, extra), like)


def with_saved_exponent_storage(strategy: PrecisionStrategy, extra: dict[str, Any]) -> PrecisionStrategy:
    """``strategy`` with the INT8 moments or FP8 exponent storage that a state dict's ``lowprec`` section ``extra``
    records (:func:`~megatron_lowprec.optim.strategies.saved_exponent_storage`): the strategy that
    wrote it, where it has FP8 moments."""
    if strategy.grouped_moments and saved_int8_moments(extra):
        return replace(strategy, moments="int8")
    if strategy.moments != "fp8":
        return strategy
    return replace(strategy, fp8_exponent_storage=saved_exponent_storage(extra))


def convert_state_dict(
    state_dict: dict[str, Any], params: list[torch.Tensor], target: PrecisionStrategy, source: PrecisionStrategy | None = None
) -> tuple[dict[str, Any], list[torch.Tensor], list[str]]:
    """An optimizer state dict (torch's, with this package's ``lowprec`` section, or megatron-core's
    with its FP32 master under :data:`STOCK_MASTER_KEY`) as ``target`` keeps it: (the new state dict,
    the new 16-bit parameters aligned with ``params``, which the caller copies into the model before
    loading the state dict, and one line per state kind). ``params`` are the saved model's
    parameters in the order of the state dict's parameter indices; ``source`` defaults to
    :func:`saved_strategy`."""
    source = saved_strategy(state_dict, target) if source is None else source
    indices = [index for group in state_dict["param_groups"] for index in group["params"]]
    if len(indices) != len(params):
        raise ValueError(f"the state dict indexes {len(indices)} parameters, {len(params)} were given")
    report = ConversionReport(source, target, STOCK if state_dict.get("lowprec") is None else None)
    new_states: dict[Any, Any] = {}
    new_params = []
    for index, param in zip(indices, params):
        saved = state_dict["state"].get(index)
        if saved is None or not any(torch.is_tensor(value) for value in saved.values()):
            new_params.append(param.detach().clone())
            if saved is not None:
                new_states[index] = dict(saved)
            continue
        new_param, new_state, errors = convert_entry(source, target, param, saved)
        new_params.append(new_param)
        new_states[index] = new_state
        report.add(param, errors)
    converted = {**state_dict, "state": new_states}
    extra = dict(state_dict.get("lowprec") or {"skipped_steps": 0, "seed": 0, "generator_state": None})
    for key in STORAGE_RECORDS:
        extra.pop(key, None)
    extra.update(option=target.name, master_storage=target.master_storage, **exponent_storage_record(target))
    converted["lowprec"] = extra
    return converted, new_params, report.lines()

