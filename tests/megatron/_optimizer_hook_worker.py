"""One rank of the optimizer-hook checks: a tiny megatron GPT trained with ``build_optimizer`` (gloo, or
NCCL where CUDA is present: see ``launch.init_process_group``).

Launched by ``test_optimizer_hook.py`` as ``python _optimizer_hook_worker.py RESULT_DIR SCENARIO JSON``
once per rank; writes ``RESULT_DIR/rank<N>.json``. The model, data and schedule are those of the
CPU-bridge checks (``_cpu_bridge_worker``).
"""

from __future__ import annotations

import hashlib
import math

import torch
from _cpu_bridge_worker import _flat, _gather, _seeded_model, _train_step, _transformer_config

from tests.megatron.launch import run_scenario


def _ddp(config, grad_reduce_in_fp32: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=_seeded_model(config))


def _optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta2=0.95, bf16=True, clip_grad=1.0
    )


def _scheduler(optimizer, steps: int):
    """Megatron's own LR/WD schedule (cosine with warmup), which also applies ``wd_mult``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = _optimizer_config()
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=2,
        lr_decay_steps=steps,
        lr_decay_style="cosine",
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )


def _train(model, optimizer, steps: int, scheduler=None, first_step: int = 0) -> dict:
    from megatron.core import parallel_state

    data_rank = parallel_state.get_data_parallel_rank()
    scheduler = scheduler or _scheduler(optimizer, steps)
    losses, successes = [], []
    for step in range(first_step, first_step + steps):
        scheduler.step(1)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.extend(_train_step(model, data_seed=1000 * step + data_rank))
        model.finish_grad_sync()
        success, _, _ = optimizer.step()
        successes.append(success)
    return {"losses": losses, "successes": successes}


def _bitwise_equal_across(tensor: torch.Tensor, group) -> bool:
    return all(torch.equal(other, tensor) for other in _gather(tensor, group))


def replicas(option: str, tensor_parallel: int, shared_randomness: bool, steps: int, fused: bool) -> dict:
    """Train, then compare parameters bit for bit across data-parallel replicas and, for parameters
    tensor parallelism does not shard, across tensor-parallel ranks."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    config = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    model = _ddp(config, grad_reduce_in_fp32=False)
    optimizer = build_optimizer(
        option, [model], _optimizer_config(), seed=5, shared_randomness=shared_randomness, fused=fused
    )
    result = _train(model, optimizer, steps)
    params = list(model.parameters())
    replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]
    result.update(
        data_parallel_identical=_bitwise_equal_across(
            _flat(params).view(torch.int32), parallel_state.get_data_parallel_group()
        ),
        tensor_parallel_replicated_identical=_bitwise_equal_across(
            _flat(replicated).view(torch.int32), parallel_state.get_tensor_model_parallel_group()
        ),
        moved=not torch.equal(_flat(params), _flat(_seeded_model(config).parameters())),
    )
    return result


def _whole_tensor(local: torch.Tensor, param, chunks: int) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard: ``chunks`` blocks along the partition
    dimension, each the concatenation of the ranks' parts (megatron's gated fc1 has two)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return local
    dim = param.partition_dim
    shards = _gather(local, parallel_state.get_tensor_model_parallel_group())
    return torch.cat([torch.cat([shard.chunk(chunks, dim)[c] for shard in shards], dim) for c in range(chunks)], dim)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def stream_words(tensor_parallel: int, pipeline_parallel: int, steps: int) -> dict:
    """A gated-MLP GPT with tied embeddings: the SR words of every parameter at step 3, reassembled
    into whole tensors and keyed by canonical name; after ``steps`` SR steps, each rank's copy of the
    tied embedding."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from megatron_lowprec.megatron.optimizer import build_optimizer, canonical_parameter_names

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    config = _transformer_config(
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, gated_linear_unit=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = _ddp(config, grad_reduce_in_fp32=False)
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer("sr", [model], _optimizer_config(), seed=5)
    names = canonical_parameter_names([model])
    words = {
        name: _digest(_whole_tensor(optimizer.optimizer.random_bits(param, 3), param, 2 if "linear_fc1" in name else 1))
        for param, name in names.items()
    }
    if steps:
        _train(model, optimizer, steps)
    embedding = [_digest(param.detach()) for param, name in names.items() if name == "embedding.word_embeddings.weight"]
    return {"words": words, "embedding": embedding, "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank()}


def _torch_fused_adamw(optimizer):
    """Megatron's optimizer with its torch AdamW running torch's fused kernel, as option D does.

    Without Transformer Engine and apex megatron wraps ``torch.optim.AdamW`` with torch's default
    kernel choice (on CPU the per-tensor loop); ``fused`` is a per-group option that AdamW reads at
    every step."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner in chained:
        assert isinstance(inner.optimizer, torch.optim.AdamW), type(inner.optimizer)
        for group in inner.optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    return optimizer


def _stock_masters(optimizer, model) -> dict[str, torch.Tensor]:
    """The FP32 main parameters of megatron's mixed-precision optimizer, by parameter name."""
    names = {param: name for name, param in model.named_parameters()}
    masters = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                masters[names[model_param]] = main_param.detach()
    return masters


def _exact_norm_in_stock_megatron(grads_for_norm, norm_type=2, grad_stats_parallel_group=None, **_) -> float:
    """megatron's ``get_grad_norm_fp32`` computed as the precision options compute it (exactly)."""
    from megatron_lowprec.megatron.distributed import global_grad_norm

    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    return global_grad_norm(grads, grad_stats_parallel_group, grads[0].device)


def option_d_against_stock_megatron(steps: int) -> dict:
    """Option D and megatron's own bf16 optimizer (Float16OptimizerWithFloat16Params around torch's
    AdamW, set to torch's fused kernel) from the same weights on the same data, the stock optimizer
    clipping by the exact gradient norm the precision options use: their losses, and whether every
    FP32 master is bit-identical to megatron's main parameter. Also megatron's own FP32 norm and the
    exact one of the last step's gradients."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel()
    config = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
    ours = _ddp(config, grad_reduce_in_fp32=True)
    stock = _ddp(config, grad_reduce_in_fp32=True)
    our_optimizer = build_optimizer("D", [ours], _optimizer_config(), fused=False)
    stock_optimizer = _torch_fused_adamw(get_megatron_optimizer(_optimizer_config(), [stock]))
    result = {"ours": _train(ours, our_optimizer, steps)["losses"]}
    megatron_optimizer.get_grad_norm_fp32 = _exact_norm_in_stock_megatron
    try:
        result["stock"] = _train(stock, stock_optimizer, steps)["losses"]
    finally:
        megatron_optimizer.get_grad_norm_fp32 = get_grad_norm_fp32
    stock_masters = _stock_masters(stock_optimizer, stock)
    our_masters = {name: our_optimizer.optimizer.state[param]["master"] for name, param in ours.named_parameters()}
    result["masters_identical"] = sorted(our_masters) == sorted(stock_masters) and all(
        torch.equal(our_masters[name].view(torch.int32), stock_masters[name].view(torch.int32)) for name in our_masters
    )
    grads = [param.main_grad for param in ours.parameters()]
    group = parallel_state.get_model_parallel_group()
    result["norms"] = [_exact_norm_in_stock_megatron(grads, grad_stats_parallel_group=group),
                       get_grad_norm_fp32(grads, grad_stats_parallel_group=group)]
    return result


def non_finite_gradient_skips_everywhere() -> dict:
    """A NaN gradient on one rank only: every rank skips the step and keeps its parameters."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = _ddp(_transformer_config(tensor_parallel=2), grad_reduce_in_fp32=False)
    optimizer = build_optimizer("C", [model], _optimizer_config(), fused=False)
    model.zero_grad_buffer()
    _train_step(model, data_seed=3)
    model.finish_grad_sync()
    if torch.distributed.get_rank() == 1:
        next(iter(model.parameters())).main_grad.view(-1)[0] = math.nan
    before = _flat(model.parameters())
    success, grad_norm, _ = optimizer.step()
    return {
        "success": success,
        "grad_norm_is_none": grad_norm is None,
        "unchanged": torch.equal(before, _flat(model.parameters())),
        "skipped_steps": optimizer.optimizer.skipped_steps,
    }


def resume(options: list[str], steps: int, master_storage: str | None = None) -> dict:
    """DP=2: ``steps`` straight against ``steps / 2`` + state dicts (model, optimizer, scheduler, RNG
    states, as a checkpoint holds them) + a fresh model and optimizer that load them and run the
    rest; per option (its masters stored as ``master_storage``), whether losses and parameters are
    bit-identical."""
    import copy

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel()
    config = _transformer_config()
    half = steps // 2
    result = {}
    for option in options:

        def fresh():
            model = _ddp(config, grad_reduce_in_fp32=False)
            optimizer = build_optimizer(
                option, [model], _optimizer_config(), seed=3, fused=False, master_storage=master_storage
            )
            return model, optimizer, _scheduler(optimizer, steps)

        model, optimizer, scheduler = fresh()
        first = _train(model, optimizer, half, scheduler)["losses"]
        tracker = tensor_parallel.get_cuda_rng_tracker()
        saved = copy.deepcopy((
            model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), torch.get_rng_state(),
            tracker.get_states(), tensor_parallel_random._get_cuda_rng_state(),
        ))
        straight = _train(model, optimizer, steps - half, scheduler, first_step=half)["losses"]
        straight_params = _flat(model.parameters())

        model, optimizer, scheduler = fresh()
        _train(model, optimizer, 1, scheduler, first_step=steps)
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        scheduler = _scheduler(optimizer, steps)
        scheduler.load_state_dict(saved[2])
        torch.set_rng_state(saved[3])
        tracker.set_states(saved[4])
        tensor_parallel_random._set_cuda_rng_state(saved[5])
        resumed = _train(model, optimizer, steps - half, scheduler, first_step=half)["losses"]
        result[option] = {
            "finite": all(math.isfinite(loss) for loss in first + straight),
            "losses_identical": resumed == straight,
            "params_identical": torch.equal(straight_params.view(torch.int32), _flat(model.parameters()).view(torch.int32)),
        }
    return result


def update_quality(option: str, tensor_parallel: int) -> dict:
    """One step on the same global weights and the same data on every rank; the model's EDQ pieces."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    config = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    model = _ddp(config, grad_reduce_in_fp32=True)
    optimizer = build_optimizer(option, [model], _optimizer_config(), fused=False, track_update_quality=True)
    model.zero_grad_buffer()
    _train_step(model, data_seed=42)
    model.finish_grad_sync()
    optimizer.step()
    quality = optimizer.update_quality()
    return {
        "edq": quality.edq,
        "imprecision_percent": quality.imprecision_percent,
        "intended_nonzero": quality.intended_nonzero,
        "numel": sum(p.numel() for p in model.parameters()),
    }


def _state_norms(model, optimizer) -> dict[str, float]:
    """Per optimizer-state key, the global sum of squares over the model, each parameter counted once;
    the FP32 master under ``master`` whichever its storage."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lowprec.optim.master import MASTER_KEYS, master_value

    def values(param, state, key):
        return master_value(param, state[key]) if key in MASTER_KEYS.values() else state[key]

    state = optimizer.optimizer.state[next(iter(model.parameters()))]
    keys = [key for key, value in state.items() if torch.is_tensor(value)]
    sums = torch.zeros(len(keys) + 1, dtype=torch.float64, device=torch.cuda.current_device())
    for param in model.parameters():
        if tensor_parallel.param_is_not_tensor_parallel_duplicate(param):
            state = optimizer.optimizer.state[param]
            sums[:-1] += torch.stack([values(param.detach(), state, key).double().square().sum() for key in keys])
            sums[-1] += param.double().square().sum()
    torch.distributed.all_reduce(sums, group=parallel_state.get_tensor_model_parallel_group())
    names = ["master" if key in MASTER_KEYS.values() else key for key in keys]
    return dict(zip([*names, "param"], sums.tolist()))


def dist_checkpoint(
    option: str, tensor_parallel: int, checkpoint_dir: str, save: bool, master_storage: str | None = None,
    load_from: str | None = None,
) -> dict:
    """Train and save a megatron dist checkpoint (model + optimizer), or load one saved at another
    tensor-parallel size (and master storage), or (``load_from``) load one and save it again; the
    state norms and the loss on fixed data either way."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    config = _transformer_config(tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0)
    model = _ddp(config, grad_reduce_in_fp32=False)
    optimizer = build_optimizer(option, [model], _optimizer_config(), fused=False, master_storage=master_storage)

    def sharded(is_loading: bool) -> dict:
        model_state = model.module.sharded_state_dict()
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}

    source = load_from if save else checkpoint_dir
    if source is None:
        _train(model, optimizer, 3)
    else:
        loaded = dist_checkpointing.load(sharded(is_loading=True), source)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    if save:
        dist_checkpointing.save(sharded(is_loading=False), checkpoint_dir)
    model.zero_grad_buffer()
    return {"norms": _state_norms(model, optimizer), "loss": _train_step(model, data_seed=77)}


def reload_model_params(option: str, master_storage: str) -> dict:
    """After 3 steps and new model weights (a checkpoint loaded without its optimizer), megatron's
    ``reload_model_params`` restarts every FP32 master from the parameters."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron.optimizer import build_optimizer
    from megatron_lowprec.optim.master import master_value, stored_master

    parallel_state.initialize_model_parallel()
    config = _transformer_config(hidden_dropout=0.0, attention_dropout=0.0)
    model = _ddp(config, grad_reduce_in_fp32=False)
    optimizer = build_optimizer(option, [model], _optimizer_config(), fused=False, master_storage=master_storage)
    _train(model, optimizer, 3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)

    def masters_are_parameters():
        return all(
            torch.equal(master_value(p.detach(), stored_master(optimizer.optimizer.state[p])), p.detach().float())
            for p in model.parameters()
        )

    before = masters_are_parameters()
    optimizer.reload_model_params()
    return {"before": before, "after": masters_are_parameters()}


SCENARIOS = {
    f.__name__: f
    for f in (
        reload_model_params,
        replicas,
        option_d_against_stock_megatron,
        non_finite_gradient_skips_everywhere,
        resume,
        update_quality,
        dist_checkpoint,
        stream_words,
    )
}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
