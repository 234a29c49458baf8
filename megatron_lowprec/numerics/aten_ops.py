"""A correctly rounded square root that eager and compiled code compute alike.

ATen's CPU ``sqrt`` comes from SLEEF and is not always correctly rounded; Inductor's is the IEEE
instruction. :func:`sqrt_rn` computes the correctly rounded result the cheapest exact way in each
mode, so that an eager and a compiled step agree bit for bit.
"""

from __future__ import annotations

import torch


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of an FP32 tensor.

    Eager: through float64 (the square root of a float is correctly rounded twice without harm, as
    53 >= 2·24 + 2). Compiled: Inductor's own ``sqrt``, the IEEE instruction on CPU and GPU.
    """
    if torch.compiler.is_compiling():
        return torch.sqrt(x)
    return x.double().sqrt().to(x.dtype)
