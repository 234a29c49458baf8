"""Strict placement: the CPU bridge's check that fails where a GPU would (a test tool).

On CPU every tensor lives in host memory, so code that places a tensor on the CPU explicitly and then
lets it meet the device passes silently under the bridge and fails on a GPU. This check, installed
into the bridge (``megatron_lowprec.megatron.cpu.activate_cpu_bridge(check=StrictPlacementCheck())``,
or in every process of the test suite through ``$MEGATRON_LOWPREC_BRIDGE_CHECK``, which
``tests/conftest.py`` sets), tags every tensor that is *placed on the host*: made by a factory
(``torch.tensor``, ``zeros``, ``empty``, ...) without a device or with ``device="cpu"``, by ``.cpu()``
or ``.to("cpu")`` where they copy, or computed from host tensors alone (``torch.nn.Parameter`` keeps its
data's tag, ``p.data = x`` takes ``x``'s), and by ``torch.from_numpy``; ``.cuda()`` clears the tag.
Every other tensor counts as being on the device: those made through the bridge's redirect,
``device=x.device``, and tensors torch makes without a torch function (autograd's gradients).
:class:`HostPlacementError`, naming the call and the line that placed the tensor, is raised when

- an operation mixes host tensors with device tensors (a 0-dim host tensor is a scalar, which CUDA
  kernels accept; ``copy_``, ``to``, indexing and ``type_as`` move data between devices legitimately):
  a model whose parameters were never moved, or a micro-batch left on the CPU, fails in its forward
  step like this;
- a host tensor is handed to a ``torch.distributed`` collective (NCCL has no CPU backend), except on a
  process group created with ``backend="gloo"`` explicitly (megatron's ``*_gloo`` groups), which
  takes CPU tensors on GPU clusters too.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_lowprec.megatron import cpu

CHECK_SPEC = f"{__name__}:StrictPlacementCheck"
"""``$MEGATRON_LOWPREC_BRIDGE_CHECK``'s value that installs this check."""

HOST_SITE_ATTRIBUTE = "_lowprec_host_site"
"""Attribute of a tensor placed on the host: the source line that placed it."""

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
    "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base",
)
"""``torch.distributed`` collectives whose tensors the check checks (``isend`` and ``irecv`` are left
as they are, since ``P2POp`` accepts them by identity; their tensors are checked in
``batch_isend_irecv``)."""

HOST_FACTORIES = frozenset(
    {
        torch.tensor, torch.as_tensor, torch.asarray, torch.empty, torch.zeros, torch.ones, torch.full,
        torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
        torch.randperm, torch.empty_strided, torch.scalar_tensor,
    }
)
"""Factories that place their result on the CPU unless a device is given (or, for ``tensor`` and
``as_tensor``, unless their data is a tensor, whose device they keep)."""

MOVES_BETWEEN_DEVICES = frozenset(
    {
        torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.__getitem__,
        torch.Tensor.__setitem__, torch.Tensor.set_,
    }
)
"""Operations that take host and device tensors together on a GPU too."""


class HostPlacementError(RuntimeError):
    """A tensor explicitly placed on the CPU met the device (see the module docstring)."""


def host_site(tensor: Any) -> str | None:
    """Where ``tensor`` was placed on the host, or ``None`` if it counts as on the device."""
    return getattr(tensor, HOST_SITE_ATTRIBUTE, None) if isinstance(tensor, torch.Tensor) else None


def _set_host_site(tensor: Any, site: str | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        return
    if site is None:
        if HOST_SITE_ATTRIBUTE in tensor.__dict__:
            delattr(tensor, HOST_SITE_ATTRIBUTE)
    else:
        setattr(tensor, HOST_SITE_ATTRIBUTE, site)


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments, one level into lists and tuples (``cat``, ``stack``, foreach ops)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


_TORCH_DIRECTORY = os.path.dirname(torch.__file__)
_SKIPPED_FILES = frozenset({__file__, cpu.__file__})
"""Frames of this module and of the bridge, which :func:`_call_site` looks past."""


def _call_site() -> str:
    """``file:line`` of the innermost frame outside torch, the bridge and this module."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIRECTORY) or frame.f_code.co_filename in _SKIPPED_FILES):
        frame = frame.f_back
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _target_device(func, args: tuple, kwargs: dict) -> Any:
    """The device that ``Tensor.to`` was asked for, or ``None``."""
    if "device" in kwargs:
        return kwargs["device"]
    for value in args[1:]:
        if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
            return value
        if isinstance(value, torch.Tensor):
            return value
    return None


def _host_copy(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` of moving ``source`` to the CPU, tagged as on the host where it is a new tensor.
    Where torch returned ``source`` itself (it is already on the CPU), it keeps its own placement:
    the check never changes what a call returns, so it cannot change a run's numbers."""
    if result is not source:
        _set_host_site(result, _call_site())
    return result


def _placed(func, args: tuple, kwargs: dict, device: Any, result: Any) -> Any:
    """The bookkeeping for one call: refuse a host/device mix, tag what lands on the host."""
    if func is torch.Tensor.cuda:
        _set_host_site(args[0], None)
        return result
    if func is torch.Tensor.cpu:
        return _host_copy(args[0], result)
    if func is torch.Tensor.to:
        target = _target_device(func, args, kwargs)
        if isinstance(target, torch.Tensor):
            _set_host_site(result, host_site(target))
            return result
        if isinstance(target, str) and target.startswith("cpu"):
            return _host_copy(args[0], result)
        if target is not None:
            _set_host_site(result, None)
            return result
    if getattr(func, "__name__", None) == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data":
        _set_host_site(args[0], host_site(args[1]))
        return result
    tensors = _tensors_in(args, kwargs)
    if not tensors:
        if func in HOST_FACTORIES and (device is None or (isinstance(device, str) and device.startswith("cpu"))):
            _set_host_site(result, _call_site())
        return result
    sites = [host_site(tensor) for tensor in tensors]
    if all(sites):
        if func in HOST_FACTORIES and device is not None and not (isinstance(device, str) and device.startswith("cpu")):
            return result
        for output in result if isinstance(result, (list, tuple)) else (result,):
            _set_host_site(output, sites[0])
        return result
    if func in MOVES_BETWEEN_DEVICES:
        return result
    for tensor, site in zip(tensors, sites):
        if site is not None and tensor.dim() > 0:
            raise HostPlacementError(
                f"{_function_name(func)} at {_call_site()} mixes a tensor placed on the CPU at {site} "
                f"(shape {tuple(tensor.shape)}) with tensors on the GPU; on CUDA this fails. "
                "Create it on torch.cuda.current_device(), or move it with .cuda()"
            )
    return result


def _function_name(func) -> str:
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    name = getattr(func, "__name__", repr(func))
    return f"{owner}.{name}" if owner else name


_EXPLICIT_GLOO_GROUPS: dict[int, Any] = {}
"""Process groups created with ``backend="gloo"`` explicitly, by ``id`` (groups live as long as the process)."""


def _recording_new_group(new_group: Callable) -> Callable:
    """``torch.distributed.new_group`` that remembers the groups asked for with ``backend="gloo"``."""

    @functools.wraps(new_group)
    def new_group_recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if group is not None and str(backend).lower() == "gloo":
            _EXPLICIT_GLOO_GROUPS[id(group)] = group
        return group

    return new_group_recorded


def _checked_collective(name: str, collective: Callable) -> Callable:
    """``collective`` refusing host tensors, except on explicitly gloo process groups."""

    @functools.wraps(collective)
    def checked(*args, **kwargs):
        group = kwargs.get("group")
        if id(group) not in _EXPLICIT_GLOO_GROUPS:
            values = [*args, *kwargs.values()]
            values += [op.tensor for value in values if isinstance(value, list) for op in value if hasattr(op, "tensor")]
            for tensor in _tensors_in(tuple(values), {}):
                site = host_site(tensor)
                if site is not None:
                    raise HostPlacementError(
                        f"torch.distributed.{name} at {_call_site()} got a tensor placed on the CPU at {site} "
                        f"(shape {tuple(tensor.shape)}); NCCL takes GPU tensors only. "
                        "Create it on torch.cuda.current_device()"
                    )
        return collective(*args, **kwargs)

    return checked


def _host_from_numpy(from_numpy: Callable) -> Callable:
    """``torch.from_numpy`` (which no torch function mode sees) tagging its tensor as on the host:
    datasets hand out host tensors this way (megatron's ``GPTDataset``)."""

    @functools.wraps(from_numpy)
    def host_from_numpy(array):
        tensor = from_numpy(array)
        _set_host_site(tensor, _call_site())
        return tensor

    return host_from_numpy


def _parameter_keeping_host_site(original_new: Callable) -> Callable:
    """``torch.nn.Parameter.__new__`` whose parameter keeps its data's host tag."""

    def new(cls, data=None, requires_grad=True):
        param = original_new(cls, data, requires_grad)
        _set_host_site(param, host_site(data))
        return param

    return new


class StrictPlacementCheck:
    """The bridge check of this module (:class:`megatron_lowprec.megatron.cpu.BridgeCheck`)."""

    def install(self, replace: Callable[[Any, str, Any], None]) -> None:
        replace(torch.distributed, "new_group", _recording_new_group(torch.distributed.new_group))
        for name in COLLECTIVES:
            if hasattr(torch.distributed, name):
                replace(torch.distributed, name, _checked_collective(name, getattr(torch.distributed, name)))
        replace(torch, "from_numpy", _host_from_numpy(torch.from_numpy))
        replace(torch.nn.Parameter, "__new__", staticmethod(_parameter_keeping_host_site(torch.nn.Parameter.__new__)))

    def observe(self, func, args: tuple, kwargs: dict, requested_device: Any, result: Any) -> None:
        _placed(func, args, kwargs, requested_device, result)
