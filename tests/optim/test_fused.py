"""The fused (compiled, per-bucket) step against the eager reference (per parameter): bit for bit, on
every device (Inductor compiles C++ on the CPU, Triton on CUDA). The tiling tests at the end reach into
Inductor's C++ code generator and are CPU-only."""

import warnings

import pytest
import torch

from megatron_lowprec.numerics import inductor
from megatron_lowprec.optim import AdamW, PrecisionStrategy, get_strategy
from megatron_lowprec.optim import fused as fused_module
from megatron_lowprec.optim import torch_fused
from megatron_lowprec.optim.kernel import bucket_kernel_
from megatron_lowprec.optim.fused import EagerFallbackWarning, fused_available

from ..allocations import measure_allocations
from .conftest import OPTIONS

pytestmark = pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")

@pytest.fixture
def device(device):
    """The suite's device, skipped where torch.compile cannot build the fused step (no Triton on CUDA)."""
    if not fused_available(device):
        pytest.skip(f"torch.compile cannot build the fused step on {device.type}: no Triton")
    return device


SHAPES = [(1000,), (3,), (129,), (4097,), (7, 13), (300,)]
"""Mixed sizes, most of them not multiples of the bucket alignment or of COAT's group of 128."""


def _twin_optimizers(option, grad_dtype=torch.bfloat16, param_dtype=torch.bfloat16, device=None, **kwargs):
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).to(device, param_dtype) for shape in SHAPES]
    eager_params = [torch.nn.Parameter(t.clone()) for t in start]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=option, seed=3, **kwargs)
    for p in eager_params + fused_params:
        p.grad_dtype = grad_dtype
    return (eager_params, AdamW(eager_params, fused=False, **hyper)), (fused_params, AdamW(fused_params, fused=True, **hyper))


def _step_twins(eager, fused, steps, seed, grad_dtype=torch.bfloat16, scale=lambda step: 1.0):
    """``steps`` steps of both optimizers on the same random gradients."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for p, q in zip(eager[0], fused[0]):
            grad = (torch.randn(p.shape, generator=generator) * scale(step)).to(p.device, grad_dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        eager[1].step()
        fused[1].step()


def _assert_bit_identical(eager, fused):
    (eager_params, eager_optimizer), (fused_params, fused_optimizer) = eager, fused
    for index, (p, q) in enumerate(zip(eager_params, fused_params)):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), f"parameter {index}"
        for key, value in eager_optimizer.state[p].items():
            other = fused_optimizer.state[q][key]
            if torch.is_tensor(value):
                assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)), f"state {key} of parameter {index}"
            else:
                assert value == other


def _update_path(option: str) -> tuple[type, str]:
    """What a step's update and its update-quality pieces go through: the parameter codec (the
    represented value, how Δθ reaches it) and the Adam kernel."""
    strategy = get_strategy(option)
    return type(strategy.param_codec), strategy.adam_kernel


FP32_GRADIENT_OPTIONS = [option for option in OPTIONS if not get_strategy(option).moment_codec.grouped] + [
    option for option in OPTIONS if get_strategy(option).moment_codec.grouped
    and _update_path(option) not in {_update_path(other) for other in OPTIONS if not get_strategy(other).moment_codec.grouped}
]
"""Every option without 8-bit moments, and each 8-bit-moment option whose update path no such option
has (coat's whole master under the reference kernel, res8's residual): an FP32 gradient is read and
the update-quality pieces taken alike beside every moment codec, and each 8-bit moment codec
compiles in the contract matrix. sr8 (stochastic rounding, as sr) compiles tracked in
``tests/megatron/test_distributed_optimizer.py`` (its distributed optimizer's fused step)."""


@pytest.mark.parametrize("option", FP32_GRADIENT_OPTIONS)
def test_fused_step_is_bit_identical_to_the_eager_reference_with_fp32_gradients(option, device):
    """Each option of :data:`FP32_GRADIENT_OPTIONS`, coat's dynamic range expansion included (its log
    and pow are the package's own, numerics/elementary.py, so Inductor's vector functions never
    enter), with FP32 gradients, both
    twins tracking update quality (read from the step's values, no bit changed): that compiled step is
    the one whose pieces ``test_fused_update_quality_equals_the_reference`` checks, compiled once.
    21 steps: three cycles of gradients from 10^-3 to 10^3. (BF16 gradients: the contract matrix,
    ``tests/optim/test_contract.py``.)"""
    eager, fused = _twin_optimizers(option, torch.float32, device=device, track_update_quality=True)
    _step_twins(eager, fused, steps=21, seed=1, grad_dtype=torch.float32, scale=lambda step: 10.0 ** (step % 7 - 3))
    _assert_bit_identical(eager, fused)


@pytest.mark.parametrize("option", ["sr8", "res8"])
def test_int8_moments_step_fused_bit_for_bit_as_the_eager_reference(option, device):
    """Companded INT8 moments (``moment_storage="int8"``) on sr8's stochastic rounding and res8's 8-bit
    residual master: the compiled step per bucket, over its groups of 128, gives the eager step's bits,
    gradients from 10^-3 to 10^3 (7 steps: one cycle)."""
    eager, fused = _twin_optimizers(option, device=device, moment_storage="int8")
    _step_twins(eager, fused, steps=7, seed=1, scale=lambda step: 10.0 ** (step % 7 - 3))
    _assert_bit_identical(eager, fused)
    state = fused[1].buckets[0].state
    assert (state["exp_avg_payload"].dtype, state["exp_avg_sq_payload"].dtype, state["exp_avg_scale"].dtype) == (
        torch.int8, torch.uint8, torch.bfloat16
    )


@pytest.mark.parametrize("option", ["A", "C", "kahan", "sr"])
def test_float16_parameters_are_bit_identical_too(option, device):
    eager, fused = _twin_optimizers(
        option, grad_dtype=torch.float16, param_dtype=torch.float16, device=device
    )
    _step_twins(eager, fused, steps=20, seed=5, grad_dtype=torch.float16)
    _assert_bit_identical(eager, fused)


@pytest.mark.parametrize("option", ["C", "sr"])
def test_parameters_without_gradient_fall_back_to_the_reference_and_stay_identical(option, device):
    eager, fused = _twin_optimizers(option, device=device)
    generator = torch.Generator().manual_seed(2)
    for step in range(6):
        for index, (p, q) in enumerate(zip(eager[0], fused[0])):
            grad = torch.randn(p.shape, generator=generator).to(device, torch.bfloat16) if (index + step) % 3 else None
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        eager[1].step()
        with pytest.warns(EagerFallbackWarning) as caught:
            fused[1].step()
        first_without = next(index for index, q in enumerate(fused[0]) if q.grad is None)
        (message,) = [str(warning.message) for warning in caught]
        assert message.startswith(f"parameter {first_without} of group 0 (shape {SHAPES[first_without]}) took the eager")
        assert message.endswith("it has no gradient, and its bucket steps together or not at all")
    _assert_bit_identical(eager, fused)


def _profiled_step_events(optimizer, params, generator) -> list[str]:
    """The names of the profiler events of one step on random gradients."""
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    return [event.name for event in profile.events()]


def test_the_fused_step_runs_the_compiled_kernel_and_no_eager_arithmetic(device):
    """One compiled region and one compiled graph per bucket call (profiler events that Dynamo and
    Inductor record), and none of the eager reference's division and square root; the eager step,
    profiled the same way, shows the opposite."""
    (eager_params, eager_optimizer), (fused_params, fused_optimizer) = _twin_optimizers("B", device=device)
    generator = torch.Generator().manual_seed(5)
    _profiled_step_events(fused_optimizer, fused_params, generator)
    for optimizer, params, compiled in ((fused_optimizer, fused_params, True), (eager_optimizer, eager_params, False)):
        names = _profiled_step_events(optimizer, params, generator)
        regions = [name for name in names if name.startswith("Torch-Compiled Region")]
        graphs = [name for name in names if name.startswith("## Call CompiledFxGraph")]
        eager_arithmetic = [name for name in names if name in ("aten::div", "aten::sqrt", "aten::addcmul_", "aten::lerp_")]
        assert (len(regions), len(graphs), bool(eager_arithmetic)) == ((1, 1, False) if compiled else (0, 0, True))


def test_a_call_past_the_recompile_limit_runs_eagerly_with_a_warning_and_the_same_bits(monkeypatch):
    def refusing_kernel(group_statistics=False):
        def call(*args):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit")

        return call

    monkeypatch.setattr(fused_module, "compiled_kernel", refusing_kernel)
    eager, fused = _twin_optimizers("B")
    with pytest.warns(EagerFallbackWarning, match=r"bucket of parameter group 0 .*recompile limit"):
        _step_twins(eager, fused, steps=2, seed=4)
    _assert_bit_identical(eager, fused)


@pytest.mark.parametrize("option, device_type, recomputed", [
    ("coat", "cpu", False), ("coat", "cuda", True), ("A", "cuda", False),
])
def test_fp8_group_statistics_are_recomputed_in_the_kernel_on_gpus_only(option, device_type, recomputed, monkeypatch):
    """The FP8-moment step compiles with GROUP_STATISTICS_OPTIONS (recompute, no bucket-sized FP32
    temporaries) for GPUs, where memory traffic limits it, and without them on CPUs, where they cost
    a third of COAT's compile; other strategies never take them."""
    from megatron_lowprec.optim import get_strategy

    assert fused_module.group_statistics_in_kernel(get_strategy(option), torch.device(device_type)) is recomputed
    asked = []
    monkeypatch.setattr(fused_module, "compiled_kernel", lambda group_statistics=False: asked.append(group_statistics) or fused_module.bucket_kernel_)
    eager, fused = _twin_optimizers(option)
    _step_twins(eager, fused, steps=1, seed=2)
    _assert_bit_identical(eager, fused)
    assert asked and set(asked) == {False}


def test_group_statistics_compile_without_the_scheduler_pass_class(monkeypatch):
    """torch 2.11 has Inductor's post-fusion pass option but not ``CustomSchedulerPass`` (on an H200
    every COAT step failed to compile on that import): the step then compiles without the pass."""
    import torch._inductor.custom_graph_pass as custom_graph_pass

    def compile_options() -> dict:
        captured = {}
        monkeypatch.setattr(torch, "compile", lambda function, **kwargs: captured.update(kwargs) or function)
        step = fused_module.compile_step_function(lambda x: x + 1, group_statistics=True)
        assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))
        return captured["options"]

    inductor.fusion_after_reordering.cache_clear()
    assert inductor.POST_FUSION_OPTION in compile_options()
    monkeypatch.delattr(custom_graph_pass, "CustomSchedulerPass")
    inductor.fusion_after_reordering.cache_clear()
    try:
        assert inductor.fusion_after_reordering() is None
        assert inductor.POST_FUSION_OPTION not in compile_options()
    finally:
        inductor.fusion_after_reordering.cache_clear()


def test_the_group_statistics_pass_pickles_so_that_inductor_caches_the_fp8_step():
    """Inductor pickles its FX graph cache key, the post-fusion pass included (keyed by its ``uuid``):
    a pass that did not pickle made every FP8-moment step compiled for a GPU bypass the cache (a
    background compile then filled nothing, and each rank compiled again). It pickles as itself."""
    import pickle

    fusion = inductor.fusion_after_reordering()
    assert pickle.loads(pickle.dumps(fusion)) is fusion


def test_without_background_compile_the_first_step_compiles_in_the_training_process(monkeypatch):
    from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES

    real, calls = fused_module.compiled_kernel(), []

    def recording(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fused_module, "compiled_kernel", lambda group_statistics=False: recording)
    eager, fused = _twin_optimizers("B", background_compile=False)
    _step_twins(eager, fused, steps=1, seed=9)
    assert len(calls) == 1 and not BACKGROUND_COMPILES.compiling() and BACKGROUND_COMPILES.child_pid() is None
    _assert_bit_identical(eager, fused)


def test_fused_is_the_default_and_owns_flat_parameter_and_gradient_buffers(device):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1)).to(device, torch.bfloat16)
    optimizer = AdamW(model.parameters(), option="A")
    bucket = optimizer.buckets[0]
    assert bucket.param_buffer is not None
    for param, offset in zip(bucket.params, bucket.offsets):
        assert param.data_ptr() == bucket.param_buffer[offset:].data_ptr()
    inputs = torch.randn(4, 5).to(device, torch.bfloat16)
    model(inputs).sum().backward()
    optimizer.step()
    assert all(p.grad.data_ptr() == bucket.grad_buffer[o:].data_ptr() for p, o in zip(bucket.params, bucket.offsets))
    optimizer.zero_grad()
    assert torch.count_nonzero(bucket.grad_buffer) == 0
    model(inputs).sum().backward()
    assert torch.count_nonzero(bucket.grad_buffer) > 0
    padding = torch.ones(bucket.numel, dtype=torch.bool, device=device)
    for param, offset in zip(bucket.params, bucket.offsets):
        padding[offset : offset + param.numel()] = False
    optimizer.step()
    assert torch.count_nonzero(bucket.param_buffer[padding]) == 0


def test_eager_path_is_selectable_and_leaves_parameters_in_place(device):
    param = torch.nn.Parameter(torch.randn(10).to(device, torch.bfloat16))
    pointer = param.data_ptr()
    optimizer = AdamW([param], option="C", fused=False)
    assert optimizer.buckets[0].param_buffer is None and param.data_ptr() == pointer


def test_a_generator_for_stochastic_rounding_needs_the_eager_path(device):
    param = torch.nn.Parameter(torch.randn(10).to(device, torch.bfloat16))
    with pytest.raises(ValueError, match="fused=False"):
        AdamW([param], option="sr", fused=True, generator=torch.Generator(device))
    assert AdamW([param], option="sr", generator=torch.Generator(device)).buckets[0].param_buffer is None


@pytest.mark.parametrize("option", FP32_GRADIENT_OPTIONS)
def test_fused_update_quality_equals_the_reference(option, device):
    """The update-quality pieces of the fused step are the eager step's (counts exactly, FP64 sums
    to 1e-12). FP32 gradients, so that the step is the one the bit-identical test above compiles;
    BF16 gradients' update quality runs compiled in ``test_master.py`` and, through megatron, in
    ``tests/megatron/test_distributed_optimizer.py``."""
    eager, fused = _twin_optimizers(option, torch.float32, device=device, track_update_quality=True)
    _step_twins(eager, fused, steps=1, seed=4, grad_dtype=torch.float32)
    expected, got = eager[1].update_quality[0], fused[1].update_quality[0]
    assert (got.intended_nonzero, got.lost) == (expected.intended_nonzero, expected.lost)
    assert got.edq == pytest.approx(expected.edq, rel=1e-12)


@pytest.mark.parametrize("option", ["A", "C", "D", "sr", "coat"])
def test_tracking_update_quality_adds_no_fp64_copy_of_the_bucket(option, monkeypatch):
    """Measured with the CPU allocator over a fused step of a 1M-parameter bucket (after the step that
    compiles): tracking EDQ and imprecision costs reductions inside the step, not FP64 copies of the
    bucket (a whole FP64 copy would be 8 bytes per parameter). Untracked with BF16 gradients and
    tracked with FP32 gradients, the steps that ``test_fused_step_is_bit_identical_to_the_eager_reference_with_fp32_gradients``
    compiles (the gradients are allocated before the measured step, in a buffer of their dtype).
    Measured here: tracking adds 2 B/parameter for A and sr and 6 for C (Inductor keeps the new
    16-bit components in a buffer that the reductions read), 0.2 for D, none for coat. Option D
    (torch's kernel) computes the intended update in FP64 copies of one window of the state at a
    time (``torch_fused.WINDOW_ELEMENTS``, 4M elements, more than this bucket): here windows of 4096
    elements, to show that they, not the bucket, bound its temporaries."""
    monkeypatch.setattr(torch_fused, "WINDOW_ELEMENTS", 4096)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in [(1000, 1000), (4097,)]]
    peaks = {}
    for track, grad_dtype in ((False, torch.bfloat16), (True, torch.float32)):
        trained = [p.detach().clone().requires_grad_() for p in params]
        for param in trained:
            param.grad_dtype = grad_dtype
        optimizer = AdamW(trained, option=option, seed=3, fused=True, track_update_quality=track)
        for _ in range(2):
            for param in trained:
                param.grad = torch.randn(param.shape, generator=generator).to(grad_dtype)
            allocations = measure_allocations(optimizer.step)
        peaks[track] = allocations.peak
        if track:
            assert optimizer.update_quality[0].intended_nonzero > 0
    numel = sum(p.numel() for p in params)
    assert (peaks[True] - peaks[False]) / numel < 8.0


@pytest.mark.parametrize("option", OPTIONS)
def test_a_fused_step_creates_no_device_tensor_from_host_data(option, monkeypatch):
    """After the first step (which builds the buckets' tables), a step creates no tensor on the device
    from host data (``torch.tensor(..., device=...)`` waits for the device to catch up): scalars reach
    the compiled kernel as 0-d host tensors, per-step tables through pinned memory. Stochastic
    rounding runs one call per bucket, as on GPUs. The kernel and the remainder masters' codec run
    uncompiled: what is checked is the step's host code around its calls, which compiling them does
    not change (they are called with the same arguments), and the compiled kernel's bits are the
    contract matrix's (``tests/optim/test_contract.py``); compiled, stochastic rounding's one call per
    bucket would cost CI a cold compile of sr's and sr8's steps that no other test shares."""
    monkeypatch.setattr(fused_module, "BUCKET_STREAM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fused_module, "compiled_kernel", lambda *flags: bucket_kernel_)
    monkeypatch.setattr(
        fused_module, "compiled_master_codec", lambda: (fused_module._join_master_window, fused_module._split_master_window_)
    )
    eager, fused = _twin_optimizers(option)
    _step_twins(eager, fused, steps=1, seed=3)
    copies = []
    for name in ("tensor", "as_tensor"):
        factory = getattr(torch, name)

        def spy(*args, _factory=factory, _name=name, **kwargs):
            if kwargs.get("device") is not None:
                copies.append(_name)
            return _factory(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    for param in fused[0]:
        param.grad = torch.ones_like(param)
    fused[1].step()
    assert copies == []


@pytest.mark.parametrize("option", ["A", "sr", "coat"])
def test_gradients_in_one_shared_buffer_are_read_in_place(option):
    """Gradients that are views of one flat buffer (as megatron DDP's ``main_grad``) are read where they
    are: the fused step allocates no gradient buffer of its own and stays bit-identical to the eager
    step. FP32 gradients, as megatron reduces them for the options with FP32 masters
    (``grad_reduce_in_fp32``, as ``lowprec-train`` configures DDP): coat's step is then the one the
    app compiles, and CI compiles it once."""
    eager, fused = _twin_optimizers(option, grad_dtype=torch.float32)
    shared = torch.zeros(sum(p.numel() for p in fused[0]) + 37, dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    for _ in range(4):
        offset = 37
        for p, q in zip(eager[0], fused[0]):
            grad = torch.randn(p.shape, generator=generator)
            p.grad = grad.clone()
            view = shared[offset : offset + q.numel()].view(q.shape)
            view.copy_(grad)
            q.grad = view
            offset += q.numel()
        eager[1].step()
        fused[1].step()
    _assert_bit_identical(eager, fused)
    assert all(bucket.grad_buffer is None and bucket.grad_rows is not None for bucket in fused[1].buckets)


@pytest.mark.parametrize(
    "strategy",
    [
        PrecisionStrategy(
            "e5m2-moments", "FP8 E5M2 moments without expansion", moments="fp8", fp8_format="e5m2",
            fp8_group_size=64, fp8_expand=False,
        ),
        PrecisionStrategy(
            "sr-fp8-moments", "stochastic rounding over FP8 E4M3 moments without range expansion", moments="fp8",
            param_update="stochastic", fp8_expand=False,
        ),
    ],
    ids=lambda strategy: strategy.name,
)
def test_a_new_strategy_is_data_only(strategy, device):
    """Strategies that no option names (FP8 E5M2 moments in groups of 64; stochastic rounding over
    FP8 E4M3 moments in groups of 128; both without range expansion) run through both paths without a
    line of new optimizer code, bit-identically. Without expansion: with it, a CPU compile of the
    step costs about 140 CPU-seconds more on CI, and the expansion's compiled paths are coat's and
    sr8's, tested above."""
    eager, fused = _twin_optimizers(strategy, device=device)
    _step_twins(eager, fused, steps=10, seed=6)
    _assert_bit_identical(eager, fused)
    assert ("exp_avg_expansion_exponent" in eager[1].state[eager[0][0]]) == strategy.fp8_expand


@pytest.mark.parametrize(
    "option, shapes", [("coat", [(100,)]), ("sr8", [(7, 13)])], ids=["coat-bucket", "sr8-bucket"]
)
def test_calls_of_one_fp8_group_compile_nothing_and_stay_identical(option, shapes):
    """A bucket of one FP8 group (coat; sr8, whose call draws its stochastic rounding's words per
    group) is stepped by the kernel uncompiled: no compilation (a group count of one recompiled the
    FP8 step, minutes on 2 cores), the eager reference's bits."""
    from torch._dynamo.utils import counters

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]
    twins = []
    for fused in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        twins.append((params, AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=option, seed=3, fused=fused)))
    graphs = counters["stats"]["unique_graphs"]
    _step_twins(*twins, steps=3, seed=6)
    assert counters["stats"]["unique_graphs"] == graphs
    _assert_bit_identical(*twins)


def test_low_precision_tiling_is_scoped_to_the_compiled_step_and_tags_the_cache_key():
    from torch._inductor.codegen import cpp

    original, tag = cpp.TilingSelect, torch.compiler.config.cache_key_tag
    with inductor.low_precision_tiling():
        assert issubclass(cpp.TilingSelect, original) and cpp.TilingSelect is not original
        assert torch.compiler.config.cache_key_tag == tag + inductor.LOW_PRECISION_TILING_TAG
    assert cpp.TilingSelect is original and torch.compiler.config.cache_key_tag == tag


def test_outer_loop_fusion_is_declined_only_while_the_step_compiles_and_tags_the_cache_key(monkeypatch):
    from torch._inductor.codegen import cpp

    original, tag = cpp.CppScheduling.can_fuse_vertical_outer_loop, torch.compiler.config.cache_key_tag
    with inductor.without_outer_loop_fusion():
        assert cpp.CppScheduling.can_fuse_vertical_outer_loop(None, None, None) is False
        assert torch.compiler.config.cache_key_tag == tag + inductor.NO_OUTER_LOOP_FUSION_TAG
    assert cpp.CppScheduling.can_fuse_vertical_outer_loop is original and torch.compiler.config.cache_key_tag == tag
    monkeypatch.delattr(cpp.CppScheduling, "can_fuse_vertical_outer_loop")
    with inductor.without_outer_loop_fusion():
        assert not hasattr(cpp.CppScheduling, "can_fuse_vertical_outer_loop") and torch.compiler.config.cache_key_tag == tag


def test_without_the_inductor_pieces_it_needs_the_tiling_is_inductor_s_own(monkeypatch):
    from torch._inductor.codegen import cpp

    monkeypatch.delattr(cpp, "_get_loop_body")
    original, tag = cpp.TilingSelect, torch.compiler.config.cache_key_tag
    with inductor.low_precision_tiling():
        assert cpp.TilingSelect is original and torch.compiler.config.cache_key_tag == tag


class _TwoValueTiling:
    """An Inductor whose ``select_tiling`` returns (factors, indices), as torch 2.11's does."""

    def select_tiling(self, fn_list, var_sizes_list):
        return [8], [0]


class _OtherSignatureTiling:
    """An Inductor whose ``select_tiling`` takes other arguments."""

    def select_tiling(self, fn_list, var_sizes_list, loop_kind, *, extra=None):
        return [8], [0], {"loop_kind": loop_kind, "extra": extra}


def test_another_select_tiling_shape_or_signature_keeps_inductor_s_result():
    two_values = inductor.low_precision_tiling_select(_TwoValueTiling)()
    assert two_values.select_tiling([], []) == ([8], [0])
    other = inductor.low_precision_tiling_select(_OtherSignatureTiling)()
    assert other.select_tiling(None, [], "outer", extra=1) == ([8], [0], {"loop_kind": "outer", "extra": 1})


def test_a_failure_while_widening_keeps_inductor_s_result_and_is_logged_once(caplog):
    class ExpectedShapeTiling:
        def select_tiling(self, fn_list, var_sizes_list):
            return [8], [0], None

    tiling = inductor.low_precision_tiling_select(ExpectedShapeTiling)()
    inductor._warn_tiling_fallback.cache_clear()
    with caplog.at_level("WARNING", logger=inductor.__name__):
        assert tiling.select_tiling(object(), []) == ([8], [0], None)
        assert tiling.select_tiling(object(), []) == ([8], [0], None)
    assert len([r for r in caplog.records if "16-bit vector tiling is off" in r.getMessage()]) == 1


def test_the_fused_step_compiles_and_stays_exact_when_the_tiling_patch_breaks(monkeypatch):
    """A fresh compilation (caches off) in which every widening raises: Inductor's own tiling is used
    and the step is still bit-identical to the eager reference."""

    def broken(selected, fn_list):
        raise ValueError("not enough values to unpack (expected 3, got 2)")

    monkeypatch.setattr(inductor, "widened_tiling", broken)
    fused_module.compiled_kernel.cache_clear()
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            eager, fused = _twin_optimizers("D-MW")
            _step_twins(eager, fused, steps=3, seed=9)
            _assert_bit_identical(eager, fused)
    finally:
        fused_module.compiled_kernel.cache_clear()
        torch._dynamo.reset()


@pytest.mark.parametrize(
    ("param_dtype", "max_call_elements"),
    [(torch.bfloat16, fused_module.MAX_CALL_ELEMENTS), (torch.float16, fused_module.MAX_CALL_ELEMENTS), (torch.bfloat16, 640)],
    ids=["bf16", "fp16", "bf16-windows"],
)
def test_stochastic_rounding_in_one_call_per_bucket_draws_the_same_words(param_dtype, max_call_elements, monkeypatch):
    """The GPU formulation (one compiled call per bucket, parameter and row found per element),
    run on CPU: bit for bit the eager step, with sharded stream layouts (rows of a split tensor).
    A bucket larger than one call's int32 element count is stepped in windows that cut its
    parameters anywhere (here windows of 640 elements: the bucket holds 6144); the round keys go to
    the device in blocks of steps (here 3, so that ten steps cross blocks)."""
    from megatron_lowprec.numerics.rounding import StreamLayout

    monkeypatch.setattr(fused_module, "BUCKET_STREAM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fused_module, "MAX_CALL_ELEMENTS", max_call_elements)
    monkeypatch.setattr(fused_module, "KEY_BLOCK_STEPS", 3)
    calls = []
    monkeypatch.setattr(fused_module, "_bucket_stream", _recording(fused_module._bucket_stream, calls))

    def layout(param):
        if param.dim() == 2:
            return StreamLayout.shard(param.numel(), tuple(param.shape), 1, 1, 3)
        return StreamLayout.whole(param.numel(), param.numel())

    eager, fused = _twin_optimizers("sr", param_dtype=param_dtype, grad_dtype=param_dtype, stream_layout=layout)
    _step_twins(eager, fused, steps=10, seed=9, grad_dtype=param_dtype)
    _assert_bit_identical(eager, fused)
    assert len(calls) == 10 * -(-fused[1].buckets[0].numel // max_call_elements)


def test_sr8_steps_each_bucket_in_one_call_with_the_words_of_split_streams(monkeypatch):
    """sr8's compiled step on a CPU: one call per bucket over its FP8 groups, bit for bit the eager
    step, with a tensor split into rows of its stream (a tensor-parallel shard: rows of 256 elements
    of a [6, 768] tensor) beside whole ones, across blocks of round keys (here 3 steps each)."""
    from megatron_lowprec.numerics.rounding import StreamLayout

    monkeypatch.setattr(fused_module, "KEY_BLOCK_STEPS", 3)
    calls, call_arguments = [], fused_module.fused_call_arguments

    def counted(*args, **kwargs):
        made = list(call_arguments(*args, **kwargs))
        calls.append(len(made))
        return iter(made)

    monkeypatch.setattr(fused_module, "fused_call_arguments", counted)
    shapes = [(6, 256), (300,), (7, 13)]

    def layout(param):
        if param.dim() == 2 and param.shape[1] == 256:
            return StreamLayout.shard(77, tuple(param.shape), 1, 1, 3)
        return StreamLayout.whole(param.numel(), param.numel())

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]
    twins = []
    for fused in (False, True):
        params = [torch.nn.Parameter(values.clone()) for values in start]
        optimizer = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option="sr8", seed=3, fused=fused, stream_layout=layout)
        twins.append((params, optimizer))
    _step_twins(*twins, steps=4, seed=9)
    _assert_bit_identical(*twins)
    assert calls == [1] * 4


def _sr8_shard_layout(param):
    """A tensor-parallel shard of stream rows of 96 elements (rank 0 of 2: the rows' indices are not
    consecutive), which FP8 groups of 128 straddle, for a [4, 96] parameter; a whole stream otherwise."""
    from megatron_lowprec.numerics.rounding import StreamLayout

    return StreamLayout.shard(5, (4, 96), 1, 0, 2) if tuple(param.shape) == (4, 96) else StreamLayout.whole(7, param.numel())


def test_sr8_fused_refuses_fp8_groups_that_straddle_stream_rows():
    """A tensor-parallel shard whose stream rows (96 elements) the FP8 group of 128 does not divide:
    fused=True is refused when the optimizer is built, in one line naming the option and the
    parameter; the eager step takes it. Rows whose indices follow each other (the one shard at a
    tensor-parallel size of 1) are one run: the fused step builds."""
    from megatron_lowprec.numerics.rounding import StreamLayout

    param = torch.nn.Parameter(torch.randn(4, 96).bfloat16())
    AdamW([param], option="sr8", fused=True, stream_layout=lambda p: StreamLayout.shard(5, (4, 96), 1, 0, 1))
    with pytest.raises(ValueError, match=r"option 'sr8' .* shape \(4, 96\) has stream rows of 96 elements.*use fused=False"):
        AdamW([param], option="sr8", fused=True, stream_layout=_sr8_shard_layout)
    optimizer = AdamW([param], option="sr8", fused=False, stream_layout=_sr8_shard_layout)
    param.grad = torch.ones_like(param)
    optimizer.step()


def _sr8_twins(fused, params_of, **kwargs):
    """fused=False's and ``fused``'s AdamW of sr8 over ``params_of()``'s parameters (the same values each
    call) and its layout source (``None``: owned), three steps on the same gradients (written into
    gradients already set, the layout's buffer); the warnings of building and stepping the second."""
    twins, caught = [], []
    for request in (False, fused):
        params, source = params_of()
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            optimizer = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option="sr8", seed=3, fused=request,
                              stream_layout=_sr8_shard_layout, layout=source(params) if source else None, **kwargs)
            generator = torch.Generator().manual_seed(9)
            for _ in range(3):
                for param in params:
                    grad = torch.randn(param.shape, generator=generator).bfloat16()
                    if param.grad is None:
                        param.grad = grad
                    else:
                        param.grad.copy_(grad)
                optimizer.step()
        twins.append((params, optimizer))
        caught = [warning for warning in recorded if issubclass(warning.category, EagerFallbackWarning)]
    return twins, caught


def test_sr8_steps_parameters_whose_groups_straddle_stream_rows_eagerly_by_default(monkeypatch):
    """fused=None (the default): the shard whose stream rows (96 elements) split FP8 groups of 128
    takes the eager step, decided when the optimizer is built, with one warning line naming its shape
    and why; the parameter beside it keeps its fused bucket (its kernel run uncompiled here: the same
    function). Every bit after three steps is fused=False's."""
    from megatron_lowprec.optim.kernel import bucket_kernel_

    monkeypatch.setattr(fused_module, "compiled_kernel", lambda group_statistics=False: bucket_kernel_)
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator).bfloat16() for shape in ((300,), (4, 96))]
    (eager, fallback), caught = _sr8_twins(None, lambda: ([torch.nn.Parameter(values.clone()) for values in start], None))
    _assert_bit_identical(eager, fallback)
    assert [bucket.laid_out for bucket in fallback[1].buckets] == [True, False]
    assert [bucket.params[0].shape for bucket in fallback[1].buckets] == [(300,), (4, 96)]
    assert len(caught) == 1, [str(warning.message) for warning in caught]
    message = str(caught[0].message)
    assert "\n" not in message and "(4, 96)" in message and "rows of 96 elements" in message and "'sr8'" in message


def test_sr8_distributed_shard_whose_groups_straddle_stream_rows_steps_eagerly_by_default():
    """A distributed optimizer's shard (a layout source) holding that parameter: fused=None steps the
    shard eagerly, with one warning line, to fused=False's bits; fused=True is refused."""
    from .references import BufferShard

    values = torch.randn(4, 96, generator=torch.Generator().manual_seed(0)).bfloat16()

    def params_of():
        param_data, grad_data = values.reshape(-1).clone(), torch.zeros(values.numel(), dtype=torch.bfloat16)
        param = torch.nn.Parameter(param_data.view(4, 96))
        param.grad = grad_data.view(4, 96)
        return [param], lambda params: BufferShard(param_data, grad_data, 0)

    (eager, fallback), caught = _sr8_twins(None, params_of)
    _assert_bit_identical(eager, fallback)
    assert len(caught) == 1 and "(4, 96)" in str(caught[0].message)
    with pytest.raises(ValueError, match=r"option 'sr8' .* shape \(4, 96\) .*use fused=False"):
        _sr8_twins(True, params_of)


def test_stochastic_rounding_in_one_call_refuses_columns_beyond_int32(monkeypatch):
    """The per-bucket stream counts an element's column in its stream row in int32: a parameter whose
    columns would pass the limit (here lowered to 299) is refused with the column and the way out."""
    from megatron_lowprec.optim.buckets import build_bucket

    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in ((64,), (300,))]
    bucket, _ = build_bucket(get_strategy("sr"), 0, params, own_params=True)
    monkeypatch.setattr(fused_module, "INT32_GRID_MAX_ROW", 299)
    with pytest.raises(ValueError, match=r"entry 1 .*column 383 .*at most 299.*fused=False"):
        fused_module._stream_tables(bucket, [0, 1], 0, bucket.numel)


def _recording(function, calls):
    def recorded(*args):
        calls.append(args)
        return function(*args)

    return recorded


def test_the_fused_step_answers_per_compute_capability(monkeypatch):
    """Every option fuses from compute capability 7.0 (Inductor's Triton minimum); below it the buckets
    take the eager step with a warning naming why, and fused=True is refused. FP8 payloads are integer
    codes below 8.9 (Triton converts to E4M3 from there), and cast on newer GPUs and on CPUs."""
    cuda = torch.device("cuda", 0)
    for capability, codes in (((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        assert fused_module.fused_unavailable_reason(cuda) is None
        assert fused_module.resolve_fused(cuda, None)
        assert fused_module.fp8_payloads_as_codes(cuda) is codes
    assert not fused_module.fp8_payloads_as_codes(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    reason = fused_module.fused_unavailable_reason(cuda)
    assert "7.0" in reason and "6.1" in reason
    with pytest.warns(EagerFallbackWarning, match="compute capability 7.0"):
        assert not fused_module.resolve_fused(cuda, None)
    with pytest.raises(ValueError, match=r"fused=True .* 6\.1"):
        fused_module.resolve_fused(cuda, True)
    assert not fused_module.resolve_fused(cuda, False)


def test_kernel_state_views_fp8_payloads_as_codes_below_sm89(monkeypatch):
    """Below sm_89 the compiled step gets coat's payloads as uint8 views of the same memory; its other
    buffers, and every buffer of a BF16 option, as they are."""
    from megatron_lowprec.optim.buckets import build_bucket

    monkeypatch.setattr(fused_module, "fp8_payloads_as_codes", lambda device: True)
    for option in ("coat", "A"):
        bucket, _ = build_bucket(get_strategy(option), 0, [torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16))], own_params=True)
        state = fused_module.kernel_state(bucket, get_strategy(option))
        for key, buffer in bucket.state.items():
            assert state[key].data_ptr() == buffer.data_ptr()
            assert state[key].dtype == (torch.uint8 if key.endswith("_payload") else buffer.dtype)


@pytest.mark.parametrize("option", ["coat", "sr8"])
def test_fp8_payloads_as_codes_step_to_the_eager_bits(option, monkeypatch):
    """The fused step's calls with integer-coded FP8 payloads (as below sm_89; the kernel run
    uncompiled here, its compiled form is checked under Triton's interpreter in tests/kernels) leave
    the eager reference's bits: a bucket's grid of FP8 groups, with and without stochastic rounding's group stream."""
    from megatron_lowprec.optim.kernel import bucket_kernel_

    monkeypatch.setattr(fused_module, "fp8_payloads_as_codes", lambda device: True)
    monkeypatch.setattr(fused_module, "compiled_kernel", lambda group_statistics=False: bucket_kernel_)
    kernel_state, payloads = fused_module.kernel_state, []

    def recorded(bucket, strategy):
        state = kernel_state(bucket, strategy)
        payloads.append(state["exp_avg_payload"].dtype)
        return state

    monkeypatch.setattr(fused_module, "kernel_state", recorded)
    eager, fused = _twin_optimizers(option)
    _step_twins(eager, fused, steps=5, seed=11, scale=lambda step: 10.0 ** (step - 3))
    _assert_bit_identical(eager, fused)
    assert payloads and set(payloads) == {torch.uint8}


PIECE_SHAPES = ((64,), (300,), (256, 16), (700,), (129,))
"""A bucket of 5.3k elements (its shard: the last 2.6k, three entries of two parameter groups)."""


def _stepped_uncompiled(strategy, kind, window, monkeypatch):
    """A bucket of :data:`PIECE_SHAPES` stepped 3 times while its compile is pending (a background
    compile that never starts), uncompiled calls in pieces of ``window`` elements; its parameters
    and state, and how many uncompiled calls ran."""
    from megatron_lowprec.optim.background_compile import BackgroundCompiles
    from tools.kernel_audit import codegen

    monkeypatch.setattr(fused_module, "EAGER_WINDOW_ELEMENTS", window)
    monkeypatch.setattr(fused_module, "BACKGROUND_COMPILES", BackgroundCompiles())
    calls, kernel = [], fused_module.bucket_kernel_
    monkeypatch.setattr(fused_module, "bucket_kernel_", lambda *args: calls.append(1) or kernel(*args))
    generator = torch.Generator().manual_seed(7)

    def fill(tensor):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))

    if kind == "plain":
        bucket, grad, entry_grads, grad_data = codegen._plain_bucket(strategy, PIECE_SHAPES, 0, device="cpu", fill=fill)
        params = bucket.param_buffer
    else:
        bucket, grad, entry_grads, grad_data = codegen._shard_bucket(strategy, PIECE_SHAPES, [0, 0, 0, 1, 1], device="cpu", fill=fill)
        params = bucket.param_buffer if bucket.param_buffer is not None else bucket.param_rows[1].source
    hyper = {0: dict(codegen.STEP_HYPER), 1: dict(codegen.STEP_HYPER, lr=3e-3, weight_decay=0.0)}
    for step in range(1, 4):
        grad_data.copy_(torch.randn(grad_data.shape, generator=generator) * 10.0 ** (step - 2))
        fused_module.fused_bucket_step_(
            bucket, strategy, grad, entry_grads, hyper, step=step,
            sr_seed=codegen.SR_SEED if strategy.param_update == "stochastic" else None,
            track_update_quality=False, background_compile=True,
        )
    return params, bucket.state, len(calls)


@pytest.mark.parametrize("kind", ["plain", "shard"])
@pytest.mark.parametrize("option", [option for option in OPTIONS if get_strategy(option).adam_kernel != "torch_fused"])
def test_an_uncompiled_call_runs_in_pieces_with_the_whole_calls_bits(option, kind, monkeypatch):
    """While its compile is pending (background compilation) a call of the fused step runs
    uncompiled, in pieces of at most ``EAGER_WINDOW_ELEMENTS`` elements, which bound the uncompiled
    kernel's temporaries. Pieces of 256 elements (entries and runs of FP8 groups cut across pieces)
    give, over 3 steps, the bits of the whole call run uncompiled, the function the fused step
    compiles (compiled against it: the fused-vs-eager tests), in a bucket that owns its parameters
    and in a distributed optimizer's shard of two parameter groups, stochastic rounding over the
    whole bucket as on GPUs."""
    monkeypatch.setattr(fused_module, "BUCKET_STREAM_DEVICES", ("cuda", "cpu"))
    strategy = get_strategy(option)
    whole_params, whole_state, whole_calls = _stepped_uncompiled(strategy, kind, 1 << 30, monkeypatch)
    params, state, calls = _stepped_uncompiled(strategy, kind, 256, monkeypatch)
    assert calls >= 3 * 10 > whole_calls
    assert torch.equal(params.view(torch.int16), whole_params.view(torch.int16))
    for key, value in whole_state.items():
        if torch.is_tensor(value):
            assert torch.equal(state[key].view(torch.uint8), value.view(torch.uint8)), key
