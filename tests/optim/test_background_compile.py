"""Background compilation (``optim/background_compile.py``): a child process fills Inductor's on-disk
cache while the steps run the same kernel uncompiled, then the training process compiles it from
that cache; a failed child; the argument skeletons the child compiles on."""

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from megatron_lowprec.optim import adamw as adamw_module
from megatron_lowprec.optim import background_compile as background_module
from megatron_lowprec.optim import fused as fused_module
from megatron_lowprec.optim.background_compile import (
    BackgroundCompiles,
    BackgroundCompileWarning,
    CompileRecipe,
    TensorSkeleton,
    call_kind,
    materialize,
    skeleton,
)
from megatron_lowprec.optim.fused import fused_available

from .test_fused import _assert_bit_identical, _step_twins, _twin_optimizers as _twins

pytestmark = pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")

GRAD_DTYPE = torch.float32


def _twin_optimizers():
    """Option B with and without background compilation, on a kind of call that no other test
    compiles (FP16 parameters, FP32 gradients), so that this process has not compiled it before."""
    return _twins("B", grad_dtype=GRAD_DTYPE, param_dtype=torch.float16, background_compile=True)


def _step(eager, fused, steps, seed):
    _step_twins(eager, fused, steps=steps, seed=seed, grad_dtype=GRAD_DTYPE)


@pytest.fixture
def compiles(monkeypatch):
    """A fresh :class:`BackgroundCompiles` in place of the process's, for the optimizers to use."""
    fresh = BackgroundCompiles()
    for module in (fused_module, adamw_module):
        monkeypatch.setattr(module, "BACKGROUND_COMPILES", fresh)
    yield fresh
    fresh._kill_child()


def test_a_child_compiles_while_the_steps_run_uncompiled_then_the_training_process_compiles_from_its_cache(
    tmp_path, compiles
):
    with temporary_cache_dir(str(tmp_path / "inductor")):
        eager, fused = _twin_optimizers()
        graphs, misses, hits = (counters[group][name] for group, name in (
            ("stats", "unique_graphs"), ("inductor", "fxgraph_cache_miss"), ("inductor", "fxgraph_cache_hit")))
        _step(eager, fused, steps=2, seed=7)
        child = compiles.child_pid()
        assert child not in (None, os.getpid()) and counters["stats"]["unique_graphs"] == graphs
        _assert_bit_identical(eager, fused)
        compiles.wait()
        assert list((tmp_path / "inductor" / "fxgraph").rglob("*")), "the child left no FX graph in the cache"
        _step(eager, fused, steps=2, seed=8)
    assert counters["stats"]["unique_graphs"] == graphs + 1, "the steps did not take the compiled kernel"
    assert (counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]) == (misses, hits + 1)
    assert not compiles.compiling()
    _assert_bit_identical(eager, fused)


def test_a_killed_child_leaves_its_kinds_to_the_training_process_with_one_warning(compiles):
    eager, fused = _twin_optimizers()
    _step(eager, fused, steps=1, seed=10)
    os.kill(compiles.child_pid(), signal.SIGKILL)
    compiles.wait()
    with pytest.warns(BackgroundCompileWarning, match=r"bucket of parameter group 0 .*status -9") as caught:
        _step(eager, fused, steps=3, seed=11)
    assert len([warning for warning in caught if warning.category is BackgroundCompileWarning]) == 1
    _assert_bit_identical(eager, fused)


def test_a_call_too_large_for_the_child_compiles_in_the_training_process(monkeypatch, compiles):
    monkeypatch.setattr(background_module, "_too_large_for_the_device", lambda args: True)
    eager, fused = _twin_optimizers()
    graphs = counters["stats"]["unique_graphs"]
    _step(eager, fused, steps=1, seed=12)
    assert compiles.child_pid() is None and not compiles.compiling()
    assert counters["stats"]["unique_graphs"] <= graphs + 1
    _assert_bit_identical(eager, fused)


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Holder:
    tensor: torch.Tensor
    name: str


def test_a_skeleton_keeps_every_tensors_metadata_and_which_share_a_storage():
    flat = torch.arange(40, dtype=torch.float32)
    args = (
        flat[4:16].view(3, 4),
        {"strided": flat[1::3], "other": torch.ones(5, dtype=torch.bfloat16)},
        [Pair(flat[:8], torch.tensor(3, dtype=torch.int32)), Holder(flat.view(torch.int32)[20:], "kept")],
        "a string", 7, None,
    )
    stripped = pickle.loads(pickle.dumps(skeleton(args)))
    assert isinstance(stripped[0], TensorSkeleton) and stripped[3:] == ("a string", 7, None)
    built = materialize(stripped)
    originals, copies = background_module._tensors(args), background_module._tensors(built)
    assert len(originals) == len(copies) == 6
    for original, copy in zip(originals, copies):
        assert (copy.dtype, copy.shape, copy.stride(), copy.storage_offset()) == (
            original.dtype, original.shape, original.stride(), original.storage_offset())
        assert copy.untyped_storage().nbytes() == original.untyped_storage().nbytes()
        assert (copy._base is None) == (original._base is None)
        assert torch.count_nonzero(copy) == 0
    storages = {copy.untyped_storage().data_ptr() for copy in copies}
    assert len(storages) == 3 and copies[0].untyped_storage().data_ptr() == copies[5].untyped_storage().data_ptr()
    assert isinstance(built[2][0], Pair) and built[2][1].name == "kept"
    assert call_kind(built) == call_kind(args)


def _add_twice_(x: torch.Tensor, y: torch.Tensor) -> None:
    x.add_(y * 2)


def test_a_compile_on_the_materialized_skeleton_of_views_fills_the_cache_entry_of_the_call(tmp_path):
    """What background compilation rests on: compiling a function on ``materialize(skeleton(args))``
    (the child's tensors) fills the FX graph cache entry that compiling it on ``args`` looks up, also
    where the arguments are views of all of a buffer's elements: Dynamo names a view's sizes apart
    from a buffer's, so a buffer in the child would miss the view's entry, and the skeleton keeps
    which tensors are views. Buffers: the first test above."""
    args = tuple(torch.zeros(3000)[0:3000] for _ in range(2))
    with temporary_cache_dir(str(tmp_path / "inductor")):
        for call_args in (materialize(skeleton(args)), args):
            torch._dynamo.reset()
            misses, hits = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
            torch.compile(_add_twice_, dynamic=True, fullgraph=True)(*call_args)
        assert (counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]) == (misses, hits + 1)


EXITING_WITH_A_CHILD = """
import torch
from megatron_lowprec.optim import AdamW
from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES

param = torch.nn.Parameter(torch.ones(300, dtype=torch.bfloat16))
optimizer = AdamW([param], option="A", fused=True, background_compile=True)
param.grad = torch.ones_like(param)
optimizer.step()
print(BACKGROUND_COMPILES.child_pid(), flush=True)
"""


def test_a_running_child_is_killed_when_the_training_process_exits():
    finished = subprocess.run([sys.executable, "-c", EXITING_WITH_A_CHILD], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    child = int(finished.stdout.split()[-1])
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_a_child_that_cannot_start_leaves_its_kinds_to_the_training_process(monkeypatch, compiles):
    def refuse(jobs):
        raise pickle.PicklingError("an argument that does not pickle")

    monkeypatch.setattr(background_module, "_start_child", refuse)
    eager, fused = _twin_optimizers()
    _step(eager, fused, steps=1, seed=13)
    assert compiles.child_pid() is None and not compiles.compiling()
    assert compiles.call(CompileRecipe(len), lambda tensor: "eager", (torch.zeros(3),), pytest.fail) == "eager"
    compiles.wait()
    assert not compiles.compiling()
    with pytest.warns(BackgroundCompileWarning, match="no compile process started: PicklingError: an argument"):
        _step(eager, fused, steps=2, seed=14)
    _assert_bit_identical(eager, fused)
