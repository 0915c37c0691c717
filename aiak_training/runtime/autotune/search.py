"""The search: one knob at a time over a few candidate values, then a confirmation round.

Why not Horovod's Bayesian optimisation: each point costs ``steps_per_sample`` real steps,
and with at most about 25 points in 300 steps a Gaussian process has too few samples to
learn a 2-D surface plus categorical switches; Horovod spends about 1,500 steps.  Step time
is close to separable in these knobs (the fusion threshold sets how many messages a step
sends, the cycle time how long each waits, the algorithm how fast each moves), so a
coordinate search over a small grid finds the same optimum with a fixed, known number of
samples.  The confirmation round measures the leading few and the job's own setting again,
and the choice is made among them only, on the mean of their two samples, so that one lucky
sample cannot pick the setting; the job's setting stays unless another clearly beats it (``MARGIN``).
"""
import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from aiak_training.runtime.autotune.knobs import Setting

CONFIRM = 3  # the leading settings, measured once more at the end with the job's own
# A setting replaces the job's own only when its mean score beats it by more than this, and
# its confirmation sample beats the job's (taken moments apart, so the same load weighs on
# both): on a noisy machine settings a few percent apart cannot be told apart, and then the
# job's setting (the one it would have run without autotune) is the safe choice.
MARGIN = 0.05


class CoordinateSearch:
    """Proposes the next setting to measure, learns each sample's score (higher is better:
    steps per second), and ends with the best setting."""

    def __init__(self, start: Setting, axes: Sequence[Tuple[str, Sequence]], max_samples: int):
        self.best = start
        self._start = start
        self._axes = list(axes)
        self._max = max_samples
        self._scores: Dict[Setting, List[float]] = {}
        self._plan: List[Setting] = []
        self._axis = -1
        self._confirming = False
        self._finalists: List[Setting] = []
        self.samples = 0
        self.done = False
        self._advance()

    @property
    def planned(self) -> int:
        """Samples the search takes when nothing is measured twice by coincidence."""
        total = 1 + sum(len(values) - 1 for _, values in self._axes)
        return min(self._max, total + (min(CONFIRM, total - 1) + 1 if total > 1 else 0))

    def next(self) -> Optional[Setting]:
        """The setting to measure next; None once the search is done."""
        return None if self.done else self._plan[0]

    def record(self, setting: Setting, score: float) -> None:
        """The score of one sample of ``setting`` (the one :meth:`next` proposed)."""
        self._scores.setdefault(setting, []).append(score)
        self.samples += 1
        if self._plan and self._plan[0] == setting:
            self._plan.pop(0)
        self.best = self._leader()
        if self.samples >= self._max:
            self.done = True
        elif not self._plan:
            self._advance()

    @property
    def kept_start(self) -> bool:
        """Whether the search ended on the job's own setting."""
        return self.done and self.best == self._start

    def score(self, setting: Setting) -> float:
        """Mean of the scores measured for ``setting``."""
        return statistics.fmean(self._scores[setting])

    def _leader(self) -> Setting:
        if self._finalists and not self._plan:
            best = max(self._finalists, key=self.score)
            start = self._start
            if best != start and (self.score(best) <= self.score(start) * (1 + MARGIN) or
                                  self._scores[best][-1] <= self._scores[start][-1]):
                return start
            return best
        return max(self._scores, key=self.score) if self._scores else self.best

    def _advance(self) -> None:
        """Plan the next axis (values not yet measured, other knobs at the best so far), the
        confirmation round after the last axis, and the end after that."""
        while not self._plan:
            if self._confirming or self.done:
                self.done = True
                return
            self._axis += 1
            if self._axis >= len(self._axes):
                self._confirming = True
                ranked = [s for s in sorted(self._scores, key=self.score, reverse=True)
                          if s != self._start]
                self._plan = [self._start] + ranked[:CONFIRM] if ranked else []
                self._finalists = list(self._plan)
                continue
            knob, values = self._axes[self._axis]
            candidates = [dataclasses.replace(self.best, **{knob: v}) for v in values]
            self._plan = [c for c in candidates if c not in self._scores]
            if not self._scores and not self._plan:
                self._plan = [self.best]
