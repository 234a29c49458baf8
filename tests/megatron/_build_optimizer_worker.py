"""One rank of the ``build_optimizer`` call checks: the tiny GPT of the optimizer-hook checks at DP=2,
its optimizer built as Megatron-LM, megatron-core and Megatron-Bridge call ``get_megatron_optimizer``.

Launched by ``test_build_optimizer.py`` as ``python _build_optimizer_worker.py RESULT_DIR SCENARIO JSON``
once per rank; writes ``RESULT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from _cpu_bridge_worker import _seeded_model, _train_step, _transformer_config
from _optimizer_hook_worker import _ddp, _optimizer_config, _scheduler

from tests.megatron.launch import run_scenario

GROUP_FIELDS = ("wd_mult", "lr_mult", "max_lr", "min_lr", "is_decoupled_lr", "default_config", "is_expert_parallel")


def _model():
    """The seeded GPT in DDP at the tensor-parallel size of the initialized model parallelism."""
    from megatron.core import parallel_state

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    config = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    return _ddp(config, grad_reduce_in_fp32=True)


def _precision_config(**fields):
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    return LowPrecisionOptimizerConfig.from_optimizer_config(_optimizer_config(), lowprec_option="C", **fields)


def _groups_by_name(model, param_groups) -> dict[str, dict]:
    """Each parameter's group settings (the megatron fields of its group), by parameter name."""
    names = {param: name for name, param in model.named_parameters()}
    return {
        names[param]: {field: group.get(field) for field in GROUP_FIELDS}
        for group in param_groups
        for param in group["params"]
    }


def _stock_groups(model, config_overrides=None, **settings) -> dict[str, dict]:
    """The groups of megatron's own optimizer for the same call, by model parameter name (its torch
    optimizer holds FP32 copies, group by group in the order of ``float16_groups``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = dataclasses.replace(_optimizer_config(), **settings)
    optimizer = get_megatron_optimizer(config, [model], config_overrides=config_overrides)
    names = {param: name for name, param in model.named_parameters()}
    groups = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_params, group in zip(inner.float16_groups, inner.optimizer.param_groups):
            groups.update({names[param]: {field: group.get(field) for field in GROUP_FIELDS} for param in model_params})
    return groups


def _custom_overrides() -> dict:
    """The standard overrides plus another learning rate and weight-decay multiplier for fc1's weight."""
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(_optimizer_config())
    overrides[ParamKey(name="*linear_fc1.weight")] = {"wd_mult": 0.5, "max_lr": 1.0e-2}
    return overrides


def calls_of_each_caller(dump_path: str) -> dict:
    """``build_optimizer`` called as Megatron-LM's ``setup_model_and_optimizer`` (0.16 to 0.19),
    megatron-core's default, positionally, and as Megatron-Bridge's ``setup_optimizer``: the
    parameter groups, compared with stock megatron's ``get_megatron_optimizer`` on the same call."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel()
    model = _model()
    config = _precision_config()
    standard = get_standard_config_overrides(config)
    calls = {
        "megatron_lm": lambda: build_optimizer(
            config, [model], config_overrides=standard, use_gloo_process_groups=True,
            dump_param_to_param_group_map=dump_path,
        ),
        "megatron_core_default": lambda: build_optimizer(config, [model]),
        "positional": lambda: build_optimizer(config, [model], _custom_overrides(), False, None, None),
        "bridge": lambda: config.provide(
            model_chunks=model, config_overrides=standard, use_gloo_process_groups=False,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        ),
        "plugin_form": lambda: build_optimizer("C", [model], _optimizer_config()),
    }
    expected = {
        "megatron_lm": _stock_groups(model, standard),
        "megatron_core_default": _stock_groups(model),
        "positional": _stock_groups(model, _custom_overrides()),
    }
    expected["bridge"] = expected["plugin_form"] = expected["megatron_lm"]
    result = {}
    for name, call in calls.items():
        optimizer = call()
        groups = _groups_by_name(model, optimizer.param_groups)
        scheduler = _scheduler(optimizer, 4)
        scheduler.step(3)
        result[name] = {
            "type": type(optimizer).__name__,
            "option": optimizer.optimizer.strategy.name,
            "same_groups_as_stock": groups == expected[name],
            "no_weight_decay": sorted(n for n, g in groups.items() if g["wd_mult"] == 0.0),
            "effective": {
                n: [group["lr"], group["weight_decay"]]
                for group in optimizer.param_groups
                for n, p in model.named_parameters()
                if any(p is q for q in group["params"])
            },
        }
    result["dumped"] = os.path.exists(dump_path) and bool(os.listdir(dump_path))
    result["parameters"] = {name: list(param.shape) for name, param in model.named_parameters()}
    return result


def _provide_trains_as_build_optimizer(steps: int) -> dict:
    """Megatron-Bridge's call (``provide``) and the plugin's ``build_optimizer("C", ...)`` from the
    same weights on the same data, with the distributed optimizer, at the initialized model
    parallelism, uncompiled (the subject is the call, not the compiled step): their losses."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lowprec.megatron.optimizer import build_optimizer

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    transformer = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    losses = {}
    for caller in ("provide", "build_optimizer"):
        model = DistributedDataParallel(
            config=transformer,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            module=_seeded_model(transformer),
        )
        distributed = dataclasses.replace(_optimizer_config(), use_distributed_optimizer=True)
        if caller == "provide":
            config = _precision_config(use_distributed_optimizer=True, lowprec_seed=4, lowprec_fused=False)
            optimizer = config.provide(model_chunks=[model], config_overrides=None, use_gloo_process_groups=True,
                                       pg_collection=None)
        else:
            optimizer = build_optimizer("C", [model], distributed, seed=4, fused=False)
        scheduler = _scheduler(optimizer, steps)
        losses[caller] = []
        for step in range(steps):
            scheduler.step(1)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses[caller].extend(_train_step(model, data_seed=100 * step + parallel_state.get_data_parallel_rank()))
            model.finish_grad_sync()
            assert optimizer.step()[0]
    return {"losses": losses, "type": type(optimizer).__name__}


def refusals() -> dict:
    """The message of each call that ``build_optimizer`` cannot honour."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel()
    model = _model()

    def message(call) -> str:
        try:
            call()
        except (ValueError, TypeError) as error:
            return str(error)
        return "accepted"

    plain = _optimizer_config()
    messages = {
        "sgd": message(lambda: build_optimizer(_precision_config(optimizer="sgd"), [model])),
        "fp16": message(lambda: build_optimizer(_precision_config(fp16=True, bf16=False), [model])),
        "cpu_offload": message(lambda: build_optimizer(_precision_config(optimizer_cpu_offload=True), [model])),
        "no_option": message(lambda: build_optimizer(plain, [model])),
        "unknown_option": message(lambda: build_optimizer("Z", [model], plain)),
        "muon_update_quality": message(lambda: build_optimizer(
            _precision_config(optimizer="muon", muon_split_qkv=False, lowprec_track_update_quality=True), [model])),
        "muon_tp_mode": message(lambda: build_optimizer(
            _precision_config(optimizer="muon", muon_split_qkv=False, muon_tp_mode="sharded"), [model])),
        "muon_distributed": message(lambda: build_optimizer(
            _precision_config(optimizer="muon", muon_split_qkv=False, use_distributed_optimizer=True), [model])),
        "foreign_groups": message(lambda: build_optimizer(
            _precision_config(), [model], pg_collection=SimpleNamespace(tp=torch.distributed.new_group([0, 1])))),
    }
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    for name, value in (("muon_coefficient_type", "polar_express"), ("muon_scalar_optimizer", "lion")):
        if name in {field.name for field in dataclasses.fields(OptimizerConfig)}:
            messages[name] = message(lambda: build_optimizer(
                _precision_config(optimizer="muon", muon_split_qkv=False, **{name: value}), [model]))
    if "use_layer_wise_distributed_optimizer" in {field.name for field in dataclasses.fields(OptimizerConfig)}:
        messages["layer_wise_adam"] = message(lambda: build_optimizer(_precision_config(use_layer_wise_distributed_optimizer=True), [model]))
    transformer = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
    scattering = DistributedDataParallel(
        config=transformer, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True), module=_seeded_model(transformer)
    )
    messages["layer_wise_scattered_gradients"] = message(lambda: build_optimizer(
        _precision_config(**{"optimizer": "muon", "muon_split_qkv": False, **_layer_wise_fields()}), [scattering]))
    first = next(model.parameters())
    first.allreduce = False
    messages["expert_parallel"] = message(lambda: build_optimizer(_precision_config(), [model]))
    return messages


def muon_is_torch_muon_on_hidden_weights(
    steps: int, checkpoint_dir: str, chains: list[list], tensor_parallel_option: str
) -> dict:
    """``optimizer="muon"`` with option D at DP=2: which parameters each chained optimizer holds, and
    after every step how far each hidden weight's FP32 master is from ``torch.optim.Muon``'s on the
    same reduced gradients (no clipping, no decay schedule), at most over the weights, in units of
    lr·s(m, n) (``"original"``: megatron's ``shape_scaling``); then
    the checkpoints and layer-wise sharding of ``chains`` (:func:`_muon_chains_agree`) and TP=2."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron import compat
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig, build_optimizer

    parallel_state.initialize_model_parallel()
    model = _model()
    config = LowPrecisionOptimizerConfig.from_optimizer_config(
        _optimizer_config(), optimizer="muon", lowprec_option="D", clip_grad=0.0, muon_split_qkv=False,
        muon_scale_mode="shape_scaling", muon_coefficient_type="simple", **{compat.muon_nesterov_field(): True},
    )
    optimizer = build_optimizer(config, [model])
    muon, adamw = (inner.optimizer for inner in optimizer.chained_optimizers)
    names = {param: name for name, param in model.named_parameters()}
    masters = {param: muon.state[param]["master"].clone() for group in muon.param_groups for param in group["params"]}
    references = {param: torch.nn.Parameter(master.clone()) for param, master in masters.items()}
    torch_muon = torch.optim.Muon(
        list(references.values()), lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
        nesterov=True, adjust_lr_fn="original",
    )
    errors = []
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _train_step(model, data_seed=100 * step + parallel_state.get_data_parallel_rank())
        model.finish_grad_sync()
        for param, reference in references.items():
            reference.grad = param.main_grad.clone()
        assert optimizer.step()[0]
        torch_muon.step()
        errors.append(max(
            (muon.state[param]["master"] - reference.detach()).abs().max().item()
            / (config.lr * math.sqrt(max(1, param.shape[0] / param.shape[1])))
            for param, reference in references.items()
        ))
    return {
        **_muon_resumes_from_its_state_dict(model, optimizer, data_seed=100 * steps + parallel_state.get_data_parallel_rank()),
        "chains": {
            option: _muon_chains_agree(option, steps, f"{checkpoint_dir}/{option}", saved_by, loaded_by, trained_by)
            for option, saved_by, loaded_by, trained_by in chains
        },
        "tensor_parallel": _muon_at_tensor_parallel_two(tensor_parallel_option, steps + 1),
        "megatron_core_muon": _megatron_core_muon_beside_ours(steps),
        "type": type(optimizer).__name__,
        "muon": sorted(names[p] for group in muon.param_groups for p in group["params"]),
        "adamw": sorted(names[p] for group in adamw.param_groups for p in group["params"]),
        "master_errors": errors,
    }


def _megatron_core_muon_beside_ours(steps: int) -> dict | None:
    """Where megatron-core's own Muon imports (with emerging-optimizers: the newest-megatron CI job),
    ``get_megatron_optimizer`` and ``build_optimizer`` with option D on one megatron Muon config (its
    defaults: quintic coefficients, spectral scale, split QKV; Nesterov, extra scale 0.2), each on its
    copy of the model, fed the same reduced gradients for ``steps`` steps, each step from our FP32
    master: the parameters each gives Muon, the momentum's largest difference over the largest
    gradient, and the largest relative (Frobenius) difference of a Muon master's update. None where it
    does not import."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_lowprec.megatron import compat
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig, build_optimizer

    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS, TensorParallelMuon
    except ImportError:
        return None
    if not HAVE_EMERGING_OPTIMIZERS:
        return None
    config = dataclasses.replace(
        _optimizer_config(), optimizer="muon", clip_grad=0.0, muon_extra_scale_factor=0.2, **{compat.muon_nesterov_field(): True}
    )
    ours_model, stock_model = _model(), _model()
    ours = build_optimizer(LowPrecisionOptimizerConfig.from_optimizer_config(config, lowprec_option="D"), [ours_model])
    stock = get_megatron_optimizer(config, [stock_model])
    muon = ours.chained_optimizers[0].optimizer
    (stock_muon,) = [inner for inner in stock.chained_optimizers if isinstance(inner.optimizer, TensorParallelMuon)]
    stock_params = dict(stock_model.named_parameters())
    main_params = {
        model_param: main_param
        for model_group, main_group in zip(stock_muon.float16_groups, stock_muon.fp32_from_float16_groups)
        for model_param, main_param in zip(model_group, main_group)
    }
    names = {param: name for name, param in ours_model.named_parameters()}
    ours_muon = {names[param]: param for group in muon.param_groups for param in group["params"]}
    momentum_error = update_error = largest_gradient = 0.0
    for step in range(steps):
        for model, optimizer in ((ours_model, ours), (stock_model, stock)):
            model.zero_grad_buffer()
            optimizer.zero_grad()
        _train_step(ours_model, data_seed=100 * step + parallel_state.get_data_parallel_rank())
        ours_model.finish_grad_sync()
        for name, param in ours_model.named_parameters():
            stock_params[name].main_grad.copy_(param.main_grad)
        before = {name: muon.state[param]["master"].clone() for name, param in ours_muon.items()}
        for name, master in before.items():
            main_params[stock_params[name]].data.copy_(master)
        assert ours.step()[0] and stock.step()[0]
        for name, param in ours_muon.items():
            main = main_params[stock_params[name]]
            largest_gradient = max(largest_gradient, param.main_grad.abs().max().item())
            momentum = (muon.state[param]["momentum"] - stock_muon.optimizer.state[main]["momentum_buffer"]).abs().max().item()
            momentum_error = max(momentum_error, momentum)
            update, expected = muon.state[param]["master"] - before[name], main.detach() - before[name]
            update_error = max(update_error, ((update - expected).norm() / expected.norm()).item())
    stock_names = {param: name for name, param in stock_model.named_parameters()}
    return {
        "muon": sorted(ours_muon) == sorted(stock_names[param] for group in stock_muon.float16_groups for param in group),
        "momentum_error": momentum_error / largest_gradient,
        "update_error": update_error,
    }


def _muon_resumes_from_its_state_dict(model, optimizer, data_seed: int) -> dict:
    """One more step, then the same step again after restoring the model and the chained optimizer's
    state dict: whether every parameter and state tensor of both optimizers came out the same."""
    import copy

    from megatron.core import parallel_state

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _train_step(model, data_seed=data_seed)
        model.finish_grad_sync()
        assert optimizer.step()[0]
        return [param.detach().clone() for param in model.parameters()] + [
            value.clone() for inner in optimizer.chained_optimizers for state in inner.optimizer.state.values()
            for value in state.values() if torch.is_tensor(value)
        ]

    saved_params = [param.detach().clone() for param in model.parameters()]
    saved_state = copy.deepcopy(optimizer.state_dict())
    first = step()
    for param, saved in zip(model.parameters(), saved_params):
        param.data.copy_(saved)
    optimizer.load_state_dict(saved_state)
    second = step()
    assert parallel_state.get_data_parallel_world_size() == 2
    return {"resumed": all(torch.equal(a, b) for a, b in zip(first, second)), "compared": len(first)}


def _muon_chains_agree(
    option: str, steps: int, checkpoint_dir: str, saved_by: str, loaded_by: list[str], trained_by: list[str], fused: bool | None = None
) -> dict:
    """``optimizer="muon"`` with ``option`` in the chain ``saved_by`` (:data:`CHAINS`) at DP=2: ``steps``
    steps, a megatron dist checkpoint of the model and the chained optimizer (``sharded_state_dict``),
    one more step. Then for each chain of ``loaded_by``, a fresh model and chain, moved off by a step
    on other data, load the checkpoint and take that step; and each chain of ``trained_by`` takes all
    the steps on the same data from the same weights (a layer-wise one then saves its state dict in
    a file per rank, as Megatron-LM's torch checkpoints do, which a fresh chain loads: whether every
    state tensor came back the same). Returns the state keys, and per chain the number
    of its tensors compared, those of the parameters and state tensors that did not come out as the
    saving chain's, bit for bit (where one is layer-wise, the state this rank holds in both), the
    tensors that neither rank compared, and the bytes of its optimizers' state tensors on this rank.
    ``fused``: the chains' ``lowprec_fused``."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    data_rank = parallel_state.get_data_parallel_rank()

    def fresh(chain: str):
        fields, build_model = CHAINS[chain]
        model = build_model()
        return model, build_optimizer(_muon_config(option, lowprec_fused=fused, **fields()), [model])

    def step(model, optimizer, index: int) -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _train_step(model, data_seed=100 * index + data_rank)
        model.finish_grad_sync()
        assert optimizer.step()[0]

    def sharded(model, optimizer, is_loading: bool) -> dict:
        model_state = model.module.sharded_state_dict()
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}

    def state_bytes(optimizer) -> int:
        return sum(value.numel() * value.element_size() for value in _state_tensors(optimizer))

    model, optimizer = fresh(saved_by)
    for index in range(steps):
        step(model, optimizer, index)
    os.makedirs(checkpoint_dir, exist_ok=True)
    dist_checkpointing.save(sharded(model, optimizer, is_loading=False), checkpoint_dir)
    step(model, optimizer, steps)
    straight = _named_tensors(model, optimizer)
    result = {"keys": sorted({key.split(" ")[0] for key in straight}), "state_bytes": {saved_by: state_bytes(optimizer)}}

    def compare(run: str, model, optimizer) -> None:
        resumed = _named_tensors(model, optimizer)
        whole = {key: " ".join(key.split(" ")[:2]) for key in resumed}
        compared = [key for key in resumed if whole[key] in straight]
        held = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(held, [sorted({whole[key] for key in compared}), sorted({*straight, *whole.values()})])
        result[run] = {
            "compared": len(compared),
            "uncompared": sorted({key for _, keys in held for key in keys} - {key for keys, _ in held for key in keys}),
            "unequal": sorted(key for key in compared if not _same_tensor(straight, key, resumed[key])),
        }
        result["state_bytes"][run.split(" ")[-1]] = state_bytes(optimizer)
        result[run]["muon_buckets"] = _muon_bucket_layouts(optimizer)

    for chain in loaded_by:
        model, optimizer = fresh(chain)
        step(model, optimizer, steps + 1)
        loaded = dist_checkpointing.load(sharded(model, optimizer, is_loading=True), checkpoint_dir)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        step(model, optimizer, steps)
        compare(f"loaded by {chain}", model, optimizer)
    for chain in trained_by:
        model, optimizer = fresh(chain)
        for index in range(steps + 1):
            step(model, optimizer, index)
        compare(f"trained by {chain}", model, optimizer)
        if chain == "layer_wise":
            path = f"{checkpoint_dir}/layer_wise_optimizer_{torch.distributed.get_rank()}.pt"
            optimizer.save_state_dict_to_file(path)
            reloaded = fresh(chain)[1]
            reloaded.load_state_dict_from_file(path)
            trained, loaded = _state_tensors(optimizer), _state_tensors(reloaded)
            result["reloaded from its file"] = len(trained) == len(loaded) > 0 and all(map(torch.equal, trained, loaded))
    return result


def _state_tensors(optimizer) -> list[torch.Tensor]:
    """Every state tensor of the chain's optimizers, in order (a distributed optimizer's: its shards' buffers)."""
    tensors = []
    for inner in optimizer.chained_optimizers:
        if not hasattr(inner, "shards"):
            tensors += [value for state in inner.optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
        else:
            tensors += [buffer for bucket in inner.state_buckets() for buffer in bucket.state.values()]
    return tensors


def _muon_bucket_layouts(optimizer) -> list[str]:
    """How each bucket of the chain's Muon optimizers holds its weights: laid out ``in place`` in
    DDP's buffer, as ``rows`` of it, or in a buffer of its ``own``."""
    from megatron_lowprec.optim import Muon

    return [
        "in place" if bucket.in_place else "rows" if bucket.param_rows is not None else "own"
        for inner in optimizer.chained_optimizers if isinstance(inner.optimizer, Muon) for bucket in inner.optimizer.buckets
    ]


def _named_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """Copies of the model's parameters and of the state tensors of the chain's optimizers, by
    ``"<kind> <parameter name>"``, flat; a distributed optimizer's state of a run of a parameter's
    elements by ``"<kind> <parameter name> <first>:<end>"``."""
    tensors = {f"param {name}": param.detach().reshape(-1).clone() for name, param in model.named_parameters()}
    names = {param: name for name, param in model.named_parameters()}
    for inner in optimizer.chained_optimizers:
        shards = getattr(inner, "shards", None)
        if shards is None:
            for param, state in inner.optimizer.state.items():
                tensors.update({f"{key} {names[param]}": value.reshape(-1).clone() for key, value in state.items() if torch.is_tensor(value)})
        for shard in shards or ():
            for piece in shard.pieces:
                run = "" if piece.numel == piece.param.numel() else f" {piece.param_start}:{piece.param_start + piece.numel}"
                tensors.update({
                    f"{key} {names[piece.param]}{run}": value.clone() for key, value in inner.piece_state(piece).items()
                })
    return tensors


def _same_tensor(tensors: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> bool:
    """Whether ``tensors`` (:func:`_named_tensors`) holds ``value`` under ``key``, or holds the whole
    parameter's state that ``key`` names a run of."""
    kind, name, *run = key.split(" ")
    if run:
        first, end = map(int, run[0].split(":"))
        return torch.equal(tensors[f"{kind} {name}"][first:end], value)
    return torch.equal(tensors[key], value)


def _muon_config(option: str, **fields):
    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    return LowPrecisionOptimizerConfig.from_optimizer_config(
        _optimizer_config(), **{"optimizer": "muon", "lowprec_option": option, "lowprec_seed": 5, "muon_split_qkv": False, **fields}
    )


def _layer_wise_fields() -> dict:
    """megatron's request for its layer-wise distributed optimizer: the ``OptimizerConfig`` field
    where the installed megatron-core has it (0.19+), else the optimizer name ``"dist_muon"``."""
    from megatron.core.optimizer import OptimizerConfig

    if "use_layer_wise_distributed_optimizer" in {field.name for field in dataclasses.fields(OptimizerConfig)}:
        return {"use_layer_wise_distributed_optimizer": True}
    return {"optimizer": "dist_muon"}


def _layer_wise_layout_model():
    """The seeded GPT in DDP built as Megatron-LM 0.19 builds it for its layer-wise distributed
    optimizer by default: parameters tagged for the layer-wise buffers, megatron's shard-aligned
    layout for them (each hidden weight whole in one rank's shard), gradients reduce-scattered."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer, tag_params_for_buffer_routing

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    transformer = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    module = _seeded_model(transformer)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    tag_params_for_buffer_routing([module])
    layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
        [param for param in module.parameters() if param.requires_grad], ddp_config.bucket_size,
        parallel_state.get_data_parallel_world_size(with_context_parallel=True), ddp_config,
    )
    return DistributedDataParallel(config=transformer, ddp_config=ddp_config, module=module, full_param_layout=layout)


CHAINS = {
    "unsharded": (dict, _model),
    "layer_wise": (_layer_wise_fields, _model),
    "layer_wise_layout": (_layer_wise_fields, _layer_wise_layout_model),
}
"""The Muon chains by name: each one's config fields and model (``layer_wise_layout``: megatron-core 0.19+)."""


def _muon_losses(option: str, tensor_parallel: int, tp_mode: str, steps: int) -> list[float]:
    """The losses of ``steps`` steps of the Muon chain from the seeded model at this tensor-parallel
    size, on data the same on every rank (so DP=2 at TP=1 trains as one rank would)."""
    from megatron_lowprec.megatron.optimizer import build_optimizer

    transformer = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    model = _ddp(transformer, grad_reduce_in_fp32=True)
    optimizer = build_optimizer(_muon_config(option, muon_tp_mode=tp_mode), [model])
    losses = []
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.extend(_train_step(model, data_seed=100 * step))
        model.finish_grad_sync()
        assert optimizer.step()[0]
    return losses


def _muon_at_tensor_parallel_two(option: str, steps: int) -> dict:
    """The Muon chain's losses at TP=1 (DP=2), then at TP=2 in each ``muon_tp_mode``; and at TP=2
    ``"duplicated"`` with QKV split, two steps of the chain's Muon on given whole-matrix gradients,
    shards gathered, against our Muon on the whole matrices (TP=1) with the same option, SR stream,
    megatron's default (quintic) coefficients and split (4 query groups of 8 query, 8 key, 8 value
    rows): whether each parameter and
    momentum is the same bit for bit."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron import compat
    from megatron_lowprec.megatron.optimizer import build_optimizer, canonical_parameter_names
    from megatron_lowprec.numerics.rounding import StreamLayout, stream_id
    from megatron_lowprec.optim import Muon
    from megatron_lowprec.optim.muon import QUINTIC_COEFFICIENT_SETS

    losses = {"tp1": _muon_losses(option, 1, "blockwise", steps)}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for tp_mode in ("blockwise", "duplicated"):
        losses[f"tp2-{tp_mode}"] = _muon_losses(option, 2, tp_mode, steps)

    model = _ddp(_transformer_config(tensor_parallel=2, hidden_dropout=0.0, attention_dropout=0.0), grad_reduce_in_fp32=True)
    config = _muon_config(option, muon_tp_mode="duplicated", muon_split_qkv=True)
    muon = build_optimizer(config, [model]).chained_optimizers[0].optimizer
    params = [param for group in muon.param_groups for param in group["params"]]
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()

    def whole(param, tensor):
        if not getattr(param, "tensor_model_parallel", False):
            return tensor.clone()
        blocks = [torch.empty_like(tensor) for _ in range(2)]
        torch.distributed.all_gather(blocks, tensor.contiguous(), group=group)
        return torch.cat(blocks, dim=param.partition_dim)

    wholes = {param: torch.nn.Parameter(whole(param, param.detach())) for param in params}
    names = canonical_parameter_names([model])
    layouts = {copy: StreamLayout.whole(stream_id(names[param]), copy.numel()) for param, copy in wholes.items()}
    reference = Muon(
        list(wholes.values()), lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
        nesterov=getattr(config, compat.muon_nesterov_field()), scale_mode="spectral", option=option, seed=5,
        ns_coefficients=QUINTIC_COEFFICIENT_SETS, stream_layout=layouts.__getitem__,
        split_rows={copy: (8, 8, 8) for param, copy in wholes.items() if names[param].endswith("linear_qkv.weight")}.get,
    )
    same = []
    for step in range(2):
        for index, (param, copy) in enumerate(wholes.items()):
            generator = torch.Generator().manual_seed(10 * step + index)
            gradient = torch.randn(copy.shape, generator=generator).to(torch.cuda.current_device())
            copy.grad = gradient.to(copy.dtype)
            shard = gradient.chunk(2, dim=param.partition_dim)[rank] if getattr(param, "tensor_model_parallel", False) else gradient
            param.grad = shard.to(param.dtype).contiguous()
        muon.step()
        reference.step()
        same.append(all(
            torch.equal(whole(param, param.detach()), copy.detach())
            and torch.equal(whole(param, muon.state[param]["momentum"]), reference.state[copy]["momentum"])
            for param, copy in wholes.items()
        ))
    sharded = sum(getattr(param, "tensor_model_parallel", False) for param in params)
    split = sorted({names[param]: list(muon.split_rows(param)) for param in params if muon.split_rows(param)}.items())
    return {"losses": losses, "duplicated_is_tp1": same, "sharded": sharded, "muon_params": len(params), "split": split}


def at_tensor_and_data_parallel_two(provide_steps: int, steps: int, checkpoint_dir: str, chains: list[list]) -> dict:
    """At TP=2 x DP=2 (4 ranks): Megatron-Bridge's call against the plugin's
    (:func:`_provide_trains_as_build_optimizer`), and the checkpoints and layer-wise sharding of the
    Muon ``chains`` (:func:`_muon_chains_agree`, ``muon_tp_mode="blockwise"``) uncompiled (the
    compiled steps' bits are the uncompiled ones'), with this rank's place in the grid."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return {
        "provide": _provide_trains_as_build_optimizer(provide_steps),
        "chains": {
            option: _muon_chains_agree(option, steps, f"{checkpoint_dir}/{option}", saved_by, loaded_by, trained_by, fused=False)
            for option, saved_by, loaded_by, trained_by in chains
        },
        "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        calls_of_each_caller, refusals, muon_is_torch_muon_on_hidden_weights, at_tensor_and_data_parallel_two,
    )
}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
