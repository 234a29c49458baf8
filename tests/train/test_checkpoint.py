"""The project's own per-rank checkpoint files load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

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
