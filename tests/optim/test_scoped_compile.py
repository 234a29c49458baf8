"""The package's compiler settings stay its own: Dynamo's recompile limit and shape settings apply
around its compiled calls only, a user's ``torch.compile`` sees torch's defaults after our fused step
ran, and outside the torch and triton versions ``numerics/inductor.py`` was written for, the fused
step is the eager one (the same bits) after one warning line."""

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from megatron_lowprec.numerics import compiled, inductor, square_sum
from megatron_lowprec.optim import AdamW
from megatron_lowprec.optim import fused as fused_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0a0+b4e4ee81d3", "2.11.0+cu130", "2.13.0+cpu", "2.14.1"])
def test_the_supported_torch_releases_are_2_10_to_2_14(version):
    assert inductor.version_problem("torch", version, inductor.SUPPORTED_TORCH) is None


@pytest.mark.parametrize("version", ["2.9.1", "2.15.0", "3.0.0", "unknown"])
def test_another_torch_is_named_in_one_line(version):
    problem = inductor.version_problem("torch", version, inductor.SUPPORTED_TORCH)
    assert problem == (
        f"torch {version} is outside the versions whose compiler internals megatron-lowprec was written for (2.10 to 2.14)"
    )


def test_the_supported_triton_releases_are_3_6_to_3_9():
    supported = inductor.SUPPORTED_TRITON
    assert all(inductor.version_problem("triton", version, supported) is None for version in ("3.6.0", "3.7.1", "3.9.0", None))
    assert all(inductor.version_problem("triton", version, supported) for version in ("3.5.1", "3.10.0"))


def test_triton_counts_on_cuda_only(monkeypatch):
    monkeypatch.setattr(inductor, "TORCH_PROBLEM", None)
    monkeypatch.setattr(inductor, "TRITON_PROBLEM", "triton 3.10.0 is outside")
    assert inductor.unsupported_reason("cpu") is None
    assert inductor.unsupported_reason("cuda") == "triton 3.10.0 is outside"


@pytest.fixture
def unsupported_torch(monkeypatch):
    """This process's torch taken as one outside :data:`~megatron_lowprec.numerics.inductor.SUPPORTED_TORCH`;
    nothing may compile."""
    problem = inductor.version_problem("torch", "2.99.0", inductor.SUPPORTED_TORCH)
    monkeypatch.setattr(inductor, "TORCH_PROBLEM", problem)
    inductor.warn_unsupported.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError("compiled outside the supported versions")

    monkeypatch.setattr(torch, "compile", refuse)
    yield problem
    inductor.warn_unsupported.cache_clear()


def test_outside_the_supported_versions_the_fused_step_is_the_eager_one_after_one_warning(unsupported_torch):
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).bfloat16() for shape in ((1000,), (7, 13))]
    twins = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fused in (False, None, None):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            twins.append((params, AdamW(params, lr=1e-2, weight_decay=0.1, option="C", seed=3, fused=fused)))
        for step in range(3):
            grads = [torch.randn(t.shape, generator=generator).bfloat16() for t in start]
            for params, optimizer in twins:
                for param, grad in zip(params, grads):
                    param.grad = grad.clone()
                optimizer.step()
    lines = [str(w.message) for w in caught if issubclass(w.category, inductor.EagerFallbackWarning)]
    assert lines == [f"{unsupported_torch}: the fused optimizer steps and compiled kernels run eagerly (the same bits, slower)"]
    for params, _ in twins[1:]:
        for param, reference in zip(params, twins[0][0]):
            assert torch.equal(param.detach().view(torch.int16), reference.detach().view(torch.int16))
    with pytest.raises(ValueError, match=r"fused=True cannot compile the step on cpu: torch 2\.99\.0 is outside"):
        fused_module.resolve_fused(torch.device("cpu"), True)


def test_outside_the_supported_versions_the_norm_and_coat_layers_run_eagerly(unsupported_torch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    square_sum._compiled_digit_sums.cache_clear()
    try:
        with pytest.warns(inductor.EagerFallbackWarning, match="torch 2.99.0"):
            assert square_sum._compiled_digit_sums() == (square_sum._windowed_digit_sums, square_sum._torch_digit_sums)
    finally:
        square_sum._compiled_digit_sums.cache_clear()
    assert compiled.compiled_where_fp8_converts(torch.neg, torch.device("cuda")) is torch.neg


def test_the_recompile_limit_set_around_each_call_is_enough_and_the_user_s_stays_torch_s(monkeypatch):
    """Dynamo reads its recompile limit when a call recompiles: the limit that
    :func:`~megatron_lowprec.numerics.inductor.compile_scoped` sets around each call (not at its
    creation) lets a function compile once per specialised integer past torch's default, and a
    function compiled by the user still stops at that default."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: real_compile(function, dynamic=True, fullgraph=True, backend="eager"))
    default = torch._dynamo.config.recompile_limit

    def ours(x, n):
        return x + n

    def users(x, n):
        return x * n

    scoped = inductor.compile_scoped(ours, {}, specialize_numbers=True, recompile_limit=default + 4)
    x = torch.ones(3)
    for n in range(default + 4):
        assert torch.equal(scoped(x, n), x + n)
    assert torch._dynamo.config.recompile_limit == default and not torch._dynamo.config.specialize_float
    with pytest.raises(inductor.recompile_limit_error()):
        scoped(x, default + 4)
    user_compiled = real_compile(users, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(specialize_int=True), pytest.raises(inductor.recompile_limit_error()):
        for n in range(default + 1):
            user_compiled(x, n)


CONFIG_SNAPSHOT = textwrap.dedent("""
    import torch
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen import cpp
    from torch.fx.experimental import _config as shapes_config

    CONFIGS = {"dynamo": dynamo_config, "inductor": inductor_config, "functorch": functorch_config,
               "fx.experimental": shapes_config, "compiler": torch.compiler.config}

    def snapshot():
        values = {f"{name}.{key}": repr(value) for name, module in CONFIGS.items() for key, value in module.get_config_copy().items()}
        values["cpp.TilingSelect"] = repr(cpp.TilingSelect)
        values["cpp.CppScheduling.can_fuse_vertical_outer_loop"] = repr(cpp.CppScheduling.can_fuse_vertical_outer_loop)
        return values

    before = snapshot()
    from megatron_lowprec.optim import AdamW

    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in ((1000,), (7, 13))]
    optimizer = AdamW(params, option="A", fused=True, background_compile=False)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape).bfloat16()
        optimizer.step()
    after = snapshot()
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    print("changed:", changed)
""")


def test_a_user_s_torch_compile_sees_torch_s_defaults_after_our_fused_step():
    """In a fresh process: every Dynamo, Inductor, AOT, symbolic-shape and compiler setting, and the
    Inductor classes the fused step patches while it compiles, captured before the package is
    imported, are the same after two compiled fused steps."""
    result = subprocess.run([sys.executable, "-c", CONFIG_SNAPSHOT], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "changed: []"
