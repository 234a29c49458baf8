"""The project's own per-rank checkpoint files load with ``torch.load(weights_only=True)``; what makes a
checkpoint count as complete, and which one a resume tries first."""

from __future__ import annotations

import json
import os
import random
import socket
import traceback

import numpy
import pytest
import torch
import xxhash

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


def test_a_flipped_byte_is_caught_by_the_rank_whose_share_holds_the_file(tmp_path):
    """Same size, other content: only the checksum tells. The marker's checksums are xxHash's own
    XXH3-128 of the bytes written; each rank of two checksums every other file of the sorted list."""
    path = _fake_checkpoint(tmp_path, 10, FILES, complete=False)
    files = {name: {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()} for name, data in FILES.items()}
    (path / checkpoint.COMPLETE_FILE).write_text(json.dumps({"iteration": 10, "world_size": 1, "files": files}))
    assert checkpoint.checkpoint_problem(path, share=(0, 1)) is None
    flipped = bytearray(FILES["common.pt"])
    flipped[20:36] = bytes(byte ^ 0xFF for byte in flipped[20:36])
    (path / "common.pt").write_bytes(bytes(flipped))
    assert checkpoint.checkpoint_problem(path) is None  # sizes alone cannot tell
    expected = "common.pt does not match its xxh3_128 checksum (its content changed after it was written)"
    assert checkpoint.checkpoint_problem(path, share=(0, 1)) == expected
    # Sorted: __0_0.distcp, common.pt, rank0.pt: rank 1 of 2 checksums common.pt, rank 0 the others.
    assert checkpoint.checkpoint_problem(path, share=(1, 2)) == expected
    assert checkpoint.checkpoint_problem(path, share=(0, 2)) is None


def _library_failure():
    """What torch.distributed.checkpoint raises for a rank's failed read: CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        raise ValueError("bad .metadata")
    except ValueError as error:
        failure = (error, traceback.extract_tb(error.__traceback__))
    raise CheckpointException("read_data", {0: failure})


def test_an_exception_from_the_checkpoint_library_names_the_checkpoint_damaged_but_ctrl_c_passes(tmp_path, monkeypatch):
    """torch.distributed.checkpoint's CheckpointException derives from BaseException (a damaged
    ``.metadata`` raises it): it marks the checkpoint damaged; KeyboardInterrupt and SystemExit do not."""
    from megatron_lowprec.megatron.cpu import cpu_bridge

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(checkpoint_port()))
    with cpu_bridge():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        try:
            with pytest.raises(checkpoint.DamagedCheckpoint, match=r"fails to load \(CheckpointException"):
                checkpoint._read_on_every_rank(tmp_path, _library_failure)
            for passing in (KeyboardInterrupt, SystemExit):
                with pytest.raises(passing):
                    checkpoint._read_on_every_rank(tmp_path, lambda passing=passing: (_ for _ in ()).throw(passing()))
        finally:
            torch.distributed.destroy_process_group()


def checkpoint_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def test_a_res8_checkpoint_with_fp32_exponents_is_told_apart_and_read_with_them():
    """The app tells a res8 checkpoint written while its FP8 exponents were FP32 (its optimizer's
    ``lowprec`` section records no exponent storage) from one of today's, and converts it as res8 with
    FP32 exponents (what its tensors hold); a checkpoint of coat, which keeps FP32 exponents, is
    told apart from neither."""
    from pathlib import Path
    from types import SimpleNamespace

    from megatron_lowprec.optim import get_strategy

    def run(option):
        return SimpleNamespace(optimizer=SimpleNamespace(optimizer=SimpleNamespace(strategy=get_strategy(option))),
                               config=SimpleNamespace(optimizer=SimpleNamespace(name="adam")))

    old = {"optimizer": {"lowprec": {"option": "res8", "master_storage": "residual8"}}}
    new = {"optimizer": {"lowprec": {"option": "res8", "master_storage": "residual8", "fp8_exponent_storage": "bf16"}}}
    coat = {"optimizer": {"lowprec": {"option": "coat", "master_storage": "fp32"}}}
    assert checkpoint._other_exponent_storages(run("res8"), old) == {("FP8 expansion exponents", "fp32", "bf16")}
    assert checkpoint._other_exponent_storages(run("res8"), new) == set()
    assert checkpoint._other_exponent_storages(run("coat"), coat) == set()
    [(_, index, source)] = checkpoint._conversion_sources(run("res8"), Path("iter_0000002"), "res8", old)
    assert (index, source.name, source.fp8_exponent_storage) == (None, "res8", "fp32")
    [(_, _, source)] = checkpoint._conversion_sources(run("D"), Path("iter_0000002"), "res8", new)
    assert source.fp8_exponent_storage == "bf16"
