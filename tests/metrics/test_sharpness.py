"""Last-token sharpness against analytic maxima over the box, and on a tiny language model."""

import time

import numpy as np
import pytest
import torch

from megatron_lowprec.metrics import box_sharpness, last_token_sharpness, sharpness


def phi(max_loss: float, base_loss: float) -> float:
    return 100.0 * (max_loss - base_loss) / (1.0 + base_loss)


@pytest.mark.parametrize("eps", [5e-4, 1e-3, 0.05])
def test_quadratic_loss_reaches_the_farthest_corner(eps):
    """f(y) = |y - c|^2 / 2 is separable and convex: over the box its maximum is at the corner
    farthest from c, where each coordinate contributes (|x_i - c_i| + eps (|x_i| + 1))^2 / 2."""
    generator = np.random.default_rng(0)
    x, center = generator.normal(size=300) * 3, generator.normal(size=300)

    def loss_and_grad(y):
        return 0.5 * float(np.sum((y - center) ** 2)), y - center

    farthest = 0.5 * float(np.sum((np.abs(x - center) + eps * (np.abs(x) + 1)) ** 2))
    expected = phi(farthest, 0.5 * float(np.sum((x - center) ** 2)))
    assert box_sharpness(loss_and_grad, x, eps) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("vocabulary", [64, 4096])
def test_cross_entropy_maximum_is_the_corner_given_by_the_gradient_signs(vocabulary, device):
    """d CE / d z_j = p_j > 0 for j != target and p_target - 1 < 0 everywhere, so the maximum over the
    box raises every other logit and lowers the target's by its full bound eps (|x_i| + 1)."""
    eps = 5e-4
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocabulary, generator=generator, dtype=torch.float64) * 4
    targets = torch.randint(0, vocabulary, (6,), generator=generator)
    values = []
    for row, target in zip(logits, targets):
        half_width = eps * (row.abs() + 1)
        corner = half_width.clone()
        corner[target] = -half_width[target]

        def cross_entropy(y):
            return float(torch.logsumexp(y, 0) - y[target])

        values.append(phi(cross_entropy(row + corner), cross_entropy(row)))
    sharpness_value = last_token_sharpness(logits.to(device, torch.float32), targets.to(device), eps)
    assert sharpness_value == pytest.approx(float(np.mean(values)), rel=1e-6)


class TinyLanguageModel(torch.nn.Module):
    def __init__(self, vocabulary=64, hidden=32):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocabulary, hidden)
        self.dropout = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(hidden, vocabulary)

    def forward(self, tokens):
        return self.head(self.dropout(torch.tanh(self.embedding(tokens).cumsum(dim=1))))


def test_tiny_model_takes_well_under_a_few_seconds_and_restores_train_mode(device):
    torch.manual_seed(2)
    model = TinyLanguageModel().train().to(device)
    tokens = torch.randint(0, 64, (8, 17)).to(device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    started = time.perf_counter()
    value = sharpness(model, batch, eps=1e-3)
    assert time.perf_counter() - started < 2.0
    assert model.training
    with torch.no_grad():
        logits = model.eval()(batch["tokens"])
    assert value == last_token_sharpness(logits[:, -1], batch["labels"][:, -1], eps=1e-3)
    assert 0 < value < 10


def test_bad_inputs_are_rejected():
    logits, targets = torch.randn(3, 10), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="eps must be positive"):
        last_token_sharpness(logits, targets, eps=0.0)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        last_token_sharpness(logits, targets[:2])
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        last_token_sharpness(logits, torch.tensor([1, 2, 10]))
    with pytest.raises(ValueError, match="'tokens' and 'labels'"):
        sharpness(TinyLanguageModel(), {"tokens": torch.zeros(2, 3, dtype=torch.long)})
