"""Last-token loss-landscape sharpness ("To FP8 and Back Again", section 3.1, whose formula the
paper's text states in words; written out below).

For the logit vector x (length V) of the last position of a sequence and f(x) the cross-entropy of
its next-token target, the box C_eps = {z : |z_i| <= eps (|x_i| + 1)} and

    phi(x, f, eps) = 100 * (max_{z in C_eps} f(x + z) - f(x)) / (1 + f(x)),

the maximum searched with SciPy's L-BFGS-B from z = 0 with the box as bounds (no random projection,
Keskar et al. 2017 adapted to the logit space). The metric is averaged over held-out sequences;
report ``eps`` with every figure (Keskar et al. used 1e-3 and 5e-4). SciPy is imported when used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

DEFAULT_EPS = 5e-4
SEARCH_SCALE = 1e-9
LossAndGradient = Callable[[np.ndarray], tuple[float, np.ndarray]]


def box_sharpness(loss_and_grad: LossAndGradient, x: np.ndarray, eps: float = DEFAULT_EPS) -> float:
    """phi(x, f, eps) for a loss ``loss_and_grad(y) -> (f(y), df/dy)`` on float64 vectors (the module's formula).

    L-BFGS-B runs on the same problem in scaled variables: z = half_width * u with u in the unit box,
    and the loss increase divided by ``SEARCH_SCALE`` times the largest |d f / d u_i| at u = 0.
    L-BFGS-B's first projected-gradient step assumes unit curvature; in these units it reaches the
    bounds of every coordinate whose first-order effect is at least ``SEARCH_SCALE`` of the largest,
    so a near-linear loss over a small box (the cross-entropy for eps ~ 1e-3) is maximised in a few
    iterations instead of thousands. The maximiser and the maximum are unchanged.
    """
    from scipy.optimize import Bounds, minimize

    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    x = np.asarray(x, dtype=np.float64)
    base_loss, base_grad = loss_and_grad(x)
    half_width = eps * (np.abs(x) + 1.0)
    largest_effect = float(np.abs(half_width * base_grad).max(initial=0.0))
    loss_unit = SEARCH_SCALE * largest_effect if largest_effect > 0 else 1.0

    def negated_increase(u: np.ndarray) -> tuple[float, np.ndarray]:
        loss, grad = loss_and_grad(x + half_width * u)
        return -(loss - base_loss) / loss_unit, -(half_width * grad) / loss_unit

    search = minimize(negated_increase, np.zeros_like(x), jac=True, method="L-BFGS-B", bounds=Bounds(-1.0, 1.0))
    increase = max(-float(search.fun) * loss_unit, 0.0)
    return 100.0 * increase / (1.0 + base_loss)


def _cross_entropy(target: int) -> LossAndGradient:
    """y -> (logsumexp(y) - y[target], softmax(y) - onehot(target)), stable in float64."""

    def loss_and_grad(logits: np.ndarray) -> tuple[float, np.ndarray]:
        shifted = logits - logits.max()
        exponentials = np.exp(shifted)
        total = exponentials.sum()
        grad = exponentials / total
        grad[target] -= 1.0
        return float(np.log(total) - shifted[target]), grad

    return loss_and_grad


def last_token_sharpness(last_logits: torch.Tensor, targets: torch.Tensor, eps: float = DEFAULT_EPS) -> float:
    """Mean over the N rows of phi for the cross-entropy of ``last_logits`` [N, V] at ``targets`` [N]."""
    if last_logits.dim() != 2 or targets.shape != last_logits.shape[:1]:
        raise ValueError(
            f"expected last_logits [N, V] and targets [N]; got {tuple(last_logits.shape)} and {tuple(targets.shape)}"
        )
    vocabulary = last_logits.shape[1]
    if bool(((targets < 0) | (targets >= vocabulary)).any()):
        raise ValueError(f"targets must lie in [0, {vocabulary}); got {targets.tolist()}")
    logits = last_logits.detach().to(device="cpu", dtype=torch.float64).numpy()
    values = [
        box_sharpness(_cross_entropy(int(target)), row, eps) for row, target in zip(logits, targets.tolist())
    ]
    return float(np.mean(values))


def sharpness(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], eps: float = DEFAULT_EPS) -> float:
    """Last-token sharpness of ``model(tokens) -> logits [B, S, V]`` on ``batch`` {"tokens", "labels"} [B, S].

    The forward runs without gradients in eval mode (no dropout); the model's mode is restored.
    """
    missing = [key for key in ("tokens", "labels") if key not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; it needs 'tokens' and 'labels', got keys {sorted(batch)}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(batch["tokens"])
    finally:
        model.train(was_training)
    if logits.dim() != 3:
        raise ValueError(f"model(tokens) must return logits [B, S, V]; got shape {tuple(logits.shape)}")
    return last_token_sharpness(logits[:, -1, :], batch["labels"][:, -1], eps)
