"""The megatron-core ``GPTModel`` of a :class:`~megatron_lowprec.train.config.ModelConfig`."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_lowprec.train.config import TrainConfig


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's vocabulary padding: round up to a multiple of ``make_divisible_by x TP``."""
    multiple = make_divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


MASKED_SOFTMAX_EXTENSIONS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
"""The compiled softmax kernels megatron's ``FusedScaleMaskSoftmax`` imports (built with apex or Megatron-LM)."""
GRADIENT_ACCUMULATION_EXTENSION = "fused_weight_gradient_mlp_cuda"
"""apex's weight-gradient GEMM that accumulates into ``main_grad`` (megatron's local linears)."""
TRANSFORMER_ENGINE = "transformer_engine"


def importable(module_name: str) -> bool:
    """Whether ``module_name`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def uses_transformer_engine_spec(config: TrainConfig) -> bool:
    """Transformer Engine's layer spec: asked for, or needed by TE's own FP8."""
    return config.model.transformer_impl == "transformer_engine" or config.precision.te_fp8_recipe is not None


def megatron_fusions(config: TrainConfig, cuda: bool) -> dict[str, bool]:
    """Megatron's fusion flags, each on only where its kernel exists, so that a missing extension
    never stops a run (Megatron-LM turns them on by default and fails without apex):

    - ``bias_activation_fusion``, ``bias_dropout_fusion``: TorchScript/``torch.compile`` fusions that
      run on any CUDA device (bias+GELU only with a bias and no gated unit);
    - ``masked_softmax_fusion``: megatron's ``FusedScaleMaskSoftmax`` kernels importable;
    - ``gradient_accumulation_fusion``: Transformer Engine's spec (its linears accumulate into
      ``main_grad``), or apex's ``fused_weight_gradient_mlp_cuda`` for the local spec;
    - ``persist_layer_norm``, ``apply_rope_fusion``: Transformer Engine's spec (megatron's local spec
      builds torch norms, which reject ``persist_layer_norm``; the fused RoPE kernel is TE's).
    """
    model = config.model
    te_spec = cuda and uses_transformer_engine_spec(config) and importable(TRANSFORMER_ENGINE)
    return {
        "bias_activation_fusion": cuda and model.add_bias_linear and model.activation != "swiglu",
        "bias_dropout_fusion": cuda,
        "masked_softmax_fusion": cuda and all(importable(name) for name in MASKED_SOFTMAX_EXTENSIONS),
        "gradient_accumulation_fusion": te_spec or (cuda and importable(GRADIENT_ACCUMULATION_EXTENSION)),
        "persist_layer_norm": te_spec,
        "apply_rope_fusion": te_spec,
    }


def transformer_config(config: TrainConfig):
    """Megatron's ``TransformerConfig`` for the model, the parallel layout and BF16 parameters, with
    the fusions of :func:`megatron_fusions` and megatron's ``deterministic_mode`` under
    ``trainer.deterministic``."""
    from megatron.core.transformer import TransformerConfig

    model, trainer = config.model, config.trainer
    te_fp8 = config.precision.te_fp8_recipe
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        activation_func=F.silu if swiglu else F.gelu,
        gated_linear_unit=swiglu,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=trainer.tensor_model_parallel_size,
        pipeline_model_parallel_size=trainer.pipeline_model_parallel_size,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=model.use_cpu_initialization,
        deterministic_mode=trainer.deterministic,
        **megatron_fusions(config, torch.cuda.is_available()),
        fp8="hybrid" if te_fp8 else None,
        fp8_recipe=te_fp8 or "delayed",
    )


def attention_backend(config: TrainConfig) -> str:
    """``model.attention_backend`` with ``auto`` resolved: TE's attention in TE's layer spec, PyTorch's
    SDPA in the local one."""
    backend = config.model.attention_backend
    if backend != "auto":
        return backend
    return "te" if uses_transformer_engine_spec(config) else "sdpa"


def layer_spec(config: TrainConfig):
    """Megatron's local (plain torch) layer spec, or Transformer Engine's when asked for or when TE's
    FP8 runs (``validate`` has checked that it is installed), with the core attention of
    :func:`attention_backend`."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_lowprec.megatron.attention import with_core_attention

    if uses_transformer_engine_spec(config):
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.model.normalization)
    return with_core_attention(spec, attention_backend(config))


def apply_layer_precision(config: TrainConfig, module) -> list[str]:
    """COAT's FP8 layer flow or the ExMy emulation in the built model (model converters); the
    names of the converted modules."""
    from megatron_lowprec.megatron.layers import apply_layer_precision as convert

    return convert([module], config.precision, option=config.precision.option)


def gpt_model(config: TrainConfig, vocab_size: int, pre_process: bool = True, post_process: bool = True):
    """A BF16 ``GPTModel`` for this rank's pipeline stage (the whole model when ``pre_process`` and
    ``post_process``), in megatron's ``Float16Module``, with the FP8 layer flow or the ExMy
    emulation applied when the precision config asks, on the current CUDA device (as Megatron-LM's
    ``get_model`` places it: modules that megatron does not initialise on the device themselves,
    such as torch's norms, are built on the CPU). ``vocab_size`` is already padded."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    transformer = transformer_config(config)
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=layer_spec(config),
        vocab_size=vocab_size,
        max_sequence_length=config.model.max_position_embeddings or config.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not config.model.untie_embeddings_and_output_weights,
        position_embedding_type=config.model.position_embedding_type,
        rotary_percent=config.model.rotary_percent,
        rotary_base=config.model.rotary_base,
    )
    model.cuda(torch.cuda.current_device())
    wrapped = Float16Module(transformer, model)
    apply_layer_precision(config, wrapped)
    return wrapped
