"""The fused step's CUDA kernels run bit for bit under Triton's interpreter, on CPU tensors.

:func:`compare` steps two twin buckets of small CPU tensors three times with the same gradients:
one through the CUDA Triton kernels that Inductor generates for an H100 (``codegen.py``; for FP8
moments also for an A100, whose kernels store the FP8 payloads as integer codes:
:func:`~megatron_lowprec.optim.fused.fp8_payloads_as_codes`), run by Triton's interpreter (``TRITON_INTERPRET=1``), the other through the eager step (the uncompiled
:func:`~megatron_lowprec.optim.kernel.bucket_kernel_`, laid out in calls as on a CPU). Every
parameter and state bit must agree. The interpreted twin takes the GPU's path through
:func:`~megatron_lowprec.optim.fused.fused_bucket_step_` (one call per bucket, stochastic rounding's
:class:`~megatron_lowprec.optim.kernel.BucketStream`: ``BUCKET_STREAM_DEVICES`` holds the CPU too;
FP8 group statistics recomputed in the kernel: ``GROUP_STATISTICS_DEVICES`` too), and Dynamo traces the step's CUDA code: it fakes every CPU tensor of one or more dimensions as a
``cuda:0`` tensor (0-d tensors are the step's host scalars, on the host on a GPU too), so that
Inductor writes the kernels of :mod:`~tools.kernel_audit.codegen`'s audit (a test compares their
sources). The wrapper Inductor writes around them runs on the host: its ``empty_strided_cuda``
allocates CPU tensors, its device guard does nothing.

Muon's fused step (:func:`~megatron_lowprec.optim.muon.fused_muon_bucket_step_`, ``optimizer="muon"``)
is compared the same way over a plain bucket of 2-D weights (:data:`MUON_SHAPES`): its momentum and
update calls run the interpreted kernels, Newton-Schulz between them runs torch's matmuls on the
host in both twins, and the eager twin's calls run the uncompiled
:func:`~megatron_lowprec.optim.kernel.muon_momentum_kernel_` and
:func:`~megatron_lowprec.optim.kernel.muon_update_kernel_`.

The interpreter runs each Triton operation with numpy, which differs from a GPU in a few known
places. Each shim (:data:`SHIMS`, :data:`LIBDEVICE_SHIMS`) makes it do what the GPU's instruction
does; nothing else of the arithmetic is changed:

* FP32 -> BF16 conversions (``.to(tl.bfloat16)`` and the implicit one of a BF16 store): the
  interpreter truncates; a GPU rounds to nearest even (``cvt.rn.bf16.f32``), NaN to 0x7FFF.
* BF16 -> FP32 conversions: the interpreter renormalizes BF16 subnormals into an FP32 exponent
  below its range (9 x 2^-133 became 2^-129); a GPU widens exactly (the bits shifted up 16 places).
* FP32 -> FP8 E4M3 (``tl.float8e4nv``): the interpreter misrounds (a carry out of the significand is
  dropped, ties round up, subnormals truncate); a GPU rounds to nearest even and saturates finite
  values at ±448 (``cvt.rn.satfinite.e4m3x2.f32``).
* ``libdevice.nearbyint`` and ``libdevice.copysign`` (COAT's FP8 group scales): the interpreter has
  no libdevice; :data:`LIBDEVICE_SHIMS` computes them as the GPU does (``cvt.rni``, a sign copy).

What needs no shim: ``div_rn`` and ``sqrt_rn`` are numpy's correctly rounded FP32 division and square
root, as ``div.rn.f32``/``sqrt.rn.f32``; the kernels are generated without FP fusion (Inductor's
``emulate_precision_casts``), so a GPU contracts no multiply-add, and the interpreter never does;
an explicit ``tl.fma`` rounds once in both; numpy keeps FP32 subnormals as ``disable_ftz`` kernels do.

One more patch changes no arithmetic, only the interpreter's speed (:func:`language_patched_once_per_launch`):
Triton's interpreter patches ``triton.language`` again at every call of a helper function inside a
kernel, which within a launch (whose own patch stays in force until it ends) changes nothing.

Triton reads ``TRITON_INTERPRET`` when a kernel (or a helper of Inductor's) is decorated, so each
comparison runs in a process of its own started with it set (:func:`run_comparisons`).

Run ``python -m tools.kernel_audit.interpret`` (``--help`` for a subset), or
``python -m tools.kernel_audit.audit --interpret``; ``--norm`` runs :func:`compare_norm` (the
exact gradient norm's kernels, integer arithmetic only: no shim).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch

from tools.kernel_audit import codegen

SHAPES = ((4, 64), (300,), (64,))
"""The parameters of a compared bucket: a matrix, and two vectors whose entries end in padding. Their
shard (the second half of megatron's buffer) lies in place, beginning 32 elements into a row; coat's,
where megatron's third parameter would start inside an FP8 group of 128, is packed."""

MUON_SHAPES = ((4, 64), (12, 16))
"""The weights of a compared Muon bucket (the second's entry ends in padding; coat's momentum holds
four FP8 groups of 128 elements). In megatron's layout the bucket lies in place; coat's, whose 448
elements are no whole number of FP8 groups, reads and writes the weights as rows of DDP's buffer."""

STEPS = 3
SEED = 27
ARCH = 90
"""The device whose kernels run by default: an H100."""


def compared_arches(option: str, master_storage: str, kind: str, optimizer: str = "adamw") -> tuple[int, ...]:
    """The devices whose kernels :func:`run_comparisons` runs for a configuration: :data:`ARCH`, and
    for AdamW's plain step with an FP32 master also one device of each other group of the audit's
    (:func:`~tools.kernel_audit.codegen.trace_groups`: FP8 payloads as integer codes below
    sm_89). The coding is the same function in every configuration of an option, and of Muon's FP8
    momentum too, and a comparison takes minutes on two cores, so one configuration per option proves it."""
    from tools.kernel_audit.audit import strategy_for

    arches = (ARCH, *(arch for arch in codegen.ARCHES if arch != ARCH))
    groups = codegen.trace_groups(strategy_for(option, master_storage), arches)
    if (optimizer, kind, master_storage) != ("adamw", "plain", "fp32"):
        groups = groups[:1]
    return tuple(group[0] for group in groups)


@dataclasses.dataclass
class Comparison:
    """The interpreted kernels' step against the eager step, for one option, master storage and kind."""

    option: str
    master_storage: str
    kind: str
    arch: int
    kernels: list[str]
    """The generated kernels that ran (names), in the order of their first launch."""
    sources: dict[str, str]
    """Name -> the Triton source Inductor wrote, of every generated kernel."""
    launches: int
    """Kernel launches over all steps."""
    mismatches: dict[str, str]
    """Tensor (``param``, or a state key) -> its first differing element, in bits."""
    seconds: float
    error: str | None = None
    """Why the interpreted step did not run (its exception's last line and the line that raised it)."""
    optimizer: str = "adamw"
    """Whose fused step: ``adamw`` or ``muon`` (``codegen.OPTIMIZERS``)."""

    @property
    def identical(self) -> bool:
        return self.error is None and not self.mismatches


def _bf16_rne(values: np.ndarray) -> np.ndarray:
    """``cvt.rn.bf16.f32``: FP32 to BF16 bits, rounded to nearest even; NaN to the GPU's 0x7FFF."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FFF), rounded)


def _e4m3_rne_satfinite(values: np.ndarray) -> np.ndarray:
    """``cvt.rn.satfinite.e4m3x2.f32``: FP32 to E4M3 bits, rounded to nearest even, finite values
    saturated at ±448 (NaN stays NaN)."""
    clamped = np.clip(values.astype(np.float32), -448.0, 448.0)
    encoded = torch.from_numpy(np.ascontiguousarray(clamped)).to(torch.float8_e4m3fn)
    return encoded.view(torch.uint8).numpy()


def _bf16_widened(bits: np.ndarray) -> np.ndarray:
    """BF16 bits to FP32 (``cvt.f32.bf16``): exact, the bits shifted up 16 places (subnormals stay
    subnormal: both formats have the same exponent range)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


SHIMS = {
    "FP32 -> BF16 rounds to nearest even (cvt.rn.bf16.f32)": ("float32", "bfloat16", _bf16_rne),
    "BF16 -> FP32 is exact, subnormals included (cvt.f32.bf16)": ("bfloat16", "float32", _bf16_widened),
    "FP32 -> FP8 E4M3 rounds to nearest even, saturating (cvt.rn.satfinite.e4m3x2.f32)": ("float32", "float8e4nv", _e4m3_rne_satfinite),
}
"""The interpreter's conversions replaced by the GPU's: description -> (source type, target type, bits)."""


LIBDEVICE_SHIMS = {
    "nearbyint": ("cvt.rni: rounds to the nearest integer, ties to even", np.rint),
    "copysign": ("exact: the magnitude of the first operand with the sign bit of the second", np.copysign),
}
"""libdevice functions the generated kernels call (the interpreter runs no libdevice: each call gives
``None``), as numpy functions that compute what the GPU's does: name -> (the GPU's result, numpy)."""

APPROXIMATE_LIBDEVICE_SHIMS = {
    "tanh": ("tanhf, within 2 ulp of tanh", np.tanh),
    "erf": ("erff, within 2 ulp of erf", np.vectorize(math.erf, otypes=[np.float64])),
    "exp": ("expf, within 2 ulp of exp", np.exp),
}
"""libdevice functions that only the tolerance comparisons of :func:`compare_coat_layers` need (the
backward passes of GELU and SwiGLU), computed by numpy within a few ulp of the GPU's: name -> (the
GPU's function, numpy)."""


def _libdevice_shim(function: Callable) -> Callable:
    """A libdevice function of interpreted tensors (or Python numbers) computed by numpy ``function``."""
    import triton.language as tl
    from triton.runtime import interpreter

    def shim(*args, _semantic=None, **kwargs):
        tensors = [arg for arg in args if isinstance(arg, tl.tensor)]
        widest = max(tensors, key=lambda tensor: tensor.handle.data.size)
        dtype = widest.handle.data.dtype
        values = [arg.handle.data if isinstance(arg, tl.tensor) else np.asarray(arg, dtype=dtype) for arg in args]
        result = np.asarray(function(*np.broadcast_arrays(*values)), dtype=dtype)
        return tl.tensor(interpreter.TensorHandle(result, widest.dtype.scalar), widest.type)

    return shim


@contextlib.contextmanager
def gpu_conversions() -> Iterator[None]:
    """The interpreter converts as a GPU does where :data:`SHIMS` says (its builder's ``cast_impl`` for
    ``.to()`` and stores, ``create_fp_to_fp`` for FP8), and computes :data:`LIBDEVICE_SHIMS`."""
    import triton.language as tl
    from torch._inductor.runtime.triton_helpers import libdevice
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    targets = {(getattr(tl, source), getattr(tl, target)): convert for source, target, convert in SHIMS.values()}

    def shimmed(original):
        def convert(self, src, dst_type, *args):
            key = (src.dtype.scalar, dst_type.scalar)
            if key in targets:
                return interpreter.TensorHandle(targets[key](src.data), dst_type.scalar)
            return original(self, src, dst_type, *args)

        return convert

    with contextlib.ExitStack() as stack:
        for name in ("cast_impl", "create_fp_to_fp", "create_fp_trunc"):
            stack.enter_context(mock.patch.object(builder, name, shimmed(getattr(builder, name))))
        for name, (_, function) in LIBDEVICE_SHIMS.items():
            stack.enter_context(mock.patch.object(libdevice, name, _libdevice_shim(function)))
        yield


def _traced_on_cuda(original: Callable) -> Callable:
    """``FakeTensorMode.from_tensor`` that gives a CPU tensor of one or more dimensions the fake
    device ``cuda:0`` (0-d tensors are the step's host scalars, on the host on a GPU too): Dynamo
    traces the step's CUDA code and Inductor compiles it for CUDA from the CPU tensors."""

    def from_tensor(mode, tensor, *args, **kwargs):
        fake = original(mode, tensor, *args, **kwargs)
        if fake.device.type == "cpu" and fake.dim() > 0:
            fake.fake_device = torch.device("cuda", 0)
        return fake

    return from_tensor


def _host_allocation(size, stride, dtype):
    """A generated wrapper's ``empty_strided_cuda``: its buffers on the host."""
    return torch.empty_strided(size, stride, dtype=dtype)


class _Launches:
    """The generated kernels, loaded by Inductor for the interpreter, each launch counted."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self.sources: dict[str, str] = {}
        self.launches = 0

    def load(self, original: Callable) -> Callable:
        def triton(async_compile, kernel_name, source_code, device_str="cuda"):
            self.sources[kernel_name] = source_code
            kernel = original(async_compile, kernel_name, source_code, device_str)
            run = kernel.run

            def counted(*args, **kwargs):
                if kernel_name not in self.kernels:
                    self.kernels.append(kernel_name)
                self.launches += 1
                return run(*args, **kwargs)

            kernel.run = counted
            return kernel

        return triton


class _NoDeviceGuard:
    """``torch.cuda._DeviceGuard`` of a generated wrapper: there is one device, the host."""

    def __init__(self, device: int) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


@contextlib.contextmanager
def interpreted_cuda_kernels(cache_dir: str, arch: int = ARCH, fx_cache: str | None = None) -> Iterator[_Launches]:
    """Compiled steps on CPU tensors run the CUDA kernels generated for ``arch``, interpreted
    with :func:`gpu_conversions`, on that GPU's path through the fused step (one call per bucket,
    FP8 payloads as codes below sm_89, FP8 group statistics recomputed in the kernel). Inside
    :func:`~tools.kernel_audit.codegen.cuda_codegen` (the device's properties, Triton's target),
    with Inductor's own kernel loading and ``compile_fx`` back (the audit's capture runs nothing);
    ``fx_cache``: its Inductor FX graph cache folder, where a step the audit generated with the same
    folder is found, not compiled again."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the interpreted kernels need TRITON_INTERPRET=1 set before triton is imported")
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor.async_compile import AsyncCompile
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_lowprec.optim import fused

    launches = _Launches()
    load, compile_fx = AsyncCompile.triton, compile_fx_module.compile_fx
    payloads_as_codes = fused.fp8_payloads_as_codes
    with codegen.cuda_codegen(arch, cache_dir, fx_cache), contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(AsyncCompile, "triton", launches.load(load)))
        stack.enter_context(mock.patch.object(compile_fx_module, "compile_fx", compile_fx))
        stack.enter_context(mock.patch.object(torch._C._dynamo.guards, "_empty_strided_cuda", _host_allocation))
        stack.enter_context(mock.patch.object(FakeTensorMode, "from_tensor", _traced_on_cuda(FakeTensorMode.from_tensor)))
        stack.enter_context(mock.patch.object(torch.cuda, "_DeviceGuard", _NoDeviceGuard))
        stack.enter_context(mock.patch.object(torch.cuda, "set_device", lambda device: None))
        stack.enter_context(mock.patch.object(fused, "BUCKET_STREAM_DEVICES", ("cuda", "cpu")))
        stack.enter_context(mock.patch.object(fused, "GROUP_STATISTICS_DEVICES", ("cuda", "cpu")))
        stack.enter_context(mock.patch.object(
            fused, "fp8_payloads_as_codes", lambda device: payloads_as_codes(torch.device("cuda", 0))
        ))
        stack.enter_context(gpu_conversions())
        stack.enter_context(language_patched_once_per_launch())
        yield launches


class _LaunchPatch:
    """The language patch of one interpreted launch; until it is restored, :func:`language_patched_once_per_launch`
    skips the patches of the ``triton.language`` modules it (or a helper since) has patched."""

    def __init__(self, scope: Any, patched: set[int]) -> None:
        self.scope, self.patched = scope, patched

    def restore(self) -> None:
        self.patched.clear()
        self.scope.restore()


@contextlib.contextmanager
def language_patched_once_per_launch() -> Iterator[None]:
    """Triton's interpreter patches the ``triton.language`` modules that a kernel's globals name (an
    ``inspect`` walk of each) at the start of each launch, and again at every call of a helper
    function inside the kernel, for the modules the helper's globals name: a coat step makes over a
    hundred thousand such calls, a third of its time. A helper's patch of modules already patched in the launch changes
    nothing and is skipped; the others are made, as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = codegen._private(interpreter, "_patch_lang", "Triton's interpreter")
    patched: set[int] = set()

    def patched_once(fn):
        modules = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if patched and modules <= patched:
            return None
        launch = not patched
        scope = patch_lang(fn)
        patched.update(modules)
        return _LaunchPatch(scope, patched) if launch else scope

    with mock.patch.object(interpreter, "_patch_lang", patched_once):
        yield


@contextlib.contextmanager
def eager_steps() -> Iterator[None]:
    """The fused steps' calls (AdamW's and Muon's) run the uncompiled kernels and master codec (the eager step)."""
    from megatron_lowprec.optim import fused, muon
    from megatron_lowprec.optim.kernel import bucket_kernel_, muon_momentum_kernel_, muon_update_kernel_

    codec = (fused._join_master_window, fused._split_master_window_)
    with mock.patch.object(fused, "compiled_kernel", lambda group_statistics=False: bucket_kernel_), \
            mock.patch.object(fused, "compiled_master_codec", lambda: codec), \
            mock.patch.object(muon, "compiled_muon_momentum_kernel", lambda group_statistics=False: muon_momentum_kernel_), \
            mock.patch.object(muon, "compiled_muon_update_kernel", lambda: muon_update_kernel_):
        yield


def _twin(strategy, kind: str, shapes: tuple[tuple[int, ...], ...] = SHAPES, optimizer: str = "adamw"):
    """A bucket of ``shapes`` on the CPU, parameters drawn from :data:`SEED` (Muon's shard: its
    bucket in megatron's layer-wise layout)."""
    generator = torch.Generator().manual_seed(SEED)

    def fill(tensor):
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)

    if kind == "plain":
        return codegen._plain_bucket(strategy, shapes, 0, device="cpu", fill=fill)
    if optimizer == "muon":
        return codegen._layout_bucket(strategy, shapes, 0, device="cpu", fill=fill)
    return codegen._shard_bucket(strategy, shapes, [0] * len(shapes), device="cpu", fill=fill)


def _params_of(bucket) -> torch.Tensor:
    """The buffer that holds the bucket's parameters: its own, megatron's whole (in place, or rows of it)."""
    if bucket.param_rows is not None:
        return bucket.param_rows[1].source
    return bucket.param_buffer if bucket.param_buffer._base is None else bucket.param_buffer._base


def _first_mismatch(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Where ``got`` and ``expected`` first differ, in bits (``None``: bit-identical)."""
    width = got.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    got_bits, expected_bits = got.reshape(-1).view(as_int), expected.reshape(-1).view(as_int)
    differ = (got_bits != expected_bits).nonzero().reshape(-1)
    if not differ.numel():
        return None
    index = int(differ[0])
    mask = (1 << (8 * width)) - 1
    return (
        f"{differ.numel()} of {got_bits.numel()} elements differ; first at {index}: "
        f"0x{int(got_bits[index]) & mask:0{2 * width}x} (interpreted) vs 0x{int(expected_bits[index]) & mask:0{2 * width}x} (eager)"
    )


def _adamw_steps(strategy, grads: list[torch.Tensor], sizes: list[int]) -> Callable:
    """Step a twin with AdamW's fused step, one gradient of ``grads`` per step."""
    from megatron_lowprec.optim.fused import fused_bucket_step_

    sr_seed = codegen.SR_SEED if strategy.param_update == "stochastic" else None

    def step_bucket(bucket, grad, entry_grads, step):
        fused_bucket_step_(
            bucket, strategy, grad, entry_grads, {0: dict(codegen.STEP_HYPER)}, step=step,
            sr_seed=sr_seed, track_update_quality=False,
        )

    return _stepping(step_bucket, grads, sizes)


def _muon_steps(strategy, grads: list[torch.Tensor], sizes: list[int]) -> Callable:
    """Step a twin with Muon's fused step (its Newton-Schulz eager on the host, as on a GPU it runs
    torch's matmuls), one gradient of ``grads`` per step."""
    from megatron_lowprec.optim.muon import fused_muon_bucket_step_, orthogonal_step_

    sr_seed = codegen.SR_SEED if strategy.param_update == "stochastic" else None
    hyper = codegen.MUON_HYPER

    def orthogonal_steps(index: int, out: torch.Tensor, direction: torch.Tensor) -> None:
        orthogonal_step_(out, direction, lr=hyper["lr"])

    def step_bucket(bucket, grad, entry_grads, step):
        fused_muon_bucket_step_(bucket, strategy, grad, entry_grads, orthogonal_steps, step=step, sr_seed=sr_seed, **hyper)

    return _stepping(step_bucket, grads, sizes)


def _stepping(step_bucket: Callable, grads: list[torch.Tensor], sizes: list[int]) -> Callable:
    """Step a twin with ``step_bucket(bucket, grad, entry_grads, step)``, one gradient of ``grads``
    per step, split into the entries' gradients by ``sizes``."""

    def run(twin):
        bucket, grad, entry_grads, _ = twin
        for step, values in enumerate(grads, start=1):
            for entry_grad, entry_values in zip(entry_grads, values.split(sizes)):
                entry_grad.copy_(entry_values)
            step_bucket(bucket, grad, entry_grads, step)

    return run


def compare(
    option: str, master_storage: str = "fp32", kind: str = "plain", steps: int = STEPS, arch: int = ARCH,
    optimizer: str = "adamw", fx_cache: str | None = None,
) -> Comparison:
    """Step twin buckets of ``option`` ``steps`` times, through the interpreted CUDA kernels of ``arch`` and the
    eager step (this process must have ``TRITON_INTERPRET=1`` from its start), and compare every bit
    (an AdamW shard laid out in place: megatron's buffers whole, its padding included, which stays
    zero). ``optimizer="muon"``: Muon's fused step over a bucket of :data:`MUON_SHAPES` (``kind="shard"``:
    in megatron's layer-wise layout, where the parameters compared are DDP's whole buffer).
    ``fx_cache``: :func:`interpreted_cuda_kernels`'s."""
    from tools.kernel_audit.audit import strategy_for

    started = time.perf_counter()
    strategy = strategy_for(option, master_storage)
    shapes, stepper = SHAPES, _adamw_steps
    if optimizer == "muon":
        from megatron_lowprec.optim.muon import muon_strategy

        strategy, shapes, stepper = muon_strategy(strategy), MUON_SHAPES, _muon_steps
    twins = {"interpreted": _twin(strategy, kind, shapes, optimizer), "eager": _twin(strategy, kind, shapes, optimizer)}
    generator = torch.Generator().manual_seed(SEED + 1)
    sizes = [grad.numel() for grad in twins["eager"][2]]
    grads = [torch.randn(sum(sizes), generator=generator) * 10.0 ** (step - steps) for step in range(steps)]
    run = stepper(strategy, grads, sizes)
    with tempfile.TemporaryDirectory(prefix="lowprec-interpret-") as cache_dir:
        with interpreted_cuda_kernels(cache_dir, arch, fx_cache) as launches:
            run(twins["interpreted"])
    with eager_steps():
        run(twins["eager"])
    interpreted, eager = twins["interpreted"][0], twins["eager"][0]
    tensors = {"param": (_params_of(interpreted), _params_of(eager))}
    tensors.update({key: (value, eager.state[key]) for key, value in interpreted.state.items() if torch.is_tensor(value)})
    mismatches = {name: found for name, (got, expected) in tensors.items() if (found := _first_mismatch(got, expected))}
    return Comparison(
        strategy.name, master_storage, kind, arch, launches.kernels, launches.sources, launches.launches, mismatches,
        time.perf_counter() - started, optimizer=optimizer,
    )


def _compare_in_worker(
    option: str, master_storage: str, kind: str, arch: int, optimizer: str = "adamw", fx_cache: str | None = None
) -> Comparison:
    """:func:`compare`, or a comparison that names the error that stopped it."""
    started = time.perf_counter()
    try:
        return compare(option, master_storage, kind, arch=arch, optimizer=optimizer, fx_cache=fx_cache)
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        where = next((f"{frame.line} ({os.path.basename(frame.filename)})" for frame in reversed(frames)), "")
        return Comparison(
            option, master_storage, kind, arch, [], {}, 0, {}, time.perf_counter() - started,
            f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''} at {where}",
            optimizer,
        )


def run_comparisons(
    pairs: Iterable[tuple[str, str]] | None = None, kinds: Iterable[str] = codegen.KINDS, workers: int = 1,
    muon_pairs: Iterable[tuple[str, str]] = (),
    muon_kinds: Iterable[str] = ("plain",),
    fx_cache: str | None = None,
) -> list[Comparison]:
    """:func:`compare` every (option, master storage) of ``pairs`` (default: the audit's
    configurations) for each kind, and Muon's step for each of ``muon_pairs`` and ``muon_kinds``,
    each on its :func:`compared_arches`, in ``workers`` processes started with ``TRITON_INTERPRET=1``
    (results in the order of ``muon_pairs``, ``muon_kinds``, then ``pairs``, ``kinds`` and arches);
    ``fx_cache``: :func:`interpreted_cuda_kernels`'s."""
    from tools.kernel_audit.audit import configurations

    tasks = [
        (option, storage, kind, arch, "muon")
        for option, storage in muon_pairs for kind in muon_kinds for arch in compared_arches(option, storage, kind, "muon")
    ]
    tasks += [
        (option, storage, kind, arch, "adamw")
        for option, storage in (configurations() if pairs is None else pairs) for kind in kinds
        for arch in compared_arches(option, storage, kind)
    ]
    context = multiprocessing.get_context("spawn")
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}), concurrent.futures.ProcessPoolExecutor(
        max_workers=max(workers, 1), mp_context=context
    ) as pool:
        return list(pool.map(functools.partial(_compare_in_worker, fx_cache=fx_cache), *zip(*tasks)))


NORM_VALUES = 4400
"""Values of :func:`compare_norm`: eight rows of ``square_sum.ROW_ELEMENTS`` in two calls, and the
last 304 values in a third, zero-padded to two rows."""


def compare_norm(dtype: torch.dtype = torch.float32, arch: int = ARCH) -> str | None:
    """The exact gradient norm's CUDA kernels (``numerics/square_sum.py``'s windowed and every-digit
    digit sums, compiled as on a GPU) interpreted on :data:`NORM_VALUES` values of ``dtype``, twice:
    gradient-like values (normal ones over 2^±12 and zeros: every row stays in its window, so the
    windowed kernel's sums are the result), then values from every binade of FP32 with zeros,
    subnormals, the largest finite value, infinities and a NaN (rows escape their windows: the
    every-digit kernel's sums), each against Σ x² · 2^298 in Python integers (each x² is exact in a
    Python float) and the counts of non-finite values and NaNs: ``None`` where they agree, else what
    differs. This process must have ``TRITON_INTERPRET=1`` from its start."""
    from megatron_lowprec.numerics import square_sum

    generator = torch.Generator().manual_seed(SEED)
    gradient_like = torch.randn(NORM_VALUES, generator=generator) * torch.exp2(
        torch.randint(-12, 13, (NORM_VALUES,), generator=generator).float()
    )
    gradient_like[::11] = 0.0
    exponents = torch.randint(-150, 128, (NORM_VALUES,), generator=generator).double()
    values = (torch.randn(NORM_VALUES, generator=generator, dtype=torch.float64) * 2.0**exponents).float()
    values[:8] = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-140), 3.4028234663852886e38, float("inf"), -float("inf"), float("nan")])
    differences = []
    with tempfile.TemporaryDirectory(prefix="lowprec-interpret-") as cache_dir:
        with interpreted_cuda_kernels(cache_dir, arch) as launches:
            digit_sums = square_sum._compiled_digit_sums.__wrapped__()
            for name, inputs in (("gradient-like", gradient_like.to(dtype)), ("every binade", values.to(dtype))):
                windowed = square_sum._carry(square_sum._added_partials(
                    square_sum._row_partials([inputs], digit_sums[0], max_rows=4), inputs.device
                ))
                escaped = int(windowed[square_sum.ESCAPED])
                sums = square_sum._carry(square_sum._cuda_digit_sums([inputs], digit_sums)).tolist()
                difference = _norm_difference(inputs, sums)
                if (escaped == 0) != (name == "gradient-like"):
                    difference = f"{escaped} values escaped their windows"
                if difference:
                    differences.append(f"{name}: {difference}")
    if not launches.launches:
        return "no generated kernel ran"
    return "; ".join(differences) or None


def _norm_difference(values: torch.Tensor, sums: list[int]) -> str | None:
    """What differs between the digit sums and counts ``sums`` and the exact ones of ``values``."""
    from megatron_lowprec.numerics import square_sum

    finite = [x for x in values.double().tolist() if math.isfinite(x)]
    expected = sum(int(x * x * 2.0**square_sum.SCALE_EXPONENT) for x in finite)
    got = sum(digit << (square_sum.DIGIT_BITS * index) for index, digit in enumerate(sums[: square_sum.DIGITS]))
    counts = (sums[square_sum.NON_FINITE], sums[square_sum.NAN])
    expected_counts = (values.numel() - len(finite), sum(math.isnan(x) for x in values.double().tolist()))
    if got == expected and counts == expected_counts:
        return None
    return f"Σx²·2^298 {got} against {expected}; non-finite and NaN counts {counts} against {expected_counts}"


COAT_BACKWARD_TOLERANCE = 1e-6
"""Largest relative L2 difference allowed between a compiled and an eager backward pass of COAT's
FP8 activations: their reductions add in other orders (FP32, rows of 64 values)."""


def compare_coat_layers(arch: int = ARCH) -> dict[str, str | None]:
    """COAT's layer kernels as a GPU that converts FP8 compiles them, interpreted on CPU tensors
    against their eager operations: ``numerics/quant.py``'s ``quantize_rows`` (E4M3, BF16 values from
    many binades with zeros and a zero row, per tensor and per 1 x 16 group), its ``quantize_matrix``
    (E4M3 per tensor, the row-major and the transposed payload written by one kernel) and
    ``layers/fp8_linear.py``'s ``row_major`` (copies of transposed E4M3 and E5M2 payloads) bit for bit; the backward passes of
    ``layers/fp8_activations.py`` (LayerNorm, RMSNorm, GELU, SwiGLU, from a saved FP8 input) within
    :data:`COAT_BACKWARD_TOLERANCE`. Name -> ``None`` where they agree, else what differs. (The E5M2
    cast has no shim: the interpreter misrounds it, the GPU does not.) This process must have
    ``TRITON_INTERPRET=1`` from its start."""
    import importlib

    from torch._inductor.runtime.triton_helpers import libdevice

    from megatron_lowprec.layers import fp8_activations
    from megatron_lowprec.numerics import quant
    from megatron_lowprec.numerics.compiled import compile_exact

    fp8_linear = importlib.import_module("megatron_lowprec.layers.fp8_linear")
    generator = torch.Generator().manual_seed(SEED)
    values = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-30, 30, (4096,), generator=generator).float())
    values[::7] = 0.0
    values[1024:1040] = 0.0
    values = values.bfloat16()
    activations = (torch.randn(32, 64, generator=generator) * 3).bfloat16()
    saved = fp8_activations.quantize_along_last_dim(activations)
    weight, bias = (torch.randn(64, generator=generator) + 1).bfloat16(), torch.randn(64, generator=generator).bfloat16()
    grad_output = torch.randn(32, 64, generator=generator).bfloat16()
    common = (saved.payload, saved.scale, fp8_activations.GROUP_SIZE, 64, torch.bfloat16)
    backward_cases = {
        "LayerNorm backward": (fp8_activations._layer_norm_grads, (*common, grad_output, weight, bias, 1e-5)),
        "RMSNorm backward": (fp8_activations._rms_norm_grads, (*common, grad_output, weight, 1e-6)),
        "GELU backward": (fp8_activations._gelu_grad, (*common, grad_output, "tanh")),
        "SwiGLU backward": (fp8_activations._swiglu_grad, (*common, grad_output[:, :32])),
    }
    results: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="lowprec-interpret-") as cache_dir:
        with interpreted_cuda_kernels(cache_dir, arch) as launches:
            quantize, copy = compile_exact(quant._quantize_rows), compile_exact(fp8_linear._copied)
            for name, rows in (("per tensor", values.view(1, -1)), ("per 1x16 group", values.view(-1, 16))):
                payload, scale = quantize(rows, torch.float8_e4m3fn)
                expected_payload, expected_scale = quant._quantize_rows(rows, torch.float8_e4m3fn)
                results[f"quantize {name}"] = _first_mismatch(payload.view(torch.uint8), expected_payload.view(torch.uint8)) or (
                    _first_mismatch(scale, expected_scale)
                )
            matrix = values.view(32, 128)
            torch._dynamo.mark_static(matrix, 1)
            got = compile_exact(quant._quantize_matrix)(matrix, torch.float8_e4m3fn, True, True)
            expected = quant._quantize_matrix(matrix, torch.float8_e4m3fn, True, True)
            results["quantize both layouts"] = next((text for text in (
                _first_mismatch(got[0].view(torch.uint8), expected[0].view(torch.uint8)),
                _first_mismatch(got[1].view(torch.uint8), expected[1].view(torch.uint8)),
                _first_mismatch(got[2], expected[2]),
            ) if text is not None), None)
            for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                payload = values.float().clamp(-448, 448).to(fp8_dtype).view(64, 64)[:, :48]
                results[f"row-major copy {fp8_dtype}"] = _first_mismatch(
                    copy(payload.t()).view(torch.uint8), payload.t().contiguous().view(torch.uint8)
                )
            with contextlib.ExitStack() as libdevice_functions:
                for name, (_, function) in APPROXIMATE_LIBDEVICE_SHIMS.items():
                    libdevice_functions.enter_context(mock.patch.object(libdevice, name, _libdevice_shim(function)))
                compiled = {name: compile_exact(function)(*arguments) for name, (function, arguments) in backward_cases.items()}
            for name, (function, arguments) in backward_cases.items():
                got, expected = compiled[name], function(*arguments)
                got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
                results[name] = next(
                    (text for text in map(_relative_difference, got, expected) if text is not None), None
                )
    if not launches.launches:
        return {"launches": "no generated kernel ran"}
    return results


def _relative_difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """The relative L2 difference of ``got`` from ``expected`` where it exceeds :data:`COAT_BACKWARD_TOLERANCE`."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{got.dtype} {tuple(got.shape)} against {expected.dtype} {tuple(expected.shape)}"
    difference = float((got.double() - expected.double()).norm() / expected.double().norm())
    return None if difference <= COAT_BACKWARD_TOLERANCE else f"relative difference {difference:.2e}"


def coat_layer_comparisons() -> dict[str, str | None]:
    """:func:`compare_coat_layers` in a process started with ``TRITON_INTERPRET=1``."""
    context = multiprocessing.get_context("spawn")
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}), concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context
    ) as pool:
        return pool.submit(compare_coat_layers).result()


def report(comparisons: list[Comparison]) -> str:
    """One line per comparison: identical or its first differing bits, the kernels and launches."""
    lines = []
    for result in comparisons:
        verdict = "bit-identical" if result.identical else f"ERROR {result.error}" if result.error else "DIFFERS " + "; ".join(f"{k}: {v}" for k, v in result.mismatches.items())
        lines.append(
            f"{result.optimizer} {result.option} ({result.master_storage}, {result.kind}, sm_{result.arch}): {verdict}; "
            f"{len(result.kernels)} kernels, "
            f"{result.launches} launches in {STEPS} steps, {result.seconds:.1f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.kernel_audit.audit import OPTIMIZERS, configurations
    from megatron_lowprec.optim.strategies import get_strategy

    parser = argparse.ArgumentParser(prog="python -m tools.kernel_audit.interpret", description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", help="an option (repeatable; default: every option)")
    parser.add_argument("--kind", action="append", choices=codegen.KINDS, help="plain or shard (default: both; Muon's shard: its bucket in megatron's layer-wise layout)")
    parser.add_argument(
        "--optimizer", action="append", choices=OPTIMIZERS, help="whose fused step (repeatable; default: AdamW's and Muon's)"
    )
    parser.add_argument("--workers", type=int, default=1, help="processes that compare configurations in parallel")
    parser.add_argument(
        "--norm", action="store_true",
        help="instead, the exact gradient norm's kernels (FP32 and BF16) against exact integer sums (compare_norm)",
    )
    args = parser.parse_args(argv)
    if args.norm:
        return _main_norm()
    pairs = configurations()
    if args.option:
        names = {get_strategy(option).name for option in args.option}
        pairs = [pair for pair in pairs if pair[0] in names]
    optimizers = args.optimizer or OPTIMIZERS
    comparisons = run_comparisons(
        pairs if "adamw" in optimizers else [], args.kind or codegen.KINDS, args.workers,
        pairs if "muon" in optimizers else [], args.kind or codegen.KINDS,
    )
    print(report(comparisons))
    return 0 if all(result.identical for result in comparisons) else 1


def norm_comparisons() -> dict[str, str | None]:
    """:func:`compare_norm` of FP32 and BF16 values, in a process started with ``TRITON_INTERPRET=1``
    (this process's Triton untouched): dtype name -> its result."""
    context = multiprocessing.get_context("spawn")
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}), concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context
    ) as pool:
        return dict(zip(("float32", "bfloat16"), pool.map(compare_norm, (torch.float32, torch.bfloat16))))


def _main_norm() -> int:
    results = norm_comparisons()
    for dtype, result in results.items():
        print(f"exact gradient norm, {dtype}: {'exact' if result is None else 'DIFFERS ' + result}")
    return 0 if all(result is None for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
