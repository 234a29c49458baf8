"""Library notices that say nothing about a run, filtered once when a program starts.

megatron-core warns at import that it falls back to plain-torch code without Transformer Engine or
apex (both optional here), and its ``TransformerConfig`` warns about the CUDA-graph scope its own
default sets; loading a ``dist_checkpointing`` checkpoint calls ``torch.distributed.checkpoint``
APIs that torch has deprecated (``load_state_dict``, ``ShardedTensor``). None of them asks anything
of the user. ``lowprec-train`` and the examples call :func:`quiet_library_notices` at start-up;
other warnings pass through.
"""

from __future__ import annotations

import re
import warnings

LIBRARY_NOTICES = (
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    (UserWarning, "full scope is deprecated"),
    (FutureWarning, "`load_state_dict` is deprecated"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)
"""(category, start of the message) of each notice filtered."""


def quiet_library_notices() -> None:
    """Ignore the :data:`LIBRARY_NOTICES` from now on in this process (call before importing megatron)."""
    for category, message in LIBRARY_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
