"""Which rank failed first, and the exit status aiakrun reports.

The records themselves (:class:`RankFailure`, how they are written and read) are in
:mod:`aiak_training.common.job.records`, shared with the watchdog.  Standard library only:
the per-rank task wrapper imports this.
"""
from __future__ import annotations

from typing import Optional, Sequence

from aiak_training.common.job.records import RankFailure


def shell_status(returncode: int) -> int:
    """Exit status a shell would report: the code itself, or 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


#: A rank killed by a signal counts as this many seconds earlier than its wrapper saw it end:
#: its peers' connections break at the same instant, and their errors (printed at once) can
#: beat the wrapper's own clock by milliseconds.
SIGNAL_LEAD_S = 1.0


def first_cause(failures: Sequence[RankFailure]) -> Optional[RankFailure]:
    """The failure that came first, by when it happened: a rank's own exception when it
    appeared (the rank may end much later, waiting in ``MPI_Finalize``), any other failure
    when its rank ended (a signal :data:`SIGNAL_LEAD_S` earlier).  Ranks that died of
    Horovod's "has been shut down" are consequences of another failure and count only when
    nothing else failed."""
    causes = [f for f in failures if not f.secondary] or list(failures)
    if not causes:
        return None

    def happened(f: RankFailure) -> float:
        if f.raised:
            return f.raised_at
        return f.time - (SIGNAL_LEAD_S if f.returncode < 0 else 0.0)

    return min(causes, key=lambda f: (happened(f), f.time))
