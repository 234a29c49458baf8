"""Every private internal of torch's compiler (``torch._dynamo``, ``torch._inductor``,
``torch._functorch``, ``torch.fx.experimental``) that the package touches, in one module, for the
torch and triton versions it was written for.

Importing it reads the installed versions (:data:`SUPPORTED_TORCH`, :data:`SUPPORTED_TRITON`).
Outside them the package compiles nothing: the fused optimizer steps, the exact gradient norm's CUDA
digit sums and COAT's compiled quantization run their eager forms, which give the same bits, after
one :class:`EagerFallbackWarning` line (:func:`warn_unsupported`).

The package changes no setting of the process. Dynamo's recompile limit, integer specialisation and
shape settings apply only around the package's own compiled calls (:func:`compile_scoped`: read by
Dynamo when a call traces or recompiles, so they surround every call, not only the compile), and
the patches of Inductor's C++ code generator (:func:`step_code_generation`) only while a fused step
is called; Inductor options go to ``torch.compile`` itself, which applies them to that compile only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

SUPPORTED_TORCH = ((2, 10), (2, 14))
"""The torch releases (first and last, inclusive) whose compiler internals this module was written
for: 2.10 is the package's minimum (``megatron_lowprec.MINIMUM_TORCH``); it runs on 2.11 (the GPU
image) and 2.13 (``constraints.txt``), and each internal it patches is checked before it is patched."""

SUPPORTED_TRITON = ((3, 6), (3, 9))
"""The triton releases (first and last, inclusive) paired with :data:`SUPPORTED_TORCH`: torch 2.10 and
2.11 require triton 3.6, 2.12 triton 3.7, 2.14 triton 3.8; ``constraints.txt`` pins 3.9."""

RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit around the package's compiled calls (at least this, or the process's
own where it is higher): each strategy, dtype and rank of a fused step's views (flat buckets;
[rows, row_length] grids under SR, with one row or more) is one compilation."""


class EagerFallbackWarning(UserWarning):
    """A compiled step or kernel of the package ran its eager form instead: the same bits, more
    kernels and passes."""


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return tuple(map(int, match.groups())) if match else None


def version_problem(package: str, version: str | None, supported: tuple[tuple[int, int], tuple[int, int]]) -> str | None:
    """Why ``package`` at ``version`` is outside ``supported`` (first and last release, inclusive), in
    one line; ``None`` where it is inside, or where ``version`` is ``None`` (not installed)."""
    if version is None:
        return None
    release = _release(version)
    if release is not None and supported[0] <= release <= supported[1]:
        return None
    first, last = (".".join(map(str, bound)) for bound in supported)
    return f"{package} {version} is outside the versions whose compiler internals megatron-lowprec was written for ({first} to {last})"


def _installed_triton_version() -> str | None:
    for name in ("triton", "pytorch-triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


TORCH_PROBLEM = version_problem("torch", torch.__version__, SUPPORTED_TORCH)
TRITON_PROBLEM = version_problem("triton", _installed_triton_version(), SUPPORTED_TRITON)
"""Read once, at import: ``None``, or why the installed torch (triton, on CUDA) is not supported."""


def unsupported_reason(device_type: str) -> str | None:
    """Why the package compiles nothing for ``device_type`` on these versions (triton counts on CUDA
    only); ``None`` where it compiles."""
    return TORCH_PROBLEM or (TRITON_PROBLEM if device_type == "cuda" else None)


@functools.cache
def warn_unsupported(reason: str) -> None:
    """Warn once per ``reason`` (:func:`unsupported_reason`) that compiled steps and kernels run eagerly."""
    warnings.warn(
        f"{reason}: the fused optimizer steps and compiled kernels run eagerly (the same bits, slower)",
        EagerFallbackWarning, stacklevel=3,
    )


def has_option(dotted_name: str) -> bool:
    """Whether this torch's Inductor has the config entry ``dotted_name`` (``"cpp.dynamic_threads"``)."""
    from torch._inductor import config

    for part in dotted_name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def supported_options(options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that this torch's Inductor has (:func:`has_option`)."""
    return {name: value for name, value in options.items() if has_option(name)}


def compile_scoped(
    function: Callable, options: dict[str, Any], *, specialize_numbers: bool = False, duck_shapes: bool = True,
    recompile_limit: int = RECOMPILE_LIMIT, around: tuple[Callable[[], contextlib.AbstractContextManager], ...] = (),
) -> Callable:
    """``torch.compile(function, dynamic=True, fullgraph=True, options=options)``, each call of which
    runs under the package's Dynamo settings, and only it: a recompile limit of at least
    ``recompile_limit``; with ``specialize_numbers``, Python numbers among the arguments constants of
    the graph (``specialize_int``, ``specialize_float``) and no ``automatic_dynamic_shapes`` (every
    size is dynamic from the first compile; Dynamo's memory of earlier calls would otherwise give a
    later compile's sizes symbols of their own, and Inductor's cache key with them); without
    ``duck_shapes``, sizes and storage offsets that are equal by chance keep symbols of their own;
    and the contexts ``around`` (each called for a context manager), entered around each call."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental import _config as shapes_config

    compiled = torch.compile(function, dynamic=True, fullgraph=True, options=options)
    shapes = contextlib.nullcontext() if duck_shapes else shapes_config.patch(use_duck_shape=False)

    @functools.wraps(function)
    def call(*args):
        settings = _dynamo_settings(specialize_numbers, max(dynamo_config.recompile_limit, recompile_limit))
        with settings, shapes, contextlib.ExitStack() as stack:
            for context in around:
                stack.enter_context(context())
            return compiled(*args)

    return call


@functools.cache
def _dynamo_settings(specialize_numbers: bool, recompile_limit: int) -> contextlib.AbstractContextManager:
    """Dynamo's config patched to :func:`compile_scoped`'s settings: one reusable patch per pair (a
    patch built per call would cost more than the call's guards)."""
    from torch._dynamo import config as dynamo_config

    fixed = {"specialize_int": True, "specialize_float": True, "automatic_dynamic_shapes": False} if specialize_numbers else {}
    return dynamo_config.patch({**fixed, "recompile_limit": recompile_limit})


def recompile_limit_error() -> type[Exception]:
    """What a compiled call raises where Dynamo refuses to compile it again (its recompile limit),
    before the call runs."""
    from torch._dynamo import exc

    return exc.FailOnRecompileLimitHit


def compile_configs() -> dict[str, Any]:
    """This process's Inductor, Dynamo and AOT configs, portable to another process
    (:func:`load_compile_configs`)."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    return {
        "inductor": inductor_config.save_config_portable(),
        "dynamo": dynamo_config.save_config_portable(),
        "functorch": functorch_config.save_config_portable(),
    }


def load_compile_configs(configs: dict[str, Any]) -> None:
    """Take another process's :func:`compile_configs` (a background compile child's whole purpose:
    compiling as its parent would)."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    inductor_config.load_config(configs["inductor"])
    dynamo_config.load_config(configs["dynamo"])
    functorch_config.load_config(configs["functorch"])


def inductor_cache_dir() -> str:
    """The directory of Inductor's on-disk caches in this process."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


GROUP_STATISTICS_OPTIONS = {
    "realize_reads_threshold": 8,
    "realize_acc_reads_threshold": 16,
    "realize_cpu_acc_reads_threshold": 16,
    "max_fusion_size": 256,
}
"""Inductor options for fused steps with FP8 moments (COAT): each group's updated moments feed the
master update, two group reductions (max|x|, smallest non-zero) and the re-quantization, and under
Inductor's defaults (4 reads; 8 or 12 accumulated) they are stored in bucket-sized FP32 buffers
between those loops. With these thresholds they are recomputed from the FP8 payloads instead, so
the step reads the state a few times but allocates only per-group buffers. Options this torch's
Inductor lacks are left out (it then stores them). ``max_fusion_size`` (64 nodes by default): a
shard's step, which also places each element in megatron's buffers, has more nodes than that where
FP8 payloads are integer codes (sm_80), and its last moment's payload store was left to a kernel of
its own. GPUs only (``optim/fused.py``: ``group_statistics_in_kernel``), with
:func:`fusion_after_reordering` (:func:`group_statistics_options`)."""

POST_FUSION_OPTION = "_post_fusion_custom_pass"
FUSION_ROUNDS = 10
"""At most as many fusion rounds as Inductor's own fusion loop."""


@functools.cache
def fusion_after_reordering() -> Any:
    """An Inductor scheduler pass (``_post_fusion_custom_pass``) that repeats Inductor's fusion
    rounds after its last, loop-reordering round, until nothing fuses. COAT's element pass reads the
    old group scales and is fused with the group reductions only in that last round, so without
    more rounds each moment's new-scale store ([groups] pointwise, after every read of the old
    scales) stays a kernel of its own: with them the plain step is one kernel, which stores each new
    scale once per group. A ``CustomSchedulerPass`` with a ``uuid``, so that Inductor's FX graph
    cache keys on it, pickled as a call of this function (Inductor pickles its cache key, and a
    class local to a function does not pickle: the step would bypass the cache); None where this
    torch has the option but not that class (torch 2.11): the step then stores each new scale in a
    kernel of its own."""
    try:
        from torch._inductor.custom_graph_pass import CustomSchedulerPass
    except ImportError:
        return None

    class FusionAfterReordering(CustomSchedulerPass):
        def __call__(self, nodes):
            if not nodes:
                return nodes
            scheduler = nodes[0].scheduler
            for _ in range(FUSION_ROUNDS):
                fused = scheduler.fuse_nodes_once(nodes, is_reorder_round=False)
                if len(fused) == len(nodes):
                    return fused
                nodes = fused
            return nodes

        def uuid(self) -> str:
            return "megatron_lowprec.fusion_after_reordering.v1"

        def __reduce__(self) -> tuple[Callable[[], Any], tuple[()]]:
            return fusion_after_reordering, ()

    return FusionAfterReordering()


def group_statistics_options() -> dict[str, Any]:
    """:data:`GROUP_STATISTICS_OPTIONS` and the :func:`fusion_after_reordering` pass, as far as this
    torch's Inductor has them."""
    options = supported_options(GROUP_STATISTICS_OPTIONS)
    if has_option(POST_FUSION_OPTION) and fusion_after_reordering() is not None:
        options[POST_FUSION_OPTION] = fusion_after_reordering()
    return options


LOW_PRECISION_TILING_TAG = "|megatron_lowprec.low_precision_tiling.v1"
"""Added to torch.compile's cache key while :func:`low_precision_tiling` is in force."""

NO_OUTER_LOOP_FUSION_TAG = "|megatron_lowprec.no_outer_loop_fusion.v1"
"""Added to torch.compile's cache key while :func:`without_outer_loop_fusion` is in force."""


@contextlib.contextmanager
def step_code_generation() -> Iterator[None]:
    """:func:`low_precision_tiling` and :func:`without_outer_loop_fusion`: what Inductor's C++ code
    generator does differently while a fused step is called (and so compiled)."""
    with low_precision_tiling(), without_outer_loop_fusion():
        yield


@contextlib.contextmanager
def low_precision_tiling() -> Iterator[None]:
    """While compiling, Inductor's C++ loops that touch a 16-bit float are vectorized as many
    elements wide as one vector of that type (16 on AVX2), not as one FP32 vector (8).

    Inductor picks the 16-bit width only when every node of a loop is 16-bit; a loop that mixes BF16
    parameters with FP32 moments or int32 SR words runs 8 wide, and ATen loads and stores 8 BF16
    through a stack buffer (a partial vector), which slows D-MW, D, sr and coat down on CPU. Only the vector width changes, not the arithmetic (the fused-vs-eager tests check every
    option bit for bit). The choice is part of the compile caches' key (``cache_key_tag``), so that
    code compiled without it is not reused.

    Inductor's own choice is kept whenever its internals differ from what is expected here: a
    missing piece (checked before patching), another signature or return shape of ``select_tiling``,
    or any exception while the width is chosen (see :func:`low_precision_tiling_select`; logged once)."""
    from torch._inductor.codegen import cpp

    original = getattr(cpp, "TilingSelect", None)
    needed = (
        hasattr(original, "select_tiling"),
        hasattr(cpp, "_get_loop_body"),
        hasattr(cpp, "get_loop_body_lowp_fp"),
        hasattr(getattr(torch.compiler, "config", None), "cache_key_tag"),
    )
    if not all(needed):
        yield
        return
    cpp.TilingSelect = low_precision_tiling_select(original)
    try:
        with _cache_key_tag_extended(LOW_PRECISION_TILING_TAG):
            yield
    finally:
        cpp.TilingSelect = original


@contextlib.contextmanager
def without_outer_loop_fusion() -> Iterator[None]:
    """While compiling, Inductor's C++ scheduler does not fuse loop nests by their outer loops.

    COAT's step offers it one such fusion (its group reductions and the element passes over the same
    groups). Inductor then generates every kernel of the fused node around shared local buffers,
    finds that their loop levels do not line up, and generates them all again apart: the same loops
    in the end (in another order), after a long first pass. Declining the fusion up front skips
    that pass. CPU code only (Triton's scheduler is another class), and
    part of the compile caches' key (``cache_key_tag``). Where this torch's C++ scheduler has no
    ``can_fuse_vertical_outer_loop``, nothing is changed."""
    from torch._inductor.codegen import cpp

    scheduling = getattr(cpp, "CppScheduling", None)
    if not hasattr(scheduling, "can_fuse_vertical_outer_loop") or not hasattr(
        getattr(torch.compiler, "config", None), "cache_key_tag"
    ):
        yield
        return
    original = scheduling.can_fuse_vertical_outer_loop
    scheduling.can_fuse_vertical_outer_loop = _no_outer_loop_fusion
    try:
        with _cache_key_tag_extended(NO_OUTER_LOOP_FUSION_TAG):
            yield
    finally:
        scheduling.can_fuse_vertical_outer_loop = original


@contextlib.contextmanager
def _cache_key_tag_extended(suffix: str) -> Iterator[None]:
    """``torch.compiler.config.cache_key_tag`` with ``suffix`` appended while the block runs: what
    ``torch.compiler.config.patch`` does, in a quarter of its time (entered at every call of a
    compiled step)."""
    config = torch.compiler.config
    tag = config.cache_key_tag
    config.cache_key_tag = tag + suffix
    try:
        yield
    finally:
        config.cache_key_tag = tag


def _no_outer_loop_fusion(scheduling: Any, node1: Any, node2: Any) -> bool:
    """``CppScheduling.can_fuse_vertical_outer_loop`` under :func:`without_outer_loop_fusion`."""
    return False


@functools.cache
def _warn_tiling_fallback(reason: str) -> None:
    """Log once per reason that Inductor's own tiling is used."""
    logging.getLogger(__name__).warning(
        "16-bit vector tiling is off, Inductor's own tiling is used (this torch's Inductor differs: %s)", reason
    )


def widened_tiling(selected: Any, fn_list: Any) -> Any:
    """``selected`` = (factors, indices, ...) with FP32-wide factors widened to one 16-bit vector when
    every low-precision node of ``fn_list`` has the same 16-bit dtype; raises on any other shape."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codegen import cpp

    factors, indices, *rest = selected
    isa = cpu_vec_isa.pick_vec_isa()
    low_precision = {cpp.get_loop_body_lowp_fp(body)[0] for body in cpp._get_loop_body(fn_list)} - {None}
    if len(low_precision) == 1 and factors and set(factors) == {isa.nelements(torch.float)}:
        factors = [isa.nelements(low_precision.pop())] * len(factors)
    return (factors, indices, *rest)


@functools.cache
def low_precision_tiling_select(base: type) -> type:
    """Inductor's ``TilingSelect`` class ``base`` with :func:`widened_tiling` applied to its choice."""

    class LowPrecisionTilingSelect(base):
        """Inductor's tiling, widened to one 16-bit vector for loops that touch a 16-bit float; Inductor's
        own result, unchanged, when it is not the expected (factors, indices, stats) or widening fails."""

        def select_tiling(self, *args, **kwargs):
            selected = super().select_tiling(*args, **kwargs)
            fn_list = kwargs.get("fn_list", args[0] if args else None)
            if not (isinstance(selected, tuple) and len(selected) == 3 and isinstance(selected[0], list)):
                _warn_tiling_fallback(f"select_tiling returned {type(selected).__name__} of another shape")
                return selected
            try:
                return widened_tiling(selected, fn_list)
            except Exception as error:
                _warn_tiling_fallback(f"{type(error).__name__}: {error}")
                return selected

    return LowPrecisionTilingSelect
