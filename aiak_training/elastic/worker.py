"""The worker's side of an elastic job: where its next world comes from, and host-change
notifications.

In an elastic job (``HOROVOD_ELASTIC=1``, started by ``aiakrun --host-discovery-script``)
every ``hvd.init()`` asks the driver for this worker's identity in the next round through
the rendezvous store (see :mod:`aiak_training.elastic.protocol`), via the Gloo transport's
``set_world_source`` hook.  Outside elastic mode nothing here is active.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from typing import Any, Callable, List, Optional

from aiak_training.elastic import protocol

ELASTIC_ENV = "HOROVOD_ELASTIC"


class ElasticJobStopped(RuntimeError):
    """The elastic driver stopped the job (too few slots after ``--elastic-timeout``, the
    ``--reset-limit`` reached, ...); the message says why."""


def elastic_enabled(environ=None) -> bool:
    """Whether this process is a worker of an elastic job started by the driver."""
    env = os.environ if environ is None else environ
    return env.get(ELASTIC_ENV, "") == "1" and bool(env.get(protocol.WORKER_ID_ENV))


class _Control:
    """This worker's connection to the driver's store (opened on first use)."""

    def __init__(self) -> None:
        self._store = None
        self._lock = threading.Lock()
        self.worker = os.environ.get(protocol.WORKER_ID_ENV, "")
        self.prefix = os.environ.get(protocol.PREFIX_ENV, protocol.DEFAULT_PREFIX)
        self.addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "")
        self.port = int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0") or 0)
        self.hostname = os.environ.get("HOROVOD_HOSTNAME", "")
        self.joins = 0
        self.round = 0

    def store(self):
        with self._lock:
            if self._store is None:
                from torch.distributed import TCPStore
                if not self.addr or not self.port:
                    raise ValueError("elastic worker: HOROVOD_GLOO_RENDEZVOUS_ADDR and "
                                     "HOROVOD_GLOO_RENDEZVOUS_PORT must name the driver's "
                                     "store")
                self._store = TCPStore(self.addr, self.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
                # Drop the client before the interpreter tears torch down.
                atexit.register(self.close)
            return self._store

    def close(self) -> None:
        with self._lock:
            self._store = None

    def next_world(self):
        """Block until the driver places this worker in a new round; its ``WorldInfo``."""
        from aiak_training.runtime.transport.gloo import WorldInfo
        store = self.store()
        seq = self.joins
        store.set(protocol.waiting_key(self.prefix, self.worker), str(seq))
        key = protocol.assign_key(self.prefix, self.worker, seq)
        limit = float(os.environ.get(protocol.WAIT_ENV, protocol.DEFAULT_ELASTIC_TIMEOUT))
        # The driver answers within --elastic-timeout (it stops the job then); the margin
        # covers its own polling, so only a vanished driver trips this.
        deadline = time.monotonic() + limit + 60
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise ElasticJobStopped(
                    f"elastic worker {self.worker}: no world from the driver within "
                    f"{limit + 60:.0f} s")
            time.sleep(0.02)
        answer = protocol.parse_answer(store.get(key).decode())
        self.joins += 1
        if answer.get("stop"):
            if answer.get("code", 1) == 0:
                print(f"aiak elastic: worker {self.worker} leaves the job: "
                      f"{answer.get('message', '')}", file=sys.stderr, flush=True)
                raise SystemExit(0)
            raise ElasticJobStopped(answer.get("message", "the elastic driver stopped the job"))
        self.round = int(answer["round"])
        # Notifications posted before this round formed are reflected in it already.
        notification_manager.skip_to(int(answer.get("updates_seen", 0)))
        return WorldInfo(rank=answer["rank"], size=answer["size"],
                         local_rank=answer["local_rank"], local_size=answer["local_size"],
                         cross_rank=answer["cross_rank"], cross_size=answer["cross_size"],
                         hostname=answer["hostname"], addr=self.addr, port=self.port,
                         prefix=protocol.world_prefix(self.prefix, self.round))

    def read_updates(self, seen: int) -> "tuple[int, list]":
        store = self.store()
        count = int(store.add(protocol.updates_key(self.prefix), 0))
        found = []
        for index in range(seen, count):
            parsed = protocol.parse_update(store.get(protocol.update_key(self.prefix,
                                                                         index)).decode())
            if parsed is not None:
                found.append(parsed)
        return count, found


_control: Optional[_Control] = None


def control() -> _Control:
    global _control
    if _control is None:
        _control = _Control()
    return _control


#: Whether :func:`install_world_source` already handed the Gloo transport its world source.
_world_source_installed = False


def install_world_source(environ=None) -> bool:
    """In an elastic worker, make every ``hvd.init()`` take its world from the driver.
    Returns whether it did (False outside elastic mode).  Idempotent."""
    if not elastic_enabled(environ):
        return False
    global _world_source_installed
    from aiak_training.runtime.transport import gloo
    if _world_source_installed:
        return True
    gloo.set_world_source(control().next_world)
    _world_source_installed = True
    return True


class WorkerNotificationManager:
    """Delivers the driver's host-change notifications to registered states.

    Polled (one store round trip) at every ``check_host_updates``, so no thread runs beside
    the training loop; outside elastic mode it does nothing.
    """

    def __init__(self) -> None:
        self._listeners: List[Any] = []
        self._seen = 0
        self._lock = threading.Lock()

    def init(self) -> None:
        """Start listening (elastic mode only)."""
        install_world_source()

    def register_listener(self, listener: Any) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: Any) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def handle_hosts_updated(self, timestamp: int, update_res: int) -> None:
        for listener in list(self._listeners):
            listener.on_hosts_updated(timestamp, update_res)

    def skip_to(self, count: int) -> None:
        with self._lock:
            self._seen = max(self._seen, count)

    def poll(self) -> None:
        """Fetch notifications the driver posted since the last poll."""
        if not self._listeners or not elastic_enabled():
            return
        with self._lock:
            self._seen, found = control().read_updates(self._seen)
        for timestamp, flags in found:
            self.handle_hosts_updated(timestamp, flags)


notification_manager = WorkerNotificationManager()


def reset_world(shutdown: Callable[[], None], init: Callable[[], None],
                attempts: int = 3) -> None:
    """``shutdown(); init()`` until a new world forms (a peer may die while it forms)."""
    from aiak_training.common.exceptions import HorovodInternalError
    for attempt in range(attempts):
        shutdown()
        try:
            init()
            return
        except (HorovodInternalError, TimeoutError, RuntimeError) as exc:
            if isinstance(exc, ElasticJobStopped) or attempt + 1 == attempts:
                raise
            print(f"aiak elastic: forming the new world failed ({exc}); retrying",
                  file=sys.stderr, flush=True)
