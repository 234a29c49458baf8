"""What differs between the supported megatron-core versions, 0.16.1 up to the newest release (0.19.x).

The rest of the package never tests a version: it calls what this module provides. Each entry
names the version that changed and what megatron does there.

- **Weight-decay exemptions and per-group overrides** (0.18): until 0.17 ``_get_param_groups``
  replaced ``config_overrides=None`` by ``get_standard_config_overrides(config)`` (no weight decay
  on biases and 1-D parameters, ``decoupled_lr`` for embeddings and the output layer); from 0.18
  ``get_megatron_optimizer`` does it and ``_get_param_groups(chunks, config, None)`` exempts
  nothing. :func:`param_groups` substitutes the standard overrides itself, as
  ``get_megatron_optimizer`` does from 0.18 on and ``_get_param_groups`` did before, so groups
  are megatron's own on every version; a caller's ``config_overrides`` replace the defaults, as
  they do in megatron.
- **Gradients for the norm** (0.19): ``MegatronOptimizer.get_main_grads_for_grad_norm()`` became
  ``get_grads_for_grad_norm(grad_norm_group=None)``. :class:`GradNormInterface` answers both names.
- **Linear layers** (0.19): ``ColumnParallelLinear`` / ``RowParallelLinear.forward`` pass
  ``gtp_remat_size`` to ``_forward_impl``; :func:`refuse_newer_linear_keywords` checks the keywords
  an override of ``_forward_impl`` receives beyond 0.16's.
- **Megatron-LM's argument parsing** (0.18): ``extra_args_provider`` moved from ``pretrain()`` to
  ``parse_and_validate_args()``; both reach ``megatron.training.arguments.parse_args``, which
  ``megatron.training.initialize`` imported by name until 0.17 (:func:`megatron_lm_argument_parsers`).
- **Megatron-LM's model building** (0.19): ``setup_model_and_optimizer`` takes the model type first
  and builds from ``cfg_container.model`` (a builder config with ``pre_wrap_hooks``) instead of a
  ``model_provider_func`` (:func:`add_model_hook`).

The CPU bridge (:mod:`megatron_lowprec.megatron.cpu`) covers the CUDA calls of every supported version.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version

MINIMUM_VERSION = Version("0.16.1")
NEWEST_TESTED_VERSION = Version("0.19.2")
SUPPORTED_RANGE = ">=0.16.1,<0.20"


def megatron_core_version() -> Version:
    """The installed megatron-core's version."""
    from megatron.core import package_info

    return Version(package_info.__version__)


def check_supported_version() -> Version:
    """The installed version; ``ImportError`` naming it and the supported range if it is older."""
    version = megatron_core_version()
    if version < MINIMUM_VERSION:
        raise ImportError(
            f"megatron-lowprec needs megatron-core {SUPPORTED_RANGE}; megatron-core {version} is installed: "
            f"pip install 'megatron-core{SUPPORTED_RANGE}'"
        )
    return version


def muon_nesterov_field() -> str:
    """The name of megatron's ``OptimizerConfig`` field that turns Nesterov momentum on for Muon:
    ``muon_use_nesterov`` until 0.18, ``muon_nesterov`` from 0.19."""
    from megatron.core.optimizer import OptimizerConfig

    names = {field.name for field in dataclasses.fields(OptimizerConfig)}
    return "muon_nesterov" if "muon_nesterov" in names else "muon_use_nesterov"


def layer_wise_fields() -> dict[str, Any]:
    """megatron's ``OptimizerConfig`` fields that ask for its layer-wise distributed optimizer with
    Muon: ``use_layer_wise_distributed_optimizer`` from 0.19, before it ``optimizer="dist_muon"``."""
    from megatron.core.optimizer import OptimizerConfig

    if "use_layer_wise_distributed_optimizer" in {field.name for field in dataclasses.fields(OptimizerConfig)}:
        return {"use_layer_wise_distributed_optimizer": True}
    return {"optimizer": "dist_muon"}


def param_groups(
    model_chunks: list[torch.nn.Module], config: Any, config_overrides: dict | None
) -> list[dict[str, Any]]:
    """megatron's parameter groups for ``model_chunks`` exactly as ``get_megatron_optimizer`` builds
    them on the installed version (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``default_config``,
    ``is_expert_parallel`` and whatever an override sets), the standard overrides applied where
    ``config_overrides`` is None. Collective over all ranks (megatron aligns the groups)."""
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    return _get_param_groups(model_chunks, config, config_overrides)


class GradNormInterface(abc.ABC):
    """Both names under which megatron-core asks a ``MegatronOptimizer`` for the gradients of its
    norm (``get_main_grads_for_grad_norm`` until 0.18, ``get_grads_for_grad_norm`` from 0.19); a
    subclass implements :meth:`grads_for_norm`."""

    @abc.abstractmethod
    def grads_for_norm(self) -> list[torch.Tensor]:
        """The gradients counted in the norm, each once over the model."""

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        if grad_norm_group is not None:
            raise ValueError(
                f"grad_norm_group={grad_norm_group!r}: the precision options clip all gradients by one norm; "
                "separate gradient-norm groups are not supported"
            )
        return self.grads_for_norm()

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        return self.grads_for_norm()


def refuse_newer_linear_keywords(keywords: dict[str, Any], layer: str) -> None:
    """``ValueError`` for keywords that a newer megatron-core passes to ``_forward_impl`` with a
    value the low-precision linears cannot honour (``gtp_remat_size`` above 1: weights sharded for
    generalized tensor-parallel rematerialisation); unknown keywords too."""
    for name, value in keywords.items():
        if name == "gtp_remat_size":
            if value not in (None, 1):
                raise ValueError(f"{layer}: gtp_remat_size={value} (GTP weight rematerialisation) is not supported")
        else:
            raise ValueError(f"{layer}: megatron passed {name}={value!r} to _forward_impl, which this layer does not know")


def megatron_lm_argument_parsers() -> list[tuple[Any, str]]:
    """(module, name) of every binding of Megatron-LM's ``parse_args`` that its training entry points
    call: ``megatron.training.arguments.parse_args`` (``parse_and_validate_args`` from 0.18) and
    ``megatron.training.initialize.parse_args`` (``initialize_megatron`` until 0.17)."""
    import importlib

    found = []
    for module_name in ("megatron.training.arguments", "megatron.training.initialize"):
        module = importlib.import_module(module_name)
        if callable(getattr(module, "parse_args", None)):
            found.append((module, "parse_args"))
    return found


def add_model_hook(
    setup_model_and_optimizer: Callable, hook: Callable[[list[torch.nn.Module]], None]
) -> Callable:
    """Megatron-LM's ``setup_model_and_optimizer`` that runs ``hook`` on the freshly built model
    chunks, before ``Float16Module`` and DDP wrap them: through ``model_provider_func`` (until
    0.18) or the builder config's ``pre_wrap_hooks`` (``cfg_container.model``, 0.19)."""
    signature = inspect.signature(setup_model_and_optimizer)

    def provider_with_hook(model_provider_func: Callable) -> Callable:
        @functools.wraps(model_provider_func)
        def provide(*args, **kwargs):
            model = model_provider_func(*args, **kwargs)
            hook([model])
            return model

        return provide

    def pre_wrap_hook(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        hook(model_chunks)
        return model_chunks

    @functools.wraps(setup_model_and_optimizer)
    def setup_with_hook(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        container = bound.arguments.get("cfg_container")
        model_config = getattr(container, "model", None)
        if model_config is not None:
            model_config.pre_wrap_hooks = [*(model_config.pre_wrap_hooks or []), pre_wrap_hook]
        elif bound.arguments.get("model_provider_func") is not None:
            bound.arguments["model_provider_func"] = provider_with_hook(bound.arguments["model_provider_func"])
        return setup_model_and_optimizer(*bound.args, **bound.kwargs)

    return setup_with_hook
