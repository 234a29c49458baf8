"""megatron-lowprec: low-precision training strategies for Megatron-core style LLM pretraining.

Layers, bottom to top (a lower layer never imports a higher one):
``numerics`` (pure tensor arithmetic) -> ``optim`` and ``metrics`` -> Megatron adapters -> training app.

Importing the package refuses a torch older than :data:`MINIMUM_TORCH`.
"""

import importlib.metadata
import re
from typing import Optional

__version__ = "0.1.0"

MINIMUM_TORCH = (2, 10)
"""The oldest torch release the plugin runs on: 2.10 brought ``Tensor.grad_dtype``, through which the
Megatron optimizer reads gradients in their own dtype (pytorch#164751), and Inductor's
``emulate_precision_casts`` without FMA contraction in Triton kernels, which keeps the fused GPU step
bit-identical to the eager one (pytorch#163073). Pre-releases of 2.10 count: NGC's images carry
builds such as ``2.10.0a0+b4e4ee81d3`` (setup.py's ``torch>=2.10.0a0`` admits them too)."""


def torch_version_problem(version: str) -> Optional[str]:
    """Why torch ``version`` (a ``torch.__version__`` string) cannot run megatron-lowprec, in one
    line, or ``None`` when it can."""
    release = re.match(r"(\d+)\.(\d+)", version)
    if release and tuple(map(int, release.groups())) >= MINIMUM_TORCH:
        return None
    minimum = ".".join(map(str, MINIMUM_TORCH))
    return (
        f"megatron-lowprec needs torch >= {minimum} (Tensor.grad_dtype, Inductor's emulate_precision_casts "
        f"without FMA); this is torch {version}: use NGC's PyTorch image 25.12 or later, "
        f"or pip install 'torch>={minimum}'"
    )


def _installed_torch_version() -> str:
    """The installed torch's version, read from its package metadata so that importing this package
    does not import torch; torch's own ``__version__`` where it has no metadata (a source tree)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def _require_supported_torch() -> None:
    problem = torch_version_problem(_installed_torch_version())
    if problem:
        raise ImportError(problem)


_require_supported_torch()
