"""Loaded at start-up by every Python process the tests launch (``tests/conftest.py`` puts this folder
on their ``PYTHONPATH``): the ranks of one test compile a graph they share one at a time.

The ranks of a data-parallel run trace the same optimizer-step graph at the same moment. Unserialized,
each runs Inductor's whole cold compile (AOT, lowering, the C++ compiler) side by side, on CI's two
cores. Here the first rank to reach a graph compiles it while the others wait, and they then find it in
Inductor's FX graph cache. The lock is keyed by the FX graph's code, so ranks that compile different
graphs (pipeline stages) still compile them side by side, and it is released when the process dies.
It changes no result: the cache returns the very code a compile would produce.
"""

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys

LOCK_DIRECTORY_VARIABLE = "MEGATRON_LOWPREC_TEST_COMPILE_LOCKS"
"""The folder of the lock files, one per graph; set by ``tests/conftest.py``, one per pytest run (shared by its xdist workers)."""


def _serialized(compile_fx):
    import fcntl
    import functools

    depth = 0

    @functools.wraps(compile_fx)
    def compile_fx_one_rank_at_a_time(model, example_inputs, *args, **kwargs):
        nonlocal depth
        if depth:
            return compile_fx(model, example_inputs, *args, **kwargs)
        key = hashlib.sha256(str(getattr(model, "code", "")).encode()).hexdigest()[:32]
        with open(os.path.join(os.environ[LOCK_DIRECTORY_VARIABLE], key), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            depth += 1
            try:
                return compile_fx(model, example_inputs, *args, **kwargs)
            finally:
                depth -= 1

    return compile_fx_one_rank_at_a_time


class _WrapCompileFxOnImport(importlib.abc.MetaPathFinder):
    """Wraps ``torch._inductor.compile_fx.compile_fx`` when that module is first imported, so that a
    process that never compiles does not import torch for it."""

    MODULE = "torch._inductor.compile_fx"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.compile_fx = _serialized(module.compile_fx)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(LOCK_DIRECTORY_VARIABLE) and sys.platform != "win32":
    sys.meta_path.insert(0, _WrapCompileFxOnImport())
