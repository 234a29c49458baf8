"""The fused step as Inductor's Triton code computes it, emulated on CPU: bit for bit the eager step.

Measured on an H100 (issue 12): Inductor's Triton code keeps the casts at loads and
stores but removes every round trip ``x.to(bf16).to(fp32)`` between two FP32 operations, even with
``emulate_precision_casts``. The CPU fused tests cannot see that, since Inductor's C++ code keeps
them. Here the fused step's compiled call is replaced by that compiler's behaviour: the very
function it compiles, :func:`~megatron_lowprec.optim.kernel.adamw_kernel_`, traced into an aten
graph (``make_fx``), with every FP32 -> 16-bit -> FP32 conversion pair bypassed, run on CPU. The
buckets, segments and stream layouts are the fused path's own. A rounding that a compiler can
remove makes this emulation differ from the eager step, as the mutation tests show.

The second part captures the aten graph that Inductor lowers for the step (its decompositions
applied) in the formulation used where it emits Triton, and checks that every floating-point
operation in it is one that IEEE 754 fixes to the bit: no FP32 division or square root (Triton
approximates the one and flushes subnormals in the other; both are done in float64 there), no
``pow``, ``log`` or ``exp`` (each backend has its own), no fused or reordered arithmetic.
"""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from megatron_lowprec.numerics import elementary, formats, mcf
from megatron_lowprec.numerics import quant as quant_module
from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim import AdamW, available_strategies, get_strategy
from megatron_lowprec.optim import codecs as codecs_module
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
    """The fused step as Triton compiles it, run on CPU: the code GPUs run (roundings that survive
    compilation, not the bare round trips that CPUs keep) with every float round trip dropped."""
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
    monkeypatch.setattr(kernel_module, "rounded_to", lambda values, dtype: values.to(dtype))
    monkeypatch.setattr(codecs_module, "rounded_to", lambda values, dtype: values.to(dtype))
    twins = _run_twins(option, torch.bfloat16, steps=5)
    assert _differing_elements(twins) > 0


def test_the_stochastic_rounding_step_has_no_64_bit_integer(round_trip_free_kernel):
    """Triton refused the fused SR step inside the Megatron hook ("Cannot bitcast data-type of size
    64 to data-type of size 32") while its stream offsets were int64: the step gets int32 words."""
    _run_twins("sr", torch.bfloat16, steps=1)
    dtypes = {_dtype(node) for graph in round_trip_free_kernel.graphs.values() for node in graph.graph.nodes}
    assert torch.int32 in dtypes and torch.int64 not in dtypes


@pytest.mark.parametrize(
    ("option", "param_dtype"),
    [(option, dtype) for option in OPTIONS for dtype in (torch.bfloat16, torch.float16)
     if dtype == torch.bfloat16 or get_strategy(option).master_storage != "remainder"],
)
def test_the_roundings_of_gpus_and_the_casts_of_cpus_give_the_same_steps(option, param_dtype, monkeypatch):
    """The eager step with GPU roundings (BF16: the cast through its bits; FP16: integer) equals the
    eager step with CPU roundings (casts)."""
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
    for gpu, cpu in zip(*runs):
        assert torch.equal(gpu.view(torch.uint8), cpu.view(torch.uint8))


EXACT_FLOAT_OPS = {
    torch.ops.aten.add.Tensor,
    torch.ops.aten.sub.Tensor,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.neg.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.copysign.Tensor,
    torch.ops.aten.round.default,
    torch.ops.aten.clamp.default,
    torch.ops.aten.clamp_min.default,
    torch.ops.aten.clamp_max.default,
    torch.ops.aten.maximum.default,
    torch.ops.aten.minimum.default,
    torch.ops.aten.amax.default,
    torch.ops.aten.amin.default,
    torch.ops.aten.where.self,
    torch.ops.aten.eq.Scalar,
    torch.ops.aten.ne.Scalar,
    torch.ops.aten.gt.Scalar,
    torch.ops.aten.lt.Scalar,
    torch.ops.aten.ge.Scalar,
    torch.ops.aten.le.Scalar,
    torch.ops.aten.eq.Tensor,
    torch.ops.aten.ne.Tensor,
    torch.ops.aten.gt.Tensor,
    torch.ops.aten.lt.Tensor,
    torch.ops.aten.ge.Tensor,
    torch.ops.aten.le.Tensor,
    torch.ops.aten.isinf.default,
    torch.ops.aten.isnan.default,
    torch.ops.aten.logical_not.default,
    torch.ops.aten.constant_pad_nd.default,
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.copy.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.permute.default,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.view.dtype,
    torch.ops.aten.alias.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
}
"""Operations on floating-point tensors whose result IEEE 754 fixes to the bit (exact, or correctly
rounded +, - and *), or that only move, compare or convert values: every backend computes them alike."""

FLOAT64_ONLY_OPS = {torch.ops.aten.div.Tensor, torch.ops.aten.sqrt.default, torch.ops.prims.div.default, torch.ops.prims.sqrt.default}
"""Correctly rounded everywhere in float64 (PTX has no approximate FP64 division or square root), but
not in FP32 on GPUs: Triton's FP32 ``/`` is ``div.full.f32``, its square root flushes subnormals."""


def _float_inexact_operations(graph_module: torch.fx.GraphModule) -> list[str]:
    """Each node that computes on floating-point values with an operation some backend does not
    compute to the bit (any op outside :data:`EXACT_FLOAT_OPS`, or FP32 division / square root)."""
    found = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
        float_dtypes = {value.dtype for value in values if isinstance(value, torch.Tensor) and value.dtype.is_floating_point}
        if not float_dtypes or node.target in EXACT_FLOAT_OPS:
            continue
        if node.target in FLOAT64_ONLY_OPS and _dtype(node) == torch.float64:
            continue
        found.append(f"{node.target} on {sorted(str(d) for d in float_dtypes)}")
    return found


class CapturingCompiler:
    """``fused.compiled_kernel`` with a backend that records the aten graph Inductor would lower
    (Inductor's decompositions applied) and runs it as it is."""

    def __init__(self):
        self.graphs = []

    def backend(self, graph_module, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._inductor.decomposition import select_decomp_table

        def record(graph, inputs):
            self.graphs.append(graph)
            return make_boxed_func(graph.forward)

        return aot_module_simplified(graph_module, example_inputs, fw_compiler=record, decompositions=select_decomp_table())

    def __call__(self, group_statistics=False):
        compiled = torch.compile(kernel_module.bucket_kernel_, backend=self.backend, dynamic=True, fullgraph=True)
        return torch._dynamo.config.patch(specialize_int=True, specialize_float=True)(compiled)


COMPILED_STRATEGIES = [s for s in available_strategies() if s.adam_kernel == "reference"] + [
    get_strategy("coat").with_master_storage("remainder"),
    get_strategy("D-BF16").with_master_storage("fp32"),
]


@pytest.fixture
def gpu_formulation(monkeypatch):
    """What the fused step computes where Inductor emits Triton: 16-bit roundings that survive compilation, division
    and square root through float64 (as on a device outside ``elementary.IEEE_FP32_DEVICES``; CUDA's
    FP32 ``div.rn``/``sqrt.rn`` formulation is checked in its PTX by ``tools/kernel_audit/audit.py``), stochastic
    rounding once per bucket."""
    monkeypatch.setattr(formats, "CAST_ROUNDING_DEVICES", ())
    monkeypatch.setattr(elementary, "NATIVE_FP32_DEVICES", ())
    monkeypatch.setattr(fused_module, "BUCKET_STREAM_DEVICES", ("cuda", "cpu"))
    compiler = CapturingCompiler()
    monkeypatch.setattr(fused_module, "compiled_kernel", compiler)
    torch._dynamo.reset()
    yield compiler
    torch._dynamo.reset()


def _run_fused(strategy, steps=2, track_update_quality=False):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in SHAPES]
    optimizer = AdamW(
        params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=strategy, fused=True,
        track_update_quality=track_update_quality,
    )
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).bfloat16()
        optimizer.step()


@pytest.mark.parametrize(
    "strategy", COMPILED_STRATEGIES, ids=lambda s: f"{s.name}:{s.master_storage}" if s.master_weights else s.name
)
def test_every_floating_point_operation_of_the_compiled_step_is_exact_on_every_backend(strategy, gpu_formulation):
    """The aten graph that Inductor lowers for a GPU holds no FP32 division, reciprocal or square root
    and no pow, log, exp or other function that backends approximate differently."""
    _run_fused(strategy)
    assert gpu_formulation.graphs, "the fused path did not call the compiled kernel"
    for graph in gpu_formulation.graphs:
        assert _float_inexact_operations(graph) == []


@pytest.mark.parametrize("module", [kernel_module, quant_module], ids=["adam-update", "coat-quantization"])
def test_a_plain_fp32_division_is_found(module, gpu_formulation, monkeypatch):
    """Mutation: one of the step's divisions back to the FP32 ``/`` that Triton approximates."""
    monkeypatch.setattr(module, "div_rn", lambda numerator, denominator: numerator / denominator)
    _run_fused(get_strategy("coat"), steps=1)
    found = [operation for graph in gpu_formulation.graphs for operation in _float_inexact_operations(graph)]
    assert any("div" in operation or "reciprocal" in operation for operation in found)


def test_torch_s_pow_and_log_are_found(gpu_formulation, monkeypatch):
    """Mutation: COAT's expansion back to torch's pow and log (SLEEF, Inductor's vector functions and
    libdevice differ)."""
    monkeypatch.setattr(quant_module, "power", torch.pow)
    monkeypatch.setattr(quant_module, "log2", torch.log2)
    _run_fused(get_strategy("coat"), steps=1)
    found = " ".join(operation for graph in gpu_formulation.graphs for operation in _float_inexact_operations(graph))
    assert "pow" in found and "log2" in found
