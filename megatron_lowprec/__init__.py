"""megatron-lowprec: low-precision training strategies for Megatron-core style LLM pretraining.

Layers, bottom to top (a lower layer never imports a higher one):
``numerics`` (pure tensor arithmetic) -> ``optim`` and ``metrics`` -> Megatron adapters -> training app.
"""

__version__ = "0.1.0"
