"""The step's statistics against independent references: the norm and clipping against fp64 and
torch's own clipping, the update quality against the pieces' plain sums."""

import math

import torch

from megatron_lowprec.metrics.update_quality import UpdateQuality
from megatron_lowprec.numerics.square_sum import square_sum_bins
from megatron_lowprec.optim import statistics

CPU = torch.device("cpu")


def test_grad_norm_is_the_exactly_rounded_norm_for_any_split_and_reduction():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3000, generator=generator) * torch.exp2(torch.randint(-30, 30, (3000,), generator=generator).float())
    exact = math.sqrt(math.fsum(value * value for value in values.double().tolist()))
    assert statistics.grad_norm([values], CPU) == exact
    one_rank = statistics.grad_norm([values[:1000]], CPU, lambda bins: None)

    def with_the_other_rank(bins: torch.Tensor) -> None:
        bins += square_sum_bins([values[2000:], values[1000:2000]], CPU)

    assert one_rank != exact and statistics.grad_norm([values[:1000]], CPU, with_the_other_rank) == exact


def test_clipping_scales_as_torch_clips_and_leaves_small_or_nan_norms_alone():
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(40, generator=generator), torch.randn(7, 3, generator=generator)]
    reference = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(reference, grads):
        param.grad = grad.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5, foreach=True)
    norm = statistics.clip_grad_norm_(grads, 0.5, CPU)
    assert math.isclose(norm, float(torch_norm), rel_tol=1e-6)
    for grad, expected in zip(grads, reference):
        torch.testing.assert_close(grad, expected.grad, rtol=1e-6, atol=0)
    kept = [grad.clone() for grad in grads]
    statistics.clip_grads_(grads, 1.0e6, norm)
    statistics.clip_grads_(grads, 1.0, math.nan)
    assert all(torch.equal(grad, before) for grad, before in zip(grads, kept))


def test_update_quality_adds_each_groups_bucket_pieces():
    pieces = [torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=torch.float64), torch.tensor([0.5, 1.0, 4.0, 0.0], dtype=torch.float64),
              torch.tensor([2.0, 2.0, 1.0, 1.0], dtype=torch.float64)]
    by_group = statistics.update_quality_by_group([0, 2, 0], pieces, 3)
    assert by_group == [UpdateQuality(3.0, 4.0, 4, 2), UpdateQuality(), UpdateQuality(0.5, 1.0, 4, 0)]

    def doubled(total: torch.Tensor) -> None:
        total *= 2

    assert statistics.summed_update_quality(pieces, CPU, doubled) == UpdateQuality(7.0, 10.0, 16, 4)
