"""Training-quality metrics: effective descent quality and imprecision (Collage §3)."""

from megatron_lowprec.metrics.sharpness import box_sharpness, last_token_sharpness, sharpness
from megatron_lowprec.metrics.update_quality import UpdateQuality, measure_update_quality, update_quality_pieces

__all__ = [
    "UpdateQuality", "box_sharpness", "last_token_sharpness", "measure_update_quality", "sharpness",
    "update_quality_pieces",
]
