"""The package's own elementary functions against float64 references, and eager against compiled:
one function on every backend (numerics/elementary.py)."""

import contextlib

import numpy as np
import pytest
import torch

from megatron_lowprec.numerics import elementary
from megatron_lowprec.numerics.elementary import div_rn, exp2, log2, power, sqrt_rn


def _random_floats(count: int, seed: int, low_bits: int = 1, high_bits: int = 0x7F800000) -> torch.Tensor:
    """Positive finite FP32 values with uniformly random bit patterns (subnormals included)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low_bits, high_bits, (count,), generator=generator, dtype=torch.int32).view(torch.float32)


def _correctly_rounded(values: torch.Tensor) -> torch.Tensor:
    """float64 values rounded once to FP32 (exact results of FP32 operands round correctly this way)."""
    return values.float()


def test_div_rn_is_the_correctly_rounded_quotient(device):
    numerators, denominators = _random_floats(200_000, 1), _random_floats(200_000, 2)
    signs = torch.where(torch.arange(200_000) % 3 == 0, -1.0, 1.0)
    numerators = numerators * signs
    expected = _correctly_rounded(numerators.double() / denominators.double())
    got = div_rn(numerators.to(device), denominators.to(device)).cpu()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_div_rn_rounds_a_python_float_to_fp32_and_divides_by_it(device):
    values = _random_floats(100_000, 3, 0x30000000, 0x50000000).to(device)
    third = float(torch.tensor(1 / 3, dtype=torch.float32))
    assert torch.equal(div_rn(values, 1 / 3).cpu(), _correctly_rounded(values.cpu().double() / third))
    assert torch.equal(div_rn(1 / 3, values).cpu(), _correctly_rounded(third / values.cpu().double()))


def test_sqrt_rn_is_correctly_rounded_subnormals_included(device):
    values = _random_floats(200_000, 4)
    expected = _correctly_rounded(values.double().sqrt())
    assert torch.equal(sqrt_rn(values.to(device)).cpu().view(torch.int32), expected.view(torch.int32))


def test_log2_is_within_its_bound_and_exact_at_powers_of_two(device):
    values = _random_floats(1_000_000, 5)
    got = log2(values.to(device)).cpu()
    exact = torch.from_numpy(np.log2(values.double().numpy()))
    half_ulp = torch.from_numpy(np.spacing(np.abs(got.numpy()))).double() / 2
    assert ((got.double() - exact).abs() - half_ulp).max() <= elementary.LOG2_ERROR_BEYOND_HALF_ULP
    exponents = torch.arange(-149, 128, dtype=torch.float64)
    assert torch.equal(log2(torch.exp2(exponents).float().to(device)).cpu(), exponents.float())


def test_exp2_is_within_its_bound_exact_at_integers_and_underflows_gradually(device):
    generator = torch.Generator().manual_seed(6)
    exponents = (torch.rand(1_000_000, generator=generator, dtype=torch.float64) * 254 - 127).float()
    got = exp2(exponents.to(device)).cpu().double()
    exact = torch.exp2(exponents.double())
    normal = exact >= torch.finfo(torch.float32).tiny
    assert ((got - exact).abs() / exact)[normal].max() <= elementary.EXP2_MAX_REL_ERROR
    integers = torch.arange(-160, 128, dtype=torch.float32)
    assert torch.equal(exp2(integers.to(device)).cpu(), torch.exp2(integers.double()).float())
    subnormal = (-126.0 - torch.rand(10_000, generator=generator, dtype=torch.float64) * 23).float()
    smallest = 2.0**-149
    off = (exp2(subnormal.to(device)).cpu().double() - torch.exp2(subnormal.double())).abs()
    assert off.max() <= smallest


def test_power_is_within_its_bound_on_coat_s_domain(device):
    generator = torch.Generator().manual_seed(7)
    bases = torch.rand(1_000_000, generator=generator)
    exponents = torch.rand(1_000_000, generator=generator) * 16 + 2.0**-10
    got = power(bases.to(device), exponents.to(device)).cpu().double()
    exact = torch.pow(bases.double(), exponents.double())
    normal = exact >= torch.finfo(torch.float32).tiny
    assert ((got - exact).abs() / exact)[normal].max() <= elementary.POWER_MAX_REL_ERROR
    assert power(torch.zeros(3, device=device), torch.full((3,), 2.5, device=device)).eq(0).all()
    assert power(torch.ones(3, device=device), torch.tensor([0.1, 1.0, 15.0], device=device)).eq(1).all()


def test_power_is_within_its_bound_for_every_exponent(device):
    """A sweep of k over [2^-10, 2^24] (log-uniform) with bases chosen so that x^k spans the normal range:
    the bound holds beyond k = 16 too, where the bases lie close to 1."""
    generator = torch.Generator().manual_seed(11)
    exponents = torch.exp2(torch.rand(1_000_000, generator=generator, dtype=torch.float64) * 34 - 10).float()
    log2_results = -torch.rand(1_000_000, generator=generator, dtype=torch.float64) * 126
    bases = torch.exp2(log2_results / exponents.double()).float().clamp(max=1.0)
    got = power(bases.to(device), exponents.to(device)).cpu().double()
    exact = torch.pow(bases.double(), exponents.double())
    normal = exact >= torch.finfo(torch.float32).tiny
    assert ((got - exact).abs() / exact)[normal].max() <= elementary.POWER_MAX_REL_ERROR
    assert (exponents[normal] > 16).sum() > 500_000


def _every_function(numerators, denominators, bases, exponents):
    return (
        div_rn(numerators, denominators),
        div_rn(numerators, 448.0),
        div_rn(17.8, denominators),
        sqrt_rn(denominators),
        log2(denominators),
        exp2(-exponents * 9),
        power(bases, exponents),
    )


@pytest.mark.parametrize(
    "native_devices, ieee_devices, ieee_division",
    [(("cpu",), (), False), ((), ("cpu",), True)],
    ids=["native", "as-on-gpus"],
)
def test_compiled_code_computes_the_same_bits_as_eager_code(native_devices, ieee_devices, ieee_division, monkeypatch):
    """Inductor's C++ code with each formulation (FP32 division and sqrt, as CPUs compile them; FP32 with
    float64 only for constant divisors, as GPUs compile them under ``division_rounding``) gives eager's
    bits."""
    monkeypatch.setattr(elementary, "NATIVE_FP32_DEVICES", native_devices)
    monkeypatch.setattr(elementary, "IEEE_FP32_DEVICES", ieee_devices)
    generator = torch.Generator().manual_seed(8)
    arguments = (
        _random_floats(50_000, 9) * torch.where(torch.arange(50_000) % 2 == 0, -1.0, 1.0),
        _random_floats(50_000, 10),
        torch.rand(50_000, generator=generator),
        torch.rand(50_000, generator=generator) * 16 + 0.01,
    )
    torch._dynamo.reset()
    compiled = torch.compile(_every_function, dynamic=True, fullgraph=True)
    with elementary.ieee_fp32_division() if ieee_division else contextlib.nullcontext():
        compiled_results = compiled(*arguments)
    for eager_result, compiled_result in zip(_every_function(*arguments), compiled_results):
        assert torch.equal(eager_result.view(torch.int32), compiled_result.view(torch.int32))
    torch._dynamo.reset()


def _traced_dtypes(function, *arguments) -> set[torch.dtype]:
    """The dtypes of every value in the graph that Dynamo traces for ``function``."""
    dtypes = set()

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            value = node.meta.get("example_value")
            if torch.is_tensor(value):
                dtypes.add(value.dtype)
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(function, backend=backend, fullgraph=True)(*arguments)
    torch._dynamo.reset()
    return dtypes


def test_compiled_division_and_sqrt_use_fp32_on_gpus_under_ieee_division(monkeypatch):
    """As traced for a GPU (IEEE_FP32_DEVICES): FP32 sqrt always, FP32 division under
    :func:`ieee_fp32_division` (float64 without it, and for constant divisors, which Inductor turns into
    reciprocal products)."""
    monkeypatch.setattr(elementary, "NATIVE_FP32_DEVICES", ())
    monkeypatch.setattr(elementary, "IEEE_FP32_DEVICES", ("cpu",))
    x, y = torch.rand(8) + 1, torch.rand(8) + 1
    assert _traced_dtypes(sqrt_rn, x) == {torch.float32}
    assert torch.float64 in _traced_dtypes(div_rn, x, y)
    with elementary.ieee_fp32_division():
        assert _traced_dtypes(div_rn, x, y) == {torch.float32}
        assert _traced_dtypes(lambda value: div_rn(17.8, value), y) == {torch.float32}
        assert torch.float64 in _traced_dtypes(lambda value: div_rn(value, 448.0), x)
        assert _traced_dtypes(lambda value, divisor: div_rn(value, divisor), x, torch.tensor(448.0)) == {torch.float32}
    monkeypatch.setattr(elementary, "IEEE_FP32_DEVICES", ())
    assert torch.float64 in _traced_dtypes(sqrt_rn, x)
