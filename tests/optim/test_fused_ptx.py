"""The fused step's division and square root in the PTX that a GPU runs (generated on this machine by
``tools/kernel_audit/codegen.py``): IEEE FP32 instructions, no FP64 and no approximation (numerics/elementary.py)."""

import re

from tools.kernel_audit.codegen import generate


def test_the_adam_update_divides_and_takes_square_roots_in_ieee_fp32_on_gpus():
    code = generate("B", arch=90)
    ptx = "\n".join(kernel.ptx for kernel in code.first_step_kernels)
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    assert not re.findall(r"\b(?:div|sqrt|rcp|mul|add|fma)\.[\w.]*f64\b", ptx)
    assert not re.findall(r"\b(?:div\.full|div\.approx|sqrt\.approx|rcp\.approx)\b|\.ftz\b", ptx)
