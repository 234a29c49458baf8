"""A stand-in for Megatron-LM core_v0.16's ``megatron.training``, which megatron-core 0.16's wheel does
not ship: only what the plugin's ``install()`` and the optimizer construction of
``setup_model_and_optimizer`` reach, each name bound in the module where Megatron-LM 0.16 binds it.
``tests/megatron/_megatron_lm_call_pattern_worker.py`` puts its parent folder on ``sys.path``."""

_ARGS = None


def get_args():
    """The parsed arguments, as Megatron-LM's ``global_vars.get_args``."""
    return _ARGS


def set_args(args) -> None:
    global _ARGS
    _ARGS = args
