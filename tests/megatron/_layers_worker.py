"""One rank of the layer-precision checks: ``apply_layer_precision`` on tiny megatron GPTs (gloo, or NCCL
where CUDA is present: see ``launch.init_process_group``).

Launched by ``test_layers.py`` as ``python _layers_worker.py RESULT_DIR`` on two ranks, with
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` set. Runs every scenario in order and
rewrites ``RESULT_DIR/rank<N>.json`` after each. Scenarios ending in ``_tp1`` use tensor-parallel size 1
(both ranks then do the same work as data-parallel replicas). Model, data and schedule are those of
the CPU-bridge checks (``_cpu_bridge_worker``), without dropout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _cpu_bridge_worker import _flat, _gather, _seeded_model, _train_step, _transformer_config, run_scenarios

from megatron_lowprec.megatron import cpu as cpu_bridge
from tests.megatron.launch import init_process_group

TRAINING_STEPS = 8


def _config(tensor_parallel: int = 1, llama: bool = False):
    """The bridge checks' tiny GPT (LayerNorm, GELU) or a Llama-style one (RMSNorm, SwiGLU, no biases)."""
    llama_settings = dict(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False
    )
    return _transformer_config(
        tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0, **(llama_settings if llama else {})
    )


def _converted(config, **settings):
    from megatron_lowprec.megatron.layers import apply_layer_precision

    model = _seeded_model(config)
    return model, apply_layer_precision(model, **settings)


def _losses_and_grads(model, data_seed: int = 7) -> tuple[list[float], list[torch.Tensor]]:
    losses = _train_step(model, data_seed=data_seed)
    return losses, [param.grad.detach().clone() for param in model.parameters()]


def _comparison(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    flat, flat_reference = _flat(grads).double(), _flat(reference).double()
    per_tensor = [
        float((g.double() - r.double()).norm() / r.double().norm()) for g, r in zip(grads, reference) if r.norm() > 0
    ]
    return {
        "relative_error": float((flat - flat_reference).norm() / flat_reference.norm()),
        "cosine": float(torch.nn.functional.cosine_similarity(flat, flat_reference, dim=0)),
        "worst_tensor_relative_error": max(per_tensor),
    }


def _error_message(action: Callable[[], object]) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return ""


def conversion_tp1() -> dict:
    """What fp8_layers and emulation convert (by keywords, by a LayerPrecision and through the
    Megatron-Bridge hook), that parameters stay, and the errors for bad requests."""
    from megatron.core import parallel_state

    from megatron_lowprec.layers.settings import LayerPrecision
    from megatron_lowprec.megatron.layers import apply_layer_precision, pre_wrap_hook

    parallel_state.initialize_model_parallel()
    model = _seeded_model(_config())
    parameters_before = [id(param) for param in model.parameters()]
    keys_before = list(model.state_dict())
    names = apply_layer_precision(model, fp8_layers=True)
    fp8_types = {name: type(model.get_submodule(name)).__name__ for name in names}
    llama, llama_names = _converted(_config(llama=True), fp8_layers=True)
    _, partial_names = _converted(_config(), fp8_layers=True, exclude=("output_layer", "decoder.layers.0"))
    emulated, emulated_names = _converted(_config(), emulation="E8M5", exclude=())
    by_option, by_option_names = _converted(_config(), precision=LayerPrecision(), option="coat")
    hooked = _seeded_model(_config())
    hook = pre_wrap_hook(LayerPrecision(emulate="E8M5", emulate_rounding="stochastic", layers_exclude=[]))
    hooked_chunks = hook([hooked])
    hooked_types = {name: type(module).__name__ for name, module in hooked.named_modules() if "Emulated" in type(module).__name__}
    return {
        "settings_types": {name: type(by_option.get_submodule(name)).__name__ for name in by_option_names},
        "hook_returns_its_chunks": hooked_chunks == [hooked],
        "hook_types": hooked_types,
        "hook_roundings": sorted({hooked.get_submodule(name).emulation.rounding for name in hooked_types}),
        "settings_without_a_flow": apply_layer_precision(
            _seeded_model(_config()), LayerPrecision(layers_exclude=["lm_head"]), option="C"
        ),
        "settings_and_keywords_error": _error_message(
            lambda: apply_layer_precision(_seeded_model(_config()), LayerPrecision(), fp8_layers=True)
        ),
        "fp8_types": fp8_types,
        "llama_types": {name: type(llama.get_submodule(name)).__name__ for name in llama_names},
        "parameters_kept": [id(param) for param in model.parameters()] == parameters_before,
        "state_dict_keys_kept": list(model.state_dict()) == keys_before,
        "partial_names": partial_names,
        "emulated_types": {name: type(emulated.get_submodule(name)).__name__ for name in emulated_names},
        "emulated_formats": sorted(
            {str(emulated.get_submodule(name).emulation.input_format) for name in emulated_names}
        ),
        "unknown_exclude_error": _error_message(
            lambda: apply_layer_precision(_seeded_model(_config()), fp8_layers=True, exclude=("lm_head",))
        ),
        "string_exclude_error": _error_message(
            lambda: apply_layer_precision(_seeded_model(_config()), fp8_layers=True, exclude="output_layer")
        ),
        "both_modes_error": _error_message(
            lambda: apply_layer_precision(_seeded_model(_config()), fp8_layers=True, emulation="E8M5")
        ),
        "second_conversion_error": _error_message(lambda: apply_layer_precision(model, fp8_layers=True)),
        "unchanged_by_failed_conversion": {name: type(model.get_submodule(name)).__name__ for name in names}
        == fp8_types,
    }


def fp8_gradients_tp1() -> dict:
    """One step (two microbatches) of the same weights and data with and without the FP8 flow."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    result = {}
    for architecture, llama in (("gpt", False), ("llama", True)):
        bf16_losses, bf16_grads = _losses_and_grads(_seeded_model(_config(llama=llama)))
        model, _ = _converted(_config(llama=llama), fp8_layers=True)
        fp8_losses, fp8_grads = _losses_and_grads(model)
        result[architecture] = {
            "bf16_losses": bf16_losses, "fp8_losses": fp8_losses, **_comparison(fp8_grads, bf16_grads)
        }
    return result


def _train(model, config, steps: int) -> list[float]:
    """Megatron DDP and megatron's mixed-precision Adam on one fixed batch; the loss of every microbatch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, clip_grad=1.0), [model])
    losses = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.extend(_train_step(model, data_seed=11))
        model.finish_grad_sync()
        optimizer.step()
    return losses


def fp8_training_tp1() -> dict:
    """A Llama-style GPT in the FP8 flow and in BF16, trained from the same weights under megatron DDP."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    config = _config(llama=True)
    fp8_model, _ = _converted(config, fp8_layers=True)
    return {
        "fp8_losses": _train(fp8_model, config, TRAINING_STEPS),
        "bf16_losses": _train(_seeded_model(config), config, TRAINING_STEPS),
    }


def emulation_tp1() -> dict:
    """E8M7 emulation of every linear (LM head included) against no emulation, bit for bit; E8M3 differs."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    result = {}
    for architecture, llama in (("gpt", False), ("llama", True)):
        plain_losses, plain_grads = _losses_and_grads(_seeded_model(_config(llama=llama)))
        e8m7_losses, e8m7_grads = _losses_and_grads(_converted(_config(llama=llama), emulation="E8M7", exclude=())[0])
        e8m3_losses, _ = _losses_and_grads(_converted(_config(llama=llama), emulation="E8M3")[0])
        result[architecture] = {
            "plain_losses": plain_losses,
            "e8m7_losses": e8m7_losses,
            "e8m3_losses": e8m3_losses,
            "grads_identical": all(
                torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(e8m7_grads, plain_grads)
            ),
        }
    return result


def pipeline_parallel_fp8() -> dict:
    """PP=2: the default exclude (the LM head) is valid on the first stage too, which has no LM head;
    one FP8-flow step through the 1F1B schedule."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    config = _transformer_config(pipeline_parallel=2, hidden_dropout=0.0, attention_dropout=0.0)
    model, names = _converted(config, fp8_layers=True)
    losses, grads = _losses_and_grads(model)
    return {
        "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "names": names,
        "losses": losses,
        "grads_finite": bool(torch.isfinite(_flat(grads)).all()),
    }


def _full(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The whole tensor of a tensor-parallel shard, gathered over the tensor-parallel group."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    return torch.cat(_gather(tensor, parallel_state.get_tensor_model_parallel_group()), dim=param.partition_dim)


def tensor_parallel_fp8() -> dict:
    """The GPT at TP=1 and TP=2 (same full weights: use_cpu_initialization), BF16 and FP8 flow."""
    from megatron.core import parallel_state

    runs = {}
    for tensor_parallel in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
        for flow in ("bf16", "fp8"):
            settings = {"fp8_layers": True} if flow == "fp8" else {}
            model, _ = _converted(_config(tensor_parallel=tensor_parallel), **settings)
            losses, grads = _losses_and_grads(model)
            params = list(model.parameters())
            runs[(tensor_parallel, flow)] = {
                "losses": losses,
                "weights": [_full(param.detach(), param) for param in params],
                "grads": [_full(grad, param) for grad, param in zip(grads, params)],
            }
        parallel_state.destroy_model_parallel()
    return {
        "same_weights": all(
            torch.equal(a, b) for a, b in zip(runs[(2, "fp8")]["weights"], runs[(1, "fp8")]["weights"])
        ),
        "losses": {f"tp{tp}_{flow}": run["losses"] for (tp, flow), run in runs.items()},
        "bf16_tp2_vs_tp1": _comparison(runs[(2, "bf16")]["grads"], runs[(1, "bf16")]["grads"]),
        "fp8_tp2_vs_tp1": _comparison(runs[(2, "fp8")]["grads"], runs[(1, "fp8")]["grads"]),
        "fp8_tp1_vs_bf16_tp1": _comparison(runs[(1, "fp8")]["grads"], runs[(1, "bf16")]["grads"]),
    }


SCENARIOS: tuple[Callable[[], dict], ...] = (
    conversion_tp1,
    fp8_gradients_tp1,
    emulation_tp1,
    fp8_training_tp1,
    tensor_parallel_fp8,
    pipeline_parallel_fp8,
)


def main(result_dir: Path) -> None:
    """Run the scenarios in order, stopping at the first failure (the other rank then fails fast)."""
    result_file = result_dir / f"rank{os.environ['RANK']}.json"
    results: dict[str, dict] = {}
    with cpu_bridge.cpu_bridge():
        init_process_group(timeout_seconds=60)
        try:
            run_scenarios(SCENARIOS, results, result_file)
        finally:
            torch.distributed.destroy_process_group()
    result_file.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
