"""A precision option in Megatron-Bridge's ``pretrain()``, with megatron-core's local layers (no
Transformer Engine layers) and mock data.

``torchrun --nproc-per-node 2 examples/megatron_bridge_pretrain.py --option C`` on GPUs (nccl) or on a
CPU (gloo ranks through the CUDA→CPU bridge), where ``python examples/megatron_bridge_pretrain.py
--option C`` runs one rank. It trains a tiny GPT for a few iterations, evaluates, and saves a ``torch_dist``
checkpoint with Bridge's ``run_config.yaml`` under ``--output-dir``; run it again with a larger
``--train-iters`` to resume from it.
"""

from __future__ import annotations

import argparse
import os

import torch

VOCAB_SIZE, SEQ_LENGTH = 128, 64


def recipe(option: str, output_dir: str, train_iters: int):
    """Bridge's ``ConfigContainer`` for a tiny GPT on megatron-core's local layer spec, with the
    precision option's optimizer config in place of Bridge's ``OptimizerConfig``."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    from megatron_lowprec.megatron.optimizer import LowPrecisionOptimizerConfig

    on_cpu = not torch.cuda.is_available()
    return ConfigContainer(
        model=GPTModelProvider(
            transformer_layer_spec=local_layer_spec,
            num_layers=2,
            hidden_size=64,
            ffn_hidden_size=256,
            num_attention_heads=4,
            seq_length=SEQ_LENGTH,
            vocab_size=VOCAB_SIZE,
            make_vocab_size_divisible_by=VOCAB_SIZE,
            position_embedding_type="rope",
            bf16=True,
            params_dtype=torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # CUDA kernels and extensions; the CPU bridge's docstring lists why each is off there.
            masked_softmax_fusion=not on_cpu,
            cross_entropy_loss_fusion=not on_cpu,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        ),
        train=TrainingConfig(train_iters=train_iters, global_batch_size=8, micro_batch_size=4),
        validation=ValidationConfig(eval_interval=train_iters, eval_iters=2),
        optimizer=LowPrecisionOptimizerConfig(
            lowprec_option=option, lr=3e-3, min_lr=3e-4, weight_decay=0.1, bf16=True, clip_grad=1.0,
        ),
        scheduler=SchedulerConfig(
            lr_warmup_iters=2, lr_decay_style="cosine", start_weight_decay=0.1, end_weight_decay=0.1,
            weight_decay_incr_style="constant", override_opt_param_scheduler=True,
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=SEQ_LENGTH, random_seed=1234, reset_position_ids=False, reset_attention_mask=False,
            eod_mask_loss=False, dataloader_type="single", num_workers=0,
        ),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB_SIZE),
        checkpoint=CheckpointConfig(
            save=os.path.join(output_dir, "checkpoints"), load=os.path.join(output_dir, "checkpoints"),
            save_interval=train_iters, ckpt_format="torch_dist",
        ),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo" if on_cpu else "nccl"),
    )


def prepare_bridge_start_up() -> None:
    """What Bridge 0.6.2's start-up needs here. Its ``initialize_megatron`` runs megatron's dataset
    ``compile_helpers`` (``make`` in ``megatron/core/datasets``), which exits where megatron-core was
    installed by pip: its wheel ships the helpers built and no Makefile. Without CUDA: the CPU bridge,
    ``initialize_megatron(allow_no_cuda=True)`` (Bridge's ``setup`` asserts CUDA otherwise), and one
    "device" per local rank whose ``set_device`` changes nothing."""
    import functools
    import importlib.util

    from megatron.bridge.training import initialize, setup

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        initialize.compile_helpers = lambda: None
    if torch.cuda.is_available():
        return
    from megatron_lowprec.megatron.cpu import activate_cpu_bridge

    activate_cpu_bridge()
    setup.initialize_megatron = functools.partial(setup.initialize_megatron, allow_no_cuda=True)
    local_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.cuda.device_count = lambda: local_ranks
    torch.cuda.set_device = lambda device: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--option", default="C", help="the precision option (default C)")
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--output-dir", default="bridge_run")
    args = parser.parse_args()

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(name, value)
    prepare_bridge_start_up()

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(recipe(args.option, args.output_dir, args.train_iters), forward_step)


if __name__ == "__main__":
    main()
