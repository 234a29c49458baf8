"""The fused step as Inductor's Triton code computes it, emulated on CPU: bit for bit the eager step.

Measured on an H100 (gpu/FINDINGS.md, issue 12): Inductor's Triton code keeps the casts at loads and
stores but removes every round trip ``x.to(bf16).to(fp32)`` between two FP32 operations, even with
``emulate_precision_casts``. The CPU fused tests cannot see that, since Inductor's C++ code keeps
them. Here the fused step's compiled call is replaced by that compiler's behaviour: the very
function it compiles, :func:`~megatron_lowprec.optim.kernel.adamw_kernel_`, traced into an aten
graph (``make_fx``), with every FP32 -> 16-bit -> FP32 conversion pair bypassed, run on CPU. The
buckets, segments and stream layouts are the fused path's own. A rounding that a compiler can
remove makes this emulation differ from the eager step, as the mutation tests show.
"""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from megatron_lowprec.numerics import formats, mcf
from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim import AdamW, available_strategies
from megatron_lowprec.optim import fused as fused_module
from megatron_lowprec.optim import kernel as kernel_module
from megatron_lowprec.optim.kernel import StepScalars, adamw_kernel_

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
CONVERSION = torch.ops.aten._to_copy.default
STRUCTURAL_OPS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.view.dtype,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}
"""Operations that may output a 16-bit float without computing in it."""

OPTIONS = [
    strategy.name
    for strategy in available_strategies()
    if strategy.adam_kernel == "reference" and strategy.moments != "fp8"
]
"""Every option whose step is elementwise FP32 and integer arithmetic (D and coat call ATen kernels)."""

SHAPES = [(1000,), (3,), (129,), (4097,), (7, 13), (6, 40), (300,)]


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def drop_round_trips(graph_module: torch.fx.GraphModule) -> int:
    """Bypass every ``x.to(16-bit).to(float32)`` with FP32 ``x``, as Inductor's Triton code does;
    return how many. Fails on any arithmetic computed in a 16-bit dtype, which that compiler would
    compute in FP32 too: the step must not have any."""
    dropped = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if _dtype(node) in SIXTEEN_BIT and node.target not in STRUCTURAL_OPS:
            raise AssertionError(f"{node.target} computes in {_dtype(node)}")
        source = node.args[0] if node.args else None
        if (
            node.target is CONVERSION
            and _dtype(node) == torch.float32
            and isinstance(source, torch.fx.Node)
            and source.target is CONVERSION
            and _dtype(source) in SIXTEEN_BIT
            and _dtype(source.args[0]) == torch.float32
        ):
            node.replace_all_uses_with(source.args[0])
            dropped += 1
    graph_module.recompile()
    return dropped


class RoundTripFreeKernel:
    """A stand-in for the compiled :func:`adamw_kernel_`: traced on fake tensors once per strategy
    and argument shapes, round trips dropped, then run eagerly (the graph's in-place copies update
    the buffers)."""

    def __init__(self):
        self.graphs = {}
        self.dropped = 0

    def __call__(self, param, grad, state, strategy, scalars, beta2_expansion, random_source, want_update):
        scalar_values = tuple(getattr(scalars, field.name) for field in dataclasses.fields(scalars))
        arguments = (param, grad, state, scalar_values, beta2_expansion, random_source)
        leaves, spec = pytree.tree_flatten(arguments)
        key = (strategy, want_update, str(spec), tuple((leaf.shape, leaf.dtype) for leaf in leaves if torch.is_tensor(leaf)))
        if key not in self.graphs:

            def body(param, grad, state, scalar_values, beta2_expansion, random_source):
                return adamw_kernel_(
                    param, grad, state, strategy, StepScalars(*scalar_values), beta2_expansion, random_source, want_update
                )

            self.graphs[key] = make_fx(body, tracing_mode="fake")(*arguments)
            self.dropped += drop_round_trips(self.graphs[key])
        return self.graphs[key](*arguments)


@pytest.fixture
def round_trip_free_kernel(monkeypatch):
    """The fused step as Triton compiles it, run on CPU: the code GPUs run (integer roundings, not the
    casts that CPUs keep) with every float round trip dropped."""
    kernel = RoundTripFreeKernel()
    monkeypatch.setattr(fused_module, "compiled_kernel", lambda *flags: kernel)
    monkeypatch.setattr(formats, "CAST_ROUNDING_DEVICES", ())
    return kernel


def _shard_layout(param: torch.nn.Parameter) -> StreamLayout:
    """Megatron-hook-like layouts: 2-D parameters as rank 1 of 2 of a tensor split along dim 1."""
    if param.dim() == 2:
        return StreamLayout.shard(param.shape[0] * 1000 + param.shape[1], tuple(param.shape), 1, 1, 2)
    return StreamLayout.whole(param.numel(), param.numel())


def _run_twins(option, param_dtype, steps, seed=0):
    """``steps`` steps of the eager optimizer and of the fused one on the same gradients, scaled over
    seven decades in BF16, five in FP16 (whose (1 - β2) g² overflows past |g| ~ 1000); returns both
    (params, optimizer)."""
    top_decade = 3 if param_dtype == torch.bfloat16 else 0
    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(shape, generator=generator).to(param_dtype) for shape in SHAPES]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=option, seed=3, stream_layout=_shard_layout)
    twins = []
    for fused in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        twins.append((params, AdamW(params, fused=fused, **hyper)))
    for step in range(steps):
        for p, q in zip(twins[0][0], twins[1][0]):
            grad = (torch.randn(p.shape, generator=generator) * 10.0 ** (top_decade - step % 7)).to(param_dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        for _, optimizer in twins:
            optimizer.step()
    return twins


def _differing_elements(twins) -> int:
    (eager_params, eager_optimizer), (fused_params, fused_optimizer) = twins
    differing = 0
    for p, q in zip(eager_params, fused_params):
        differing += int((p.detach().view(torch.int16) != q.detach().view(torch.int16)).sum())
        for key, value in eager_optimizer.state[p].items():
            if torch.is_tensor(value):
                differing += int((value.view(torch.uint8) != fused_optimizer.state[q][key].view(torch.uint8)).sum())
    return differing


@pytest.mark.parametrize(
    ("option", "param_dtype"),
    [(option, torch.bfloat16) for option in OPTIONS]
    + [(option, torch.float16) for option in ("B", "C", "kahan", "sr")],
)
def test_fused_step_without_round_trips_is_bit_identical_to_the_eager_step(option, param_dtype, round_trip_free_kernel):
    twins = _run_twins(option, param_dtype, steps=20)
    assert round_trip_free_kernel.graphs, "the fused path did not call the compiled kernel"
    assert _differing_elements(twins) == 0


def test_the_emulation_sees_a_rounding_done_by_casts_in_mcf(round_trip_free_kernel, monkeypatch):
    """Mutation: MCF's rounding back to the cast round trip. Eager results are unchanged (the casts
    round alike there), but a compiler that drops round trips computes other numbers."""
    monkeypatch.setattr(mcf, "_round", lambda wide_value, dtype: wide_value.to(dtype).to(wide_value.dtype))
    twins = _run_twins("B", torch.bfloat16, steps=5)
    assert round_trip_free_kernel.dropped > 0
    assert _differing_elements(twins) > 0


@pytest.mark.parametrize("option", ["C", "kahan"])
def test_the_emulation_sees_a_rounding_done_by_a_cast_in_the_kernel(option, round_trip_free_kernel, monkeypatch):
    """Mutation: the kernel's rounding of an operand (Collage-plus' (1 - β2) g², Kahan's compensated
    update) back to a plain cast."""
    monkeypatch.setattr(kernel_module, "_rounded_to", lambda values, dtype: values.to(dtype))
    twins = _run_twins(option, torch.bfloat16, steps=5)
    assert _differing_elements(twins) > 0


def test_the_stochastic_rounding_step_has_no_64_bit_integer(round_trip_free_kernel):
    """Triton refused the fused SR step inside the Megatron hook ("Cannot bitcast data-type of size
    64 to data-type of size 32") while its stream offsets were int64: the step gets int32 words."""
    _run_twins("sr", torch.bfloat16, steps=1)
    dtypes = {_dtype(node) for graph in round_trip_free_kernel.graphs.values() for node in graph.graph.nodes}
    assert torch.int32 in dtypes and torch.int64 not in dtypes


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("option", OPTIONS)
def test_the_integer_roundings_of_gpus_and_the_casts_of_cpus_give_the_same_steps(option, param_dtype, monkeypatch):
    """The eager step with GPU roundings (integer) equals the eager step with CPU roundings (casts)."""
    runs = []
    for devices in (("cpu",), ()):
        monkeypatch.setattr(formats, "CAST_ROUNDING_DEVICES", devices)
        generator = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(param_dtype)) for shape in SHAPES]
        optimizer = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=option, seed=3, fused=False)
        for _ in range(10):
            for param in params:
                param.grad = (torch.randn(param.shape, generator=generator) * 1e-2).to(param_dtype)
            optimizer.step()
        runs.append([param.detach().clone() for param in params] + [
            value.clone() for param in params for value in optimizer.state[param].values() if torch.is_tensor(value)
        ])
    for integer, cast in zip(*runs):
        assert torch.equal(integer.view(torch.uint8), cast.view(torch.uint8))
