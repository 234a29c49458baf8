"""``trainer.deterministic``: a GPU run that repeats bit for bit (same layout, same machine type).

What makes GPU training non-repeatable, and what this switches off, as Megatron-LM's reproducibility
notes and PyTorch's randomness notes list it:

- kernels that accumulate with atomics (embedding and scatter backward, some cuBLAS algorithms
  with a split workspace): ``torch.use_deterministic_algorithms(True)`` selects deterministic
  implementations and raises on an operation that has none, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  lets cuBLAS choose deterministically;
- attention backward: SDPA's FlashAttention-2 and memory-efficient kernels add up dQ with atomics
  by default, and in strict deterministic mode run their deterministic variants; cuDNN's attention
  has none, so :class:`~megatron_lowprec.megatron.attention.SDPAttention` excludes it
  (:data:`DETERMINISTIC_SDPA_BACKENDS`), and megatron's ``deterministic_mode`` makes Transformer
  Engine's attention choose likewise (with ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``);
- NCCL's NVLink SHARP reductions (``NCCL_ALGO=^NVLS``; ring and tree reductions repeat);
- cuDNN's autotuning (``cudnn.benchmark``) picks kernels by timing.

Environment variables are set only where the user has not set them, before the process group and
the first cuBLAS handle exist. CPU runs repeat without any of this; it costs nothing there.
"""

from __future__ import annotations

import os

import torch

DETERMINISTIC_ENVIRONMENT = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_ALGO": "^NVLS",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}
"""Set (unless already set) for a deterministic run."""


def enable_determinism() -> None:
    """Deterministic algorithms everywhere (see the module docstring); call before CUDA and NCCL start."""
    for name, value in DETERMINISTIC_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
