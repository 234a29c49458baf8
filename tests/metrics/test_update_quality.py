import math

import pytest
import torch

from megatron_lowprec.metrics import UpdateQuality, measure_update_quality


def test_edq_is_the_projection_of_the_effective_update_on_the_intended_direction(device):
    generator = torch.Generator().manual_seed(0)
    intended = torch.randn(1000, generator=generator, dtype=torch.float64)
    before = torch.randn(1000, generator=generator, dtype=torch.float64)
    effective = intended.clone()
    effective[:100] = 0.0
    quality = measure_update_quality(intended.to(device), before.to(device), (before + effective).to(device))
    expected = sum(a * b for a, b in zip(intended.tolist(), (before + effective - before).tolist()))
    norm = math.sqrt(sum(a * a for a in intended.tolist()))
    assert quality.edq == pytest.approx(expected / norm, rel=1e-12)
    assert quality.lost == 100
    assert quality.imprecision_percent == pytest.approx(10.0)


def test_pieces_add_up_to_the_metric_of_the_concatenation(device):
    generator = torch.Generator().manual_seed(1)
    intended = torch.randn(300, generator=generator, dtype=torch.float64)
    intended[::7] = 0.0
    before = torch.randn(300, generator=generator, dtype=torch.float64)
    after = before + intended * (torch.rand(300, generator=generator, dtype=torch.float64) > 0.3)
    intended, before, after = intended.to(device), before.to(device), after.to(device)
    whole = measure_update_quality(intended, before, after)
    parts = measure_update_quality(intended[:120], before[:120], after[:120]) + measure_update_quality(
        intended[120:], before[120:], after[120:]
    )
    assert parts.intended_nonzero == whole.intended_nonzero and parts.lost == whole.lost
    assert parts.edq == pytest.approx(whole.edq, rel=1e-12)
    assert UpdateQuality.from_tensor(parts.to_tensor()) == parts


def test_no_intended_update_gives_zero_metrics_not_nan(device):
    zeros = torch.zeros(4, dtype=torch.float64, device=device)
    quality = measure_update_quality(zeros, zeros, zeros)
    assert quality.edq == 0.0 and quality.imprecision_percent == 0.0
