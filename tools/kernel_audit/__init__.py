"""The audit of the optimizer's GPU kernels: generating them on any machine (``codegen``), auditing
their instructions, launches and memory traffic (``audit``) and running them under Triton's
interpreter against the eager step (``interpret``). Test tooling of the repository, not of the
installed package: it patches private internals of torch and triton (its fake CUDA device among
them) while it runs, and nothing in ``megatron_lowprec`` imports it. Run it from the repository
root: ``python -m tools.kernel_audit.audit``."""
