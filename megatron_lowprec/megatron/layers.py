"""Model converters that put the layers/ flows into a built megatron-core model (torchtitan-style).

Call :func:`apply_layer_precision` after the GPTModel (local spec, ``get_gpt_layer_local_spec``) is
built and before it is wrapped in megatron's DistributedDataParallel. Modules keep their parameters
(the same Parameter objects, so state dicts and checkpoints are unchanged); converted modules get
a subclass of their class (or, for norms, a drop-in replacement) whose only change is the arithmetic:

- Linears (``ColumnParallelLinear`` / ``RowParallelLinear``): their ``_forward_impl``, the call megatron
  makes with (input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, ...), runs the
  matmul through :func:`~megatron_lowprec.layers.fp8_linear` (COAT section 5.2) or
  :func:`~megatron_lowprec.layers.emulated_linear` ("To FP8 and Back Again" section 3.2). Megatron's
  tensor-parallel communication around it is kept: the forward's gathers and reductions stay in
  ``forward``, and ``allreduce_dgrad`` (column-parallel input gradients) becomes the all-reduce of
  ``copy_to_tensor_model_parallel_region`` in front of the matmul. Each TP rank quantizes its own
  shard with its own scales. The weight gradient is returned as ``weight.grad``, which megatron
  DDP's backward hook adds into ``weight.main_grad`` (``grad_added_to_main_grad`` stays False), as
  megatron's own linear does when ``gradient_accumulation_fusion`` is False; with the fusion on the
  same hook still accumulates it, unfused. Sequence parallelism and deferred embedding wgrad are
  rejected.
- FP8 flow only: norms (``input_layernorm``, ``pre_mlp_layernorm``, ``final_layernorm``; torch.nn.LayerNorm
  or RMSNorm as megatron's ``WrappedTorchNorm`` builds them without apex) become FP8LayerNorm /
  FP8RMSNorm, and the MLP's activation (GELU, or SwiGLU when ``config.gated_linear_unit``) saves its
  input in FP8 (COAT section 5.2).

Attention's softmax path (``core_attention``) and the embedding are never touched. ``exclude``
defaults to the LM head (``output_layer``): COAT's FP8 precision flow is defined for the decoder
layer (Fig. 1a, Tables 2 and 6) and leaves the head outside it; emulating the head is what stops E7M7
training in "To FP8 and Back Again" (section 4.2), so emulation excludes it too unless asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP

from megatron_lowprec.layers import (
    EmulationConfig,
    FP8LayerNorm,
    FP8RMSNorm,
    emulated_linear,
    fp8_gelu,
    fp8_linear,
    fp8_swiglu,
)
from megatron_lowprec.layers.settings import LayerPrecision, layer_precision_of
from megatron_lowprec.megatron import compat
from megatron_lowprec.optim.settings import SettingError

NORM_NAMES = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")
LAST_STAGE_MODULES = ("output_layer", "final_layernorm")
"""Built by the last pipeline stage only: valid in ``exclude`` on every stage."""
FP8_NORMS = {torch.nn.LayerNorm: FP8LayerNorm, torch.nn.RMSNorm: FP8RMSNorm}


class _LowPrecisionLinear:
    """Megatron's ``_forward_impl`` with the matmul of ``_matmul``; see the module docstring."""

    def _forward_impl(
        self,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer=None,
        wgrad_deferral_limit=None,
        tp_group=None,
        **newer_keywords,
    ):
        compat.refuse_newer_linear_keywords(newer_keywords, type(self).__name__)
        if allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return self._matmul(input, weight, bias)


class _FP8Linear(_LowPrecisionLinear):
    def _matmul(self, input, weight, bias):
        return fp8_linear(input, weight, bias)


class _EmulatedLinear(_LowPrecisionLinear):
    emulation: EmulationConfig

    def _matmul(self, input, weight, bias):
        return emulated_linear(input, weight, bias, self.emulation)


class FP8ColumnParallelLinear(_FP8Linear, ColumnParallelLinear):
    """ColumnParallelLinear whose matmul runs through COAT's FP8 linear."""


class FP8RowParallelLinear(_FP8Linear, RowParallelLinear):
    """RowParallelLinear whose matmul runs through COAT's FP8 linear."""


class EmulatedColumnParallelLinear(_EmulatedLinear, ColumnParallelLinear):
    """ColumnParallelLinear whose matmul is emulated in ExMy formats (``self.emulation``)."""


class EmulatedRowParallelLinear(_EmulatedLinear, RowParallelLinear):
    """RowParallelLinear whose matmul is emulated in ExMy formats (``self.emulation``)."""


FP8_LINEARS = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}
EMULATED_LINEARS = {
    ColumnParallelLinear: EmulatedColumnParallelLinear,
    RowParallelLinear: EmulatedRowParallelLinear,
}


class FP8ActivationMLP(MLP):
    """Megatron's MLP (fc1, bias, activation, fc2) whose GELU / SwiGLU saves its input in FP8."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("FP8ActivationMLP does not support per_token_scale (MoE experts); exclude those MLPs")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        activated = fp8_swiglu(intermediate) if self.config.gated_linear_unit else fp8_gelu(intermediate)
        return self.linear_fc2(activated)


def _check_mlp(name: str, mlp: MLP) -> None:
    config = mlp.config
    supported = (config.activation_func is F.silu) if config.gated_linear_unit else (config.activation_func is F.gelu)
    if not supported or config.use_te_activation_func:
        activation = getattr(config.activation_func, "__name__", config.activation_func)
        raise ValueError(
            f"{name}: FP8 activations support F.gelu (gated_linear_unit=False) or F.silu (gated_linear_unit=True, "
            f"SwiGLU) without use_te_activation_func; got {activation} "
            f"with gated_linear_unit={config.gated_linear_unit}, use_te_activation_func={config.use_te_activation_func}"
        )
    if config.activation_func_clamp_value is not None or config.glu_linear_offset != 0.0:
        raise ValueError(
            f"{name}: FP8 activations need activation_func_clamp_value=None and glu_linear_offset=0; got "
            f"{config.activation_func_clamp_value} and {config.glu_linear_offset}"
        )


def _check_linear(name: str, linear: ColumnParallelLinear | RowParallelLinear) -> None:
    if type(linear) not in FP8_LINEARS:
        raise ValueError(
            f"{name}: only megatron's ColumnParallelLinear and RowParallelLinear are converted, "
            f"not their subclass {type(linear).__name__}; exclude it"
        )
    if linear.sequence_parallel:
        raise ValueError(f"{name}: sequence_parallel is not supported by the low-precision linears")
    if linear.config.defer_embedding_wgrad_compute and getattr(linear, "grad_output_buffer", None) is not None:
        raise ValueError(f"{name}: defer_embedding_wgrad_compute is not supported by the low-precision linears")


def _check_norm(name: str, norm: torch.nn.Module) -> None:
    if type(norm) not in FP8_NORMS:
        raise ValueError(
            f"{name}: FP8 norms replace torch.nn.LayerNorm or torch.nn.RMSNorm (megatron's WrappedTorchNorm, "
            f"local spec without apex); got {type(norm).__name__}"
        )


def _convertible_modules(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(qualified name, parent, attribute, module) of every linear, norm and MLP a conversion may touch."""
    found = []
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 else ""
        for parent_name, parent in chunk.named_modules():
            for attribute, module in parent.named_children():
                is_norm = attribute in NORM_NAMES and not isinstance(module, IdentityOp)
                if is_norm or isinstance(module, (ColumnParallelLinear, RowParallelLinear, MLP)):
                    name = f"{parent_name}.{attribute}" if parent_name else attribute
                    found.append((prefix + name, parent, attribute, module))
    return found


def _matches(name: str, entry: str) -> bool:
    """Whether ``entry`` is a run of whole dotted components of ``name`` ("layers.1" is not in "layers.10")."""
    return f".{entry}." in f".{name}."


def _check(precision: LayerPrecision, option: str | None) -> LayerPrecision:
    """``precision``'s fields (of a :class:`LayerPrecision` or a config derived from it) as a
    :class:`LayerPrecision`, checked; a ValueError naming the bad setting as the dataclass's field."""
    precision = layer_precision_of(precision)
    try:
        precision.check(option)
    except SettingError as error:
        raise ValueError(error.spelled(lambda name: f"LayerPrecision.{name}")) from None
    return precision


KEYWORD_DEFAULTS = {"fp8_layers": False, "emulation": None, "exclude": ("output_layer",)}
""":func:`apply_layer_precision`'s keywords and their defaults, which a :class:`LayerPrecision` replaces."""


def apply_layer_precision(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    precision: LayerPrecision | None = None,
    *,
    option: str | None = None,
    fp8_layers: bool = False,
    emulation: EmulationConfig | None = None,
    exclude: Sequence[str] = ("output_layer",),
) -> list[str]:
    """Convert the linears, norms and MLP activations of ``model_chunks`` in place; return their names.

    Every module is checked before any is converted, so a ValueError leaves the model unchanged.

    ``precision``: the layers' settings (:class:`~megatron_lowprec.layers.settings.LayerPrecision`,
    as ``lowprec-train``'s ``precision`` keys and Megatron-LM's flags give them), checked first with
    the precision ``option``, which decides an unset ``fp8_layers``; settings that ask for neither
    flow convert nothing. In place of it, the keywords: ``fp8_layers``: COAT's FP8 flow (FP8
    linears, FP8-saving norms and activations). ``emulation``: the linears' matmuls emulated in ExMy
    formats (an EmulationConfig or what ``EmulationConfig.parse`` reads, e.g. "E8M5", or a mapping
    with one format per role); the two are exclusive. Modules whose qualified name contains an entry of
    ``exclude`` as whole dotted components ("output_layer", "decoder.layers.0", "linear_fc2") stay
    as they are; an entry that matches no convertible module raises ValueError listing the valid
    names (the last pipeline stage's LAST_STAGE_MODULES are valid on every stage). Names are those
    of ``named_modules()``, prefixed with the chunk index ("0.", "1.") when there are several chunks.
    """
    if precision is not None:
        given = {"fp8_layers": fp8_layers, "emulation": emulation, "exclude": exclude}
        keywords = [name for name, value in given.items() if value != KEYWORD_DEFAULTS[name]]
        if keywords:
            raise ValueError(f"give a LayerPrecision or the keywords {', '.join(keywords)}, not both")
        precision = _check(precision, option)
        fp8_layers, emulation = precision.uses_fp8_layers(option), precision.emulation()
        if not fp8_layers and emulation is None:
            return []
        exclude = precision.layers_exclude
    if fp8_layers and emulation is not None:
        raise ValueError("choose fp8_layers=True or an emulation config, not both: they replace the same matmuls")
    if isinstance(exclude, str):
        raise ValueError(f"exclude must be a sequence of module names, e.g. ({exclude!r},), not a string")
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    convertible = _convertible_modules(chunks)
    for entry in exclude:
        if entry not in LAST_STAGE_MODULES and not any(_matches(name, entry) for name, *_ in convertible):
            valid = sorted({name.rsplit(".", 1)[-1] for name, *_ in convertible} | set(LAST_STAGE_MODULES))
            raise ValueError(
                f"exclude entry {entry!r} matches no convertible module; valid module names: {', '.join(valid)} "
                "(or any dotted part of a qualified name, e.g. 'decoder.layers.0')"
            )
    if emulation is not None:
        emulation = EmulationConfig.parse(emulation)
    plan = []
    for name, parent, attribute, module in convertible:
        if any(_matches(name, entry) for entry in exclude):
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and (fp8_layers or emulation is not None):
            _check_linear(name, module)
        elif isinstance(module, MLP) and fp8_layers:
            if type(module) is not MLP:
                raise ValueError(f"{name}: only megatron's MLP is converted, not {type(module).__name__}; exclude it")
            _check_mlp(name, module)
        elif attribute in NORM_NAMES and fp8_layers:
            _check_norm(name, module)
        else:
            continue
        plan.append((name, parent, attribute, module))
    for name, parent, attribute, module in plan:
        if isinstance(module, MLP):
            module.__class__ = FP8ActivationMLP
        elif attribute in NORM_NAMES:
            setattr(parent, attribute, FP8_NORMS[type(module)].from_module(module))
        elif fp8_layers:
            module.__class__ = FP8_LINEARS[type(module)]
        else:
            module.__class__ = EMULATED_LINEARS[type(module)]
            module.emulation = emulation
    return [name for name, *_ in plan]


def pre_wrap_hook(
    precision: LayerPrecision, option: str | None = None
) -> Callable[[list[torch.nn.Module]], list[torch.nn.Module]]:
    """``precision`` as a model converter for Megatron-Bridge, which runs each hook its model
    provider registers on the built model chunks before wrapping them:
    ``cfg.model.register_pre_wrap_hook(pre_wrap_hook(LayerPrecision(fp8_layers=True)))``. The
    settings are checked here, when the hook is made (ValueError naming the bad one)."""
    precision = _check(precision, option)

    def convert(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        apply_layer_precision(model_chunks, precision, option=option)
        return model_chunks

    return convert
