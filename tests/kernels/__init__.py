MUON_CI_CONFIGURATIONS = [("A", "fp32"), ("C", "fp32"), ("kahan", "fp32"), ("sr", "fp32"), ("coat", "fp32"), ("D-MW", "fp32")]
"""(option, master storage) of Muon's fused step that CI audits and interprets: one per rounding family
(BF16 nearest, MCF, Kahan, stochastic rounding, FP8 momentum with an FP32 master, FP32 momentum).
Every option and storage: ``python -m megatron_lowprec.kernels.audit --optimizer muon --interpret``."""
