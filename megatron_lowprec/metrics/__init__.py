"""Training-quality metrics: effective descent quality and imprecision (Collage §3)."""

from megatron_lowprec.metrics.update_quality import UpdateQuality, measure_update_quality

__all__ = ["UpdateQuality", "measure_update_quality"]
