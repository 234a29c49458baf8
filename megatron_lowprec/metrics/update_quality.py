"""Effective descent quality (EDQ, Collage Def. 3.3, eq. 3) and imprecision percentage (Collage §3, Fig. 3).

Both are kept as additive pieces (sums and counts) so that a distributed caller can all-reduce the
pieces over the data-, tensor- and pipeline-parallel groups before dividing. An optimizer step
computes them as a 4-element FP64 tensor on the parameters' device (:func:`update_quality_pieces`),
inside its compiled kernel, and adds them up there: no host synchronisation until a caller reads
an :class:`UpdateQuality` (:meth:`UpdateQuality.from_tensor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class UpdateQuality:
    """Additive pieces of the update-quality metrics for a set of parameters.

    The intended update Δθ is what the optimizer computed in FP32; the effective update Δ̂θ is the
    change of the represented value (θ + δθ for MCF parameters, the master for FP32-master options).
    """

    intended_dot_effective: float = 0.0
    """Σ Δθ · Δ̂θ."""

    intended_sq_norm: float = 0.0
    """Σ Δθ²."""

    intended_nonzero: int = 0
    """Number of elements with Δθ ≠ 0."""

    lost: int = 0
    """Number of elements with Δθ ≠ 0 whose represented value did not change (lost arithmetic)."""

    def __add__(self, other: UpdateQuality) -> UpdateQuality:
        return UpdateQuality(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def edq(self) -> float:
        """EDQ = <Δθ / ‖Δθ‖, Δ̂θ> (Collage eq. 3); 0 when there was no intended update."""
        norm = math.sqrt(self.intended_sq_norm)
        return self.intended_dot_effective / norm if norm > 0 else 0.0

    @property
    def imprecision_percent(self) -> float:
        """Share (%) of elements meant to move whose represented value stayed put."""
        return 100.0 * self.lost / self.intended_nonzero if self.intended_nonzero else 0.0

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The pieces as one float64 tensor, ready for ``torch.distributed.all_reduce``."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, pieces: torch.Tensor) -> UpdateQuality:
        """Inverse of :meth:`to_tensor` (after a sum all-reduce)."""
        values = pieces.tolist()
        return cls(values[0], values[1], int(values[2]), int(values[3]))


def update_quality_pieces(
    intended: torch.Tensor, represented_before: torch.Tensor, represented_after: torch.Tensor
) -> torch.Tensor:
    """The pieces of one tensor as an FP64 tensor [Σ Δθ·Δ̂θ, Σ Δθ², #(Δθ ≠ 0), #lost] on its device
    (the represented values should be exact, e.g. float64 sums of components). Reductions only: a
    compiled caller keeps no tensor-sized temporary, and nothing is copied to the host."""
    intended = intended.double()
    effective = represented_after.double() - represented_before.double()
    moving = intended != 0
    return torch.stack(
        [
            (intended * effective).sum(),
            (intended * intended).sum(),
            moving.sum().double(),
            (moving & (effective == 0)).sum().double(),
        ]
    )


def measure_update_quality(
    intended: torch.Tensor, represented_before: torch.Tensor, represented_after: torch.Tensor
) -> UpdateQuality:
    """:func:`update_quality_pieces` read back as an :class:`UpdateQuality` (one host synchronisation)."""
    return UpdateQuality.from_tensor(update_quality_pieces(intended, represented_before, represented_after))
