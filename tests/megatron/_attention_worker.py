"""One rank of the SDPA core-attention checks: tiny megatron GPTs on gloo with the CPU bridge.

Launched by ``test_attention.py`` as ``python _attention_worker.py RESULT_DIR`` on two ranks, with
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` set. Each scenario builds the same
seeded GPT twice, once with megatron's ``DotProductAttention`` and once with ``SDPAttention`` in
the local layer spec (core attention has no parameters, so the weights are identical), and runs one
forward-backward step of two micro-batches through megatron's schedule on the same data.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _cpu_bridge_worker import (
    MICRO_BATCH_SIZE,
    SEQ_LENGTH,
    VOCAB_SIZE,
    _flat,
    _seeded_model,
    _train_step,
    _transformer_config,
    run_scenarios,
)

from megatron_lowprec.megatron import cpu as cpu_bridge
from tests.megatron.launch import init_process_group


def _model(config, backend: str):
    """The bridge checks' tiny GPT (RoPE, tied embeddings), seeded, with ``backend``'s core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lowprec.megatron.attention import with_core_attention

    return _seeded_model(config, with_core_attention(get_gpt_layer_local_spec(), backend))


def _comparison(model, reference) -> dict:
    grads = _flat(param.grad for param in model.parameters()).double()
    reference_grads = _flat(param.grad for param in reference.parameters()).double()
    return {
        "grad_relative_error": float((grads - reference_grads).norm() / reference_grads.norm()),
        "grads_nonzero": bool(reference_grads.norm() > 0),
    }


def _eval_logits(model) -> torch.Tensor:
    """Forward only, in eval mode: the logits of one fixed batch."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH), generator=generator).cuda()
    position_ids = torch.arange(SEQ_LENGTH, device=torch.cuda.current_device()).expand(MICRO_BATCH_SIZE, -1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, position_ids, None)
    model.train()
    return logits.float()


def _equivalence(tensor_parallel: int) -> dict:
    """Multi-head (4 heads) and grouped-query (4 heads, 2 groups) GPTs without dropout, both backends."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    result = {"tensor_parallel_size": parallel_state.get_tensor_model_parallel_world_size()}
    for name, groups in (("mha", None), ("gqa", 2)):
        config = _transformer_config(
            tensor_parallel=tensor_parallel, hidden_dropout=0.0, attention_dropout=0.0, num_query_groups=groups
        )
        unfused, sdpa = _model(config, "unfused"), _model(config, "sdpa")
        unfused_logits, sdpa_logits = _eval_logits(unfused), _eval_logits(sdpa)
        result[name] = {
            "core_attention": type(sdpa.module.decoder.layers[0].self_attention.core_attention).__name__,
            "unfused_losses": _train_step(unfused, data_seed=7),
            "sdpa_losses": _train_step(sdpa, data_seed=7),
            "logits_max_abs_error": float((sdpa_logits - unfused_logits).abs().max()),
            "logits_max_abs": float(unfused_logits.abs().max()),
            **_comparison(sdpa, unfused),
        }
    return result


def equivalence_tp1() -> dict:
    return _equivalence(1)


def equivalence_tp2() -> dict:
    return _equivalence(2)


def dropout_tp2() -> dict:
    """Attention dropout 0.5 (no hidden dropout) at TP=2: drawn from the tracker's model-parallel
    stream, not torch's default generator; reproducible from the seed and under full recompute."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    settings = dict(tensor_parallel=2, hidden_dropout=0.0, attention_dropout=0.5)
    model = _model(_transformer_config(**settings), "sdpa")
    default_state = torch.get_rng_state()
    losses = _train_step(model, data_seed=7)
    default_generator_untouched = torch.equal(torch.get_rng_state(), default_state)
    again = _train_step(_model(_transformer_config(**settings), "sdpa"), data_seed=7)
    recomputed = _model(
        _transformer_config(**settings, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        "sdpa",
    )
    recomputed_losses = _train_step(recomputed, data_seed=7)
    without_dropout = _train_step(
        _model(_transformer_config(tensor_parallel=2, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"), data_seed=7
    )
    return {
        "losses": losses,
        "again": again,
        "recomputed_losses": recomputed_losses,
        "recompute_grads_equal": torch.equal(
            _flat(param.grad for param in model.parameters()), _flat(param.grad for param in recomputed.parameters())
        ),
        "without_dropout": without_dropout,
        "default_generator_untouched": default_generator_untouched,
    }


def unsupported_settings_tp1() -> dict:
    """Sliding windows and softmax offsets are refused when the model is built."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    errors = {}
    for name, setting in (("window", {"window_size": (4, 0)}), ("softmax", {"softmax_type": "off-by-one"})):
        try:
            _model(_transformer_config(**setting), "sdpa")
            errors[name] = ""
        except ValueError as error:
            errors[name] = str(error)
    return errors


def deterministic_backends_tp1() -> dict:
    """The SDPA backends each forward of a GPT built with and without megatron's ``deterministic_mode``
    may choose from."""
    from megatron.core import parallel_state

    from megatron_lowprec.megatron import attention

    parallel_state.initialize_model_parallel()
    allowed = {}
    sdpa = attention.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        backends = ("flash", "mem_efficient", "math", "cudnn")
        allowed[mode] = [name for name in backends if getattr(torch.backends.cuda, f"{name}_sdp_enabled")()]
        return sdpa(*args, **kwargs)

    attention.F.scaled_dot_product_attention = recording
    try:
        for mode in (True, False):
            _eval_logits(_model(_transformer_config(deterministic_mode=mode), "sdpa"))
    finally:
        attention.F.scaled_dot_product_attention = sdpa
    return {"deterministic": allowed[True], "default": allowed[False]}


SCENARIOS: tuple[Callable[[], dict], ...] = (
    equivalence_tp1, equivalence_tp2, dropout_tp2, unsupported_settings_tp1, deterministic_backends_tp1,
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


if __name__ == "__main__":
    main(Path(sys.argv[1]))
