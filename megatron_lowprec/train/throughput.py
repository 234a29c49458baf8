"""Model FLOPs, TFLOP/s per GPU, MFU and peak memory, as Megatron-LM reports them for a training run.

Model FLOPs count the matrix multiplications a dense GPT needs per token, forward and backward (the
backward pass does two matmuls per forward one: the data gradient and the weight gradient), without
activation recompute: Megatron-LM's ``num_floating_point_operations`` (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", App. "Floating-point operations")
extended to grouped-query attention and gated MLPs, with the full ``s x s`` attention matrix counted
as PaLM's model FLOPs utilisation does (Chowdhery et al. 2022, App. B: 6N + 12 L H Q T per token).
Norms, softmax, activations and the optimizer are not counted. MFU divides the achieved model
FLOP/s of one GPU by its dense BF16 peak.
"""

from __future__ import annotations

import resource
import sys

import torch

from megatron_lowprec.train.config import ModelConfig

PEAK_BF16_FLOPS = (
    ("H200", 989.4e12),
    ("H100 80GB HBM3", 989.4e12),
    ("H100 SXM", 989.4e12),
    ("A100", 312.0e12),
)
"""Dense (no 2:4 sparsity) BF16 tensor-core peaks from NVIDIA's data sheets, by a part of
``torch.cuda.get_device_name()``: H200 and H100 SXM5 989.4 TFLOP/s, A100 (SXM4 and PCIe) 312.
The H100 SXM5 reports itself as "NVIDIA H100 80GB HBM3"; H100 PCIe and NVL, whose peaks differ, are
not listed, so their MFU is omitted rather than guessed."""

GIB = 2.0**30


def training_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Model FLOPs of one training token (forward and backward) of ``model`` with the padded
    ``vocab_size``.

    Per layer and token, forward, at 2 FLOPs per multiply-add, with hidden size h, query heads n,
    key/value groups g, head size d = h / n, MLP width f and sequence length s:
    QKV projection 2 h (n + 2 g) d, attention scores 2 s n d, scores x values 2 s n d, output
    projection 2 n d h, MLP 2 h f (x 2 for fc1 and fc2, x 3 with a gated unit, whose fc1 is 2f wide).
    Plus the LM head, 2 h V. Training is 3 x forward.
    """
    hidden, heads = model.hidden_size, model.num_attention_heads
    groups = model.num_query_groups or heads
    head_size = hidden // heads
    ffn = model.ffn_hidden_size or 4 * hidden
    mlp_matmuls = 3 if model.activation == "swiglu" else 2
    per_layer = (
        2 * hidden * (heads + 2 * groups) * head_size
        + 2 * 2 * model.seq_length * heads * head_size
        + 2 * heads * head_size * hidden
        + 2 * mlp_matmuls * hidden * ffn
    )
    forward = model.num_layers * per_layer + 2 * hidden * vocab_size
    return 3.0 * forward


def peak_bf16_flops() -> float | None:
    """Dense BF16 peak FLOP/s of the current GPU, where :data:`PEAK_BF16_FLOPS` knows it; else None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in name), None)


def throughput(flops_per_token: float, tokens_per_second: float, world_size: int, peak: float | None) -> dict:
    """``tflops_per_gpu`` (model TFLOP/s per GPU) and, when ``peak`` is known, ``mfu`` (a fraction)."""
    per_gpu = flops_per_token * tokens_per_second / world_size
    result = {"tflops_per_gpu": per_gpu / 1e12}
    if peak is not None:
        result["mfu"] = per_gpu / peak
    return result


def _resident_set_peak_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory() -> dict:
    """This process's peak memory in GiB, the largest over all ranks: on GPUs ``peak_allocated_gib``
    and ``peak_reserved_gib`` (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, what
    Megatron-LM's memory report prints), on CPUs ``peak_rss_gib`` (the resident set size). Collective."""
    if torch.cuda.is_available():
        names = ("peak_allocated_gib", "peak_reserved_gib")
        values = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    else:
        names, values = ("peak_rss_gib",), [_resident_set_peak_bytes()]
    peaks = torch.tensor(values, dtype=torch.float64, device=torch.cuda.current_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    return {name: float(value) / GIB for name, value in zip(names, peaks.tolist())}
