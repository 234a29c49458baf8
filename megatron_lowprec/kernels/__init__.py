"""Tools over the optimizer's GPU kernels: generating them on any machine (``codegen``) and auditing
their instructions, launches and memory traffic (``audit``). Nothing below this package imports it."""
