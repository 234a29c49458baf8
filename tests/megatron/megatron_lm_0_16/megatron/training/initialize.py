"""Megatron-LM 0.16's ``initialize_megatron``: ``parse_args`` bound here by name (which the plugin
replaces in this module too), ``validate_args``, the global arguments, model parallelism."""

from megatron.core import parallel_state

from megatron.training import set_args
from megatron.training.arguments import parse_args, validate_args


def initialize_megatron(extra_args_provider=None, args_defaults=None):
    """Arguments parsed and validated, then model parallelism over the existing process group."""
    args = parse_args(extra_args_provider, False)
    validate_args(args)
    set_args(args)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
