"""The CUDA kernels of one fused optimizer step, generated and compiled on a machine without a GPU.

:func:`generate` runs one step of :func:`~megatron_lowprec.optim.fused.fused_bucket_step_` (the
code path of :class:`~megatron_lowprec.optim.AdamW` and of the distributed optimizer's shards) on
fake ``cuda`` tensors under ``FakeTensorMode``, with the device properties of an H100 (sm_90) or an
A100 (sm_80). Inductor then generates the Triton kernels a GPU would run; each is compiled with the
``ptxas`` shipped in the triton wheel to PTX and cubin (SASS on demand). No kernel runs.

Making Inductor target CUDA on a CPU build of torch touches private internals (:func:`cuda_codegen`
lists them); every one is restored on exit, and the caches of this process that remember "no
CUDA" are cleared on entry and exit. Generated code and Triton's compilations go to a temporary
directory. The pinned versions (``constraints.txt``) are those this was written against: where one
of these internals changed, :class:`CodegenSetupError` names it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import re
import tempfile
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from megatron_lowprec.megatron.layout import ROW, build_shard_bucket
from megatron_lowprec.optim.buckets import ALIGNMENT, Bucket, build_bucket, params_in_place
from megatron_lowprec.optim.strategies import PrecisionStrategy, get_strategy

ARCHES = (90, 80)
"""Compute capabilities :func:`generate` targets: 90 (H100), 80 (A100)."""

OPTIMIZERS = ("adamw", "muon")
"""Whose fused step :func:`generate_for` generates: AdamW's (one compiled call per bucket) or Muon's
(two: the momentum before Newton-Schulz, the update after it)."""

CALLS_PER_STEP = {"adamw": 1, "muon": 2}
"""Compiled calls of one fused step over a plain bucket, per optimizer."""

KINDS = ("plain", "shard")
"""``plain``: a bucket that owns its parameters and gradients (:class:`~megatron_lowprec.optim.AdamW`);
``shard``: a distributed optimizer's shard, laid out in place in megatron's DDP buffers, whose
parameters and gradients are slices of them (Muon: its bucket in megatron's shard-aligned layer-wise
layout, whole parameters left in DDP's buffer as rows, ``params_in_buffer``)."""

DEVICE_PROPERTIES = {
    90: dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30),
    80: dict(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108, total_memory=80 << 30),
}
"""What Inductor asks of the device (the rest as ``COMMON_PROPERTIES``)."""

COMMON_PROPERTIES = dict(
    max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536, max_threads_per_block=1024, warp_size=32,
    L2_cache_size=40 << 20, is_integrated=False, is_multi_gpu_board=False, gcnArchName="",
)

CUDA_DEVICE_TYPE = 1
META_DEVICE_TYPE = 14
"""c10's ``DeviceType`` values: the CUDA slot of the device-guard registry takes the Meta guard (no-ops)."""

PARAM_SHAPES = ((256, 128), (380,), (64,))
"""The parameters of a generated step: a matrix, and two vectors whose bucket entries end in padding."""

STEP_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


class CodegenSetupError(RuntimeError):
    """A private internal of torch or triton that :func:`generate` relies on is missing or changed."""


@dataclasses.dataclass
class Kernel:
    """One generated Triton kernel, compiled for one architecture."""

    name: str
    graph: int
    """Index of the compiled graph whose wrapper launches it."""
    source: str
    """The Triton source Inductor wrote."""
    ptx: str
    launches: int
    """Launches of this kernel in the first step."""
    elements_per_thread: float
    """Elements of its block per thread (block sizes over threads) in the compiled config."""
    asm: Any = dataclasses.field(repr=False, default=None)
    """Triton's compiled kernel's ``asm`` (ttir, ttgir, llir, ptx, cubin; SASS on demand)."""

    @property
    def sass(self) -> str:
        """The SASS, disassembled from the cubin by the triton wheel's ``cuobjdump`` when asked."""
        return self.asm["sass"]


@dataclasses.dataclass
class StepCode:
    """The code of one fused optimizer step and what a sequence of further steps launched."""

    option: str
    master_storage: str
    kind: str
    arch: int
    kernels: list[Kernel]
    """Every kernel generated during the sequence that compiled for ``arch``."""
    steps: list[StepRecord]
    wrappers: list[str]
    """Inductor's Python wrapper code of each compiled graph."""
    compile_errors: dict[str, str]
    """Kernels that Triton could not compile for ``arch``: name -> the error's last line."""
    optimizer: str = "adamw"
    """One of :data:`OPTIMIZERS`: whose fused step this is."""

    @property
    def first_step_kernels(self) -> list[Kernel]:
        return [kernel for kernel in self.kernels if kernel.launches]


def _device_properties(arch: int) -> types.SimpleNamespace:
    if arch not in DEVICE_PROPERTIES:
        raise ValueError(f"arch={arch!r} is not valid; choose one of {', '.join(map(str, ARCHES))}")
    return types.SimpleNamespace(**DEVICE_PROPERTIES[arch], **COMMON_PROPERTIES)


def _private(owner: Any, name: str, what: str) -> Any:
    """``owner.name``, or :class:`CodegenSetupError` naming ``what`` it is."""
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise CodegenSetupError(f"{what}: {getattr(owner, '__name__', owner)!r} has no {name!r} (torch {torch.__version__})") from error


@contextlib.contextmanager
def _cuda_device_guard() -> Iterator[None]:
    """c10's device-guard registry with the Meta guard in the CUDA slot: a CPU build registers none,
    and Dynamo's and slicing's device guards of fake CUDA tensors then fail."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    symbol = "_ZN3c104impl26device_guard_impl_registryE"
    try:
        registry = (ctypes.c_void_p * (META_DEVICE_TYPE + 1)).in_dll(ctypes.CDLL(path), symbol)
    except (OSError, ValueError) as error:
        raise CodegenSetupError(f"c10's device guard registry ({symbol} in {path}): {error}") from error
    if not registry[META_DEVICE_TYPE]:
        raise CodegenSetupError("c10's device guard registry has no Meta guard to stand in for CUDA")
    previous = registry[CUDA_DEVICE_TYPE]
    if previous is None:
        registry[CUDA_DEVICE_TYPE] = registry[META_DEVICE_TYPE]
    try:
        yield
    finally:
        registry[CUDA_DEVICE_TYPE] = previous


class _TargetDriver:
    """A stand-in for Triton's CUDA driver: the target architecture, and nothing to launch on."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    def get_device_interface(self) -> Any:
        return torch.cuda

    def is_active(self) -> bool:
        return True


def _clear_no_cuda_caches() -> None:
    """Forget what this process cached about the device: Triton's availability and backend, Inductor's
    device properties, Dynamo's compiled frames."""
    import torch._inductor.runtime.hints as hints
    import torch.utils._triton as torch_triton
    from torch._dynamo import device_interface

    for function in (
        torch_triton.has_triton, _private(torch_triton, "triton_backend", "torch.utils._triton"),
        _private(torch_triton, "triton_hash_with_backend", "torch.utils._triton"),
    ):
        function.cache_clear()
    create = _private(hints.DeviceProperties, "create", "Inductor's DeviceProperties")
    if hasattr(create, "cache_clear"):
        create.cache_clear()
    _private(device_interface, "caching_worker_device_properties", "Dynamo's device interface").clear()
    torch._dynamo.reset()
    from megatron_lowprec.optim import fused

    fused.compiled_kernel.cache_clear()
    fused.compiled_master_codec.cache_clear()
    from megatron_lowprec.optim import muon

    muon.compiled_muon_momentum_kernel.cache_clear()
    muon.compiled_muon_update_kernel.cache_clear()


class _Capture:
    """What the patched compile path records: Triton sources, the wrapper code of each compiled graph,
    and the order in which compiled graphs were called."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[int, str]] = {}
        """Kernel key ``graph:name`` -> (graph, source)."""
        self.wrappers: list[str] = []
        self.calls: list[int] = []
        """The graph of each compiled call, in order."""
        self.generating = True
        """Whether a graph compiled now is generated (else only counted, with empty wrapper code)."""

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> types.SimpleNamespace:
        """``AsyncCompile.triton`` (called while the graph's wrapper module loads): record the kernel and
        hand the wrapper a placeholder, never launched."""
        graph = len(self.wrappers)
        self.sources[f"{graph}:{kernel_name}"] = (graph, source_code)
        return types.SimpleNamespace(name=kernel_name)

    def graph_launches(self, graph: int) -> dict[str, int]:
        """Launches in one call of ``graph``: each Triton kernel (``name.run(``) by key, and torch's own
        kernels (``extern_kernels.*``, ``aten.*``) under ``"extern"``."""
        body = self.wrappers[graph].split("def call(", 1)[-1].split("\ndef ", 1)[0]
        counts = {"extern": len(re.findall(r"^\s+(?:\w+ = )?(?:extern_kernels|aten|torch\.ops\.aten)\.", body, flags=re.M))}
        for name in re.findall(r"^\s+(\w+)\.run\(", body, flags=re.M):
            counts[f"{graph}:{name}"] = counts.get(f"{graph}:{name}", 0) + 1
        return counts

    def launches(self, calls: list[int]) -> int:
        return sum(sum(self.graph_launches(graph).values()) for graph in calls)

    def kernel_launches(self, key: str, calls: list[int]) -> int:
        return sum(self.graph_launches(graph).get(key, 0) for graph in calls)

    def compile_fx(self, original):
        """Inductor's ``compile_fx`` that generates the code, keeps the wrapper source and returns the
        traced FX graph itself, so that the step runs on the fake tensors without launching anything."""

        def inner_compile(graph, example_inputs, **kwargs):
            from torch._inductor.compile_fx import compile_fx_inner

            compiled = compile_fx_inner(graph, example_inputs, **kwargs)
            source = getattr(compiled, "source_code", None)
            if source is None:
                raise CodegenSetupError(f"Inductor's compiled graph {type(compiled).__name__} has no source_code")
            self.wrappers.append(source)
            return compiled

        def compile_fx(model, example_inputs, *args, **kwargs):
            graphs = len(self.wrappers)
            if self.generating:
                kwargs["inner_compile"] = inner_compile
                original(model, example_inputs, *args, **kwargs)
                if len(self.wrappers) != graphs + 1:
                    raise CodegenSetupError(f"Inductor compiled {len(self.wrappers) - graphs} graphs for one Dynamo frame")
            else:
                self.wrappers.append("")

            def run(*inputs):
                self.calls.append(graphs)
                return model.forward(*inputs)

            return run

        return compile_fx


class _CudaToCpu(torch.utils._python_dispatch.TorchDispatchMode):
    """Inductor's constant folding evaluates one-element tensors on their device: on CPU instead."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        def to_cpu(value):
            if isinstance(value, torch.device) and value.type == "cuda":
                return torch.device("cpu")
            if torch.is_tensor(value) and value.device.type == "cuda":
                return value.cpu()
            return value

        args, kwargs = torch.utils._pytree.tree_map(to_cpu, (args, kwargs or {}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_codegen(arch: int, cache_dir: str, fx_cache: str | None = None) -> Iterator[_Capture]:
    """Inductor generates (and does not run) CUDA Triton code for ``arch`` on this machine; the
    kernels' sources and wrappers are recorded in the yielded capture. Inductor's caches are off,
    but with ``fx_cache``: then its FX graph cache lies in that folder, so that a process that
    compiles a graph compiled there before (for the same arch, with the same Inductor settings) loads
    the code written then (:mod:`~tools.kernel_audit.interpret` compiles the audit's steps again).
    Every patch is undone on exit; a private internal that is missing or moved raises
    :class:`CodegenSetupError`."""
    capture = _Capture()
    with contextlib.ExitStack() as stack:
        try:
            _enter_cuda_setup(stack, arch, cache_dir, capture, fx_cache)
        except (AttributeError, ImportError, TypeError) as error:
            raise CodegenSetupError(
                f"CUDA code generation with torch {torch.__version__} (pinned: constraints.txt): {error}"
            ) from error
        yield capture


def _enter_cuda_setup(
    stack: contextlib.ExitStack, arch: int, cache_dir: str, capture: _Capture, fx_cache: str | None = None
) -> None:
    """The patches of :func:`cuda_codegen`, each undone by ``stack``."""
    import triton
    from triton.backends.compiler import GPUTarget
    import torch._inductor.async_compile as async_compile
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.constant_folding as constant_folding
    import torch._inductor.runtime.triton_helpers as triton_helpers
    from torch._dynamo import device_interface
    from torch._inductor import config as inductor_config

    props = _device_properties(arch)
    cuda_interface = _private(device_interface, "CudaInterface", "Dynamo's device interface")
    stack.enter_context(_cuda_device_guard())
    stack.enter_context(mock.patch.dict(os.environ, {
        "TORCHINDUCTOR_CACHE_DIR": fx_cache or os.path.join(cache_dir, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
    }))
    for owner in (torch.cuda, cuda_interface):
        stack.enter_context(mock.patch.object(owner, "get_device_properties", lambda device=None: props))
    stack.enter_context(mock.patch.object(cuda_interface, "is_available", staticmethod(lambda: True)))
    stack.enter_context(mock.patch.object(cuda_interface, "is_bf16_supported", staticmethod(lambda *a, **k: True)))
    stack.enter_context(mock.patch.object(torch.cuda, "device_count", lambda: 1))
    stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
    stack.enter_context(mock.patch.object(cuda_interface, "device_count", staticmethod(lambda: 1)))
    stack.enter_context(mock.patch.object(cuda_interface, "current_device", staticmethod(lambda: 0)))
    stack.enter_context(mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, create=True))
    stack.enter_context(mock.patch.object(triton_helpers, "set_driver_to_gpu", lambda: None))
    _private(async_compile.AsyncCompile, "triton", "Inductor's AsyncCompile")
    stack.enter_context(mock.patch.object(async_compile.AsyncCompile, "triton", lambda self, *a, **k: capture.triton(*a, **k)))
    original_compile_fx = _private(compile_fx_module, "compile_fx", "Inductor")
    stack.enter_context(mock.patch.object(compile_fx_module, "compile_fx", capture.compile_fx(original_compile_fx)))
    folder = _private(constant_folding, "ConstantFolder", "Inductor's constant folding")
    fold = folder.run

    def fold_on_cpu(*args, **kwargs):
        with _CudaToCpu():
            return fold(*args, **kwargs)

    stack.enter_context(mock.patch.object(folder, "run", fold_on_cpu))
    stack.enter_context(inductor_config.patch(
        {"compile_threads": 1, "force_disable_caches": fx_cache is None, "use_static_triton_launcher": False,
         "triton.autotune_pointwise": False, **({"fx_graph_cache": True} if fx_cache else {})},
    ))
    if fx_cache:
        from torch._functorch import config as functorch_config

        # AOTAutograd's own cache would skip compile_fx_inner, where the capture records each wrapper.
        stack.enter_context(functorch_config.patch({"enable_autograd_cache": False}))
    target = GPUTarget("cuda", arch, 32)
    driver = triton.runtime.driver
    previous_driver = _private(driver, "_active", "Triton's driver config")
    driver.set_active(_TargetDriver(target))
    stack.callback(setattr, driver, "_active", previous_driver)
    _clear_no_cuda_caches()
    stack.callback(_clear_no_cuda_caches)


def compile_kernel(name: str, source: str, arch: int) -> tuple[Any, float]:
    """The compiled ``asm`` and the elements per thread of a generated kernel for ``arch``, through
    Inductor's own Triton compile options (the kernel's device properties retargeted to ``arch``). A reduction's first autotuning config
    only: its configs differ in block sizes, not in operations (pointwise kernels have one,
    ``triton.autotune_pointwise`` being off)."""
    from torch._inductor.async_compile import _load_triton_kernel_from_source

    autotuner = _load_triton_kernel_from_source(name, source)
    props = _private(autotuner, "device_props", "Inductor's CachingAutotuner")
    autotuner.device_props = props._replace(cc=arch, major=arch // 10)
    configs = _private(autotuner, "configs", "Inductor's CachingAutotuner")
    precompile = _private(autotuner, "_precompile_config", "Inductor's CachingAutotuner")
    heuristics_log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    level = heuristics_log.level
    heuristics_log.setLevel(logging.CRITICAL)
    try:
        result = precompile(configs[0])
    finally:
        heuristics_log.setLevel(level)
    binary = getattr(result, "kernel", result)
    asm = _private(binary, "asm", "Triton's compiled kernel")
    block = math.prod(value for key, value in configs[0].kwargs.items() if key.endswith("BLOCK"))
    block *= math.prod(int(size) for size in re.findall(r"R0_BLOCK: tl.constexpr = (\d+)", source))
    return asm, block / (configs[0].num_warps * 32)


def _plain_bucket(
    strategy: PrecisionStrategy, shapes: tuple[tuple[int, ...], ...], group: int,
    device: str = "cuda", fill: Callable[[torch.Tensor], None] | None = None,
) -> tuple[Bucket, Any, list[torch.Tensor], torch.Tensor]:
    """A bucket of parameter group ``group`` that owns its parameters and gradient buffer, as
    :class:`~megatron_lowprec.optim.AdamW` builds it; its gradient buffer last. ``fill`` sets the
    parameters' values before the bucket is built (zeros otherwise)."""
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=device)) for shape in shapes]
    for param in params if fill else ():
        fill(param.data)
    bucket, _ = build_bucket(strategy, group, params, own_params=True)
    grad = torch.zeros(bucket.numel, dtype=torch.bfloat16, device=device)
    return bucket, grad, [bucket.view(grad, index) for index in range(len(params))], grad


MEGATRON_PARAM_ALIGNMENT = 64
"""Elements megatron-core pads each parameter's start to in its DDP buffers under the distributed optimizer."""


def _shard_bucket(
    strategy: PrecisionStrategy, shapes: tuple[tuple[int, ...], ...], groups: list[int],
    device: str = "cuda", fill: Callable[[torch.Tensor], None] | None = None,
) -> tuple[Bucket, Any, list[torch.Tensor], torch.Tensor]:
    """A distributed optimizer's state bucket for the second half of a DDP bucket that holds
    parameters of ``shapes`` as megatron lays them out (each start padded to
    :data:`MEGATRON_PARAM_ALIGNMENT` elements, the end to 128), built as ``megatron/distributed.py``
    builds it (:func:`~megatron_lowprec.megatron.layout.build_shard_bucket`; entry ``i`` in parameter
    group ``groups[i]``): the shard begins half a row into a row of the buffer (as a shard of DP=4
    may), or, with FP8 moments, at the start of that FP8 group (the rank's range once
    ``owned_bounds`` has moved the boundary off the group). The whole gradient buffer last. ``fill``
    sets the parameter buffer's values before the bucket is built (zeros otherwise; megatron's
    padding stays zero)."""
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=device)) for shape in shapes]
    numels = [param.numel() for param in params]
    starts, position = [], 0
    for numel in numels:
        position = -(-position // MEGATRON_PARAM_ALIGNMENT) * MEGATRON_PARAM_ALIGNMENT
        starts.append(position)
        position += numel
    total = -(-position // ALIGNMENT) * ALIGNMENT
    param_data = torch.zeros(total, dtype=torch.bfloat16, device=device)
    grad_data = torch.zeros(total, dtype=torch.bfloat16, device=device)
    if fill:
        fill(param_data)
    for end, start in zip([start + numel for start, numel in zip(starts, numels)], starts[1:] + [total]):
        param_data[end:start] = 0
    shard_start = total // 2 + ROW // 2
    if strategy.moments == "fp8":
        shard_start -= shard_start % strategy.fp8_group_size
    runs, run_starts, members = [], [], []
    for param, first, numel in zip(params, starts, numels):
        begin = max(shard_start, first)
        if begin < first + numel:
            runs.append((begin - first, first + numel - begin))
            run_starts.append(begin)
            members.append(param)
    bucket, grad = build_shard_bucket(
        strategy, members, runs, run_starts, groups[-len(members):], None, param_data, grad_data, shard_start, total,
    )
    entry_grads = [grad_data[begin : begin + numel] for begin, (_, numel) in zip(run_starts, runs)]
    return bucket, grad, entry_grads, grad_data


LAYOUT_GAP = 64
"""Elements of another rank's shard before and after the parameters of :func:`_layout_bucket` in DDP's buffer."""


def _layout_bucket(
    strategy: PrecisionStrategy, shapes: tuple[tuple[int, ...], ...], group: int,
    device: str = "cuda", fill: Callable[[torch.Tensor], None] | None = None,
) -> tuple[Bucket, Any, list[torch.Tensor], torch.Tensor]:
    """Muon's bucket in megatron's shard-aligned layer-wise layout (``Muon(params_in_buffer=True, buffer_row=ROW)``):
    whole parameters of ``shapes`` of parameter group ``group`` that stay in a DDP buffer as megatron
    lays out one rank's shard of it (each start padded to :data:`MEGATRON_PARAM_ALIGNMENT` elements,
    the padding zero), between :data:`LAYOUT_GAP` elements of other ranks' shards, laid out in place
    (:func:`~megatron_lowprec.optim.buckets.params_in_place`), their gradients the same range of DDP's
    gradient buffer, or, where that layout does not fit, both read as rows of DDP's buffers (the
    whole gradient buffer last). ``fill`` sets the parameter buffer's values
    before the bucket is built (zeros otherwise; megatron's padding stays zero)."""
    numels = [math.prod(shape) for shape in shapes]
    starts, position = [], LAYOUT_GAP
    for numel in numels:
        position = -(-position // MEGATRON_PARAM_ALIGNMENT) * MEGATRON_PARAM_ALIGNMENT
        starts.append(position)
        position += numel
    total = position + LAYOUT_GAP
    param_data = torch.zeros(total, dtype=torch.bfloat16, device=device)
    grad_data = torch.zeros(total, dtype=torch.bfloat16, device=device)
    if fill:
        fill(param_data)
    for start, end in zip([start + numel for start, numel in zip(starts, numels)], starts[1:]):
        param_data[start:end] = 0
    params = []
    for shape, start, numel in zip(shapes, starts, numels):
        param = torch.nn.Parameter(torch.zeros(0, dtype=torch.bfloat16, device=device))
        param.data = param_data[start : start + numel].view(shape)
        params.append(param)
    in_place = params_in_place(strategy, params, ROW)
    bucket, _ = build_bucket(strategy, group, params, own_params=False, in_place=in_place)
    entry_grads = [grad_data[start : start + numel] for start, numel in zip(starts, numels)]
    if in_place is not None:
        return bucket, grad_data[starts[0] : starts[-1] + numels[-1]], entry_grads, grad_data
    bucket.param_rows = (starts, bucket.rows_in(param_data, starts))
    return bucket, bucket.rows_in(grad_data, starts), entry_grads, grad_data


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One optimizer step of a generated sequence: which bucket, which step, which scalars."""

    label: str
    bucket: str
    """Key of the bucket in :data:`BUCKETS` (built once per sequence, then stepped again)."""
    step: int
    hyper: dict[int, dict[str, float]]


BUCKETS = {
    "main": (PARAM_SHAPES, [0, 0, 0]),
    "other group": (PARAM_SHAPES, [1, 1, 1]),
    "one FP8 group": (((100,),), [0]),
    "two groups": (PARAM_SHAPES, [0, 0, 1]),
}
"""Parameter shapes and each parameter's group of the buckets a sequence steps."""

OTHER_HYPER = dict(lr=3e-4, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.0)


def step_cases(kind: str) -> list[StepCase]:
    """The steps :func:`generate` runs: the first defines the step's kernels; the others must reuse them
    (a later step, another learning rate, another parameter group's scalars, a bucket of one FP8
    group; a shard whose entries belong to two parameter groups)."""
    base, later = dict(STEP_HYPER), dict(STEP_HYPER, lr=5e-4)
    cases = [
        StepCase("first step", "main", 1, {0: base}),
        StepCase("next step, new lr", "main", 2, {0: later}),
        StepCase("other parameter group", "other group", 1, {1: OTHER_HYPER}),
        StepCase("bucket of one FP8 group", "one FP8 group", 1, {0: base}),
    ]
    if kind == "shard":
        cases.append(StepCase("shard of two parameter groups", "two groups", 1, {0: base, 1: OTHER_HYPER}))
    return cases


@dataclasses.dataclass
class StepRecord:
    """What one step of the sequence launched."""

    label: str
    new_graphs: int
    """Graphs compiled during this step (recompilations, after the first step)."""
    launches: int
    """Kernel launches of the step (Triton kernels and torch's own)."""


MUON_SHAPES = ((256, 128), (48, 32))
"""The weights of a generated Muon step (the second's bucket entry ends in padding)."""

MUON_HYPER = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True)


def muon_step_cases() -> list[StepCase]:
    """The Muon steps :func:`generate_muon` runs: the first defines the kernels, a later step with
    another learning rate and a bucket of another parameter group must reuse them."""
    later, other = dict(MUON_HYPER, lr=5e-4), dict(MUON_HYPER, lr=3e-4, weight_decay=0.0, momentum=0.9)
    return [
        StepCase("first step", "main", 1, {0: MUON_HYPER}),
        StepCase("next step, new lr", "main", 2, {0: later}),
        StepCase("other parameter group", "other group", 1, {1: other}),
    ]


def _muon_step(bucket: Bucket, strategy: PrecisionStrategy, grad: Any, entry_grads: list[torch.Tensor], case: StepCase) -> None:
    """One fused Muon step of ``bucket``, its Newton-Schulz replaced by a copy of the direction (eager
    matmuls generate no kernel)."""
    from megatron_lowprec.optim.muon import fused_muon_bucket_step_

    def copied_direction(index: int, out: torch.Tensor, direction: torch.Tensor) -> None:
        out.copy_(direction)

    fused_muon_bucket_step_(
        bucket, strategy, grad, entry_grads, copied_direction, step=case.step,
        sr_seed=SR_SEED if strategy.param_update == "stochastic" else None, **case.hyper[bucket.group_index],
    )


def _run_cases(strategy: PrecisionStrategy, kind: str, capture: _Capture, optimizer: str = "adamw") -> tuple[list[StepRecord], list[int]]:
    """Run :func:`step_cases` (Muon: :func:`muon_step_cases`) on fake tensors; what each launched, and
    the graphs the first step called."""
    from megatron_lowprec.optim.fused import fused_bucket_step_

    buckets: dict[str, tuple[Bucket, Any, list[torch.Tensor], torch.Tensor]] = {}
    records, first_step = [], None
    for case in muon_step_cases() if optimizer == "muon" else step_cases(kind):
        if case.bucket not in buckets:
            shapes, groups = BUCKETS[case.bucket]
            if kind == "plain":
                built = _plain_bucket(strategy, MUON_SHAPES if optimizer == "muon" else shapes, groups[0])
            elif optimizer == "muon":
                built = _layout_bucket(strategy, MUON_SHAPES, groups[0])
            else:
                built = _shard_bucket(strategy, shapes, groups)
            buckets[case.bucket] = built
        bucket, grad, entry_grads, _ = buckets[case.bucket]
        graphs, calls = len(capture.wrappers), len(capture.calls)
        if optimizer == "muon":
            _muon_step(bucket, strategy, grad, entry_grads, case)
        else:
            fused_bucket_step_(
                bucket, strategy, grad, entry_grads, case.hyper, step=case.step,
                sr_seed=SR_SEED if strategy.param_update == "stochastic" else None, track_update_quality=False,
            )
        records.append(StepRecord(case.label, len(capture.wrappers) - graphs, capture.launches(capture.calls[calls:])))
        if first_step is None:
            first_step = capture.calls[calls:]
            capture.generating = False
    return records, first_step


SR_SEED = 1234


def generate_for(
    option: str, master_storage: str = "fp32", kind: str = "plain", arches: tuple[int, ...] = ARCHES, optimizer: str = "adamw",
    fx_cache: str | None = None,
) -> dict[int, StepCode]:
    """The kernels of one fused step of ``option`` (its FP32 master stored as ``master_storage``) for
    a ``kind`` bucket, compiled for each compute capability of ``arches``, with the launches and
    recompilations of the steps of :func:`step_cases`. Traced once per group of :func:`trace_groups`
    (Inductor writes the same Triton code for every arch of a group), with its first arch's device
    properties; a graph compiled again after the first step is counted but not generated.
    ``optimizer="muon"``: Muon's fused step (:func:`muon_step_cases`; ``kind="shard"``: its bucket in
    megatron's shard-aligned layer-wise layout, :func:`_layout_bucket`). ``fx_cache``: Inductor's FX
    graph cache folder (:func:`cuda_codegen`)."""
    strategy = get_strategy(option)
    if master_storage != strategy.master_storage:
        strategy = strategy.with_master_storage(master_storage)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not valid; choose one of {', '.join(OPTIMIZERS)}")
    if optimizer == "muon":
        from megatron_lowprec.optim.muon import muon_strategy

        strategy = muon_strategy(strategy)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not valid; choose one of {', '.join(KINDS)}")
    for arch in arches:
        _device_properties(arch)
    from torch._subclasses.fake_tensor import FakeTensorMode

    codes = {}
    for traced in trace_groups(strategy, arches):
        with tempfile.TemporaryDirectory(prefix="lowprec-codegen-") as cache_dir, cuda_codegen(traced[0], cache_dir, fx_cache) as capture:
            with FakeTensorMode(allow_non_fake_inputs=True):
                records, first_step = _run_cases(strategy, kind, capture, optimizer)
            for arch in traced:
                kernels, errors = [], {}
                for key, (graph, source) in capture.sources.items():
                    name = key.split(":", 1)[1]
                    try:
                        asm, per_thread = compile_kernel(name, source, arch)
                    except CodegenSetupError:
                        raise
                    except Exception as error:
                        errors[key] = _last_line(error)
                        continue
                    kernels.append(Kernel(
                        name, graph, source, asm["ptx"], capture.kernel_launches(key, first_step), per_thread, asm
                    ))
                codes[arch] = StepCode(
                    strategy.name, master_storage, kind, arch, kernels, records, capture.wrappers, errors, optimizer
                )
    return {arch: codes[arch] for arch in arches}


def trace_groups(strategy: PrecisionStrategy, arches: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``arches`` grouped by the step the fused path traces for them: one group, but for FP8 moments
    the arches below :data:`~megatron_lowprec.numerics.compiled.FP8_CONVERSION_CAPABILITY` apart (their
    payloads are integer codes: :func:`~megatron_lowprec.optim.fused.fp8_payloads_as_codes`)."""
    from megatron_lowprec.numerics.compiled import FP8_CONVERSION_CAPABILITY

    groups: dict[bool, list[int]] = {}
    for arch in arches:
        codes = strategy.moments == "fp8" and divmod(arch, 10) < FP8_CONVERSION_CAPABILITY
        groups.setdefault(codes, []).append(arch)
    return [tuple(group) for group in groups.values()]


def generate_function(
    function: Callable, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, arch: int = 90, static_dims: tuple[int, ...] = ()
) -> list[Kernel]:
    """The kernels Inductor generates for ``function`` of fake CUDA tensors of ``shapes`` and ``dtype``
    (one call; the sizes of ``static_dims`` constants of the graph, ``torch._dynamo.mark_static``, as
    the caller's code marks them), compiled for ``arch``: the audit's rules applied to code other than the step."""
    _device_properties(arch)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tempfile.TemporaryDirectory(prefix="lowprec-codegen-") as cache_dir, cuda_codegen(arch, cache_dir) as capture:
        with FakeTensorMode(allow_non_fake_inputs=True):
            inputs = [torch.empty(shape, dtype=dtype, device="cuda") for shape in shapes]
            for tensor in inputs:
                for dim in static_dims:
                    torch._dynamo.mark_static(tensor, dim)
            torch.compile(function, dynamic=True, fullgraph=True)(*inputs)
        kernels = []
        for key, (graph, source) in capture.sources.items():
            name = key.split(":", 1)[1]
            asm, per_thread = compile_kernel(name, source, arch)
            kernels.append(Kernel(name, graph, source, asm["ptx"], capture.kernel_launches(key, capture.calls), per_thread, asm))
    return kernels


def generate(option: str, master_storage: str = "fp32", kind: str = "plain", arch: int = 90) -> StepCode:
    """:func:`generate_for` one architecture."""
    return generate_for(option, master_storage, kind, (arch,))[arch]


def _last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
