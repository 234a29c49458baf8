"""The storage codecs (``optim/codecs.py``) against independent references: torch's casts, fp64
arithmetic and ml_dtypes; their byte counts against what they allocate; every registered option's
codecs (read from the registry)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_lowprec.optim import available_strategies
from megatron_lowprec.optim.buckets import state_keys, zero_state
from megatron_lowprec.optim.codecs import (
    MASTER_CODECS,
    BareParameter,
    FP8GroupMoment,
    FP32Moment,
    Int8GroupMoment,
    KahanCompensation,
    MasterCodec,
    MCFPair,
    MomentCodec,
    ParamCodec,
    ParamDtypeMoment,
    StochasticParameter,
    master_codec_of,
)
from megatron_lowprec.optim.master import new_master
from megatron_lowprec.optim.strategies import MASTER_STORAGES, PrecisionStrategy


def _variants() -> list[PrecisionStrategy]:
    """Every registered option, with its 8-bit moments in each storage and its master in each."""
    variants = []
    for strategy in available_strategies():
        variants.append(strategy)
        if strategy.grouped_moments:
            variants.append(strategy.with_moment_storage("int8" if strategy.moments == "fp8" else "fp8"))
        if strategy.master_weights:
            variants += [strategy.with_master_storage(storage) for storage in MASTER_STORAGES if storage != strategy.master_storage]
    return variants


VARIANTS = _variants()


def _variant_id(strategy: PrecisionStrategy) -> str:
    return f"{strategy.name}-{strategy.moments}-{strategy.master_storage if strategy.master_weights else 'none'}"


@pytest.mark.parametrize("strategy", VARIANTS, ids=_variant_id)
def test_every_option_is_a_choice_of_codecs_whose_parts_are_its_state(strategy):
    """The codecs say the state's keys and dtypes: each moment's parts, then the parameter codec's tensor."""
    moment, param = strategy.moment_codec, strategy.param_codec
    assert isinstance(moment, MomentCodec) and isinstance(param, ParamCodec)
    assert (strategy.moments == "fp8") == isinstance(moment, FP8GroupMoment)
    assert (strategy.moments == "int8") == isinstance(moment, Int8GroupMoment)
    assert isinstance(param, MasterCodec) == strategy.master_weights
    if strategy.master_weights:
        assert param is MASTER_CODECS[strategy.master_storage]
    like = torch.zeros(0, dtype=torch.bfloat16)
    state = zero_state(strategy, 300, like)
    moment_keys = [key for name in strategy.moment_names for key in moment.keys(name)]
    assert list(state)[: len(moment_keys)] == moment_keys
    expected = moment_keys + ([param.key] if param.key is not None else [])
    assert [key for key in state_keys(strategy) if key != "exp_avg_sq_lo"] == expected
    if param.key is not None and not strategy.master_weights:
        assert state[param.key].dtype == param.state_dtype(like.dtype) == like.dtype


@pytest.mark.parametrize("strategy", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("numel", [256, 300])
def test_bytes_of_the_codecs_are_what_their_state_allocates(strategy, numel):
    """Each moment's :meth:`bytes` and the strategy's state bytes equal the allocated buffers' bytes
    (groups counted whole, a partial last one included)."""
    like = torch.zeros(0, dtype=torch.bfloat16)
    state = zero_state(strategy, numel, like)
    for name in strategy.moment_names:
        allocated = sum(state[key].nbytes for key in strategy.moment_codec.keys(name))
        assert strategy.moment_codec.bytes(numel) == strategy.moment_bytes(numel) == allocated
    total = sum(value.nbytes for value in state.values())
    if strategy.master_weights:
        master = new_master(strategy, numel, like)
        total += master.nbytes
        assert strategy.master_bytes * numel == master.nbytes
    assert strategy.state_bytes(numel) == total


def test_codecs_are_frozen_hashable_constants_equal_for_equal_strategies():
    """A compiled step sees a codec as a constant: frozen, hashable, the same for equal strategies."""
    for strategy in VARIANTS:
        twin = dataclasses.replace(strategy)
        assert twin.moment_codec == strategy.moment_codec and hash(twin.moment_codec) == hash(strategy.moment_codec)
        assert twin.param_codec == strategy.param_codec
        with pytest.raises(dataclasses.FrozenInstanceError):
            strategy.moment_codec.size = 1


def _sample(numel: int, seed: int, low: float = -20, high: float = 4) -> torch.Tensor:
    """``numel`` FP32 values of random signs with magnitudes 2^u, u uniform in [``low``, ``high``)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.empty(numel).uniform_(low, high, generator=generator))
    signs = torch.where(torch.rand(numel, generator=generator) < 0.5, -1.0, 1.0)
    return magnitudes * signs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_moment_in_the_parameter_dtype_is_torchs_cast_and_decodes_exactly(dtype):
    codec, values = ParamDtypeMoment(), _sample(300, 1)
    state = codec.zeros("exp_avg", values.numel(), torch.zeros(0, dtype=dtype))
    codec.encode_(state, "exp_avg", values, check_finite=True)
    assert state["exp_avg"].dtype == dtype and torch.equal(state["exp_avg"], values.to(dtype))
    decoded = codec.decode(state, "exp_avg", values.shape)
    assert decoded.dtype == torch.float32 and torch.equal(decoded.double(), values.to(dtype).double())


def test_an_fp32_moment_is_decoded_as_the_stored_tensor_itself():
    codec, values = FP32Moment(), _sample(300, 2)
    state = codec.zeros("exp_avg", values.numel(), torch.zeros(0, dtype=torch.bfloat16))
    codec.encode_(state, "exp_avg", values, check_finite=True)
    assert torch.equal(state["exp_avg"], values)
    assert codec.decode(state, "exp_avg", values.shape) is state["exp_avg"]


ML_DTYPES_FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


@pytest.mark.parametrize("fp8_format", sorted(ML_DTYPES_FP8))
def test_fp8_groups_without_expansion_match_ml_dtypes(fp8_format):
    """COAT §3 in fp64: scale = max|x| / fp8_max rounded to FP32; payload = ml_dtypes' RNE cast of
    the FP32 quotient x / scale; decoded = payload · scale in FP32."""
    group_size, numel = 128, 128 * 3 + 44
    codec = FP8GroupMoment(fp8_format, group_size, expand=False, exponent_storage="fp32")
    values = _sample(numel, 3)
    state = codec.zeros("exp_avg", numel, torch.zeros(0, dtype=torch.bfloat16))
    codec.encode_(state, "exp_avg", values, check_finite=True)
    assert set(state) == {"exp_avg_payload", "exp_avg_scale"}

    fp8, fp8_max = ML_DTYPES_FP8[fp8_format]
    x = values.double().numpy()
    padded = np.concatenate([x, np.zeros(-numel % group_size)]).reshape(-1, group_size)
    scale = (np.abs(padded).max(axis=1) / fp8_max).astype(np.float32)
    quotient = (padded / scale.astype(np.float64)[:, None]).astype(np.float32)
    payload = quotient.astype(fp8).reshape(-1)[:numel]
    assert np.array_equal(state["exp_avg_scale"].numpy(), scale)
    stored = state["exp_avg_payload"].view(torch.uint8).numpy()
    assert np.array_equal(stored, payload.view(np.uint8))

    decoded = codec.decode(state, "exp_avg", values.shape)
    group_scale = np.repeat(scale, group_size)[:numel]
    assert np.array_equal(decoded.numpy(), payload.astype(np.float32) * group_scale)


@pytest.mark.parametrize("exponent_storage", ["fp32", "bf16"])
def test_fp8_groups_with_expansion_follow_coats_formulas_in_fp64(exponent_storage):
    """Under range expansion (COAT §4.2) each group stores its k in ``exponent_storage``; the payload
    is ml_dtypes' cast of fp8_max · sign(x) |x / M|^k with that k (a near-tie may land on the
    neighbouring code), and decodes as M · sign(q) |q / fp8_max|^(1/k), M = scale · fp8_max."""
    group_size, numel = 128, 128 * 4
    codec = FP8GroupMoment("e4m3", group_size, expand=True, exponent_storage=exponent_storage)
    values = _sample(numel, 4, low=-16, high=-10)
    state = codec.zeros("exp_avg", numel, torch.zeros(0, dtype=torch.bfloat16))
    codec.encode_(state, "exp_avg", values, check_finite=True)
    exponent = state["exp_avg_expansion_exponent"]
    assert exponent.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[exponent_storage]
    assert exponent.numel() == numel // group_size and bool((exponent > 1).all())

    fp8, fp8_max = ML_DTYPES_FP8["e4m3"]
    k = np.repeat(exponent.double().numpy(), group_size)
    group_max = np.repeat(state["exp_avg_scale"].double().numpy() * fp8_max, group_size)
    x = values.double().numpy()
    expected = (np.sign(x) * fp8_max * (np.abs(x) / group_max) ** k).astype(fp8).astype(np.float64)
    payload = state["exp_avg_payload"].double().numpy()
    off = payload != expected
    assert off.mean() < 0.01
    assert np.all(np.abs(payload[off] - expected[off]) <= np.abs(np.nextafter(expected[off].astype(np.float32), 0) - expected[off]) * 2 + 2.0**-9)

    decoded = codec.decode(state, "exp_avg", values.shape).double().numpy()
    reference = group_max * np.sign(payload) * (np.abs(payload) / fp8_max) ** (1 / k)
    assert np.allclose(decoded, reference, rtol=2.0**-20, atol=0)


def _bf16_toward_zero(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_int8_groups_decode_their_codes_as_the_fp64_formulas(moment):
    """Signed moments decode s·q/(254-|q|), non-negative ones (q·s/255)^2, each division rounded once
    to FP32, on BF16 scales truncated from the group's largest magnitude (of square roots)."""
    group_size, numel = 128, 128 * 2 + 5
    codec = Int8GroupMoment(group_size)
    values = _sample(numel, 5)
    square_root = moment == "exp_avg_sq"
    if square_root:
        values = values * values
    state = codec.zeros(moment, numel, torch.zeros(0, dtype=torch.bfloat16))
    codec.encode_(state, moment, values, check_finite=True)
    payload, scale = state[f"{moment}_payload"], state[f"{moment}_scale"]
    assert payload.dtype == (torch.uint8 if square_root else torch.int8) and scale.dtype == torch.bfloat16

    x = values.double().numpy()
    padded = np.concatenate([x, np.zeros(-numel % group_size)]).reshape(-1, group_size)
    if square_root:
        padded = np.sqrt(padded)
    assert np.array_equal(scale.double().numpy(), np.maximum(_bf16_toward_zero(np.abs(padded).max(axis=1)), 2.0**-126))

    codes = payload.double().numpy()
    group_scale = np.repeat(scale.float().numpy(), group_size)[:numel]
    if square_root:
        root = ((codes * group_scale) / 255).astype(np.float32)
        expected = root * root
    else:
        expected = (codes / (254 - np.abs(codes))).astype(np.float32) * group_scale
    assert np.array_equal(codec.decode(state, moment, values.shape).numpy(), expected)


def _fp32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("storage", MASTER_STORAGES)
def test_each_master_codec_stores_a_value_and_reads_it_back(storage):
    """Whole: the value itself, the parameter its torch cast. Remainder: the FP32 value exactly (its
    bits), the parameter within half a BF16 ULP. Residual8: the value on a grid of 16 significant bits
    (within 2^-16 of it relatively)."""
    codec = MASTER_CODECS[storage]
    assert master_codec_of(codec.dtype) is codec and new_master(PrecisionStrategy("x", "x", master_weights=True, master_storage=storage), 3, torch.zeros(0)).dtype == codec.dtype
    value = _sample(1000, 6)
    param = torch.zeros(1000, dtype=torch.bfloat16)
    state = {codec.key: torch.zeros(1000, dtype=codec.dtype)}
    codec.store_(param, state, value)
    read = codec.value(param, state)
    assert read.dtype == torch.float32 and torch.equal(codec.represented(param, state), read.double())
    if storage == "fp32":
        assert torch.equal(read, value) and torch.equal(param, value.to(torch.bfloat16))
    else:
        error = (read.double() - value.double()).abs() / value.double().abs()
        assert torch.equal(read.view(torch.int32), value.view(torch.int32)) if storage == "remainder" else error.max() <= 2.0**-16
        half_ulp = value.double().abs() * 2.0**-8
        assert bool(((param.double() - value.double()).abs() <= half_ulp).all())


@pytest.mark.parametrize("storage", MASTER_STORAGES)
def test_a_master_resets_to_the_parameter(storage):
    codec = MASTER_CODECS[storage]
    param = _sample(64, 7).to(torch.bfloat16)
    stored = torch.full((64,), 3, dtype=codec.dtype)
    codec.reset_(param, stored)
    assert torch.equal(codec.join(param, stored), param.float())


TINY_UPDATE = 1e-4
"""Under half a BF16 ULP of 1 (2^-8): lost by the bare parameter's nearest rounding."""


def _apply_tiny_updates(codec: ParamCodec, steps: int) -> tuple[torch.Tensor, dict]:
    param = torch.ones(4096, dtype=torch.bfloat16)
    state = {} if codec.key is None else {codec.key: torch.zeros(4096, dtype=codec.state_dtype(param.dtype))}
    generator = torch.Generator().manual_seed(8)
    update = torch.full((4096,), TINY_UPDATE)
    for _ in range(steps):
        words = torch.randint(-(2**31), 2**31, (4096,), dtype=torch.int64, generator=generator).to(torch.int32)
        codec.apply_update_(param, state, update, words)
    return param, state


def test_parameter_codecs_keep_what_nearest_rounding_of_the_parameter_loses():
    """100 updates of 1e-4 to θ = 1 make 1.01 in fp64: the bare parameter rounds each away; the MCF
    pair (θ, δθ) and Kahan's parameter and compensation hold the sum to a tenth of what is lost
    (δθ and c round each step to 16 bits themselves); Kahan's parameter ends within a BF16 ULP;
    stochastic rounding is right on average (SR paper, Alg. 1)."""
    steps, exact = 100, 1.0 + 100 * np.float64(np.float32(TINY_UPDATE))
    param, state = _apply_tiny_updates(BareParameter(), steps)
    assert bool((param == 1).all())

    codec = MCFPair()
    param, state = _apply_tiny_updates(codec, steps)
    assert (codec.represented(param, state) - exact).abs().max().item() < 1e-3
    assert torch.equal(codec.value(param, state).double(), codec.represented(param, state).float().double())

    codec = KahanCompensation()
    param, state = _apply_tiny_updates(codec, steps)
    assert (param.double() - exact).abs().max().item() <= 2.0**-7
    assert (param.double() + state[codec.key].double() - exact).abs().max().item() < 1e-3
    assert torch.equal(codec.represented(param, state), param.double())

    param, _ = _apply_tiny_updates(StochasticParameter(), steps)
    assert abs(param.double().mean().item() - exact) < 1e-3


def test_codecs_describe_their_storage_in_the_conversion_reports_words():
    assert FP32Moment().describe("exp_avg", torch.bfloat16) == "FP32"
    assert ParamDtypeMoment().describe("exp_avg", torch.float16) == "FP16"
    assert FP8GroupMoment("e4m3", 128, True, "bf16").describe("exp_avg", torch.bfloat16) == (
        "FP8 e4m3 1x128 groups with range expansion (k in BF16)"
    )
    assert FP8GroupMoment("e5m2", 64, False, "fp32").describe("exp_avg", torch.bfloat16) == "FP8 e5m2 1x64 groups"
    assert Int8GroupMoment(128).describe("exp_avg", torch.bfloat16) == "INT8 (companded, signed) 1x128 groups with a BF16 scale"
    assert Int8GroupMoment(128).describe("exp_avg_sq", torch.bfloat16).startswith("INT8 (square root, unsigned)")
    assert [codec.describe(torch.bfloat16) for codec in (BareParameter(), StochasticParameter(), MCFPair(), KahanCompensation())] == [
        "BF16", "BF16", "BF16 pair (θ, δθ)", "BF16 + Kahan compensation"
    ]
    assert [codec.describe(torch.bfloat16) for codec in MASTER_CODECS.values()] == [
        f"FP32 master ({storage})" for storage in MASTER_STORAGES
    ]
