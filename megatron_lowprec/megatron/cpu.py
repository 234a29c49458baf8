"""The CUDA→CPU bridge: megatron-core on a CPU-only torch build with the gloo backend.

megatron-core (0.16.1 to 0.19) hard-codes CUDA in places that have a plain CPU meaning. Without CUDA,
:func:`activate_cpu_bridge` bridges exactly the calls below (each is also an entry of
:data:`BRIDGED_CALLS`); with CUDA it does nothing. Paths are relative to ``megatron/core``.

Device requests, redirected by :class:`CudaToCpuMode` (a ``torch.overrides.TorchFunctionMode``):

- ``device=`` naming CUDA (``"cuda"``, ``torch.device("cuda")`` or an integer index, which is what
  ``torch.cuda.current_device()`` returns) → CPU. Buffers are allocated this way in ``utils.py``
  (``GlobalMemoryBuffer.get_tensor``, ``local_multi_tensor_l2_norm``),
  ``distributed/param_and_grad_buffer.py`` (the DDP parameter and gradient buffers),
  ``tensor_parallel/data.py`` (``broadcast_data``), ``pipeline_parallel/p2p_communication.py``
  (receive buffers), ``pipeline_parallel/schedules.py`` (the token count), ``transformer/utils.py``
  (``get_default_causal_mask``), ``models/common/embeddings/rotary_pos_embedding.py``,
  ``optimizer/optimizer.py`` and ``optimizer/clip_grads.py``.
- positional ``Tensor.to(<CUDA device>)`` (``x.to(torch.cuda.current_device())``, as training scripts
  move their batches) → ``Tensor.to("cpu")``.
- ``Tensor.cuda()`` → the tensor itself: ``tensor_parallel/data.py`` (``broadcast_data``) and
  ``models/common/language_module/language_module.py`` (``setup_embeddings_and_output_layer``, which
  ties the embeddings of the first and the last pipeline stage).
- ``Tensor.type()`` → ``"torch.cuda.<T>Tensor"`` for a CPU tensor: the mixed-precision optimizers
  accept only parameters of those type names (``optimizer/optimizer.py``
  ``Float16OptimizerWithFloat16Params``, ``optimizer/distrib_optimizer.py`` ``DistributedOptimizer``,
  ``optimizer/clip_grads.py`` ``clip_grad_by_total_norm_fp32``).
- ``torch.autograd._engine_run_backward`` runs the backward pass with the mode pushed.
  ``torch.autograd.backward`` is itself overridable, so the mode is popped while it runs (as while any
  function it intercepts runs); the backward pass would then request CUDA devices unbridged, as
  activation recompute does when it re-runs the forward (``tensor_parallel/random.py``
  ``CheckpointFunction.backward`` → ``transformer/utils.py`` ``get_default_causal_mask``).

``torch.cuda`` functions, which raise without CUDA or are queued for a CUDA initialisation that
never comes:

- ``torch.cuda.current_device()`` → 0, an index the mode maps to CPU: megatron passes it as
  ``device=`` (``utils.py``, ``distributed/param_and_grad_buffer.py``, ``tensor_parallel/data.py``,
  ``pipeline_parallel/p2p_communication.py``, ``models/common/embeddings/rotary_pos_embedding.py``).
- ``torch.cuda.synchronize()`` → no-op: ``pipeline_parallel/p2p_communication.py`` ``_communicate``
  synchronises after the batched sends and receives between pipeline stages.
- ``torch.cuda.manual_seed(seed)`` → seeds torch's default CPU generator, which CPU dropout draws
  from: ``tensor_parallel/random.py`` ``model_parallel_cuda_manual_seed`` seeds the default
  (data-parallel) stream this way; torch would silently drop the call.

The RNG tracker behind ``tensor_parallel.get_cuda_rng_tracker()`` (``tensor_parallel/random.py``):

- ``CudaRNGStatesTracker`` → :func:`cpu_rng_states_tracker_class`, a subclass whose named states
  are CPU generator states and whose ``fork`` swaps them into the default CPU generator.
  ``initialize_rng_tracker`` builds the tracker from this module attribute (a tracker built before
  activation is set aside until deactivation). The original ``add``
  reads ``torch.cuda.get_rng_state()``, and its ``fork`` swaps CUDA states that CPU dropout never
  reads; megatron forks the tracker for attention dropout (``transformer/dot_product_attention.py``),
  tensor-parallel weight initialisation (``tensor_parallel/layers.py``) and sequence-parallel dropout.
- ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` → ``torch.get_rng_state`` /
  ``torch.set_rng_state``: activation recompute saves and restores the "CUDA" state through them
  (``_get_all_rng_states`` / ``_set_all_rng_states`` for ``CheckpointFunction``). The originals
  raise, or queue the state with a stack trace that is never released.

Streams, events and the device's generator state, which megatron-core 0.17 to 0.19 touch on every step:

- ``torch.cuda.current_stream()`` / ``torch.cuda.default_stream()`` → the one :class:`CpuStream`: from 0.19
  ``distributed/param_and_grad_buffer.py`` ``start_grad_sync`` waits on the current stream for
  CUDA-graph weight-gradient events at every gradient sync; several distributed-optimizer
  instances, MoE and offloading paths do so too. CPU kernels run in program order, so waiting is a no-op.
- ``torch.cuda.Stream(...)`` → a new :class:`CpuStream`, and ``torch.cuda.stream(s)`` → a context
  that changes nothing (side streams for overlapped communication and offloading).
- ``torch.cuda.Event(...)`` → :class:`CpuEvent`, already complete when recorded (its
  ``elapsed_time`` measures host time): events between streams and for timing.
- ``torch.cuda.get_rng_state()`` / ``torch.cuda.set_rng_state(state)`` → the default CPU generator's state:
  ``rerun_state_machine.py`` saves and restores the RNG states around every validated step, and
  Megatron-LM's ``megatron/training/checkpointing.py`` stores them in checkpoints.

The device's description, which Megatron-LM's ``megatron/training`` reads while it validates the
arguments; only callers in ``megatron.*`` get it, torch's own keep torch's error without CUDA (Inductor
keys its compile cache on that error):

- ``torch.cuda.get_device_properties(...)`` → :class:`CpuDeviceProperties`: compute capability 0.0,
  the host's memory and cores. ``arguments.py`` ``validate_args`` asks ``get_device_arch_version()``
  (``utils.py``) for the major version with tensor or context parallelism (below 10 it then requires
  ``CUDA_DEVICE_MAX_CONNECTIONS=1``) and with Megatron FSDP.
- ``torch.cuda.get_device_capability(...)`` → ``(0, 0)``: ``arguments.py`` with ``--moe-grouped-gemm``
  (which then refuses, as it should on a device without GroupedGEMM kernels).
- ``torch.cuda.get_device_name(...)`` → the properties' name: Megatron-LM's GPU sniff test (0.19).

Not bridged, because torch already makes them harmless without CUDA, or megatron-core reaches them only
on paths a CPU run does not take: ``torch.cuda.empty_cache`` (a no-op while CUDA is uninitialised),
CUDA graphs. ``tests/megatron/test_cpu_bridge.py`` fails, naming the call, when a
megatron-core version needs more.

Checks: on CPU every tensor lives in host memory, so code that places a tensor on the CPU explicitly
and lets it meet the device passes here and fails on a GPU. A :class:`BridgeCheck` installed in the
bridge (``activate_cpu_bridge(check=...)``, or ``$MEGATRON_LOWPREC_BRIDGE_CHECK=module:callable`` in
every process that activates it) sees each call the mode handles and may refuse it; the test suite
installs its strict placement check (``tests/strict_bridge.py``) this way, so that such code fails
in CI as it would on a GPU.

BF16 models need megatron's ``Float16Module`` as on GPU. Keep ``TransformerConfig``'s fusions off, as
they are by default: ``gradient_accumulation_fusion``, ``apply_rope_fusion`` and
``persist_layer_norm`` need CUDA extensions, and ``bias_activation_fusion`` / ``bias_dropout_fusion``
go through ``torch.compile``, which queries ``torch.cuda.get_device_properties``. The device redirect
is thread-local, like every torch function mode: activate the bridge in the thread that runs megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


class BridgedCall(NamedTuple):
    """One call the bridge replaces, what replaces it, and the megatron-core code that needs it."""

    call: str
    replacement: str
    needed_by: str


BRIDGED_CALLS: tuple[BridgedCall, ...] = (
    BridgedCall(
        "device=",
        "CUDA devices and integer indices become CPU",
        "utils.py, distributed/param_and_grad_buffer.py, tensor_parallel/data.py, pipeline_parallel/*, "
        "transformer/utils.py, optimizer/*",
    ),
    BridgedCall(
        "Tensor.to(<CUDA device>)",
        "moves to the CPU",
        "batches moved by training scripts; CUDA-graph static inputs, the hybrid context-parallel schedule",
    ),
    BridgedCall(
        "Tensor.cuda",
        "returns the tensor itself",
        "tensor_parallel/data.py, models/common/language_module/language_module.py",
    ),
    BridgedCall(
        "Tensor.type",
        "reports a CPU tensor as torch.cuda.<T>Tensor",
        "optimizer/optimizer.py, optimizer/distrib_optimizer.py, optimizer/clip_grads.py",
    ),
    BridgedCall(
        "torch.autograd._engine_run_backward",
        "runs the backward pass with the device redirect active",
        "tensor_parallel/random.py CheckpointFunction.backward (activation recompute)",
    ),
    BridgedCall(
        "torch.cuda.current_device",
        "returns 0, which device= maps to CPU",
        "utils.py, distributed/param_and_grad_buffer.py, tensor_parallel/data.py, p2p_communication.py",
    ),
    BridgedCall("torch.cuda.synchronize", "no-op", "pipeline_parallel/p2p_communication.py _communicate"),
    BridgedCall(
        "torch.cuda.manual_seed",
        "seeds the default CPU generator",
        "tensor_parallel/random.py model_parallel_cuda_manual_seed",
    ),
    BridgedCall(
        "CudaRNGStatesTracker",
        "CpuRNGStatesTracker, states kept as CPU generator states; an earlier tracker set aside",
        "tensor_parallel/random.py initialize_rng_tracker (get_cuda_rng_tracker)",
    ),
    BridgedCall(
        "_get_cuda_rng_state",
        "torch.get_rng_state",
        "tensor_parallel/random.py _get_all_rng_states (activation recompute)",
    ),
    BridgedCall(
        "_set_cuda_rng_state",
        "torch.set_rng_state",
        "tensor_parallel/random.py _set_all_rng_states (activation recompute)",
    ),
    BridgedCall(
        "torch.cuda.current_stream",
        "the one CpuStream, whose waits are no-ops",
        "distributed/param_and_grad_buffer.py start_grad_sync (0.19), distributed optimizer instances, MoE",
    ),
    BridgedCall("torch.cuda.default_stream", "the one CpuStream", "distributed/, optimizer/ (0.17+)"),
    BridgedCall("torch.cuda.Stream", "a new CpuStream", "side streams for communication and offloading (0.17+)"),
    BridgedCall("torch.cuda.stream", "a context that changes nothing", "side streams (0.17+)"),
    BridgedCall("torch.cuda.Event", "CpuEvent, complete when recorded", "stream synchronisation and timing (0.17+)"),
    BridgedCall(
        "torch.cuda.get_rng_state",
        "the default CPU generator's state",
        "rerun_state_machine.py, Megatron-LM's megatron/training/checkpointing.py",
    ),
    BridgedCall(
        "torch.cuda.set_rng_state",
        "sets the default CPU generator's state",
        "rerun_state_machine.py, Megatron-LM's megatron/training/checkpointing.py",
    ),
    BridgedCall(
        "torch.cuda.get_device_properties",
        "CpuDeviceProperties: capability 0.0, the host's memory and cores",
        "Megatron-LM's megatron/training/arguments.py validate_args (get_device_arch_version)",
    ),
    BridgedCall(
        "torch.cuda.get_device_capability",
        "(0, 0)",
        "Megatron-LM's megatron/training/arguments.py validate_args (--moe-grouped-gemm)",
    ),
    BridgedCall(
        "torch.cuda.get_device_name",
        "the CpuDeviceProperties' name",
        "Megatron-LM's megatron/training/gpu_sniff_test.py (0.19)",
    ),
)


CHECK_ENV_VARIABLE = "MEGATRON_LOWPREC_BRIDGE_CHECK"
"""``module:callable`` of a :class:`BridgeCheck` factory, installed wherever the bridge is activated
without an explicit ``check`` (the test suite sets it in every process it starts)."""


class BridgeCheck(Protocol):
    """A check that runs inside the bridge, such as the test suite's strict placement check."""

    def install(self, replace: Callable[[Any, str, Any], None]) -> None:
        """Replace further attributes with ``replace(owner, name, value)``; deactivation restores them."""

    def observe(self, func: Callable, args: tuple, kwargs: dict, requested_device: Any, result: Any) -> None:
        """Look at one call the mode handled (after the redirect) and its result; raising fails the call."""


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to the CPU; CPU tensors report ``torch.cuda.*`` type names.
    A ``check`` sees every call made outside ``torch.distributed``'s own code and outside compilation."""

    def __init__(self, check: BridgeCheck | None = None) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        requested_device = kwargs.get("device")
        if func is torch.Tensor.cuda:
            result = args[0]
        else:
            if _is_cuda_device(requested_device):
                kwargs = {**kwargs, "device": torch.device("cpu")}
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], torch.device("cpu"), *args[2:])
            result = func(*args, **kwargs)
        if self.check is not None and not torch.compiler.is_compiling() and not _called_from_torch_distributed():
            self.check.observe(func, args, kwargs, requested_device, result)
        return result


_TORCH_DISTRIBUTED_DIRECTORY = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
"""``torch.distributed`` places the tensors of its object collectives by backend (the CPU for gloo):
checks leave the calls made there alone."""


def _called_from_torch_distributed() -> bool:
    """Whether the call being handled comes from ``torch.distributed``'s own code (two frames up:
    ``__torch_function__``, then its caller)."""
    return sys._getframe(2).f_code.co_filename.startswith(_TORCH_DISTRIBUTED_DIRECTORY)



def _cuda_type_name(tensor: torch.Tensor) -> str:
    name = torch.Tensor.type(tensor)
    if tensor.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


def _run_backward_with_mode(run_backward: Callable, mode: CudaToCpuMode) -> Callable:
    """``run_backward`` with ``mode`` pushed when the caller's torch-function handling popped it."""

    @functools.wraps(run_backward)
    def run_backward_bridged(*args, **kwargs):
        if mode in _get_current_function_mode_stack():
            return run_backward(*args, **kwargs)
        with mode:
            return run_backward(*args, **kwargs)

    return run_backward_bridged


@functools.cache
def cpu_rng_states_tracker_class() -> type:
    """megatron's ``CudaRNGStatesTracker`` with its named states kept as CPU generator states."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    class CpuRNGStatesTracker(tensor_parallel_random.CudaRNGStatesTracker):
        """A fork swaps the named state into the default CPU generator, which CPU dropout draws from."""

        def add(self, name: str, seed: int) -> None:
            """Track a new named state seeded with ``seed``; the default generator is left alone."""
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(
            self, name: str = tensor_parallel_random._MODEL_PARALLEL_RNG_TRACKER_NAME
        ) -> Iterator[None]:
            """Draw from the named state inside the block, then restore the state outside it."""
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current rng state {self._current_state_name} is not the forked state {name}"
                    )
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _current_device() -> int:
    """Device index 0, which :class:`CudaToCpuMode` maps to the CPU."""
    return 0


def _synchronize(device: Any = None) -> None:
    """CPU kernels run synchronously: there is nothing to wait for."""


def _seed_default_generator(seed: int) -> None:
    """Seed the default CPU generator, which stands in for the current CUDA device's."""
    torch.default_generator.manual_seed(int(seed))


def _get_default_rng_state(
    device: Any = None, clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """The default CPU generator's state, which stands in for the current CUDA device's."""
    return torch.get_rng_state()


def _set_default_rng_state(
    new_state: torch.Tensor, device: Any = None, graph_safe: bool = False
) -> None:
    """Set the default CPU generator's state, which stands in for the current CUDA device's."""
    torch.set_rng_state(new_state)


class CpuEvent:
    """``torch.cuda.Event`` on the CPU: complete as soon as it is recorded, since CPU kernels run in
    program order; ``elapsed_time`` gives the host time between two recorded events in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end_event.recorded_at - self.recorded_at) * 1000.0


class CpuStream:
    """``torch.cuda.Stream`` on the CPU: work is never queued, so every wait returns at once."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None


_CPU_STREAM = CpuStream()


def _current_stream(device: Any = None) -> CpuStream:
    """The one CPU stream, which stands in for the current (and the default) CUDA stream."""
    return _CPU_STREAM


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(s)``: CPU work runs in program order whichever stream is named."""
    return contextlib.nullcontext(stream)


def _get_device_rng_state(device: Any = "cuda") -> torch.Tensor:
    """The default CPU generator's state, which stands in for the current CUDA device's."""
    return torch.get_rng_state()


def _set_device_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Set the default CPU generator's state, which stands in for the current CUDA device's."""
    torch.set_rng_state(new_state)


class CpuDeviceProperties(NamedTuple):
    """What ``torch.cuda.get_device_properties`` reports for the host: no CUDA compute capability."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int


HOST_PROPERTIES = CpuDeviceProperties(
    name="cpu (megatron-lowprec CPU bridge)",
    major=0,
    minor=0,
    total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    multi_processor_count=os.cpu_count() or 1,
)
"""The host, described as ``torch.cuda.get_device_properties`` describes a GPU."""


def _asked_by_megatron() -> bool:
    """Whether the function calling the bridged call (two frames up) belongs to megatron."""
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.")


def _described_to_megatron(original: Callable, description: Callable[[], Any]) -> Callable:
    """``original``, except that megatron's calls get ``description()``. torch's own callers keep the
    original's error without CUDA: Inductor keys its cache on it (``codecache.CacheBase.get_system``)."""

    @functools.wraps(original)
    def described(*args, **kwargs):
        return description() if _asked_by_megatron() else original(*args, **kwargs)

    return described


class _BridgeState:
    """The active mode and the original value of every attribute the bridge replaced."""

    def __init__(self) -> None:
        self.mode: CudaToCpuMode | None = None
        self.originals: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, replacement: Any) -> None:
        own = vars(owner) if isinstance(owner, type) else {}
        self.originals.append((owner, name, own[name] if name in own else getattr(owner, name)))
        setattr(owner, name, replacement)


_STATE = _BridgeState()


def is_cpu_bridge_active() -> bool:
    """Whether :func:`activate_cpu_bridge` is in effect."""
    return _STATE.mode is not None


def check_from_environment() -> BridgeCheck | None:
    """The check that ``$MEGATRON_LOWPREC_BRIDGE_CHECK`` names (``module:callable``), or ``None``."""
    spec = os.environ.get(CHECK_ENV_VARIABLE, "").strip()
    if not spec:
        return None
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"${CHECK_ENV_VARIABLE}={spec!r}: expected 'module:callable'")
    return getattr(importlib.import_module(module_name), factory_name)()


def active_check() -> BridgeCheck | None:
    """The check installed in the active bridge, if any."""
    return None if _STATE.mode is None else _STATE.mode.check


_FROM_ENVIRONMENT: Any = object()


def activate_cpu_bridge(check: BridgeCheck | None = _FROM_ENVIRONMENT) -> bool:
    """Bridge megatron-core's CUDA calls to the CPU when CUDA is unavailable; idempotent.

    ``check`` (default: :func:`check_from_environment`; ``None`` for none) runs inside the bridge.
    Returns whether the bridge is active: False, having changed nothing, when CUDA is available.
    """
    if torch.cuda.is_available():
        return False
    if is_cpu_bridge_active():
        return True
    try:
        from megatron.core.tensor_parallel import random as tensor_parallel_random
    except ImportError as error:
        raise ImportError(
            "the CPU bridge adapts megatron-core, which is not installed: "
            "pip install 'megatron-lowprec[megatron]'"
        ) from error

    mode = CudaToCpuMode(check_from_environment() if check is _FROM_ENVIRONMENT else check)
    if mode.check is not None:
        mode.check.install(_STATE.replace)
    _STATE.replace(
        torch.autograd,
        "_engine_run_backward",
        _run_backward_with_mode(torch.autograd._engine_run_backward, mode),
    )
    _STATE.replace(torch.cuda, "current_device", _current_device)
    _STATE.replace(torch.cuda, "synchronize", _synchronize)
    _STATE.replace(torch.cuda, "manual_seed", _seed_default_generator)
    _STATE.replace(torch.cuda, "current_stream", _current_stream)
    _STATE.replace(torch.cuda, "default_stream", _current_stream)
    _STATE.replace(torch.cuda, "Stream", CpuStream)
    _STATE.replace(torch.cuda, "stream", _stream_context)
    _STATE.replace(torch.cuda, "Event", CpuEvent)
    _STATE.replace(torch.cuda, "get_rng_state", _get_device_rng_state)
    _STATE.replace(torch.cuda, "set_rng_state", _set_device_rng_state)
    for name, description in (
        ("get_device_properties", lambda: HOST_PROPERTIES),
        ("get_device_capability", lambda: (HOST_PROPERTIES.major, HOST_PROPERTIES.minor)),
        ("get_device_name", lambda: HOST_PROPERTIES.name),
    ):
        _STATE.replace(torch.cuda, name, _described_to_megatron(getattr(torch.cuda, name), description))
    _STATE.replace(tensor_parallel_random, "CudaRNGStatesTracker", cpu_rng_states_tracker_class())
    _STATE.replace(tensor_parallel_random, "_CUDA_RNG_STATE_TRACKER", None)
    _STATE.replace(tensor_parallel_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    _STATE.replace(tensor_parallel_random, "_get_cuda_rng_state", _get_default_rng_state)
    _STATE.replace(tensor_parallel_random, "_set_cuda_rng_state", _set_default_rng_state)
    mode.__enter__()
    _STATE.mode = mode
    return True


def deactivate_cpu_bridge() -> None:
    """Undo :func:`activate_cpu_bridge`, restoring every replaced attribute; a no-op when inactive."""
    if not is_cpu_bridge_active():
        return
    if _get_current_function_mode_stack()[-1:] != [_STATE.mode]:
        raise RuntimeError(
            "the CPU bridge's torch function mode is not the innermost one in this thread; "
            "exit the modes entered after activation first"
        )
    _STATE.mode.__exit__(None, None, None)
    _STATE.mode = None
    for owner, name, original in reversed(_STATE.originals):
        setattr(owner, name, original)
    _STATE.originals.clear()


@contextlib.contextmanager
def cpu_bridge(check: BridgeCheck | None = _FROM_ENVIRONMENT) -> Iterator[bool]:
    """:func:`activate_cpu_bridge` for the block; yields whether the bridge is active."""
    was_active = is_cpu_bridge_active()
    active = activate_cpu_bridge(check)
    try:
        yield active
    finally:
        if active and not was_active:
            deactivate_cpu_bridge()
