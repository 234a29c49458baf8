"""Pure tensor numerics: float formats, multi-component floats, stochastic rounding, FP8 quantization.

This package imports torch alone: no torch.distributed, no megatron.
"""
