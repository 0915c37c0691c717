"""Lightning's ``ClusterEnvironment`` answered by aiak-training's runtime.

Whoever started the ranks (``aiakrun``, ``mpirun``, Ray, Spark) already told the runtime who
is who; Lightning reads rank, world size, local rank and node from here instead of from
torch.distributed's variables.  The runtime is initialised on the first question, with
:func:`start_runtime`.
"""
from __future__ import annotations

import os
from typing import Optional

import aiak_training.torch as hvd
from aiak_training.common.tuning import ALLREDUCE_ALGORITHM

ALGORITHM_ENV = ALLREDUCE_ALGORITHM.variable


def start_runtime(allreduce_algorithm: Optional[str] = None) -> None:
    """``hvd.init()`` if it has not run, with ``AIAK_ALLREDUCE_ALGO`` set to
    ``allreduce_algorithm`` first when one is given.  RuntimeError when the runtime already
    runs with another algorithm setting: it is chosen once, at init."""
    if allreduce_algorithm is not None:
        if hvd.is_initialized():
            if os.environ.get(ALGORITHM_ENV, "auto") != allreduce_algorithm:
                raise RuntimeError(
                    f"allreduce_algorithm={allreduce_algorithm!r}: hvd.init() already ran with "
                    f"{ALGORITHM_ENV}={os.environ.get(ALGORITHM_ENV, 'auto')}; create the "
                    "strategy before calling hvd.init(), or set the variable (aiakrun "
                    f"{ALLREDUCE_ALGORITHM.flag}) instead")
        else:
            os.environ[ALGORITHM_ENV] = allreduce_algorithm
    if not hvd.is_initialized():
        hvd.init()


class EnvironmentMethods:
    """The ``ClusterEnvironment`` methods; :func:`aiak_training.lightning.strategy.build`
    combines them with the installed Lightning's base class."""

    def __init__(self, allreduce_algorithm: Optional[str] = None) -> None:
        self._allreduce_algorithm = allreduce_algorithm

    def _ready(self) -> None:
        start_runtime(self._allreduce_algorithm)

    @property
    def creates_processes_externally(self) -> bool:
        """The launcher made every rank: Lightning must not spawn any."""
        return True

    @property
    def main_address(self) -> str:
        """Not used: the runtime has its own rendezvous."""
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        """Not used: the runtime has its own rendezvous."""
        return 0

    @staticmethod
    def detect() -> bool:
        """True under a launcher that tells ranks who they are (MPI or aiakrun's Gloo mode)."""
        return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                             "PMIX_RANK", "HOROVOD_RANK"))

    def world_size(self) -> int:
        self._ready()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        _agree("the number of processes", size, self.world_size())

    def global_rank(self) -> int:
        self._ready()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        _agree("this process's rank", rank, self.global_rank())

    def local_rank(self) -> int:
        self._ready()
        return hvd.local_rank()

    def node_rank(self) -> int:
        self._ready()
        return hvd.cross_rank()


def _agree(what: str, lightning: int, launcher: int) -> None:
    """Lightning may only confirm what the launcher decided (aiakrun -np N, the hosts)."""
    if lightning != launcher:
        raise ValueError(f"Lightning computed {lightning} for {what}, but the launcher made it "
                         f"{launcher}: the launcher decides (aiakrun -np N, its hosts)")
