"""The project's own per-rank checkpoint files load with ``torch.load(weights_only=True)``; what makes a
checkpoint count as complete, and which one a resume tries first."""

from __future__ import annotations

import json
import os
import random

import numpy
import pytest
import torch

from megatron_lowprec.optim import AdamW
from megatron_lowprec.train import checkpoint


def test_a_rank_file_holding_a_pickled_callable_is_refused(tmp_path):
    tampered = tmp_path / "rank0.pt"
    torch.save({"rng": os.system, "layout": {}}, tampered)
    with pytest.raises(ValueError, match=r"refusing to load .*rank0\.pt.*posix\.system|refusing to load .*rank0\.pt.*GLOBAL"):
        checkpoint.load_rank_file(tampered)


def test_rng_states_and_a_coat_optimizer_state_round_trip_through_weights_only_files(tmp_path):
    """What ``save`` writes per rank (every RNG state; coat's FP8 optimizer state) loads with
    ``weights_only=True`` and restores the generators: the same draws after restoring."""
    param = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    optimizer = AdamW([param], option="coat", fused=False)
    param.grad = torch.randn(300, dtype=torch.bfloat16)
    optimizer.step()
    random.seed(3)
    numpy.random.seed(4)
    torch.manual_seed(5)
    path = tmp_path / "rank0.pt"
    torch.save({"rng": checkpoint._rng_states(), "optimizer": optimizer.state_dict()}, path)
    expected = (random.random(), numpy.random.rand(), torch.rand(1))
    loaded = checkpoint.load_rank_file(path)
    checkpoint._set_rng_states(loaded["rng"])
    assert (random.random(), numpy.random.rand(), torch.rand(1)) == expected
    payload = loaded["optimizer"]["state"][0]["exp_avg_payload"]
    assert payload.dtype == optimizer.state[param]["exp_avg_payload"].dtype
    assert torch.equal(payload.view(torch.uint8), optimizer.state[param]["exp_avg_payload"].view(torch.uint8))


def _fake_checkpoint(run_dir, iteration: int, files: dict[str, bytes], complete: bool = True):
    """A checkpoint directory as ``save`` leaves it: the files, then the completion marker."""
    path = checkpoint.checkpoint_path(run_dir, iteration)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if complete:
        marker = {"iteration": iteration, "world_size": 1, "files": {name: len(data) for name, data in files.items()}}
        (path / checkpoint.COMPLETE_FILE).write_text(json.dumps(marker))
    return path


FILES = {"__0_0.distcp": b"x" * 500, "common.pt": b"c" * 50, "rank0.pt": b"r" * 80}


def test_a_checkpoint_counts_only_with_its_marker_and_every_file_it_lists(tmp_path):
    intact = _fake_checkpoint(tmp_path, 10, FILES)
    assert checkpoint.checkpoint_problem(intact) is None
    truncated = _fake_checkpoint(tmp_path, 20, FILES)
    os.truncate(truncated / "__0_0.distcp", 100)
    assert checkpoint.checkpoint_problem(truncated) == "__0_0.distcp has 100 bytes, 500 were written"
    missing = _fake_checkpoint(tmp_path, 30, FILES)
    os.remove(missing / "rank0.pt")
    assert checkpoint.checkpoint_problem(missing) == "rank0.pt is missing"
    half_written = _fake_checkpoint(tmp_path, 40, FILES, complete=False)
    assert "has no complete.json" in checkpoint.checkpoint_problem(half_written)
    assert checkpoint.checkpoint_problem(tmp_path / "nowhere") == "does not exist"


def test_resume_tries_latest_then_older_checkpoints_newest_first(tmp_path):
    """``latest`` decides (a run resumed from an older checkpoint may leave newer ones behind); the
    first intact candidate is the one resumed from; a ``.partial`` directory is never a candidate."""
    for iteration in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, iteration, FILES)
    (checkpoint.checkpoints_dir(tmp_path) / "iter_0000050.partial").mkdir()
    latest = checkpoint.checkpoints_dir(tmp_path) / checkpoint.LATEST_FILE
    latest.write_text("iter_0000030")
    assert [path.name for path in checkpoint.resume_candidates(tmp_path)] == ["iter_0000030", "iter_0000020", "iter_0000010"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "iter_0000030"
    os.truncate(checkpoint.checkpoint_path(tmp_path, 30) / "common.pt", 1)
    os.remove(checkpoint.checkpoint_path(tmp_path, 20) / checkpoint.COMPLETE_FILE)
    assert checkpoint.latest_checkpoint(tmp_path).name == "iter_0000010"
    latest.unlink()
    assert [path.name for path in checkpoint.resume_candidates(tmp_path)] == [
        "iter_0000040", "iter_0000030", "iter_0000020", "iter_0000010"]
