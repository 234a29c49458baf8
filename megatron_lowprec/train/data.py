"""The run's tokenizer and ``GPTDataset`` splits, and the micro-batches of each global batch.

Sample order follows megatron's pretraining sampler: global batch ``s`` holds samples
``[s x G, (s + 1) x G)``; micro-batch ``j`` of data-parallel rank ``r`` takes
``s x G + j x (b x DP) + r x b + [0, b)`` for micro-batch size ``b``. The data position is therefore
the iteration alone, which checkpoints store, and every rank reads its own samples (tensor- and
pipeline-parallel peers read the same ones).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_lowprec.train.config import ConfigError, TrainConfig

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclasses.dataclass
class TrainingData:
    """The tokenizer and the train and validation splits."""

    tokenizer: object
    train: object
    valid: object


def _tokenizer(config: TrainConfig):
    from megatron_lowprec.data import build_tokenizer, prepare_embedded_default

    data = config.data
    if data.kind == "embedded":
        if torch.distributed.get_rank() == 0:
            embedded = prepare_embedded_default(data.cache_dir)
        torch.distributed.barrier()
        if torch.distributed.get_rank() != 0:
            embedded = prepare_embedded_default(data.cache_dir)
        return embedded.tokenizer(), [embedded.data_prefix]
    tokenizer = build_tokenizer(
        data.tokenizer_type,
        tokenizer_dir=data.tokenizer_dir,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        sentencepiece_model=data.sentencepiece_model,
    )
    return tokenizer, list(data.data_prefix)


def build_training_data(config: TrainConfig) -> TrainingData:
    """Prepare the embedded corpus on first use (rank 0 while the others wait) and build the splits
    with ``BlendedMegatronDatasetBuilder``, sized for ``max_steps`` and one evaluation."""
    from megatron_lowprec.data import build_gpt_datasets

    tokenizer, prefixes = _tokenizer(config)
    global_batch = config.trainer.global_batch_size
    train, valid, _ = build_gpt_datasets(
        prefixes,
        tokenizer,
        seq_length=config.model.seq_length,
        num_samples=(max(config.trainer.max_steps, 1) * global_batch, config.trainer.eval_iters * global_batch, None),
        split=config.data.split,
        seed=config.trainer.seed,
        weights=config.data.data_weights,
        cache_dir=config.data.cache_dir,
        create_attention_mask=False,
    )
    if train is None or valid is None:
        raise ConfigError(f"data.split={config.data.split!r} leaves no training or no validation samples")
    return TrainingData(tokenizer, train, valid)


def batches(dataset, config: TrainConfig, first_sample: int, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch starting at ``first_sample``, on
    the current CUDA device (as Megatron-LM's ``get_batch`` moves them)."""
    from megatron.core import parallel_state

    micro = config.trainer.micro_batch_size
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    result = []
    for microbatch in range(num_microbatches):
        start = first_sample + microbatch * micro * dp_size + dp_rank * micro
        samples = [dataset[index % len(dataset)] for index in range(start, start + micro)]
        result.append(
            {
                key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]).cuda(non_blocking=True)
                for key in BATCH_KEYS
            }
        )
    return result
