"""One rank of the CPU-bridge checks: megatron-core scenarios on gloo with the CUDA→CPU bridge active.

Launched by ``test_cpu_bridge.py`` through ``launch.run_ranks`` as ``python _cpu_bridge_worker.py
RESULT_DIR`` once per rank. Without CUDA every scenario runs while real CUDA is forbidden (see
:func:`real_cuda_forbidden`); with CUDA the same scenarios run on NCCL, one GPU per rank, and the
bridge stays inactive. Tensors are placed as Megatron-LM places them, on ``torch.cuda.current_device()``.
The rank writes ``RESULT_DIR/rank<N>.json`` with one entry per scenario plus, without CUDA, what the
CUDA tripwire saw.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_lowprec.megatron import cpu as cpu_bridge
from tests.megatron.launch import init_process_group

VOCAB_SIZE = 64
SEQ_LENGTH = 16
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 2
SEED = 1234
SKIPPED_DIRECTORIES = (f"{os.sep}torch{os.sep}", cpu_bridge.__file__)


class RealCudaCallError(RuntimeError):
    """A call reached torch's real CUDA initialisation, which a CPU-only run must never do."""


def _call_site() -> str:
    """The innermost frame outside torch and the bridge, and the torch function it called, if any."""
    torch_callee = None
    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(skipped in frame.filename for skipped in SKIPPED_DIRECTORIES):
            torch_callee = torch_callee or frame
            continue
        called = f" -> torch {torch_callee.name}()" if torch_callee else ""
        return f"{frame.filename}:{frame.lineno} ({frame.name}: {frame.line!r}){called}"
    return "unknown call site"


def _deferred_cuda_calls(queued_before: int) -> list[str]:
    """CUDA calls that torch queued for a CUDA initialisation that never comes, i.e. silently dropped.

    ``torch.manual_seed`` also queues ``torch.cuda.manual_seed_all`` next to seeding the CPU; that is
    not a dropped call, so only ``torch.cuda.manual_seed`` is looked for among the queued seeds.
    """
    queued = [stack for _, stack in torch.cuda._queued_calls[queued_before:]]
    seed = torch.cuda._lazy_seed_tracker.manual_seed_cb
    if seed is not None:
        queued.append(seed[1])
    return [stack[-3].strip() for stack in queued]


def _modules_holding(function: Callable) -> list[object]:
    return [
        module
        for module in list(sys.modules.values())
        if module is not None and vars(module).get("_lazy_init") is function
    ]


@contextlib.contextmanager
def real_cuda_forbidden() -> Iterator[dict[str, list[str]]]:
    """Make torch's CUDA initialisation raise :class:`RealCudaCallError` naming the caller.

    Every path to real CUDA (``torch.cuda.current_device()``, a tensor on a CUDA device, ...) goes
    through ``torch.cuda._lazy_init``; it is replaced here and in every module that imported it by
    name. Yields a report whose ``reached`` lists each call site that tried (also those whose error a
    caller swallowed) and, after exit, whose ``deferred`` lists CUDA calls that torch queued instead
    of running: without CUDA, ``torch.cuda.manual_seed`` and friends are silently dropped.
    """
    report: dict[str, list[str]] = {"reached": [], "deferred": []}
    original_lazy_init = torch.cuda._lazy_init
    queued_before = len(torch.cuda._queued_calls)

    def refuse_cuda_initialisation() -> None:
        site = _call_site()
        report["reached"].append(site)
        raise RealCudaCallError(
            f"real CUDA reached from {site}; megatron-core needs more bridging in "
            "megatron_lowprec/megatron/cpu.py"
        )

    for module in _modules_holding(original_lazy_init):
        module._lazy_init = refuse_cuda_initialisation
    try:
        yield report
    finally:
        for module in _modules_holding(refuse_cuda_initialisation):
            module._lazy_init = original_lazy_init
        report["deferred"] = _deferred_cuda_calls(queued_before)


def _transformer_config(tensor_parallel: int = 1, pipeline_parallel: int = 1, **overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _gpt_model(config, layer_spec=None):
    """A tiny bf16 GPTModel (RoPE, tied embeddings) for this rank's pipeline stage, in Float16Module;
    ``layer_spec`` defaults to megatron's local spec."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    )
    model.cuda(torch.cuda.current_device())
    return Float16Module(config, model)


def _batches(data_seed: int) -> list[dict[str, torch.Tensor]]:
    """Microbatches as megatron's ``get_batch`` would see them: broadcast from tensor-parallel rank 0."""
    from megatron.core import tensor_parallel

    generator = torch.Generator().manual_seed(data_seed)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
        batch = tensor_parallel.broadcast_data(list(batch), batch, torch.int64)
        positions = torch.arange(SEQ_LENGTH, device=torch.cuda.current_device())
        batch["position_ids"] = positions.expand(MICRO_BATCH_SIZE, -1)
        batches.append(batch)
    return batches


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _train_step(model, data_seed: int) -> list[float]:
    """One forward+backward over the microbatches through megatron's schedule; the losses seen here."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(_batches(data_seed)),
        model=[model],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=False,
    )
    return [float(reduced["lm loss"]) for reduced in losses]


def _seeded_model(config, layer_spec=None):
    from megatron.core import tensor_parallel

    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return _gpt_model(config, layer_spec)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([tensor.detach().float().flatten() for tensor in tensors])


def _gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


def tensor_parallel_step() -> dict:
    """TP=2: GPT steps with dropout, with and without activation recompute (same dropout masks)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = _seeded_model(_transformer_config(tensor_parallel=2))
    losses = _train_step(model, data_seed=7)
    recomputed_model = _seeded_model(
        _transformer_config(
            tensor_parallel=2,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        )
    )
    recomputed_losses = _train_step(recomputed_model, data_seed=7)
    grads = [param.grad for param in model.parameters()]
    return {
        "tensor_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "tensor_parallel_rank": parallel_state.get_tensor_model_parallel_rank(),
        "losses": losses,
        "recomputed_losses": recomputed_losses,
        "recompute_grads_equal": torch.equal(
            _flat(grads), _flat(param.grad for param in recomputed_model.parameters())
        ),
        "grads_finite": bool(torch.isfinite(_flat(grads)).all()),
    }


def rng_tracker() -> dict:
    """TP=2: the model-parallel stream differs across TP ranks, the others agree; reseeding repeats."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def dropout_mask(stream: str | None) -> torch.Tensor:
        with tracker.fork(stream) if stream else contextlib.nullcontext():
            return torch.nn.functional.dropout(torch.ones(256, device=torch.cuda.current_device()), p=0.5) > 0

    def masks() -> dict[str, torch.Tensor]:
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        model_parallel = dropout_mask("model-parallel-rng")
        default_after_fork = dropout_mask(None)
        data_parallel = dropout_mask(tensor_parallel.get_data_parallel_rng_tracker_name())
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        return {
            "model_parallel": model_parallel,
            "data_parallel": data_parallel,
            "default_after_fork": default_after_fork,
            "default_without_fork": dropout_mask(None),
        }

    first, second = masks(), masks()
    group = parallel_state.get_tensor_model_parallel_group()
    gathered = {name: _gather(mask.to(torch.uint8), group) for name, mask in first.items()}
    return {
        "tracker_class": type(tracker).__name__,
        "reproducible": all(torch.equal(first[name], second[name]) for name in first),
        "model_parallel_differs_across_tp": not torch.equal(*gathered["model_parallel"]),
        "data_parallel_same_across_tp": torch.equal(*gathered["data_parallel"]),
        "default_same_across_tp": torch.equal(*gathered["default_without_fork"]),
        "fork_restores_default_stream": torch.equal(
            first["default_after_fork"], first["default_without_fork"]
        ),
    }


def _ddp_model_and_optimizer(**ddp_settings):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _transformer_config()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **ddp_settings)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=_seeded_model(config))
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        bf16=True,
        clip_grad=1.0,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
    return model, get_megatron_optimizer(optimizer_config, [model])


def data_parallel_ddp() -> dict:
    """DP=2: megatron DDP averages the grads of different data; a mixed-precision Adam step follows."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    model, optimizer = _ddp_model_and_optimizer()
    model.zero_grad_buffer()
    losses = _train_step(model, data_seed=100 + torch.distributed.get_rank())
    local_grads = _gather(_flat(param.main_grad for param in model.parameters()))
    model.finish_grad_sync()
    synced_grads = _gather(_flat(param.main_grad for param in model.parameters()))
    update_successful, grad_norm, _ = optimizer.step()
    return {
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "losses": losses,
        "local_grads_differ": not torch.equal(*local_grads),
        "synced_grads_equal": torch.equal(*synced_grads),
        "synced_grads_are_mean": torch.allclose(synced_grads[0], (local_grads[0] + local_grads[1]) / 2),
        "grads_nonzero": bool(synced_grads[0].abs().sum() > 0),
        "optimizer": type(optimizer.chained_optimizers[0]).__name__,
        "update_successful": bool(update_successful),
        "grad_norm_finite": math.isfinite(grad_norm),
        "params_equal_after_step": torch.equal(*_gather(_flat(model.parameters()))),
    }


def distributed_optimizer() -> dict:
    """DP=2: DDP with overlapped grad reduce-scatter and megatron's distributed optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    parallel_state.initialize_model_parallel()
    model, optimizer = _ddp_model_and_optimizer(
        use_distributed_optimizer=True, overlap_grad_reduce=True
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = model.no_sync
    model.zero_grad_buffer()
    losses = _train_step(model, data_seed=100 + torch.distributed.get_rank())
    before_step = _flat(model.parameters())
    update_successful, grad_norm, _ = optimizer.step()
    after_step = _flat(model.parameters())
    return {
        "losses": losses,
        "optimizer": type(optimizer.chained_optimizers[0]).__name__,
        "update_successful": bool(update_successful),
        "grad_norm_finite": math.isfinite(grad_norm),
        "params_changed": not torch.equal(before_step, after_step),
        "params_equal_after_step": torch.equal(*_gather(after_step)),
    }


def pipeline_parallel_step() -> dict:
    """PP=2: one GPT step through the 1F1B schedule, embeddings tied across the two stages."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model = _seeded_model(_transformer_config(pipeline_parallel=2))
    losses = _train_step(model, data_seed=7)
    return {
        "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": losses,
        "grads_finite": bool(torch.isfinite(_flat(param.grad for param in model.parameters())).all()),
    }


SCENARIOS: tuple[Callable[[], dict], ...] = (
    tensor_parallel_step,
    rng_tracker,
    data_parallel_ddp,
    distributed_optimizer,
    pipeline_parallel_step,
)


def _run_scenario(scenario: Callable[[], dict]) -> dict:
    from megatron.core import parallel_state

    started = time.perf_counter()
    try:
        result = {"ok": True, **scenario()}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        parallel_state.destroy_model_parallel()
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def run_scenarios(scenarios: tuple[Callable[[], dict], ...], results: dict[str, dict], result_file: Path) -> None:
    """Run ``scenarios`` in order into ``results``, rewriting ``result_file`` after each, and stop at
    the first failure (the other ranks then fail fast); a full pass ends at a barrier."""
    for scenario in scenarios:
        results[scenario.__name__] = _run_scenario(scenario)
        result_file.write_text(json.dumps(results, indent=1, default=str))
        if not results[scenario.__name__]["ok"]:
            return
    torch.distributed.barrier()


def _replaceable_attributes() -> dict[str, object]:
    """The attributes the bridge replaces, and the torch function mode stack, as they are now."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    attributes = {
        f"torch.cuda.{name}": getattr(torch.cuda, name)
        for name in (
            "current_device", "synchronize", "manual_seed", "current_stream", "default_stream", "Stream", "stream",
            "Event", "get_rng_state", "set_rng_state",
        )
    }
    attributes["torch.autograd._engine_run_backward"] = torch.autograd._engine_run_backward
    for name in (
        "CudaRNGStatesTracker",
        "_CUDA_RNG_STATE_TRACKER",
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
    ):
        attributes[f"tensor_parallel.random.{name}"] = getattr(tensor_parallel_random, name)
    attributes["function mode stack"] = tuple(torch.overrides._get_current_function_mode_stack())
    return attributes


def _changed(before: dict[str, object]) -> list[str]:
    now = _replaceable_attributes()
    return sorted(name for name in before if now[name] != before[name])


def main(result_dir: Path) -> None:
    """Run the scenarios in order, stopping at the first failure (the other rank then fails fast).

    The results file is rewritten after every scenario, so a run killed on timeout still tells how far
    it got.
    """
    result_file = result_dir / f"rank{os.environ['RANK']}.json"
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as tripwire:
        cuda_report = None if torch.cuda.is_available() else tripwire.enter_context(real_cuda_forbidden())
        before = _replaceable_attributes()
        with cpu_bridge.cpu_bridge() as active:
            results["activation"] = {"active": active, "changed": _changed(before)}
            init_process_group(timeout_seconds=60)
            try:
                run_scenarios(SCENARIOS, results, result_file)
            finally:
                torch.distributed.destroy_process_group()
        results["deactivation"] = {"not_restored": _changed(before)}
    if cuda_report is not None:
        results["cuda_tripwire"] = {**cuda_report, "cuda_initialized": torch.cuda.is_initialized()}
    result_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
