"""The strict CPU bridge catches the device-placement bugs that stopped ``lowprec-train`` on GPUs.

Each bug is put back into the app (``_device_placement_worker.REINTRODUCED``) and must fail on CPU
with the place that put a tensor on the CPU, as it failed on an H100; the app as it is trains.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from tests.megatron.launch import run_ranks

WORKER = Path(__file__).with_name("_device_placement_worker.py")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="hydra-core is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the strict bridge checks CPU runs"),
]

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.seq_length=16",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=2",
    "trainer.max_steps=1",
    "precision.background_compile=false",
    "trainer.eval_iters=1",
    "trainer.save=false",
    "logging.wandb=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("cache")
    [results] = run_ranks(
        WORKER, tmp_path_factory.mktemp("placement"), 1, json.dumps([*TINY, f"data.cache_dir={cache}"]),
        timeout_seconds=400,
    )
    return results


def test_the_app_as_it_is_trains_under_the_strict_bridge(runs):
    assert runs["unchanged"] is None


@pytest.mark.parametrize(
    "bug, expected",
    [
        ("parameter_count_on_cpu", r"torch.distributed.all_reduce at .*train/metrics.py:\d+ got a tensor placed on the CPU at .*_device_placement_worker.py:\d+"),
        ("loss_totals_on_cpu", r"torch.distributed.all_reduce at .*train/loop.py:\d+ got a tensor placed on the CPU at .*_device_placement_worker.py:\d+"),
        ("batches_on_cpu", r"embedding at .* mixes a tensor placed on the CPU at .*datasets/gpt_dataset.py:\d+"),
        ("model_not_moved", r"mixes a tensor placed on the CPU at .*megatron/core/.*\.py:\d+"),
    ],
    ids=lambda value: value if " " not in value and "*" not in value else "",
)
def test_each_reintroduced_bug_fails_with_its_call_site(runs, bug, expected):
    message = runs[bug]
    assert message is not None, f"{bug}: the strict bridge let it train"
    assert re.search(expected, message), message
