"""Suite-wide settings and fixtures.

The CPU bridge runs with the strict placement check (``tests/strict_bridge.py``) in every test and every
process the tests start (``$MEGATRON_LOWPREC_BRIDGE_CHECK``, with the repository root on ``PYTHONPATH``
so that they import it), so that code placing a tensor on the CPU where a GPU run needs it on the device
fails here as it would on a GPU.

Those processes also load ``tests/subprocess_site/sitecustomize.py``: ranks that compile the same graph
take turns, so that all but the first find it in Inductor's cache. One lock folder per pytest run: the
pytest-xdist workers, started with this process's environment, keep it, so that two files' tests
compiling the same graph at the same time take turns too. The GPU code that ``tests/kernels``
generates has one Inductor FX graph cache per run the same way (:data:`KERNEL_FX_CACHE_VARIABLE`).

``device``: the devices a device-agnostic test runs on, one test per device. The CPU always, CUDA
where ``torch.cuda.is_available()``: on a GPU machine ``python3 -m pytest`` runs such a test on both
(ids ``test_x[cpu-...]`` and ``test_x[cuda-...]``), CPU CI runs the CPU half. A test that takes it
creates its tensors on that device (random data from a CPU ``torch.Generator`` moved with
``.to(device)``, so that both devices see the same values) and compares against references computed on
the CPU (fp64, numpy, ml_dtypes) after ``.cpu()``.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_lowprec.megatron.cpu import CHECK_ENV_VARIABLE

from .strict_bridge import CHECK_SPEC

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
KERNEL_FX_CACHE_VARIABLE = "MEGATRON_LOWPREC_TEST_KERNEL_FX_CACHE"
"""The folder of Inductor's FX graph cache for the GPU code that ``tests/kernels`` generates on the
CPU, one per pytest run (its xdist workers keep it): the interpreter's comparisons
(``test_interpret.py``) load the steps the audit (``test_audit.py``) generated, not compile them again."""
os.environ.setdefault(CHECK_ENV_VARIABLE, CHECK_SPEC)
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, (str(REPOSITORY_ROOT), str(REPOSITORY_ROOT / "tests" / "subprocess_site"), os.environ.get("PYTHONPATH")))
)
for variable, prefix in (
    ("MEGATRON_LOWPREC_TEST_COMPILE_LOCKS", "megatron-lowprec-compile-locks-"),
    (KERNEL_FX_CACHE_VARIABLE, "megatron-lowprec-kernel-fx-cache-"),
):
    if not os.path.isdir(os.environ.get(variable, "")):
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, os.environ[variable], True)

SLOW_FILES_FIRST = (
    "tests/kernels/test_audit.py",
    "tests/megatron/test_distributed_optimizer.py",
    "tests/train/test_app.py",
    "tests/optim/test_fused.py",
    "tests/benchmarks/test_gpu_check.py",
    "tests/test_docker_image.py",
    "tests/optim/test_master.py",
)
"""The suite's longest files (pytest's durations on 2 cores), started first; the kernel audit before
all, so that the interpreter's comparisons, later, find its steps (:data:`KERNEL_FX_CACHE_VARIABLE`)."""


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml): a worker per core, at most 4, since many tests start 2-4 ranks."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items) -> None:
    """pytest-xdist (``--dist loadfile``, with ``--no-loadscope-reorder``: otherwise it orders the
    files by their number of tests) hands whole files to its workers in collection order: the
    longest files go first, so that no worker is left running one of them alone at the end."""
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(REPOSITORY_ROOT).as_posix(), len(rank)))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """The device under test: ``torch.device("cpu")``, then ``torch.device("cuda")`` where there is one."""
    return torch.device(request.param)


@pytest.fixture(scope="module")
def megatron_rank(tmp_path_factory):
    """One gloo rank with megatron's parallel state, inside the CPU bridge (a no-op with CUDA), for the
    tests of a module that build megatron models in-process; skipped without megatron-core."""
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lowprec.megatron.cpu import cpu_bridge

    store = dist.FileStore(str(tmp_path_factory.mktemp("megatron_rank") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with cpu_bridge():
            parallel_state.initialize_model_parallel()
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            yield
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
