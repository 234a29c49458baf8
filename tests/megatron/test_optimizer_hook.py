"""Precision options as Megatron optimizers (``build_optimizer``), trained on CPU with gloo, or with NCCL
on one GPU per rank where CUDA is present."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from ..options import MASTER_OPTIONS, OPTIONS
from .launch import run_ranks

WORKER = Path(__file__).with_name("_optimizer_hook_worker.py")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
]


def _run(result_dir: Path, world_size: int, scenario: str, **arguments) -> list[dict]:
    result_dir.mkdir(parents=True, exist_ok=True)
    return run_ranks(WORKER, result_dir, world_size, scenario, json.dumps(arguments))


@pytest.mark.parametrize(
    "option, world_size, tensor_parallel, fused",
    [
        ("sr", 2, 1, False),
        ("sr", 2, 2, False),
        ("sr", 2, 1, True),
        ("sr", 4, 2, False),
        ("A", 2, 2, False),
        ("C", 2, 2, False),
        ("D", 2, 2, False),
    ],
)
def test_replicas_stay_bit_identical(tmp_path, option, world_size, tensor_parallel, fused):
    """DP=2, TP=2 and TP2xDP2: finite losses, every step taken, parameters moved; data-parallel
    replicas bit-identical; TP-replicated parameters bit-identical across TP ranks (20 steps for
    stochastic rounding, as the SR acceptance asks, 8 otherwise)."""
    ranks = _run(tmp_path, world_size, "replicas", option=option, tensor_parallel=tensor_parallel,
                 shared_randomness=True, steps=20 if option == "sr" else 8, fused=fused)
    for rank in ranks:
        assert all(math.isfinite(loss) for loss in rank["losses"])
        assert all(rank["successes"]) and rank["moved"]
        assert rank["data_parallel_identical"] and rank["tensor_parallel_replicated_identical"]


def test_stochastic_rounding_replicas_drift_without_shared_randomness(tmp_path):
    """The negative control of the SR paper's ablation: each rank its own bits, replicas differ."""
    ranks = _run(tmp_path, 2, "replicas", option="sr", tensor_parallel=1, shared_randomness=False, steps=20, fused=False)
    assert not any(rank["data_parallel_identical"] for rank in ranks)


def test_every_element_draws_the_same_sr_bits_at_every_layout(tmp_path):
    """The SR words of each parameter (gated MLP, tied embeddings), reassembled into whole tensors,
    are the same at TP=1, TP=2 and PP=2, and differ between parameters; after 4 SR steps at PP=2 the
    first stage's embedding and the last stage's tied copy are still bit-identical."""
    single = _run(tmp_path / "tp1", 1, "stream_words", tensor_parallel=1, pipeline_parallel=1, steps=0)
    tensor_parallel = _run(tmp_path / "tp2", 2, "stream_words", tensor_parallel=2, pipeline_parallel=1, steps=0)
    pipeline = _run(tmp_path / "pp2", 2, "stream_words", tensor_parallel=1, pipeline_parallel=2, steps=4)
    reference = single[0]["words"]
    assert len(set(reference.values())) == len(reference) > 10
    assert all(rank["words"] == reference for rank in tensor_parallel)
    stages: dict[str, str] = {}
    for rank in pipeline:
        for name, digest in rank["words"].items():
            assert stages.setdefault(name, digest) == digest
    assert stages == reference
    first, last = sorted(pipeline, key=lambda rank: rank["pipeline_rank"])
    assert len(first["embedding"]) == len(last["embedding"]) == 1
    assert first["embedding"] == last["embedding"]


def test_option_d_reproduces_stock_megatron_bf16_optimizer(tmp_path):
    """Option D does what megatron's Float16OptimizerWithFloat16Params + torch AdamW(fused) does
    (DP=2, FP32 gradients clipped at 1.0): the same losses and FP32 masters, bit for bit, when both
    clip by the same norm (D runs torch's fused AdamW kernel). The precision options' norm is the
    exact one, which megatron's FP32 norm approximates to within FP32 rounding."""
    ranks = _run(tmp_path, 2, "option_d_against_stock_megatron", steps=20)
    for rank in ranks:
        assert rank["ours"] == rank["stock"]
        assert rank["masters_identical"]
        exact, megatron = rank["norms"]
        assert megatron == pytest.approx(exact, rel=1e-6)


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(tmp_path):
    ranks = _run(tmp_path, 2, "non_finite_gradient_skips_everywhere")
    for rank in ranks:
        assert rank["success"] is False and rank["grad_norm_is_none"]
        assert rank["unchanged"] and rank["skipped_steps"] == 1


def test_resume_from_state_dicts_continues_bit_identically(tmp_path):
    """Every option at DP=2 (dropout on): 6 steps straight = 3 steps, state dicts, 3 steps in a fresh
    model and optimizer (which first took a step of its own, so that loading must overwrite it)."""
    ranks = _run(tmp_path, 2, "resume", options=OPTIONS, steps=6)
    for rank in ranks:
        for option in OPTIONS:
            assert rank[option] == {"finite": True, "losses_identical": True, "params_identical": True}, option


def test_update_quality_is_the_same_at_tp1_and_tp2(tmp_path):
    """EDQ and imprecision of one step of option A from the same global weights on the same data:
    the model-parallel reduction counts every parameter once, so TP=2 reports what TP=1 does, up to
    the different order of TP=2's reductions (bf16 activations) in the gradients."""
    tp1 = _run(tmp_path / "tp1", 2, "update_quality", option="A", tensor_parallel=1)
    tp2 = _run(tmp_path / "tp2", 2, "update_quality", option="A", tensor_parallel=2)
    assert tp1[0]["intended_nonzero"] == tp2[0]["intended_nonzero"] == tp2[1]["intended_nonzero"]
    assert tp1[0]["intended_nonzero"] > 0.99 * tp1[0]["numel"]
    assert tp2[0]["edq"] == tp2[1]["edq"]
    assert tp2[0]["edq"] == pytest.approx(tp1[0]["edq"], rel=1e-2)
    assert tp2[0]["imprecision_percent"] == pytest.approx(tp1[0]["imprecision_percent"], abs=1.0)
    assert 0 < tp1[0]["imprecision_percent"] < 100


@pytest.mark.parametrize("option", ["C", "D"])
def test_dist_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path, option):
    """megatron dist_checkpointing: save model + optimizer at TP=2, load at TP=1 (resharded). Every
    state component and the parameters keep their global norms (fp64 sums of the same values), and
    the loss on fixed data agrees up to TP's reduction order."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    saved = _run(tmp_path / "save", 2, "dist_checkpoint", option=option, tensor_parallel=2,
                 checkpoint_dir=str(checkpoint), save=True)
    loaded = _run(tmp_path / "load", 2, "dist_checkpoint", option=option, tensor_parallel=1,
                  checkpoint_dir=str(checkpoint), save=False)
    assert loaded[0]["norms"] == pytest.approx(saved[0]["norms"], rel=1e-12)
    assert loaded[0]["loss"] == pytest.approx(saved[0]["loss"], rel=1e-4)


def test_remainder_masters_resume_from_state_dicts_bit_identically(tmp_path):
    """Every option with an FP32 master, the master as a remainder below the BF16 parameters, at DP=2:
    resuming from the model's and the optimizer's state dicts continues bit-identically."""
    ranks = _run(tmp_path, 2, "resume", options=MASTER_OPTIONS, steps=6, master_storage="remainder")
    for rank in ranks:
        for option in MASTER_OPTIONS:
            assert rank[option] == {"finite": True, "losses_identical": True, "params_identical": True}, option


def test_a_whole_master_checkpoint_loads_into_remainders_at_another_layout_and_back(tmp_path):
    """dist_checkpointing: D with whole FP32 masters saved at TP=2 loads at TP=1 into remainder masters
    (the FP32 master is the checkpoint form of both), which save again and load at TP=2 into whole
    masters: every state, the FP32 masters included, keeps its global norm, and the loss agrees."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    saved = _run(tmp_path / "save", 2, "dist_checkpoint", option="D", tensor_parallel=2, checkpoint_dir=str(first),
                 save=True, master_storage="fp32")
    loaded = _run(tmp_path / "load", 2, "dist_checkpoint", option="D", tensor_parallel=1, checkpoint_dir=str(second),
                  save=True, master_storage="remainder", load_from=str(first))
    back = _run(tmp_path / "back", 2, "dist_checkpoint", option="D", tensor_parallel=2, checkpoint_dir=str(second),
                save=False, master_storage="fp32")
    for result in (loaded, back):
        norms, expected = result[0]["norms"], saved[0]["norms"]
        assert sorted(norms) == sorted(expected)
        for key in expected:
            if key != "param":
                assert norms[key] == pytest.approx(expected[key], rel=1e-12), key
        assert result[0]["loss"] == pytest.approx(saved[0]["loss"], rel=1e-4)


@pytest.mark.parametrize("option, master_storage", [("D", "remainder"), ("coat", "fp32")])
def test_reload_model_params_restarts_the_masters_from_the_model(tmp_path, option, master_storage):
    (rank,) = _run(tmp_path, 1, "reload_model_params", option=option, master_storage=master_storage)
    assert rank == {"before": False, "after": True}
