"""Megatron-LM 0.16's optimizer construction in ``setup_model_and_optimizer``: megatron-core's
``get_megatron_optimizer`` and ``get_megatron_muon_optimizer`` imported into this module by name, an
Adam config from the arguments for ``adam``, ``muon`` and ``dist_muon`` alike, the standard
overrides, and the ``'muon' in config.optimizer`` branch that calls the Muon builder, which looks
the name up in this module's globals (where the plugin's ``install()`` replaces it)."""

import dataclasses

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import AdamOptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer.muon import get_megatron_muon_optimizer

from megatron.training import get_args


def get_model(model_provider_func, model_type):
    """The provider's model (Float16Module included) in megatron's DDP, as one chunk."""
    args = get_args()
    module = model_provider_func(pre_process=True, post_process=True)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer
    )
    return [DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)]


def get_megatron_optimizer_config(args):
    """An ``AdamOptimizerConfig`` of the arguments' fields for Adam and Muon, and the standard overrides."""
    fields = {field.name: getattr(args, field.name) for field in dataclasses.fields(AdamOptimizerConfig) if hasattr(args, field.name)}
    config = AdamOptimizerConfig(**fields)
    return config, get_standard_config_overrides(config=config)


def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
    """The model, then the optimizer through the builder 0.16 calls for ``--optimizer``; no scheduler."""
    args = get_args()
    model = get_model(model_provider_func, model_type)
    config, config_overrides = get_megatron_optimizer_config(args)
    config.timers = None
    if "muon" not in config.optimizer:
        optimizer = get_megatron_optimizer(
            config, model, config_overrides=config_overrides, use_gloo_process_groups=True,
            dump_param_to_param_group_map=None,
        )
    else:
        optimizer = get_megatron_muon_optimizer(
            config, model, config_overrides=config_overrides, use_gloo_process_groups=True,
            layer_wise_distributed_optimizer="dist" in config.optimizer,
        )
    return model, optimizer, None
