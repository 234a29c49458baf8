"""Use a precision option from an existing Megatron training script: ``build_optimizer`` in place of
``get_megatron_optimizer``.

Runs anywhere: ``torchrun --nproc_per_node 2 examples/megatron_build_optimizer.py --option C`` on GPUs,
or plainly ``python examples/megatron_build_optimizer.py`` on a CPU (gloo, one rank, through the
CUDA→CPU bridge). It trains a tiny GPT to memorise a few random sequences and prints the loss, the
gradient norm, and Collage's EDQ and imprecision % of every step.
"""

from __future__ import annotations

import argparse
import os

import torch

VOCAB_SIZE, SEQ_LENGTH, MICRO_BATCH_SIZE = 128, 32, 4


def build_model(tensor_parallel: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=tensor_parallel,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        position_embedding_type="rope",
    )
    gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))


def train(option: str, steps: int, tensor_parallel: int) -> None:
    from megatron.core import parallel_state, tensor_parallel as tp
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lowprec.megatron.optimizer import build_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    tp.model_parallel_cuda_manual_seed(1234)
    model = build_model(tensor_parallel)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta2=0.95, bf16=True, clip_grad=1.0)
    optimizer = build_optimizer(option, [model], optimizer_config, track_update_quality=True)

    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    sequences = torch.randint(0, VOCAB_SIZE, (2, MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        position_ids = torch.arange(SEQ_LENGTH, device=torch.cuda.current_device()).expand(MICRO_BATCH_SIZE, -1)
        output = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
        return output, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach()})

    for step in range(steps):
        tokens = tp.broadcast_data(["tokens"], {"tokens": sequences[step % 2]}, torch.int64)["tokens"]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ_LENGTH,
            micro_batch_size=MICRO_BATCH_SIZE,
            forward_only=False,
        )
        model.finish_grad_sync()
        success, grad_norm, _ = optimizer.step()
        quality = optimizer.update_quality()
        if torch.distributed.get_rank() == 0:
            print(
                f"step {step:3d}  loss {float(losses[0]['loss']):.4f}  grad norm {grad_norm:.3f}  "
                f"EDQ {quality.edq:.3e}  imprecision {quality.imprecision_percent:.2f}%  ok={success}"
            )
    parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--option", default="C", help="precision option, e.g. A, B, C, D, D-MW, kahan, sr, coat")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args()

    from megatron_lowprec.megatron.notices import quiet_library_notices

    quiet_library_notices()
    from megatron_lowprec.megatron.cpu import activate_cpu_bridge
    from megatron_lowprec.optim import get_strategy

    get_strategy(args.option)
    on_cpu = activate_cpu_bridge()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("gloo" if on_cpu else "nccl")
    try:
        train(args.option, args.steps, args.tensor_parallel)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
