"""One rank of the distributed-optimizer checks: the tiny megatron GPT of the optimizer-hook checks,
trained with and without ``use_distributed_optimizer`` on gloo.

Launched by ``test_distributed_optimizer.py`` as ``python _distributed_optimizer_worker.py RESULT_DIR
SCENARIO JSON`` once per rank; writes ``RESULT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from pathlib import Path

import torch
from _cpu_bridge_worker import _flat, _seeded_model, _train_step, _transformer_config
from _optimizer_hook_worker import _optimizer_config, _scheduler, _train

from tests.megatron.launch import run_scenario


def _ddp(config, distributed: bool, bucket_size: int | None = None, grad_reduce_in_fp32: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=distributed, bucket_size=bucket_size,
        overlap_grad_reduce=bucket_size is not None,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=_seeded_model(config))


def _optimizer(option: str, model, distributed: bool, fused: bool = False, **options):
    """The optimizer of ``option``: a name, or NAME:MASTER_STORAGE (``D:remainder``)."""
    from megatron_lowprec.megatron.optimizer import build_optimizer

    name, _, master_storage = option.partition(":")
    config = dataclasses.replace(_optimizer_config(), use_distributed_optimizer=distributed)
    return build_optimizer(name, [model], config, seed=11, fused=fused, master_storage=master_storage or None, **options)


def _unsharded_state_bytes(optimizer) -> int:
    return sum(buffer.numel() * buffer.element_size() for bucket in optimizer.optimizer.buckets for buffer in bucket.state.values())


def _train_with_finalize(model, optimizer, steps: int) -> dict:
    """``steps`` steps in which megatron's schedule syncs the gradients once, through
    ``finalize_model_grads`` (DDP reduction, then the tied embedding's all-reduce across stages):
    a second ``finish_grad_sync`` would reduce-scatter already reduced shards again."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    model.config.finalize_model_grads_func = finalize_model_grads
    scheduler = _scheduler(optimizer, steps)
    losses, successes, grad_norms = [], [], []
    for step in range(steps):
        scheduler.step(1)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.extend(_train_step(model, data_seed=1000 * step + parallel_state.get_data_parallel_rank()))
        success, grad_norm, _ = optimizer.step()
        successes.append(success)
        grad_norms.append(grad_norm)
    return {"losses": losses, "successes": successes, "grad_norms": grad_norms}


def sharded_equals_unsharded(
    options: list[str], tensor_parallel: int, steps: int, bucket_size: int | None, fused: bool = False,
    pipeline_parallel: int = 1, grad_reduce_in_fp32: bool = False,
) -> dict:
    """Per option: ``steps`` steps with and without the distributed optimizer from the same weights
    on the same data (DDP buckets of ``bucket_size`` elements, gradients reduced in FP32 or BF16;
    the distributed optimizer's step eager or ``fused``, the unsharded optimizer's eager, the
    reference: a fused step is the eager one bit for bit, and a compile of the unsharded step would
    cost CI a coat-sized compile that no other test shares; tied embeddings across
    ``pipeline_parallel`` stages); whether
    losses, gradient norms and parameters are bit-identical, the optimizer state bytes each rank
    holds, how many graphs torch.compile built for the option, and the layout's figures."""
    from megatron.core import parallel_state
    from torch._dynamo.utils import counters

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    config = _transformer_config(
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, hidden_dropout=0.0, attention_dropout=0.0
    )
    result = {}
    for option in options:
        runs = {}
        graphs_before = counters["stats"]["unique_graphs"]
        for distributed in (False, True):
            model = _ddp(config, distributed, bucket_size, grad_reduce_in_fp32)
            optimizer = _optimizer(option, model, distributed, fused and distributed, track_update_quality=True)
            losses = _train_with_finalize(model, optimizer, steps)
            quality = optimizer.update_quality()
            state_bytes = optimizer.state_bytes() if distributed else _unsharded_state_bytes(optimizer)
            runs[distributed] = (losses, _flat(model.parameters()), state_bytes, quality, optimizer)
        sharded = runs[True][4]
        result[option] = {
            "successes": all(runs[True][0]["successes"]) and all(runs[False][0]["successes"]),
            "losses_identical": runs[True][0]["losses"] == runs[False][0]["losses"],
            "grad_norms_identical": runs[True][0]["grad_norms"] == runs[False][0]["grad_norms"],
            "grad_norms": runs[False][0]["grad_norms"],
            "params_identical": torch.equal(runs[True][1].view(torch.int32), runs[False][1].view(torch.int32)),
            "sharded_bytes": runs[True][2],
            "sharded_padding_bytes": sum(
                (state_bucket.numel - sum(state_bucket.numels)) / state_bucket.numel
                * sum(buffer.numel() * buffer.element_size() for buffer in state_bucket.state.values())
                for state_bucket in sharded.state_buckets()
            ),
            "unsharded_bytes": runs[False][2],
            "buckets": len(sharded.shards),
            "bytes_per_element": runs[True][2] / sum(shard.end - shard.start for shard in sharded.shards),
            "edq": [runs[True][3].edq, runs[False][3].edq],
            "imprecision": [runs[True][3].imprecision_percent, runs[False][3].imprecision_percent],
            "halo": len(runs[True][4]._halo),
            "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,
        }
    result["data_parallel_size"] = parallel_state.get_data_parallel_world_size()
    return result


def _sharded_checkpoint(model, optimizer, scheduler, is_loading: bool) -> dict:
    model_state = model.module.sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading),
        "scheduler": scheduler.state_dict(),
    }


def _load_checkpoint(option: str, config, distributed: bool, checkpoint_dir: str, steps: int):
    """A fresh model and optimizer (which first take a step of their own, so that loading must
    overwrite it) loaded from ``checkpoint_dir``."""
    from megatron.core import dist_checkpointing

    model = _ddp(config, distributed)
    optimizer = _optimizer(option, model, distributed)
    scheduler = _scheduler(optimizer, steps)
    _train(model, optimizer, 1, scheduler)
    loaded = dist_checkpointing.load(_sharded_checkpoint(model, optimizer, scheduler, is_loading=True), checkpoint_dir)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler = _scheduler(optimizer, steps)
    scheduler.load_state_dict(loaded["scheduler"])
    return model, optimizer, scheduler


def save_and_resume(options: list[str], checkpoint_dir: str, steps: int) -> dict:
    """DP=2 with the distributed optimizer: ``steps`` straight against ``steps / 2``, a
    dist_checkpointing save (kept under ``checkpoint_dir/<option>`` for other layouts to load) and a
    fresh model and optimizer that load it and run the rest; per option, whether the losses and
    parameters are bit-identical."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    config = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
    half = steps // 2
    result = {}
    for option in options:
        directory = Path(checkpoint_dir) / option
        if torch.distributed.get_rank() == 0:
            directory.mkdir(parents=True)
        torch.distributed.barrier()
        model = _ddp(config, True)
        optimizer = _optimizer(option, model, True)
        scheduler = _scheduler(optimizer, steps)
        _train(model, optimizer, half, scheduler)
        dist_checkpointing.save(_sharded_checkpoint(model, optimizer, scheduler, is_loading=False), str(directory))
        straight = _train(model, optimizer, steps - half, scheduler, first_step=half)["losses"]
        straight_params = _flat(model.parameters())
        model, optimizer, scheduler = _load_checkpoint(option, config, True, str(directory), steps)
        resumed = _train(model, optimizer, steps - half, scheduler, first_step=half)["losses"]
        result[option] = {
            "losses_identical": resumed == straight,
            "params_identical": torch.equal(straight_params.view(torch.int32), _flat(model.parameters()).view(torch.int32)),
        }
    return result


def _same_state(sharded, sharded_model, unsharded, unsharded_model) -> bool:
    """Whether every piece of the sharded optimizer's state equals, bit for bit, the same elements
    of the unsharded optimizer's state (the models are built alike, so their parameters pair up)."""
    from megatron_lowprec.optim.buckets import PER_GROUP_PARTS

    pairs = dict(zip(sharded_model.parameters(), unsharded_model.parameters()))
    strategy = sharded.optimizer.strategy
    group = strategy.fp8_group_size if strategy.moments == "fp8" else 1
    for shard in sharded.shards:
        for piece in shard.pieces:
            whole = unsharded.optimizer.state[pairs[piece.param]]
            for key, value in sharded.piece_state(piece).items():
                if key.endswith(PER_GROUP_PARTS):
                    expected = whole[key][piece.param_start // group : piece.param_start // group + value.numel()]
                else:
                    expected = whole[key].reshape(-1)[piece.param_start : piece.param_start + piece.numel]
                if not torch.equal(value.view(torch.uint8), expected.contiguous().view(torch.uint8)):
                    return False
    return True


def _sharded_masters(optimizer) -> torch.Tensor | None:
    """The FP32 masters the distributed optimizer holds (remainders joined with their parameters), flat."""
    from megatron_lowprec.megatron.checkpoint_state import checkpoint_state

    strategy = optimizer.optimizer.strategy
    if not strategy.master_weights:
        return None
    return torch.cat([
        checkpoint_state(optimizer.piece_state(piece), piece.numel, strategy, param=param)["master"]
        for shard in optimizer.shards for piece, param in zip(shard.pieces, shard.params())
    ])


def load_elsewhere(options_at: dict[str, list[str]], checkpoint_dir: str, steps: int) -> dict:
    """Other layouts, one after another in the same processes (the tensor-parallel sizes of
    ``options_at``), load the checkpoint of each of their options with and without the distributed
    optimizer (:func:`_load_at`), per tensor-parallel size."""
    from megatron.core import parallel_state

    results = {}
    for tensor_parallel, options in options_at.items():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=int(tensor_parallel))
        results[tensor_parallel] = _load_at(options, checkpoint_dir, int(tensor_parallel), steps)
        parallel_state.destroy_model_parallel()
    return results


def _load_at(options: list[str], checkpoint_dir: str, tensor_parallel: int, steps: int) -> dict:
    """At ``tensor_parallel``: whether the loaded states agree bit for bit, and both runs' losses over
    the next ``steps``. An option ``LOADED<-SAVED`` loads the checkpoint of option SAVED (another
    master storage): whether its FP32 masters equal, bit for bit, those that SAVED (listed before it)
    loaded."""
    config = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    result, masters = {}, {}
    for entry in options:
        option, _, saved = entry.partition("<-")
        runs = {
            distributed: _load_checkpoint(option, config, distributed, str(Path(checkpoint_dir) / (saved or option)), 2 * steps)
            for distributed in (True, False)
        }
        same_state = _same_state(runs[True][1], runs[True][0], runs[False][1], runs[False][0])
        masters[entry] = _sharded_masters(runs[True][1])
        losses = {
            distributed: _train(model, optimizer, steps, scheduler, first_step=steps)["losses"]
            for distributed, (model, optimizer, scheduler) in runs.items()
        }
        result[entry] = {"same_state": same_state, "sharded": losses[True], "unsharded": losses[False]}
        if saved:
            result[entry]["same_masters"] = torch.equal(masters[entry].view(torch.int32), masters[saved].view(torch.int32))
    return result


def _counting_uncompiled_calls(calls: list[int]):
    """The fused step calls its kernel uncompiled, every call counted in ``calls``, and joins and
    splits remainder masters with the uncompiled codec: what is measured (the calls per step, what a
    step keeps allocated, host-to-device copies) is the fused path's, which compiling its kernel does
    not change, and the compiled kernel's bits are the contract matrix's (tests/optim/test_contract.py).
    Compiled, each stepped option would cost a cold compile on CI's two cores."""
    from megatron_lowprec.optim import fused
    from megatron_lowprec.optim.kernel import bucket_kernel_

    def counting(*flags):
        def call(*args):
            calls.append(1)
            return bucket_kernel_(*args)

        return call

    fused.compiled_kernel = counting
    fused.compiled_master_codec = lambda: (fused._join_master_window, fused._split_master_window_)


@contextlib.contextmanager
def _spying_host_to_device_copies(copies: list[str]):
    """Record every ``torch.tensor`` / ``torch.as_tensor`` that places its data on a device: a copy from
    the host that waits for the device (the step's scalars and tables must not need one)."""
    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def spy(name):
        def factory(*args, **kwargs):
            if kwargs.get("device") is not None:
                copies.append(f"torch.{name}(..., device={kwargs['device']})")
            return factories[name](*args, **kwargs)

        return factory

    for name in factories:
        setattr(torch, name, spy(name))
    try:
        yield
    finally:
        for name, factory in factories.items():
            setattr(torch, name, factory)


def _backward(model, optimizer, data_seed: int) -> None:
    """Gradients of one step, synced once (as megatron's schedule does with finalize_model_grads)."""
    from megatron.core.distributed import finalize_model_grads

    model.config.finalize_model_grads_func = finalize_model_grads
    model.zero_grad_buffer()
    optimizer.zero_grad()
    _train_step(model, data_seed=data_seed)


def optimizer_costs(options: list[str], stepped_options: list[str], bucket_size: int, hidden_size: int) -> dict:
    """DP=2, per option and with and without the distributed optimizer (fused, its kernel uncompiled:
    :func:`_counting_uncompiled_calls`; stochastic rounding one call per bucket, as on GPUs; gradients
    reduced in FP32 for the options with FP32 masters, as ``lowprec-train`` configures DDP): the bytes
    the optimizer's construction leaves allocated (:func:`tests.allocations.kept_allocations`, less
    the flat buffer that the unsharded optimizer moves the parameters into, their old storage freed),
    against the state it reports; and for ``stepped_options``, what a step keeps allocated, the
    kernel calls of one step against the number of its state buckets and of its parameters, and
    host-to-device copies during a step."""
    from megatron.core import parallel_state

    from megatron_lowprec.optim import fused, get_strategy
    from tests.allocations import kept_allocations

    parallel_state.initialize_model_parallel()
    fused.BUCKET_STREAM_DEVICES = ("cuda", "cpu")
    calls: list[int] = []
    copies: list[str] = []
    _counting_uncompiled_calls(calls)
    config = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0, hidden_size=hidden_size, num_layers=1)
    result = {}
    for option in options:
        master_weights = get_strategy(option.partition(":")[0]).master_weights
        for distributed in (False, True):
            model = _ddp(config, distributed, bucket_size, grad_reduce_in_fp32=master_weights)
            numel = sum(param.numel() for param in model.parameters())
            built = kept_allocations(lambda: _optimizer(option, model, distributed, fused=True))
            optimizer = built.result
            if distributed:
                reported = optimizer.state_bytes()
                entries = sum(len(b.numels) for b in optimizer.state_buckets())
                state_buckets = len(optimizer.state_buckets())
                owned = sum(sum(b.numels) for b in optimizer.state_buckets())
                padding = sum(b.numel - sum(b.numels) for b in optimizer.state_buckets())
                moved_params = 0
            else:
                reported = _unsharded_state_bytes(optimizer)
                moved_params = sum(bucket.param_buffer.nbytes for bucket in optimizer.optimizer.buckets)
                entries = sum(len(bucket.params) for bucket in optimizer.optimizer.buckets)
                state_buckets = len(optimizer.optimizer.buckets)
                owned = sum(sum(bucket.numels) for bucket in optimizer.optimizer.buckets)
                padding = sum(bucket.numel - sum(bucket.numels) for bucket in optimizer.optimizer.buckets)
            costs = {
                "built_bytes": built.end - moved_params,
                "reported_bytes": reported,
                "owned": owned,
                "padding": padding,
                "parameters": numel,
                "state_buckets": state_buckets,
                "entries": entries,
            }
            if option in stepped_options:
                for data_seed in (1, 2):
                    _backward(model, optimizer, data_seed)
                    del calls[:], copies[:]
                    with _spying_host_to_device_copies(copies):
                        stepped = kept_allocations(optimizer.step)
                    assert stepped.result[0], f"{option}: a step was skipped"
                costs.update(step_kept_bytes=stepped.end, compiled_calls=len(calls), copies=list(copies))
            result[f"{option}-{'sharded' if distributed else 'unsharded'}"] = costs
    return result


def _whole_states(pieces_by_rank: list[list], numels: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's states, whole, from the (name, first element, states) runs every rank owned."""
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for name, first, states in (run for pieces in pieces_by_rank for run in pieces):
        for key, value in states.items():
            target = whole.setdefault(name, {}).setdefault(key, torch.full((numels[name],), math.nan, dtype=value.dtype, device=value.device))
            target[first : first + value.numel()] = value
    return whole


def _owned_states(optimizer, names: dict) -> list:
    """(name, first element, flat copies of its states) for each piece this rank's distributed optimizer owns."""
    return [
        (names[piece.param], piece.param_start, {key: value.clone() for key, value in optimizer.piece_state(piece).items()})
        for shard in optimizer.shards for piece in shard.pieces
    ]


def _chain_converted_as_rounded(model, chain, source: dict[str, dict[str, torch.Tensor]]) -> dict[str, list[str]]:
    """Per parameter of a converted Muon ``chain``, its states that are not ``source``'s (by the
    model's parameter names) rounded as B keeps them (:func:`_converted_as_rounded`)."""
    names = {param: name for name, param in model.module.named_parameters()}
    return {
        names[param]: _converted_as_rounded(
            param.detach().reshape(-1), {key: value.reshape(-1) for key, value in state.items() if torch.is_tensor(value)},
            source[names[param]],
        )
        for inner in chain.chained_optimizers for param, state in inner.optimizer.state.items()
    }


def _converted_as_rounded(value: torch.Tensor, states: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> list[str]:
    """The states of option B's (θ, δθ) and 16-bit moments that are not the source's FP32 master
    and moments rounded to nearest even by torch's casts: θ the master's nearest BF16, δθ the
    nearest BF16 of the exact FP32 rest, each moment its nearest BF16."""
    master = source["master"]
    theta = master.bfloat16()
    wrong = [] if torch.equal(value, theta) else ["value"]
    if not torch.equal(states["param_lo"], (master - theta.float()).bfloat16()):
        wrong.append("param_lo")
    return wrong + [key for key in states if key not in ("param_lo", "step") and not torch.equal(states[key], source[key].bfloat16())]


def _conversion_lines(load) -> tuple[list[str], str | None]:
    """The ``megatron-lowprec:`` lines ``load()`` printed, and the first line of what it raised."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            load()
    except (ValueError, SystemExit) as error:
        return [], str(error)
    return [line for line in printed.getvalue().splitlines() if line.startswith("megatron-lowprec: ")], None


def converting_loads(checkpoint_dir: str, steps: int) -> dict:
    """DP=2: option D's distributed optimizer, and D's Muon chain, train ``steps`` steps and save a
    dist checkpoint; option B's (the distributed optimizer, the chain and the layer-wise chain) built with
    ``convert_checkpoint=True`` load it as Megatron-LM's entry reads it
    (:func:`~megatron_lowprec.megatron.megatron_lm.optimizer_template_for`) and take a step. Returns
    per optimizer the states that are not D's rounded as B keeps them (:func:`_converted_as_rounded`:
    on every rank, each owned run of each parameter, and every whole parameter), the conversion's lines
    (rank 0), the step's success and loss, and what a B optimizer without the setting says, through
    Megatron-LM's load and through ``load_state_dict``, and what the distributed optimizer given the
    chain's checkpoint says."""
    from megatron.core import dist_checkpointing, parallel_state
    from _build_optimizer_worker import _layer_wise_fields, _model as _muon_model, _muon_config

    from megatron_lowprec.megatron.megatron_lm import optimizer_template_for
    from megatron_lowprec.megatron.optimizer import build_optimizer, saved_option_template
    from megatron_lowprec.optim.strategies import get_strategy

    parallel_state.initialize_model_parallel()
    config = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
    root = Path(checkpoint_dir)

    def save(model, optimizer, name: str) -> str:
        directory = root / name
        if torch.distributed.get_rank() == 0:
            directory.mkdir(parents=True)
        torch.distributed.barrier()
        model_state = model.module.sharded_state_dict()
        dist_checkpointing.save({"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state)}, str(directory))
        return str(directory)

    def load(model, optimizer, directory: str, template=optimizer_template_for):
        def run():
            model_state = model.module.sharded_state_dict()
            sharded = optimizer.sharded_state_dict(model_state, is_loading=True)
            loaded = dist_checkpointing.load({"model": model_state, "optimizer": template(optimizer, sharded, directory)}, directory)
            model.module.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
        return _conversion_lines(run)

    result = {}
    model = _ddp(config, True)
    names = {param: name for name, param in model.module.named_parameters()}
    numels = {name: param.numel() for param, name in names.items()}
    saved = _optimizer("D", model, True)
    _train(model, saved, steps, _scheduler(saved, steps + 2))
    directory = save(model, saved, "distributed")
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, _owned_states(saved, names))
    source = _whole_states(gathered, numels)
    refusals = {}
    model = _ddp(config, True)
    _, refusals["megatron_lm"] = load(model, _optimizer("B", model, True), directory)
    _, refusals["load_state_dict"] = load(
        model, _optimizer("B", model, True), directory, lambda _, sharded, __: saved_option_template(sharded, get_strategy("D"))
    )
    model = _ddp(config, True)
    names = {param: name for name, param in model.module.named_parameters()}
    converted = _optimizer("B", model, True, convert_checkpoint=True)
    lines, _ = load(model, converted, directory)
    wrong = {
        f"{names[piece.param]} {piece.param_start}": _converted_as_rounded(
            piece.param.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel], converted.piece_state(piece),
            {key: value[piece.param_start : piece.param_start + piece.numel] for key, value in source[names[piece.param]].items()},
        )
        for shard in converted.shards for piece in shard.pieces
    }
    wrong.update({
        name: ["whole value"] for param, name in names.items() if not torch.equal(param.detach().reshape(-1), source[name]["master"].bfloat16())
    })
    after = _train(model, converted, 1, _scheduler(converted, steps + 2), first_step=steps)
    result["distributed"] = {
        "wrong": {key: value for key, value in wrong.items() if value}, "runs": len(wrong), "lines": lines,
        "elements": sum(numels.values()), "step": after, "refusals": refusals,
    }

    def muon_chain(option: str, **fields):
        model = _muon_model()
        return model, build_optimizer(_muon_config(option, lowprec_fused=False, **fields), [model])

    model, saved = muon_chain("D")
    _train(model, saved, steps, _scheduler(saved, steps + 2))
    directory = save(model, saved, "muon")
    names = {param: name for name, param in model.module.named_parameters()}
    source = {
        names[param]: {key: value.reshape(-1).clone() for key, value in state.items() if torch.is_tensor(value)}
        for inner in saved.chained_optimizers for param, state in inner.optimizer.state.items()
    }
    model, refusing = muon_chain("B")
    _, refusal = load(model, refusing, directory)
    model = _ddp(config, True)
    _, single = load(model, _optimizer("B", model, True, convert_checkpoint=True), directory)
    model, converted = muon_chain("B", lowprec_convert_checkpoint=True)
    lines, _ = load(model, converted, directory)
    wrong = _chain_converted_as_rounded(model, converted, source)
    after = _train(model, converted, 1, _scheduler(converted, steps + 2), first_step=steps)
    result["muon"] = {
        "wrong": {key: value for key, value in wrong.items() if value}, "runs": len(wrong), "lines": lines,
        "elements": {inner.label: sum(param.numel() for param in inner.get_parameters()) for inner in converted.chained_optimizers},
        "step": after, "refusals": {"megatron_lm": refusal, "into_one_optimizer": single},
    }
    model, converted = muon_chain("B", lowprec_convert_checkpoint=True, **_layer_wise_fields())
    lines, _ = load(model, converted, directory)
    wrong = _chain_converted_as_rounded(model, converted, source)
    wrong.update({
        name: ["whole value"] for name, param in model.module.named_parameters()
        if not torch.equal(param.detach().reshape(-1), source[name]["master"].bfloat16())
    })
    result["layer_wise_muon"] = {"wrong": {key: value for key, value in wrong.items() if value}, "runs": len(wrong), "lines": lines,
                                 "step": _train(model, converted, 1, _scheduler(converted, steps + 2), first_step=steps)}
    return result


SCENARIOS = {
    f.__name__: f for f in (sharded_equals_unsharded, save_and_resume, load_elsewhere, optimizer_costs, converting_loads)
}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
