"""One rank of the checks of ``lowprec-convert`` on checkpoints of megatron-core's own
``DistributedOptimizer``, at DP=2 on gloo (through the CPU bridge).

``round_trip`` builds the tiny GPT of :mod:`tests.megatron.test_convert_optimizer` with megatron-core's
optimizer as megatron-core builds it with ``use_distributed_optimizer`` (each rank owns half of every
state), takes two steps and writes, per rank, the state of the parameter elements it owns as the
optimizer holds them (``rank<N>.pt``: per parameter name, the owned range of the flattened parameter
and the FP32 master, ``exp_avg`` and ``exp_avg_sq`` over it; every BF16 parameter; each parameter's
checkpoint key), an
independent record of what a checkpoint must hold. It then saves the run as Megatron-LM does, in
the ``fully_reshardable`` form (``--dist-ckpt-optim-fully-reshardable``) and in the default
``dp_reshardable`` one, both with Megatron-LM's content metadata. Rank 0 converts the first to
option D and that to ``stock`` with ``use_distributed_optimizer=True``; every rank then resumes the
result in a new megatron-core distributed optimizer, as Megatron-LM's ``load_checkpoint`` does (the
checkpoint's content metadata choosing the form), and reports whether its owned states and step are
the saved ones bit for bit, and whether one more step from the same gradients gives both
optimizers the same parameters.

Launched as ``python _stock_distributed_worker.py RESULT_DIR SCENARIO JSON`` once per rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron.launch import run_scenario

MODEL = ["model.hidden_size=128", "model.num_layers=1", "model.seq_length=16", "model.vocab_size=128"]
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": False,
                     "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                  "chained_optim_avoid_prefix": True}


def _distributed_model():
    """The tiny GPT in DDP with ``use_distributed_optimizer``, and megatron's optimizer config of the app's baseline."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import megatron_optimizer_config
    from megatron_lowprec.train.model import gpt_model

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = compose(["baseline=megatron", *MODEL, "optimizer.use_distributed_optimizer=true"])
    torch.manual_seed(5)
    module = gpt_model(config, config.model.vocab_size)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(config=module.config, module=module, ddp_config=ddp_config)
    assert parallel_state.get_data_parallel_world_size() == 2
    return model, megatron_optimizer_config(config.optimizer)


def _stock_distributed():
    from megatron.core.optimizer import get_megatron_optimizer

    model, config = _distributed_model()
    return model, get_megatron_optimizer(config, [model])


def _into_distributed_b(root: Path) -> dict:
    """The ``fully_reshardable`` checkpoint loaded, as Megatron-LM's entry reads it with
    ``--lowprec-convert-checkpoint``, into option B's distributed optimizer: the states of each run
    this rank owns and of every whole parameter that are not the saved FP32 masters and moments (both
    ranks' ``rank<N>.pt``) rounded as B keeps them, the lines (rank 0), the step and the next step's success."""
    from _distributed_optimizer_worker import _conversion_lines, _converted_as_rounded
    from megatron.core import dist_checkpointing

    from megatron_lowprec.megatron.megatron_lm import optimizer_template_for
    from megatron_lowprec.megatron.optimizer import build_optimizer

    model, config = _distributed_model()
    names = {param: name for name, param in model.module.named_parameters()}
    source = {name: {key: torch.full((param.numel(),), float("nan"), device=torch.cuda.current_device()) for key in ("master", "exp_avg", "exp_avg_sq")}
              for param, name in names.items()}
    for rank in range(torch.distributed.get_world_size()):
        for name, owned in torch.load(root / f"rank{rank}.pt", weights_only=True)["owned"].items():
            start, end = owned["range"]
            for key, saved_key in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                source[name][key][start:end] = owned[saved_key].cuda()
    optimizer = build_optimizer("B", [model], config, convert_checkpoint=True)
    directory = str(root / "fully_reshardable")

    def load():
        model_state = model.module.sharded_state_dict()
        template = optimizer_template_for(optimizer, optimizer.sharded_state_dict(model_state, is_loading=True), directory)
        loaded = dist_checkpointing.load({"model": model_state, "optimizer": template}, directory)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    lines, _ = _conversion_lines(load)
    wrong = {
        f"{names[piece.param]} {piece.param_start}": _converted_as_rounded(
            piece.param.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel], optimizer.piece_state(piece),
            {key: value[piece.param_start : piece.param_start + piece.numel] for key, value in source[names[piece.param]].items()},
        )
        for shard in optimizer.shards for piece in shard.pieces
    }
    wrong.update({name: ["whole value"] for param, name in names.items()
                  if not torch.equal(param.detach().reshape(-1), source[name]["master"].bfloat16())})
    step = optimizer.common_step()
    _step(model, optimizer, 2)
    return {"wrong": {key: value for key, value in wrong.items() if value}, "runs": len(wrong), "lines": lines,
            "elements": sum(param.numel() for param in names), "step": step}


def _step(model, optimizer, seed: int) -> None:
    """One step from gradients drawn from ``seed``, the same on every rank (as after their reduction)."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 1e-2)
    optimizer.step()


def _owned(model, optimizer) -> dict:
    """Per parameter name, (start, end) of the elements this rank owns in the flattened parameter and
    their FP32 master, ``exp_avg`` and ``exp_avg_sq``, as the optimizer holds them; and the step."""
    (inner,) = optimizer.chained_optimizers
    names = {param: name for name, param in model.module.named_parameters()}
    owned = {}
    for gbuf_range_maps in inner.gbuf_ranges:
        for range_maps in gbuf_range_maps.values():
            for range_map in range_maps:
                for param, ranges in range_map["param_map"].items():
                    tensors = inner._get_main_param_and_optimizer_states(param)
                    owned[names[param]] = {
                        "range": (ranges["param"].start, ranges["param"].end),
                        **{key: tensors[key].detach().clone() for key in ("param", "exp_avg", "exp_avg_sq")},
                    }
    steps = {float(state["step"]) for state in inner.optimizer.state.values()}
    return {"owned": owned, "steps": sorted(steps)}


def _save(model, optimizer, directory: Path, metadata: dict) -> None:
    from megatron.core import dist_checkpointing

    directory.mkdir(exist_ok=True)
    model_state = model.module.sharded_state_dict()
    optimizer_state = optimizer.sharded_state_dict(model_state, metadata=metadata)
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer_state}, str(directory), content_metadata=metadata)


def _load(model, optimizer, directory: Path) -> None:
    """Megatron-LM's ``load_checkpoint``: the checkpoint's content metadata picks the optimizer's form.

    megatron-core (0.16 to 0.19) copies each loaded state into every tensor of the inner optimizer's
    state, torch AdamW's ``step`` too, which the ``fully_reshardable`` form does not hold (its step is in
    the parameter groups): with torch's AdamW, as without Transformer Engine or Apex (whose fused Adam
    keeps no per-parameter step), its own checkpoint fails with ``KeyError: 'step'``. The load here
    gives that copy the step that ``load_state_dict`` has just restored from the parameter groups."""
    from megatron.core import dist_checkpointing

    (inner,) = optimizer.chained_optimizers
    set_states = inner._set_main_param_and_optimizer_states

    def with_the_restored_step(model_param, tensors):
        group_index, group_order = inner.model_param_group_index_map[model_param]
        state = inner.optimizer.state[inner.optimizer.param_groups[group_index]["params"][group_order]]
        set_states(model_param, {**tensors, "step": state["step"]} if "step" in state else tensors)

    inner._set_main_param_and_optimizer_states = with_the_restored_step

    metadata = dist_checkpointing.load_content_metadata(str(directory)) or {}
    model_state = model.module.sharded_state_dict()
    template = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(template, str(directory))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def round_trip(directory: str) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron_lowprec.train.convert import convert_checkpoint

    rank = torch.distributed.get_rank()
    root = Path(directory)
    model, optimizer = _stock_distributed()
    _step(model, optimizer, 0)
    _step(model, optimizer, 1)
    saved = _owned(model, optimizer)
    params = {name: param.detach().clone() for name, param in model.module.named_parameters()}
    names = {param: name for name, param in model.module.named_parameters()}
    keys = {names[sharded.data]: sharded.key for sharded in nested_values(model.module.sharded_state_dict())
            if isinstance(getattr(sharded, "data", None), torch.nn.Parameter)}
    torch.save({**saved, "params": params, "keys": keys}, root / f"rank{rank}.pt")
    _save(model, optimizer, root / "fully_reshardable", FULLY_RESHARDABLE)
    _save(model, optimizer, root / "dp_reshardable", DP_RESHARDABLE)
    lines = []
    if rank == 0:
        with torch._C.DisableTorchFunction():  # lowprec-convert is a CPU program of its own, outside the bridge
            lines += convert_checkpoint(root / "fully_reshardable", root / "d", "D")
            lines += convert_checkpoint(root / "d", root / "back", "stock", use_distributed_optimizer=True)
    torch.distributed.barrier()

    resumed = {}
    for name in ("fully_reshardable", "back"):
        resumed_model, resumed_optimizer = _stock_distributed()
        _step(resumed_model, resumed_optimizer, 7)  # torch's AdamW has a step to load over only once it stepped
        _load(resumed_model, resumed_optimizer, root / name)
        resumed[name] = (resumed_model, resumed_optimizer, _owned(resumed_model, resumed_optimizer))
    model, optimizer, loaded = resumed["back"]
    states_identical = sorted(loaded["owned"]) == sorted(saved["owned"]) and all(
        loaded["owned"][name]["range"] == owned["range"]
        and all(torch.equal(loaded["owned"][name][key], owned[key]) for key in ("param", "exp_avg", "exp_avg_sq"))
        for name, owned in saved["owned"].items()
    )
    params_identical = all(torch.equal(param, params[name]) for name, param in model.module.named_parameters())
    for resumed_model, resumed_optimizer, _ in resumed.values():
        _step(resumed_model, resumed_optimizer, 2)
    continued_identical = all(
        torch.equal(a, b) for a, b in zip(
            resumed["fully_reshardable"][0].module.parameters(), resumed["back"][0].module.parameters(), strict=True)
    )
    return {
        "into_distributed_b": _into_distributed_b(root),
        "lines": lines, "states_identical": states_identical, "params_identical": params_identical,
        "steps": saved["steps"], "loaded_steps": loaded["steps"], "continued_identical": continued_identical,
    }


if __name__ == "__main__":
    run_scenario({"round_trip": round_trip})
