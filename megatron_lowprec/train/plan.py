"""What a config will do, in words: the text ``trainer.dry_run=true`` prints after the resolved config."""

from __future__ import annotations

from megatron_lowprec.train.config import (
    TrainConfig, data_parallel_size, option_label, precision_strategy, reduces_grads_in_fp32,
)
from megatron_lowprec.optim.strategies import LOW_PRECISION_BYTES
from megatron_lowprec.train.model import attention_backend, padded_vocab_size
from megatron_lowprec.train.model_size import parameter_count


def _vocab_size(config: TrainConfig) -> int | None:
    from megatron_lowprec.data.prepare import EMBEDDED_DEFAULT_VOCAB_SIZE

    if config.model.vocab_size is not None:
        return config.model.vocab_size
    return EMBEDDED_DEFAULT_VOCAB_SIZE if config.data.kind == "embedded" else None


def _state_shards(config: TrainConfig, dp: int) -> int:
    """Ranks that megatron's distributed optimizer divides the optimizer state over (1 without it)."""
    return dp if config.optimizer.use_distributed_optimizer else 1


def _bytes_per_param(config: TrainConfig, dp: int) -> float:
    """Bytes per parameter on each rank as allocated: parameter, gradient buffer, optimizer state."""
    strategy = precision_strategy(config.precision)
    return strategy.bytes_per_param(
        grad_reduce_in_fp32=reduces_grads_in_fp32(config.precision), state_shards=_state_shards(config, dp)
    )


def _bytes_text(config: TrainConfig, dp: int) -> str:
    """The bytes/param of ``config`` and what they are made of."""
    strategy = precision_strategy(config.precision)
    fp32 = reduces_grads_in_fp32(config.precision)
    shards = _state_shards(config, dp)
    state = strategy.state_bytes(strategy.fp8_group_size) / strategy.fp8_group_size / shards
    sharded = f" (sharded over DP {shards})" if shards > 1 else ""
    return (
        f"{_bytes_per_param(config, dp):g} bytes/param: {LOW_PRECISION_BYTES} parameter + {strategy.grad_bytes(fp32)} "
        f"gradient (precision.grad_reduce_in_fp32={str(fp32).lower()}) + {state:g} optimizer state{sharded}"
    )


def describe(config: TrainConfig, world_size: int, world_size_note: str = "") -> str:
    """Layout, batch arithmetic, model size and optimizer memory of ``config`` on ``world_size`` ranks;
    ``world_size_note`` says where that world size comes from when it was not launched."""
    trainer, model = config.trainer, config.model
    strategy = precision_strategy(config.precision)
    dp = data_parallel_size(config, world_size)
    microbatches = trainer.global_batch_size // (trainer.micro_batch_size * dp)
    tokens_per_step = trainer.global_batch_size * model.seq_length
    lines = [
        "plan:",
        f"  ranks: {world_size} = TP {trainer.tensor_model_parallel_size} x PP "
        f"{trainer.pipeline_model_parallel_size} x DP {dp}" + (f" ({world_size_note})" if world_size_note else ""),
        f"  batch: global {trainer.global_batch_size} = micro {trainer.micro_batch_size} x DP {dp} x "
        f"{microbatches} accumulated micro-batches; {tokens_per_step:,} tokens/step",
        f"  steps: {trainer.max_steps} ({trainer.max_steps * tokens_per_step:,} tokens), "
        f"warmup {config.optimizer.lr_warmup_steps}, {config.optimizer.lr_decay_style} decay "
        f"{config.optimizer.lr:g} -> {config.optimizer.min_lr:g}",
        f"  precision: option {option_label(config.precision)}, {_bytes_text(config, dp)}",
        f"  attention: {attention_backend(config)} (model.attention_backend={model.attention_backend})",
    ]
    vocab_size = _vocab_size(config)
    if vocab_size is None:
        lines.append("  model: parameter count needs model.vocab_size (the tokenizer's is read at run time)")
    else:
        padded = padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by, trainer.tensor_model_parallel_size)
        count = parameter_count(model, padded)
        per_rank = count / (trainer.tensor_model_parallel_size * trainer.pipeline_model_parallel_size)
        lines.append(
            f"  model: {model.name}, {count / 1e6:,.1f}M parameters (vocab {padded}); "
            f"~{per_rank * _bytes_per_param(config, dp) / 2**30:,.2f} GiB of parameters, gradients and optimizer state per rank"
        )
        state = per_rank * strategy.state_bytes(strategy.fp8_group_size) / strategy.fp8_group_size / 2**30
        chosen = "sharded" if config.optimizer.use_distributed_optimizer else "unsharded"
        lines.append(
            f"  optimizer state per rank: {state:,.3f} GiB unsharded, {state / dp:,.3f} GiB sharded over DP {dp} "
            f"(optimizer.use_distributed_optimizer={str(config.optimizer.use_distributed_optimizer).lower()}: {chosen})"
        )
    return "\n".join(lines)
