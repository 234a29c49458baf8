"""``build_optimizer`` takes the call of ``get_megatron_optimizer`` on every supported megatron-core
(0.16.1 to 0.19), builds megatron's own parameter groups there, and implements Megatron-Bridge's
``provide`` contract; what it cannot honour stops with one clear error. Multi-process checks run at
DP=2 and at TP=2 x DP=2 on CPU with gloo (NCCL on GPUs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from .launch import run_ranks

WORKER = Path(__file__).with_name("_build_optimizer_worker.py")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
]


MEGATRON_CORE_MUON_TOLERANCE = 0.1
"""How far (in Frobenius norm, relative to it) a step's update of a Muon master through
``build_optimizer`` (option D) may be from megatron-core's own Muon's on the test GPT's gradients.
As on random matrices (``NEWTON_SCHULZ_INPUT_TOLERANCE`` in tests/optim/test_muon.py), the two differ
where the BF16 Newton-Schulz starts: our (torch's) normalisation in BF16 against emerging-optimizers'
in FP32 then rounded; the first steps' gradients of a tiny model are of low rank, and the iterations
amplify the rounding noise in their null space, so more: measured 4.8% after one step and 5.4% over
two. With our input normalised in FP32 instead, the difference falls to 1.1e-6, so everything else
(coefficients, scale, split, decay) is megatron's; a wrong coefficient set gives 21%, no QKV split 87%."""


def _megatron_core_muon_imports() -> bool:
    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS
    except ImportError:
        return False
    return HAVE_EMERGING_OPTIMIZERS


def _run(result_dir: Path, scenario: str, world_size: int = 2, on_cpu: bool = False, **arguments) -> list[dict]:
    result_dir.mkdir(parents=True, exist_ok=True)
    return run_ranks(WORKER, result_dir, world_size, scenario, json.dumps(arguments), on_cpu=on_cpu)


def test_signature_takes_get_megatron_optimizers_parameters_in_its_order():
    """Every parameter of the installed ``get_megatron_optimizer``, at the same position and with
    the same default, so that any call of it (positional or by keyword) is a call of ``build_optimizer``."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_lowprec.megatron.optimizer import build_optimizer

    ours = list(inspect.signature(build_optimizer).parameters.values())
    theirs = list(inspect.signature(get_megatron_optimizer).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert [p.default for p in ours[2 : len(theirs)]] == [p.default for p in theirs[2:]]


def test_callers_get_megatrons_groups_and_biases_and_norms_no_weight_decay(tmp_path):
    """Called as Megatron-LM's ``setup_model_and_optimizer`` calls it (standard overrides, gloo
    flag, group-map dump), as megatron-core's default (no overrides: megatron 0.18+ applies the
    standard ones inside ``get_megatron_optimizer``, 0.16/0.17 inside ``_get_param_groups``),
    positionally with a caller's override, as Megatron-Bridge's ``setup_optimizer`` calls
    ``provide``, and in the plugin's form: the parameter groups are stock megatron's for the same
    call; biases and norm weights get no weight decay; the override's wd_mult and max_lr reach the
    scheduled learning rate and weight decay."""
    ranks = _run(tmp_path, "calls_of_each_caller", dump_path=str(tmp_path / "group_map"))
    result = ranks[0]
    exempt = sorted(name for name, shape in result["parameters"].items() if len(shape) == 1 or name.endswith(".bias"))
    assert any("layernorm" in name for name in exempt) and any(name.endswith(".bias") for name in exempt)
    for caller in ("megatron_lm", "megatron_core_default", "positional", "bridge", "plugin_form"):
        called = result[caller]
        assert called["type"] == "LowPrecisionOptimizer" and called["option"] == "C", caller
        assert called["same_groups_as_stock"], caller
        assert called["no_weight_decay"] == exempt, caller
        for name, (lr, weight_decay) in called["effective"].items():
            assert weight_decay == (0.0 if name in exempt else pytest.approx(0.1 * (0.5 if "fc1.weight" in name and caller == "positional" else 1.0))), (caller, name)
    fc1 = next(name for name in result["parameters"] if name.endswith("linear_fc1.weight"))
    other = next(name for name in result["parameters"] if name.endswith("linear_fc2.weight"))
    positional = result["positional"]["effective"]
    assert positional[fc1][0] > positional[other][0], "the override's max_lr did not reach the learning rate"
    assert result["dumped"]


@pytest.fixture(scope="module")
def tensor_and_data_parallel_two(tmp_path_factory) -> list[dict]:
    """One launch of 4 ranks at TP=2 x DP=2, on the CPU bridge on every machine (a GPU machine has
    rarely four): Megatron-Bridge's call beside the plugin's, and the layer-wise Muon chains against
    the unsharded one (:func:`_muon_tp2_dp2_chains`)."""
    result_dir = tmp_path_factory.mktemp("tp2_dp2")
    return _run(result_dir, "at_tensor_and_data_parallel_two", world_size=4, on_cpu=True, provide_steps=3, steps=1,
                checkpoint_dir=str(result_dir / "checkpoint"), chains=_muon_tp2_dp2_chains())


def test_bridges_provide_trains_as_build_optimizer_with_the_distributed_optimizer(tensor_and_data_parallel_two):
    """Megatron-Bridge's call and the plugin's form of the same option and seed, with the distributed
    optimizer at TP=2 x DP=2, uncompiled: identical losses."""
    for rank in tensor_and_data_parallel_two:
        provided = rank["provide"]
        assert provided["type"] == "DistributedLowPrecisionOptimizer"
        assert provided["losses"]["provide"] == provided["losses"]["build_optimizer"]
        assert len(provided["losses"]["provide"]) == 6


MUON_CHECKPOINT_STATES = {"sr": ["param", "momentum", "exp_avg", "exp_avg_sq"], "C": ["param", "momentum", "param_lo", "exp_avg_sq_lo"]}
"""The options whose Muon chain resumes from a dist checkpoint, and state keys that must be among those compared."""

def _muon_chains() -> list[list]:
    """(option, the chain that saves a dist checkpoint, the chains that load it, the chains that train
    from scratch) at DP=2: the layer-wise chains train as the unsharded one (sr), and the all-reduced
    one saves a checkpoint that the unsharded chain loads (C), each a step as the other chain takes
    it; the unsharded chain resumes its own (sr). They load the unsharded chain's at TP=2 x DP=2
    (:func:`_muon_tp2_dp2_chains`)."""
    return [["sr", "unsharded", ["unsharded"], _layer_wise_chains()], ["C", "layer_wise", ["unsharded"], []]]


def _layer_wise_chains() -> list[str]:
    """The layer-wise chains: DDP all-reducing, and megatron's shard-aligned layout where
    megatron-core has it (0.19+)."""
    from megatron.core.optimizer import layer_wise_optimizer

    layout = ["layer_wise_layout"] if hasattr(layer_wise_optimizer.LayerWiseDistributedOptimizer, "compute_full_param_layout") else []
    return ["layer_wise", *layout]


def _muon_tp2_dp2_chains() -> list[list]:
    """The Muon chains at TP=2 x DP=2: the unsharded chain saves a dist checkpoint (option sr), which
    each layer-wise chain loads."""
    return [["sr", "unsharded", _layer_wise_chains(), []]]


MUON_MASTER_TOLERANCE = 2**-6
"""Per step, in units of lr·s(m, n): how far option D's Muon masters may be from torch.optim.Muon's
(the bound of tests/optim/test_muon.py)."""


def test_muon_updates_hidden_weights_as_torch_muon_and_the_rest_with_adamw(tmp_path):
    """optimizer="muon", option D: Muon holds exactly the 2-D weights of the transformer layers, AdamW
    the embedding, output layer, norms and biases; each Muon master is torch.optim.Muon's within
    lr·s·2^-6 per step (tests/optim/test_muon.py: torch's lerps and ``add_(alpha=)`` round once, ours
    multiply and add apart);
    a step after reloading the chained state dict repeats the uninterrupted step exactly. Options sr
    and C (MCF's δθ) save the model and the chain as a megatron dist checkpoint
    (``sharded_state_dict``) after 2 steps, and a fresh chain that loads it takes the third step bit
    for bit as the uninterrupted run. At TP=2 (option sr), ``muon_tp_mode="duplicated"`` updates each
    shard as our Muon updates the whole matrix at TP=1, bit for bit given the same gradients (QKV
    split, ``muon_split_qkv=True``, into megatron's query, key and value rows per group); trained
    on the same data, both TP=2 modes keep TP=1's losses within 2e-3 over 3 steps (the first
    step's, on the same weights, within 5e-4: TP=2's BF16 matmuls sum in another order; measured
    at most 4e-4 duplicated, 1.2e-3 blockwise, which orthogonalizes each shard on its own).

    megatron's layer-wise distributed optimizer (``use_layer_wise_distributed_optimizer``, or
    ``optimizer="dist_muon"`` before megatron-core 0.19) at DP=2 trains 3 steps as the unsharded chain,
    every parameter and each rank's state bit for bit (option sr; from megatron-core 0.19 also in
    megatron's shard-aligned layout, DDP reduce-scattering, its Muon fused in DDP's buffer, each of
    its buckets laid out in place there), with
    each rank holding part of the state and both ranks together all of it (sr and C); the unsharded
    chain resumes from the layer-wise chain's dist checkpoint (C) and from its own (sr), bit for bit;
    and its state dict in a file per rank (Megatron-LM's torch checkpoints) restores every state
    tensor. (Loading the unsharded chain's checkpoint: at TP=2 x DP=2, in
    :func:`test_layer_wise_muon_at_tensor_and_data_parallel_two_is_the_unsharded_chain`.)

    Where megatron-core's own Muon imports (the newest-megatron CI job), ``get_megatron_optimizer``
    with ``optimizer="muon"`` (megatron's ``TensorParallelMuon``) and ``build_optimizer`` with option
    D on the same megatron config (its default quintic coefficients, spectral scale and QKV split)
    give Muon the same parameters, and fed the same gradients for 2 steps, each from our master,
    keep the same momentum (within 2 FP32 ulps of the largest gradient per step) and each master's
    update within :data:`MEGATRON_CORE_MUON_TOLERANCE` of megatron's."""
    ranks = _run(tmp_path, "muon_is_torch_muon_on_hidden_weights", steps=2, checkpoint_dir=str(tmp_path / "checkpoint"),
                 chains=(chains := _muon_chains()), tensor_parallel_option="sr")
    for rank in ranks:
        assert rank["type"] == "LowPrecisionMuonOptimizer"
        assert rank["muon"] and all(".layers." in name and name.endswith("weight") for name in rank["muon"])
        assert not any("norm" in name or "embedding" in name or "output_layer" in name for name in rank["muon"])
        assert any("embedding" in name for name in rank["adamw"]) and any(name.endswith("bias") for name in rank["adamw"])
        assert all(0 <= error <= step * MUON_MASTER_TOLERANCE for step, error in enumerate(rank["master_errors"], 1))
        assert rank["resumed"] and rank["compared"] > len(rank["muon"]) + len(rank["adamw"])
        tensor_parallel = rank["tensor_parallel"]
        assert tensor_parallel["duplicated_is_tp1"] == [True, True]
        assert tensor_parallel["sharded"] == tensor_parallel["muon_params"] > 0
        assert tensor_parallel["split"] == [[f"decoder.layers.{layer}.self_attention.linear_qkv.weight", [8, 8, 8]]
                                            for layer in range(2)]
        tp1 = tensor_parallel["losses"]["tp1"]
        for mode in ("blockwise", "duplicated"):
            losses = tensor_parallel["losses"][f"tp2-{mode}"]
            assert len(losses) == len(tp1) == 6 and all(abs(a - b) < 5e-4 for a, b in zip(losses[:2], tp1[:2])), mode
            assert max(abs(a - b) for a, b in zip(losses, tp1)) < 2e-3, (mode, losses, tp1)
        megatron_core = rank["megatron_core_muon"]
        assert (megatron_core is None) == (not _megatron_core_muon_imports())
        if megatron_core is not None:
            assert megatron_core["muon"] and megatron_core["momentum_error"] <= 2 * 2**-22, megatron_core
            assert megatron_core["update_error"] <= MEGATRON_CORE_MUON_TOLERANCE, megatron_core
        for option, saved_by, loaded_by, trained_by in chains:
            ran = rank["chains"][option]
            assert set(MUON_CHECKPOINT_STATES[option]) <= set(ran["keys"]), (option, ran["keys"])
            for run in [f"loaded by {chain}" for chain in loaded_by] + [f"trained by {chain}" for chain in trained_by]:
                assert ran[run]["unequal"] == [] and ran[run]["uncompared"] == [], (option, run, ran[run])
                assert ran[run]["compared"] > len(rank["muon"]) + len(rank["adamw"]), (option, run)
            assert ran.get("reloaded from its file", "layer_wise" not in trained_by) is True, option
            if "layer_wise_layout" in trained_by:
                layouts = ran["trained by layer_wise_layout"]["muon_buckets"]
                assert layouts and set(layouts) == {"in place"}, layouts
    for option, *_ in chains:
        state_bytes = [rank["chains"][option]["state_bytes"] for rank in ranks]
        unsharded = state_bytes[0]["unsharded"]
        assert all(held["unsharded"] == unsharded and held["layer_wise"] < 0.75 * unsharded for held in state_bytes), state_bytes
        assert sum(held["layer_wise"] for held in state_bytes) == unsharded, state_bytes
        assert all(held.get("layer_wise_layout", 0) < 0.75 * unsharded for held in state_bytes), state_bytes


def test_layer_wise_muon_at_tensor_and_data_parallel_two_is_the_unsharded_chain(tensor_and_data_parallel_two):
    """At TP=2 x DP=2 (4 ranks, blockwise), option sr, uncompiled: each layer-wise chain (DDP
    all-reducing, and megatron's shard-aligned layout where megatron-core has it) loads the unsharded
    chain's dist checkpoint and takes its next step as it does, every parameter and held state bit
    for bit; each rank holds part of its tensor-parallel rank's state (its two data-parallel ranks
    together all of it, all-reduced)."""
    ranks = tensor_and_data_parallel_two
    for option, _, loaded_by, _ in _muon_tp2_dp2_chains():
        for rank in ranks:
            assert rank["data_parallel_size"] == 2
            ran = rank["chains"][option]
            assert set(MUON_CHECKPOINT_STATES[option]) <= set(ran["keys"]), (option, ran["keys"])
            for chain in loaded_by:
                run = ran[f"loaded by {chain}"]
                assert run["unequal"] == [] and run["uncompared"] == [] and run["compared"] > 0, (option, chain, run)
        for tensor_rank in (0, 1):
            state_bytes = [rank["chains"][option]["state_bytes"] for rank in ranks if rank["tensor_rank"] == tensor_rank]
            unsharded = state_bytes[0]["unsharded"]
            assert all(held["unsharded"] == unsharded for held in state_bytes), state_bytes
            assert all(held[chain] < 0.75 * unsharded for held in state_bytes for chain in loaded_by), state_bytes
            assert sum(held["layer_wise"] for held in state_bytes) == unsharded, state_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_wise_owners_deal_parameters_as_megatrons_layer_wise_optimizer(monkeypatch, world_size):
    """Without a shard-aligned layout, megatron-core's ``LayerWiseDistributedOptimizer`` deals the
    parameters of all its optimizers' groups to the data-parallel ranks (its ping-pong assignment,
    run here on stand-in groups, which it narrows to rank 0's); :func:`layer_wise_owners` gives each
    parameter the same rank."""
    from types import SimpleNamespace

    import torch
    from megatron.core.optimizer import layer_wise_optimizer

    from megatron_lowprec.megatron.optimizer import layer_wise_owners

    sizes = [[64, 8, 8, 512], [96, 8], [512, 1, 64, 32, 32]]
    groups = [{"params": [torch.nn.Parameter(torch.zeros(size)) for size in group]} for group in sizes]
    every_param = [param for group in groups for param in group["params"]]
    optimizers = [SimpleNamespace(param_groups=groups[:2]), SimpleNamespace(param_groups=groups[2:])]
    monkeypatch.setattr(layer_wise_optimizer, "get_pg_size", lambda group=None: world_size)
    monkeypatch.setattr(layer_wise_optimizer, "get_pg_rank", lambda group=None: 0)
    stock = SimpleNamespace(dp_cp="dp_cp", expt_dp="expt_dp", pg_collection=SimpleNamespace(dp_cp="dp_cp", expt_dp="expt_dp"))
    deal = getattr(layer_wise_optimizer.LayerWiseDistributedOptimizer, "_shard_params_ping_pong", None)
    if deal is None:
        layer_wise_optimizer.LayerWiseDistributedOptimizer.shard_params(stock, optimizers)
    else:
        deal(stock, optimizers, world_size, world_size)
    position = {id(param): index for index, param in enumerate(every_param)}
    stock_owners = {position[id(param)]: rank for rank, params in enumerate(stock.dp_cp_params_list) for param in params}
    ours = layer_wise_owners(every_param, world_size)
    assert ours == [stock_owners[index] for index in range(len(every_param))]
    assert len(set(ours)) == world_size


def test_what_cannot_be_honoured_stops_with_one_clear_error(tmp_path):
    messages = _run(tmp_path, "refusals")[0]
    assert "config.optimizer='sgd'" in messages["sgd"] and "optimizer='adam' or 'muon'" in messages["sgd"]
    assert "config.fp16=True" in messages["fp16"] and "BF16" in messages["fp16"]
    assert "config.optimizer_cpu_offload=True" in messages["cpu_offload"]
    assert "without a precision option" in messages["no_option"] and "LowPrecisionOptimizerConfig" in messages["no_option"]
    assert "unknown precision option 'Z'" in messages["unknown_option"] and "coat" in messages["unknown_option"]
    assert "pg_collection's tp" in messages["foreign_groups"]
    from megatron.core.optimizer import OptimizerConfig

    fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
    if "muon_coefficient_type" in fields:
        assert "config.muon_coefficient_type='polar_express'" in messages["muon_coefficient_type"]
        assert "choose 'quintic' or 'simple'" in messages["muon_coefficient_type"]
    if "muon_scalar_optimizer" in fields:
        assert "set muon_scalar_optimizer='adam'" in messages["muon_scalar_optimizer"]
    assert "config.use_distributed_optimizer=True" in messages["muon_distributed"] and "muon" in messages["muon_distributed"]
    assert "lowprec_track_update_quality=True" in messages["muon_update_quality"]
    assert "config.muon_tp_mode='sharded'" in messages["muon_tp_mode"] and "'blockwise' or 'duplicated'" in messages["muon_tp_mode"]
    assert "expert-parallel" in messages["expert_parallel"]
    if "use_layer_wise_distributed_optimizer" in fields:
        assert "optimizer='adam' use use_distributed_optimizer=True" in messages["layer_wise_adam"]
    scattered = messages["layer_wise_scattered_gradients"]
    assert "needs megatron's layer-wise layout" in scattered and "use_distributed_optimizer=False" in scattered


def test_config_names_a_valid_option_and_keeps_megatrons_fields():
    from megatron.core.optimizer import OptimizerConfig

    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    megatron = OptimizerConfig(lr=2e-4, weight_decay=0.05, bf16=True, clip_grad=0.5, use_distributed_optimizer=True)
    config = LowPrecisionOptimizerConfig.from_optimizer_config(megatron, lowprec_option="sr", lowprec_seed=9)
    assert isinstance(config, OptimizerConfig)
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(OptimizerConfig)} == {
        f.name: getattr(megatron, f.name) for f in dataclasses.fields(OptimizerConfig)
    }
    assert (config.lowprec_option, config.lowprec_seed, config.lowprec_shared_randomness) == ("sr", 9, True)
    with pytest.raises(ValueError, match="unknown precision option 'E5M3'; valid options: A"):
        LowPrecisionOptimizerConfig(lowprec_option="E5M3")
    with pytest.raises(ValueError, match="needs lowprec_option, one of A"):
        LowPrecisionOptimizerConfig(lr=1e-3)


def test_both_optimizers_share_one_gradient_norm_clipping_and_update_quality():
    """The unsharded and the distributed optimizer take the gradient norm, clipping and update quality
    from one implementation (the existing multi-rank tests check that they find the same bits)."""
    from megatron_lowprec.megatron.distributed import DistributedLowPrecisionOptimizer, ExactGradientStatistics
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizer

    for name in ("get_grad_norm", "clip_grad_norm", "update_quality"):
        shared = getattr(ExactGradientStatistics, name)
        assert getattr(LowPrecisionOptimizer, name) is shared and getattr(DistributedLowPrecisionOptimizer, name) is shared
