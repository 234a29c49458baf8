"""The distributed optimizer (ZeRO-1) of every precision option against the unsharded hook, on CPU with gloo."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_lowprec.megatron.layout import ROW
from megatron_lowprec.optim.buckets import ALIGNMENT

from ..options import OPTIONS, OTHER_MASTER_STORAGES, layout_kind, one_per_feature, one_per_kind, strategy_of
from .launch import run_ranks

WORKER = Path(__file__).with_name("_distributed_optimizer_worker.py")

PIPELINE_OPTIONS = one_per_kind(OPTIONS, lambda strategy: (strategy.param_update, strategy.moments == "fp8"))
"""One option of each way to update the parameter, and FP8 moments."""
LAYOUT_FEATURES = ("row grids", "FP8 groups", "master below the parameters")
"""The entries of :func:`~tests.options.layout_kind`, by name."""
FUSED_SHARD_OPTIONS = one_per_feature(
    OPTIONS, lambda strategy: {name for name, held in zip(LAYOUT_FEATURES, layout_kind(strategy) or ()) if held}
)
"""Options that together step, compiled, each way a shard's layout differs from a flat one:
stochastic rounding's row grids, FP8 groups' group-aligned chunks, a master stored below megatron's
parameter buffer (an option that combines two counts for both; the contract matrix,
``tests/optim/test_contract.py``, steps every option's shard layouts fused and eager, bit for bit)."""

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
]


def _run(result_dir: Path, world_size: int, scenario: str, worker: Path = WORKER, **arguments) -> list[dict]:
    result_dir.mkdir(parents=True, exist_ok=True)
    return run_ranks(worker, result_dir, world_size, scenario, json.dumps(arguments), timeout_seconds=600, on_cpu=True)


@pytest.mark.parametrize(
    "options, world_size, tensor_parallel, pipeline_parallel, bucket_size, steps, fused, grad_reduce_in_fp32",
    [
        (OPTIONS + OTHER_MASTER_STORAGES, 2, 1, 1, 3000, 6, False, False),
        (OPTIONS, 2, 1, 1, 3000, 6, False, True),
        (OPTIONS, 4, 2, 1, None, 6, False, False),
        (PIPELINE_OPTIONS, 4, 1, 2, None, 4, False, False),
        (FUSED_SHARD_OPTIONS, 2, 1, 1, 3000, 3, True, False),
    ],
    ids=["dp2-small-buckets", "dp2-fp32-reduction", "tp2xdp2", "pp2xdp2", "dp2-fused"],
)
def test_sharded_states_train_bit_identically_and_hold_their_share(
    tmp_path, options, world_size, tensor_parallel, pipeline_parallel, bucket_size, steps, fused, grad_reduce_in_fp32
):
    """Each option, with and without the distributed optimizer, from the same weights on the same
    data: the same losses and parameters bit for bit (DP=2 with small buckets, so that shard
    boundaries cut coat's FP8 groups and their tails travel; TP=2 x DP=2 with one bucket; PP=2 x
    DP=2 with the embedding tied across stages; the distributed optimizer's compiled kernel on
    stochastic rounding's row grids, FP8 groups' group-aligned chunks and a master stored below
    megatron's parameter buffer (:data:`FUSED_SHARD_OPTIONS`), against the unsharded optimizer's eager step; masters stored as remainders, D's through torch's fused kernel; DP=2 with Megatron-LM's defaults, FP32 gradient
    reduction and clipping at 1.0, where both find the same gradient norms, which clip). Without
    the zero padding of its state buckets' layout, each rank holds at most its share of the
    unsharded state plus one alignment unit per bucket (the share is smaller by the unsharded
    buckets' padding), the ranks hold equal shares within
    one unit per bucket, and the update-quality pieces summed over the ranks match. Uncompiled runs
    compile nothing (option D's remainder masters included)."""
    ranks = _run(tmp_path, world_size, "sharded_equals_unsharded", options=options,
                 tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, steps=steps,
                 bucket_size=bucket_size, fused=fused, grad_reduce_in_fp32=grad_reduce_in_fp32)
    data_parallel = ranks[0]["data_parallel_size"]
    assert data_parallel == 2
    fp8_option = next(option for option in options if strategy_of(option).moments == "fp8")
    if bucket_size is not None:
        assert ranks[0][fp8_option]["buckets"] > 1 and ranks[0][fp8_option]["halo"] > 0
    for option in options:
        results = [rank[option] for rank in ranks]
        for result in results:
            assert result["successes"] and result["losses_identical"] and result["params_identical"], option
            assert result["grad_norms_identical"], option
            assert max(result["grad_norms"]) > 1.0, "clipping at 1.0 never acted"
            unit = ALIGNMENT * result["bytes_per_element"] * result["buckets"]
            unpadded = result["sharded_bytes"] - result["sharded_padding_bytes"]
            assert unpadded <= result["unsharded_bytes"] / data_parallel + unit, option
            assert result["sharded_bytes"] >= 0.9 * result["unsharded_bytes"] / data_parallel, option
            assert result["edq"][0] == pytest.approx(result["edq"][1], rel=1e-9)
            assert result["imprecision"][0] == result["imprecision"][1]
            assert fused or result["compiled_graphs"] == 0, option
        shares = [result["sharded_bytes"] - result["sharded_padding_bytes"] for result in results]
        assert max(shares) - min(shares) <= unit, option


SAVED_OPTIONS = OPTIONS + OTHER_MASTER_STORAGES
"""The options whose dist checkpoints ``test_dist_checkpoint_resumes_bit_identically_and_reshards`` saves."""
RESHARDED_AT_DP4 = one_per_kind(
    SAVED_OPTIONS,
    lambda strategy: (strategy.moments == "fp8", strategy.master_weights and strategy.master_storage,
                      strategy.param_update == "stochastic"),
)
"""One option of each checkpoint form (``megatron/checkpoint_state.py``: FP8 moments' per-group
parts, a master stored below the parameter, joined when saved) and each shard layout (stochastic
rounding's row grids): what loading at DP=4 cuts differently. The other options' states are
per-element tensors of these forms, which DP=4 cuts alike; TP=2 x DP=2 loads every option."""


def test_dist_checkpoint_resumes_bit_identically_and_reshards(tmp_path):
    """Every option, and masters stored as remainders: a dist checkpoint saved at DP=2 with the
    distributed optimizer resumes at DP=2 bit-identically to a straight run; at TP=2 x DP=2 (every
    option) and at DP=4 (:data:`RESHARDED_AT_DP4`), the distributed and the unsharded optimizer load
    the same state bit for bit from it and take the same first step, and (TP=2 x DP=2) a checkpoint
    of whole FP32 masters loads into remainders (and back) as the same masters bit for bit. At TP=2
    x DP=2 their later losses are identical too; at DP=4 they agree to 1e-4 (gloo's reduce-scatter
    and all-reduce add four ranks' BF16 gradients in different orders, which the unsharded run at
    DP=4 also shows without any checkpoint)."""
    checkpoint = tmp_path / "checkpoint"
    saved = _run(tmp_path / "save", 2, "save_and_resume", options=SAVED_OPTIONS, checkpoint_dir=str(checkpoint), steps=6)
    for rank in saved:
        for option in SAVED_OPTIONS:
            assert rank[option] == {"losses_identical": True, "params_identical": True}, option
    across_storages = [f"{other}<-{other.partition(':')[0]}" for other in OTHER_MASTER_STORAGES]
    options_at = {"1": RESHARDED_AT_DP4, "2": SAVED_OPTIONS + across_storages}
    ranks = _run(tmp_path / "load", 4, "load_elsewhere", options_at=options_at, checkpoint_dir=str(checkpoint), steps=2)
    for tensor_parallel, options in options_at.items():
        for rank in ranks:
            for option in options:
                result = rank[tensor_parallel][option]
                assert result["same_state"], (tensor_parallel, option)
                assert result.get("same_masters", True), (tensor_parallel, option)
                assert result["sharded"][:2] == result["unsharded"][:2], (tensor_parallel, option)
                if tensor_parallel == "2":
                    assert result["sharded"] == result["unsharded"], option
                else:
                    assert result["sharded"] == pytest.approx(result["unsharded"], rel=1e-4), option


COMPAT_WORKER = Path(__file__).with_name("_checkpoint_compat_worker.py")
CHECKPOINTS_967A844 = Path(__file__).parent / "fixtures" / "checkpoints_967a844.tar.xz"
"""Checkpoints written by the package at commit 967a844 (options coat and D-BF16, the plain and the
distributed optimizer, DP=2): ``_checkpoint_compat_worker.py``'s ``write`` scenario, run with that
version first on ``PYTHONPATH``; per rank its ``state_dict()`` (the distributed optimizer's in its
per-shard format) and model parameters, and torch_dist saves of ``sharded_state_dict``."""


def test_checkpoints_of_the_earlier_version_load_bit_for_bit(tmp_path):
    """The plain and the distributed optimizer load every checkpoint that 967a844 wrote
    (:data:`CHECKPOINTS_967A844`) with every state as saved, bit for bit: per-rank state dicts of
    both (the distributed one's per-shard buffers, padding included), torch_dist saves of both into
    the optimizer that wrote them, and the plain one's into the distributed optimizer; the
    distributed optimizer's state dict now has the plain one's format. The ranks run this checkout's
    package."""
    import tarfile

    directory = tmp_path / "checkpoints"
    with tarfile.open(CHECKPOINTS_967A844) as archive:
        archive.extractall(directory, filter="data")
    ranks = _run(tmp_path / "load", 2, "load", options=["coat", "D-BF16"], directory=str(directory), worker=COMPAT_WORKER)
    for rank in ranks:
        assert Path(rank["package"]).resolve().is_relative_to(Path(__file__).resolve().parents[2])
        for option in ("coat", "D-BF16"):
            assert rank[option] == {
                "plain per-rank": True,
                "plain torch_dist of plain": True,
                "distributed per-rank": True,
                "distributed torch_dist of plain": True,
                "distributed torch_dist of distributed": True,
                "distributed format is plain's": True,
            }, option


@pytest.fixture(scope="module")
def costs(tmp_path_factory) -> list[dict]:
    return _run(
        tmp_path_factory.mktemp("costs"), 2, "optimizer_costs", options=OPTIONS + OTHER_MASTER_STORAGES, stepped_options=STEPPED_OPTIONS,
        bucket_size=None, hidden_size=128,
    )


STEPPED_OPTIONS = one_per_kind(
    OPTIONS + OTHER_MASTER_STORAGES,
    lambda strategy: (strategy.adam_kernel, strategy.param_update == "stochastic", strategy.moments == "fp8",
                      strategy.master_weights and strategy.master_storage),
)
"""Options whose fused steps are measured too: one of each kind of call (flat, torch's fused AdamW,
stochastic rounding per bucket, FP8 group grids, a remainder master in either, a residual master).
Their kernel runs uncompiled there (``_distributed_optimizer_worker.optimizer_costs``): the calls, what
a step keeps and its copies are the fused path's, the compiled kernel's bits the contract matrix's."""


@pytest.mark.parametrize("layout", ["unsharded", "sharded"])
@pytest.mark.parametrize("option", OPTIONS + OTHER_MASTER_STORAGES)
def test_the_optimizer_allocates_its_state_and_no_gradient_copy(costs, option, layout):
    """Measured with the CPU allocator on each rank of a DP=2 megatron GPT whose tensors are whole
    multiples of the alignment: building the optimizer leaves exactly the state it reports
    allocated (no second gradient buffer, no FP32 copy beside the masters of D, coat and D-BF16; a few words
    of tables per parameter, and an int32 per row of 64 elements where the step reads each row's
    parameter group); that state is the option's bytes/param less parameter and gradient over
    the elements the rank updates, plus, in a shard laid out in place in megatron's buffers, the
    padding megatron leaves before each parameter (under 64 elements each); a step keeps nothing
    allocated."""
    per_element = strategy_of(option).bytes_per_param(grad_reduce_in_fp32=False) - 4
    for rank in costs:
        result = rank[f"{option}-{layout}"]
        rows = (result["owned"] + result["padding"]) // ROW + 2 * result["state_buckets"]
        tables = 128 * result["entries"] + 4 * rows
        assert result["reported_bytes"] <= result["built_bytes"] <= result["reported_bytes"] + tables
        assert result["reported_bytes"] == pytest.approx(per_element * (result["owned"] + result["padding"]), rel=1e-9)
        assert result["padding"] <= (0 if layout == "unsharded" else ROW * result["entries"])
        if option in STEPPED_OPTIONS:
            assert result["step_kept_bytes"] == 0


@pytest.mark.parametrize("layout", ["unsharded", "sharded"])
@pytest.mark.parametrize("option", STEPPED_OPTIONS)
def test_a_fused_step_calls_its_kernel_once_per_state_bucket_and_copies_nothing_to_the_device(costs, option, layout):
    """A fused step (stochastic rounding as on GPUs, whole buckets) calls its kernel, which a GPU runs
    compiled, once per state bucket, not per parameter (D runs torch's fused kernel: none), and
    creates no tensor on the device from host data (a copy that waits for the device)."""
    for rank in costs:
        result = rank[f"{option}-{layout}"]
        expected = 0 if strategy_of(option).adam_kernel == "torch_fused" else result["state_buckets"]
        assert result["compiled_calls"] == expected
        assert result["entries"] > result["state_buckets"]
        assert result["copies"] == []


def test_shard_boundaries_move_to_the_end_of_a_cut_fp8_group():
    from megatron_lowprec.megatron.layout import owned_bounds

    params = [(0, 300), (320, 1024)]
    assert owned_bounds(1024, 2, params, 1) == [0, 512, 1024]
    assert owned_bounds(1024, 2, params, 128) == [0, 576, 1024]
    assert owned_bounds(1024, 2, [(0, 1024)], 128) == [0, 512, 1024]
    with pytest.raises(ValueError, match="fewer than one FP8 group"):
        owned_bounds(128, 4, [(0, 128)], 128)


def test_a_megatron_core_without_the_sharding_machinery_is_refused(monkeypatch):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_lowprec.megatron.distributed import megatron_sharding_api

    monkeypatch.delattr(DistributedOptimizer, "_build_model_gbuf_param_range_map")
    with pytest.raises(ValueError, match=r"megatron-core >= 0\.16; megatron-core \S+ lacks DistributedOptimizer\._build_model_gbuf_param_range_map"):
        megatron_sharding_api()


def test_model_chunks_without_the_distributed_optimizer_are_refused():
    from types import SimpleNamespace

    from megatron.core.optimizer import OptimizerConfig

    from megatron_lowprec.megatron.distributed import build_distributed_optimizer
    from megatron_lowprec.optim import get_strategy

    chunk = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=False))
    with pytest.raises(ValueError, match=r"DistributedDataParallelConfig\(use_distributed_optimizer=True\)"):
        build_distributed_optimizer(
            get_strategy("C"), [chunk], OptimizerConfig(use_distributed_optimizer=True), [],
            seed=0, fused=False, track_update_quality=False, stream_layouts={},
        )


CONVERSION_REFUSAL = "the optimizer state was saved with option 'D', this optimizer runs 'B'; build_optimizer(..., convert_checkpoint=True) converts it"


def test_option_d_checkpoints_load_into_option_b_with_convert_checkpoint(tmp_path):
    """At DP=2, dist checkpoints of option D's distributed optimizer and of its Muon chain load, as
    Megatron-LM's entry reads them, into option B's built with ``convert_checkpoint=True`` (the chain's
    into B's chain and its layer-wise chain, each rank holding its parameters' states): on every
    rank each owned run of each parameter, and every whole parameter, holds D's FP32 master and
    moments as torch's casts round them (θ the master's nearest BF16, δθ the exact rest's, each
    moment its nearest BF16), one line per state kind over both ranks' elements (the chain's per
    optimizer, the layer-wise chain's the same as the chain's), and a further step succeeds. Without
    the setting, Megatron-LM's load stops and ``load_state_dict`` raises, in one line naming it; the
    chain's checkpoint given to one optimizer stops Megatron-LM's load in one line."""
    ranks = _run(tmp_path, 2, "converting_loads", checkpoint_dir=str(tmp_path / "checkpoints"), steps=1)
    for rank in ranks:
        for optimizer in ("distributed", "muon", "layer_wise_muon"):
            result = rank[optimizer]
            assert result["runs"] > 0 and result["wrong"] == {}, (optimizer, result["wrong"])
            assert result["step"]["successes"] == [True] and all(math.isfinite(loss) for loss in result["step"]["losses"])
    first = ranks[0]["distributed"]
    assert [line.split(": ")[2] for line in first["lines"]] == ["value", "exp_avg", "exp_avg_sq"]
    assert all(line.startswith("megatron-lowprec: converted D -> B: ") for line in first["lines"])
    assert all(f", {first['elements']} elements, " in line for line in first["lines"]), first["lines"]
    assert first["refusals"] == {
        "megatron_lm": f"{tmp_path / 'checkpoints' / 'distributed'} was saved with --lowprec-option D, this run has "
                       "--lowprec-option B: --lowprec-convert-checkpoint converts its optimizer state to B",
        "load_state_dict": CONVERSION_REFUSAL,
    }
    muon = ranks[0]["muon"]
    kinds = {"Muon": ["value", "momentum"], "AdamW": ["value", "exp_avg", "exp_avg_sq"]}
    assert [tuple(line.split(": ")[1:4:2]) for line in muon["lines"]] == [
        (label, kind) for label, label_kinds in kinds.items() for kind in label_kinds]
    for line in muon["lines"]:
        label = line.split(": ")[1]
        assert "converted D -> B: " in line and f", {muon['elements'][label]} elements, " in line, line
    assert ranks[0]["layer_wise_muon"]["lines"] == muon["lines"]
    assert muon["refusals"] == {
        "megatron_lm": f"{tmp_path / 'checkpoints' / 'muon'} was saved with --lowprec-option D, this run has "
                       "--lowprec-option B: --lowprec-convert-checkpoint converts its optimizer state to B",
        "into_one_optimizer": f"{tmp_path / 'checkpoints' / 'muon'} holds the state of a chain of optimizers (Muon and "
                              "AdamW), this run has one optimizer: resume with the optimizer it was saved with",
    }
    assert [rank["distributed"]["refusals"]["load_state_dict"] for rank in ranks] == [CONVERSION_REFUSAL] * 2
