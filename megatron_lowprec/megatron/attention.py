"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for megatron's layer specs.

megatron-core's local spec computes attention with ``DotProductAttention``: the ``[b, np, sq, sk]``
score matrix of every head is materialised, masked, soft-maxed and multiplied with the values. Without
Transformer Engine that is the only fused-free path, and it is memory-bound. :class:`SDPAttention`
keeps ``DotProductAttention``'s interface, head partitioning and scaling but hands the whole
computation to PyTorch's SDPA, which dispatches to FlashAttention-2, the memory-efficient kernel or
cuDNN on GPUs (the math or the CPU flash kernel on CPUs); the score matrix is never stored.

- Causal masking: ``is_causal`` when no mask is passed (megatron's GPT passes none and builds the
  causal mask inside its softmax); a passed boolean mask uses megatron's convention (``True`` masks
  the position) and is inverted for SDPA (``True`` attends).
- Grouped-query attention: ``num_query_groups`` key/value heads per ``num_attention_heads`` query
  heads, shared by SDPA's ``enable_gqa`` without repeating keys and values in memory.
- Tensor parallelism: each rank holds ``num_attention_heads / TP`` query heads and
  ``num_query_groups / TP`` key/value heads, as ``DotProductAttention`` does.
- Attention dropout: drawn inside SDPA while megatron's RNG tracker is forked to its model-parallel
  stream, as ``DotProductAttention`` forks it for its dropout (each tensor-parallel rank drops its own
  heads' probabilities; activation recompute restores the stream and redraws the same mask).
- Determinism: under megatron's ``deterministic_mode`` SDPA may choose only
  :data:`DETERMINISTIC_SDPA_BACKENDS`, whose backward passes are deterministic when
  ``torch.use_deterministic_algorithms(True)`` is on (``lowprec-train trainer.deterministic=true``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

DETERMINISTIC_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""SDPA's backends that have a deterministic backward pass (FlashAttention-2 and the memory-efficient
kernel run it in PyTorch's strict deterministic mode; cuDNN's attention has none)."""

ATTENTION_BACKENDS = ("sdpa", "unfused", "te")


def sdpa_backends(deterministic: bool) -> contextlib.AbstractContextManager:
    """SDPA restricted to :data:`DETERMINISTIC_SDPA_BACKENDS` when ``deterministic``, else its own choice."""
    return sdpa_kernel(list(DETERMINISTIC_SDPA_BACKENDS)) if deterministic else contextlib.nullcontext()
"""Core attention of the layer spec: PyTorch's SDPA (:class:`SDPAttention`), megatron's unfused
``DotProductAttention``, or Transformer Engine's ``TEDotProductAttention``."""


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` computed by ``scaled_dot_product_attention``.

    Refuses, when built, what SDPA cannot express: sliding-window attention and softmax variants
    with an offset (``softmax_type`` other than ``vanilla``).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        if config.window_size is not None:
            raise ValueError(
                f"SDPAttention does not support sliding-window attention (window_size={config.window_size}); "
                "use attention_backend 'unfused' or 'te'"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type='vanilla' only, not {config.softmax_type!r}; "
                "use attention_backend 'unfused' or 'te'"
            )
        layer_scaling = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * layer_scaling
        """``softmax_scale`` (1/sqrt(head dim) by default); ``DotProductAttention`` divides it by the
        layer number under query-key layer scaling and multiplies the scores back inside its
        softmax, so the product is the scale actually applied."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[sq, b, np, hn]`` queries and ``[sk, b, ng, hn]`` keys and values to the ``[sq, b, np x hn]``
        context, like ``DotProductAttention.forward``."""
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences; use attention_backend 'te'")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        seq_q, seq_k = query.size(0), key.size(0)
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal and seq_q > 1
        if is_causal and seq_q != seq_k:
            raise ValueError(f"the causal mask is only for self attention, not {seq_q} queries over {seq_k} keys")
        sdpa_mask = None if attention_mask is None else ~attention_mask
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

        def attend() -> torch.Tensor:
            with sdpa_backends(self.config.deterministic_mode):
                return F.scaled_dot_product_attention(
                    query,
                    key,
                    value,
                    attn_mask=sdpa_mask,
                    dropout_p=dropout_p,
                    is_causal=is_causal,
                    scale=self.sdpa_scale,
                    **({"enable_gqa": True} if grouped else {}),
                )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(seq_q, context.size(0), self.hidden_size_per_partition)


def core_attention_module(backend: str) -> type:
    """The core-attention class of ``backend`` (one of :data:`ATTENTION_BACKENDS`); ``te`` imports
    Transformer Engine, which must be installed."""
    if backend == "sdpa":
        return SDPAttention
    if backend == "unfused":
        return DotProductAttention
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    raise ValueError(f"attention backend {backend!r} is not valid; choose one of: {', '.join(ATTENTION_BACKENDS)}")


def with_core_attention(layer_spec, backend: str):
    """``layer_spec`` (a GPT transformer-layer ``ModuleSpec``, local or TE) with its self-attention's
    core attention replaced by ``backend``'s; the spec is changed in place and returned."""
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention_module(backend)
    return layer_spec
