"""Elastic jobs whose workers run a Python function (Ray actors, Spark tasks) rather than a
command: the same :class:`ElasticDriver`, with a front end's own discovery and spawner.

A front end provides ``discover() -> {host: slots}`` and ``spawn(wid, slot)`` returning a
:class:`FunctionWorker`: a handle with ``poll``/``signal``/``wait`` (what the driver needs of a
process) plus ``result()`` and ``error``, so that the job can hand back the return values of the
last world's ranks, or the exception that ended it.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional, TextIO

from aiak_training.elastic import protocol
from aiak_training.runner.modes.elastic.driver import ElasticDriver, ElasticSettings
from aiak_training.runner.modes.elastic.hosts import Slot


class FunctionWorker:
    """Base for a worker whose exit code becomes known asynchronously (no Popen to poll).

    Subclasses implement :meth:`_check` (return the exit code once known, else None) and
    :meth:`signal`; ``_value`` and ``error`` hold what the function returned or raised.
    """

    def __init__(self) -> None:
        self._code: Optional[int] = None
        self._value: Any = None
        self.error: Optional[BaseException] = None

    def _check(self) -> Optional[int]:
        raise NotImplementedError

    def signal(self, signum: int) -> None:
        raise NotImplementedError

    def poll(self) -> Optional[int]:
        if self._code is None:
            self._code = self._check()
        return self._code

    def wait(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._code

    def result(self) -> Any:
        return self._value


def worker_env(settings: ElasticSettings, port: int, wid: str, host: str,
               addr: str) -> Dict[str, str]:
    """The environment that makes a process an elastic worker of the driver whose store
    listens at ``addr:port`` (aiakrun's spawner adds its interface choice on top)."""
    return {"HOROVOD_ELASTIC": "1", "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), protocol.PREFIX_ENV: settings.prefix,
            "PYTHONUNBUFFERED": "1", protocol.WAIT_ENV: f"{settings.elastic_timeout:g}",
            "HOROVOD_HOSTNAME": host, protocol.WORKER_ID_ENV: wid}


class ElasticJobError(RuntimeError):
    """An elastic function job failed; the message says why (the driver's reason), and the
    exception a rank raised, if any, is chained as ``__cause__``."""


def run_function_job(settings: ElasticSettings, discover: Callable[[], Dict[str, int]],
                     spawn: Callable[[str, Slot], FunctionWorker], store,
                     log: TextIO = sys.stderr, error_cls: type = ElasticJobError,
                     abort: Optional[Callable[[], Optional[str]]] = None) -> List[Any]:
    """Run the driver to the end; the last world's results in rank order, or ``error_cls``
    naming the reason the job failed (``abort``: see :class:`ElasticDriver`)."""
    driver = ElasticDriver(settings, discover, spawn, store, log=log, abort=abort)
    outcome = driver.run()
    if outcome.exit_code != 0:
        causes = [w.process.error for w in driver.workers.values()
                  if getattr(w.process, "error", None) is not None]
        raise error_cls(f"{settings.log_prefix}: elastic job failed: {outcome.error}") \
            from (causes[-1] if causes else None)
    return [w.process.result() for w in driver.final_workers()]
