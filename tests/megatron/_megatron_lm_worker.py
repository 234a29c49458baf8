"""One rank of the Megatron-LM entry checks: megatron's own ``megatron.training`` (shipped in the
megatron-core package from 0.17) with :func:`megatron_lowprec.megatron.megatron_lm.install`.

Launched by ``test_megatron_lm.py`` as ``python _megatron_lm_worker.py RESULT_DIR SCENARIO JSON``; the
JSON holds the command-line arguments after Megatron-LM's script name. Megatron-LM's
``initialize_megatron`` parses them (through the installed ``parse_args``) and sets up gloo and model
parallelism, then its ``setup_model_and_optimizer`` builds a tiny GPT from a model provider written
here and the optimizer, and its ``train_step`` trains a few iterations. Writes ``RESULT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import torch

from megatron_lowprec.megatron import megatron_lm

VOCAB_SIZE = 128
SEQ_LENGTH = 32
MICRO_BATCH_SIZE = 2


def model_provider(pre_process=True, post_process=True, vp_stage=None, **_):
    """A GPTModel with megatron's local layer spec, configured from Megatron-LM's arguments."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
    )


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(SEQ_LENGTH, device=torch.cuda.current_device()).expand(MICRO_BATCH_SIZE, -1)
    output = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _batches(step: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(step * 100 + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator)
    return [tokens.to(torch.cuda.current_device())]


def _initialize_megatron(args_defaults: dict) -> None:
    """What ``pretrain_gpt.py`` does before training: from 0.18 ``parse_and_validate_args`` parses the
    arguments and ``initialize_megatron`` takes none; until 0.17 ``initialize_megatron`` parses them."""
    from megatron.training import arguments, training

    if hasattr(arguments, "parse_and_validate_args"):
        arguments.parse_and_validate_args(args_defaults=args_defaults)
        training.initialize_megatron()
    else:
        training.initialize_megatron(args_defaults=args_defaults)


def pretrain_routing(argv: list[str], steps: int) -> dict:
    """Megatron-LM's argument parsing, model and optimizer construction with the plugin installed
    (the plugin's lines kept), then ``steps`` iterations of Megatron-LM's ``train_step``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, training

    sys.argv = ["pretrain_gpt.py", *argv]
    cpu_trial = megatron_lm.activate_cpu_trial()
    megatron_lm.install()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _initialize_megatron({"tokenizer_type": "NullTokenizer"})
        model, optimizer, scheduler = training.setup_model_and_optimizer(
            model_provider_func=model_provider, model_type=ModelType.encoder_or_decoder
        )
    print(printed.getvalue(), end="", flush=True)
    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    losses = []
    for step in range(steps):
        result = training.train_step(
            _forward_step, RerunDataIterator(iter(_batches(step))), model, optimizer, scheduler, config,
            get_forward_backward_func(),
            iteration=step,
        )
        losses.append(float(result[0]["lm loss"]))
        assert not result[1], "megatron's train_step skipped the iteration"
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = chained[0].optimizer
    layers = [type(module).__name__ for module in model[0].modules()]
    return {
        **_muon_settings(model[0], chained),
        "cpu_trial": cpu_trial,
        "plugin_lines": [line for line in printed.getvalue().splitlines() if line.startswith("megatron-lowprec:")],
        "lowprec_option": args.lowprec_option,
        "optimizer": type(optimizer).__name__,
        "option": getattr(getattr(inner, "strategy", None), "name", None),
        "seed": getattr(inner, "seed", None),
        "fp8_linears": sum(name.startswith("FP8") and name.endswith("ParallelLinear") for name in layers),
        "emulated_linears": sum(name.startswith("Emulated") for name in layers),
        "losses_finite": all(math.isfinite(loss) for loss in losses),
        "losses": losses,
        "weight_decays": sorted({group["weight_decay"] for group in optimizer.param_groups}),
    }


def _muon_settings(model, chained) -> dict:
    """With ``--optimizer muon``: the chained optimizers' classes, the Muon group's settings and the
    names of the parameters Muon updates."""
    from megatron_lowprec.optim import Muon

    muon = [inner.optimizer for inner in chained if isinstance(inner.optimizer, Muon)]
    if not muon:
        return {}
    group = muon[0].param_groups[0]
    names = {param: name for name, param in model.named_parameters()}
    return {
        "chained": [type(inner.optimizer).__name__ for inner in chained],
        "muon_group": {key: group[key] for key in ("momentum", "nesterov", "ns_steps", "scale_mode", "extra_scale_factor")},
        "muon_params": sorted(names[param] for group in muon[0].param_groups for param in group["params"]),
        "split_rows": {names[param]: list(rows) for param in names if (rows := muon[0].split_rows(param))},
    }


LOSSES: list[float] = []
"""The loss of every micro-batch this rank computed the loss of (last pipeline stage)."""


def _gpt_datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """``pretrain_gpt.py``'s dataset provider, built on every rank (``is_distributed``): the indexed
    dataset of ``--data-path``, else ``--mock-data``'s. Tensor-parallel ranks read the same samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length,
        blend=None if args.mock_data else (args.data_path, None), split=args.split,
        tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset, train_valid_test_num_samples, lambda: True, config
    ).build()


_gpt_datasets_provider.is_distributed = True


def _gpt_forward_step(data_iterator, model):
    """``pretrain_gpt.py``'s forward step on a batch every rank reads itself; the loss per token."""
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    loss_mask = batch["loss_mask"].to(device)
    output = model(
        batch["tokens"].to(device), batch["position_ids"].to(device), None,
        labels=batch["labels"].to(device), loss_mask=loss_mask,
    )

    def loss_func(per_token_loss):
        loss_sum = (per_token_loss.float().view(-1) * loss_mask.view(-1)).sum()
        tokens = loss_mask.sum().to(torch.int)
        LOSSES.append(float(loss_sum / tokens))
        return loss_sum, tokens, {"lm loss": torch.cat([loss_sum.detach().view(1), tokens.float().view(1)])}

    return output, loss_func


def pretrain_gpt(argv: list[str]) -> dict:
    """Megatron-LM's own ``pretrain`` (initialisation, model, optimizer, training loop, evaluation,
    checkpoints), as its ``pretrain_gpt.py`` calls it at the installed version, with the plugin."""
    from megatron.core.enums import ModelType
    from megatron.training import arguments, training

    sys.argv = ["pretrain_gpt.py", *argv]
    megatron_lm.activate_cpu_trial()
    megatron_lm.install()
    defaults = {"tokenizer_type": "NullTokenizer"}
    try:
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    except ImportError:
        training.pretrain(_gpt_datasets_provider, model_provider, ModelType.encoder_or_decoder, _gpt_forward_step,
                          args_defaults=defaults)
    else:
        args = arguments.parse_and_validate_args(args_defaults=defaults)
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        training.pretrain(container, _gpt_datasets_provider, ModelType.encoder_or_decoder, _gpt_forward_step)
    from megatron.core import parallel_state

    return {
        "losses": LOSSES,
        "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "data_rank": parallel_state.get_data_parallel_rank(),
    }


SCENARIOS = {f.__name__: f for f in (pretrain_routing, pretrain_gpt)}


def main(result_dir: Path, scenario: str, arguments: dict) -> None:
    result = SCENARIOS[scenario](**arguments)
    (result_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
