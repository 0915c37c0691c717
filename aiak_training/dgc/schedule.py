"""Sparsity warm-up (paper section 3.3): the density falls exponentially over the first epochs.

The paper's schedule raises the sparsity 75% -> 93.75% -> 98.4375% -> 99.6% -> 99.9%: the
densities 0.25, 0.0625, 0.015625, 0.004 during warm-up, then the final density (0.001).
The warm-up is split into equal stages, one per warm-up density, measured either in
optimizer steps or in epochs.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

#: Warm-up densities of the paper (sparsity 75%, 93.75%, 98.4375%, 99.6%).
PAPER_WARMUP_DENSITIES: Tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.004)


class DensitySchedule:
    """Density as a function of the optimizer step (or of the epoch).

    Args:
        density: the final density, used once warm-up is over.
        warmup_densities: densities of the warm-up stages, in order; ``()`` for no warm-up.
        warmup_steps: warm-up length in optimizer steps.  Stage ``i`` covers steps
            ``s`` with ``floor(s * S / warmup_steps) == i`` (S = number of stages), i.e.
            equal parts, rounded down at the boundaries.
        warmup_epochs: warm-up length in epochs, used when ``warmup_steps`` is None.  With
            ``steps_per_epoch`` it becomes ``round(warmup_epochs * steps_per_epoch)`` steps;
            without, the position is the epoch the training loop reports through
            ``optimizer.set_epoch(epoch)`` (fractions allowed), and stage ``i`` covers epochs
            ``e`` with ``floor(e * S / warmup_epochs) == i``.
        steps_per_epoch: optimizer steps per epoch (see ``warmup_epochs``).
    """

    def __init__(self, density: float, warmup_densities: Sequence[float] = PAPER_WARMUP_DENSITIES,
                 warmup_steps: Optional[int] = None, warmup_epochs: Optional[float] = None,
                 steps_per_epoch: Optional[int] = None):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        self.density = float(density)
        self.warmup_densities = tuple(float(d) for d in warmup_densities)
        for d in self.warmup_densities:
            if not 0.0 < d <= 1.0:
                raise ValueError(f"warm-up densities must be in (0, 1], got {d}")
        if warmup_steps is not None and warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if warmup_epochs is not None and warmup_epochs < 0:
            raise ValueError("warmup_epochs must be >= 0")
        if steps_per_epoch is not None and steps_per_epoch <= 0:
            raise ValueError("steps_per_epoch must be > 0")
        if warmup_steps is None and warmup_epochs is not None and steps_per_epoch is not None:
            warmup_steps = int(round(warmup_epochs * steps_per_epoch))
        self.warmup_steps = warmup_steps
        self.warmup_epochs = None if warmup_steps is not None else warmup_epochs
        if not self.warmup_densities or (warmup_steps is None and not self.warmup_epochs):
            self.warmup_steps, self.warmup_epochs = 0, None

    @property
    def needs_epoch(self) -> bool:
        """True when the position comes from ``set_epoch`` rather than the step count."""
        return self.warmup_epochs is not None

    def __call__(self, step: int, epoch: Optional[float] = None) -> float:
        """The density at optimizer step ``step`` (0-based) or at epoch ``epoch``."""
        stages = len(self.warmup_densities)
        if self.needs_epoch:
            e = 0.0 if epoch is None else float(epoch)
            stage = math.floor(e * stages / self.warmup_epochs) if e >= 0 else 0
        else:
            if step >= self.warmup_steps:
                return self.density
            stage = (step * stages) // self.warmup_steps
        return self.warmup_densities[stage] if stage < stages else self.density

    def __repr__(self) -> str:
        length = (f"warmup_epochs={self.warmup_epochs}" if self.needs_epoch
                  else f"warmup_steps={self.warmup_steps}")
        return (f"DensitySchedule(density={self.density}, "
                f"warmup_densities={self.warmup_densities}, {length})")
