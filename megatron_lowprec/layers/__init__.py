"""Low-precision layers as plain torch autograd functions and modules (torch and numerics only).

- :mod:`.fp8_linear`: COAT's FP8 linear (E4M3 forward, E5M2 output gradients, FP8 input saved).
- :mod:`.fp8_activations`: RMSNorm, LayerNorm, GELU, SwiGLU saving their input as per-group FP8.
- :mod:`.emulation`: ExMy emulation of matmul inputs, weights, outputs and gradients.
"""

from megatron_lowprec.layers.emulation import EmulationConfig, emulate_format, emulated_linear
from megatron_lowprec.layers.fp8_activations import (
    FP8GELU,
    FP8LayerNorm,
    FP8RMSNorm,
    FP8SwiGLU,
    fp8_gelu,
    fp8_layer_norm,
    fp8_rms_norm,
    fp8_swiglu,
)
from megatron_lowprec.layers.fp8_linear import FP8Linear, fp8_linear, fp8_weight_cache

__all__ = [
    "EmulationConfig",
    "FP8GELU",
    "FP8LayerNorm",
    "FP8Linear",
    "FP8RMSNorm",
    "FP8SwiGLU",
    "emulate_format",
    "emulated_linear",
    "fp8_gelu",
    "fp8_layer_norm",
    "fp8_linear",
    "fp8_rms_norm",
    "fp8_swiglu",
    "fp8_weight_cache",
]
