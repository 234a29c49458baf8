"""Where ``torch.compile`` keeps what it built, so that a user's next run starts warm.

Inductor writes its on-disk caches (FX graphs, generated C++ and Triton code, compiled libraries)
under ``$TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``: a directory that
containers, CI jobs and reboots empty, so every run would compile the fused step again (tens of
seconds on a CPU). :func:`keep_inductor_cache` points it at ``$XDG_CACHE_HOME/megatron_lowprec/inductor``
(``~/.cache/megatron_lowprec/inductor`` without ``XDG_CACHE_HOME``) unless the user chose a directory.
"""

from __future__ import annotations

import os
from pathlib import Path

INDUCTOR_CACHE_ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"


def persistent_inductor_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/megatron_lowprec/inductor``, or ``~/.cache/megatron_lowprec/inductor``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron_lowprec" / "inductor"


def keep_inductor_cache() -> str:
    """Set ``$TORCHINDUCTOR_CACHE_DIR`` to :func:`persistent_inductor_cache_dir` unless it is set;
    the directory Inductor will use. Call it before the first ``torch.compile`` of the process
    (Inductor reads the variable once, then writes its own default into it)."""
    return os.environ.setdefault(INDUCTOR_CACHE_ENV_VAR, str(persistent_inductor_cache_dir()))
