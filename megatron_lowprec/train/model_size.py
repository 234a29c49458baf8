"""The parameter count of a :class:`~megatron_lowprec.train.config.ModelConfig`, computed from its
shape alone: no tensor is allocated and no megatron-core is needed.

The count follows the modules megatron-core's ``GPTModel`` creates (the local and the Transformer
Engine layer specs hold the same parameters):

- word embeddings, ``vocab_size x hidden``, and learned absolute position embeddings,
  ``max_position_embeddings x hidden`` (rotary embeddings have no parameters);
- per layer: the attention and MLP input norms, the fused query/key/value projection (grouped-query
  attention shrinks the key and value parts to ``num_query_groups`` heads), the attention output
  projection, and the MLP, whose first projection is twice as wide when gated (SwiGLU);
- the final norm, and the LM head when it is not tied to the word embeddings (it has no bias).

LayerNorm has a weight and a bias, RMSNorm a weight; ``add_bias_linear`` adds a bias to each of the
four linear layers of a transformer layer.
"""

from __future__ import annotations

from megatron_lowprec.train.config import ModelConfig


def _norm_parameters(model: ModelConfig) -> int:
    return 2 * model.hidden_size if model.normalization == "LayerNorm" else model.hidden_size


def _linear_parameters(model: ModelConfig, inputs: int, outputs: int) -> int:
    return inputs * outputs + (outputs if model.add_bias_linear else 0)


def layer_parameter_count(model: ModelConfig) -> int:
    """Parameters of one transformer layer."""
    hidden = model.hidden_size
    head_dim = hidden // model.num_attention_heads
    query_groups = model.num_query_groups or model.num_attention_heads
    query_width = model.num_attention_heads * head_dim
    key_value_width = query_groups * head_dim
    ffn = model.ffn_hidden_size or 4 * hidden
    gated = model.activation == "swiglu"
    attention = _linear_parameters(model, hidden, query_width + 2 * key_value_width) + _linear_parameters(
        model, query_width, hidden
    )
    mlp = _linear_parameters(model, hidden, 2 * ffn if gated else ffn) + _linear_parameters(model, ffn, hidden)
    return 2 * _norm_parameters(model) + attention + mlp


def parameter_count(model: ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole ``GPTModel``; ``vocab_size`` is the padded vocabulary the model is
    built with (:func:`megatron_lowprec.train.model.padded_vocab_size`)."""
    hidden = model.hidden_size
    embeddings = vocab_size * hidden
    if model.position_embedding_type == "learned_absolute":
        embeddings += (model.max_position_embeddings or model.seq_length) * hidden
    output_layer = vocab_size * hidden if model.untie_embeddings_and_output_weights else 0
    return embeddings + model.num_layers * layer_parameter_count(model) + _norm_parameters(model) + output_layer
