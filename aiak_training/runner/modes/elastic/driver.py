"""The elastic driver: discovers hosts, runs one worker per slot, forms the successive
worlds (rounds) and ends the job.

Each round is formed only when every worker chosen for it asks for its next world (see
:mod:`aiak_training.elastic.protocol`); until then the workers of the previous round keep
training.  A worker that exits non-zero gets its host blacklisted (with the cool-down);
the survivors notice through a failed collective, restore their last commit and ask for the
next world.  Hosts added or removed by the discovery script are announced to the workers,
which stop at their next ``state.commit()`` (``HostsUpdatedInterrupt``) and ask too; new
hosts are announced only once their workers are ready, so the others do not wait for them.
The job fails, with every worker exiting non-zero, when fewer than ``--min-np`` slots are
usable for ``--elastic-timeout`` seconds, or when a reset would exceed ``--reset-limit``.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, TextIO, Tuple

from aiak_training.common.job.records import describe_returncode
from aiak_training.elastic import protocol
from aiak_training.elastic.state import HostUpdateResult
from aiak_training.runner.modes.elastic.discovery import DiscoveryError
from aiak_training.runner.modes.elastic.hosts import (Blacklist, HostOrder, Slot, assign_ranks,
                                                      plan_slots)
from aiak_training.runner.report.failure import shell_status

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class ElasticSettings:
    num_proc: Optional[int]
    min_np: int
    max_np: Optional[int]
    elastic_timeout: float = 600.0
    reset_limit: Optional[int] = None
    cooldown: Optional[Tuple[float, float]] = None
    discovery_interval: float = 1.0
    prefix: str = protocol.DEFAULT_PREFIX
    poll: float = 0.02
    stop_grace: float = 10.0
    # Bound on a worker's start (until it first asks for a world): --start-timeout.
    start_timeout: float = 120.0
    # Who speaks in the log, and what the settings are called there: the Ray and Spark
    # front ends reuse this driver, and their users know keyword arguments, not flags.
    log_prefix: str = "aiakrun"
    names: Dict[str, str] = field(default_factory=dict)

    def name(self, flag: str) -> str:
        """The user's name for the setting aiakrun calls ``flag`` (e.g. ``--min-np``)."""
        return self.names.get(flag, flag)


@dataclass
class Worker:
    wid: str
    slot: Slot
    process: object  # spawn.WorkerProcess (or a test double with poll/signal/wait)
    started: float
    joins: int = 0            # worlds given so far; the next request carries this number
    stopping: bool = False    # the driver asked it to leave: its exit is not a failure
    exit_code: Optional[int] = None
    rank: Optional[int] = None

    @property
    def host(self) -> str:
        return self.slot[0]

    def describe(self) -> str:
        where = f"host {self.host} slot {self.slot[1]}"
        return f"worker {self.wid} ({where}" + (f", rank {self.rank})" if self.rank is not None
                                                else ")")


@dataclass
class DriverResult:
    exit_code: int
    rounds: int
    resets: int
    lost_hosts: List[str] = field(default_factory=list)
    error: Optional[str] = None


class ElasticDriver:
    """Runs an elastic job; :meth:`run` returns when it ends.

    ``discover()`` returns ``{host: slots}`` (raising ``DiscoveryError``); ``spawn(wid, slot)``
    starts a worker and returns its process; ``store`` is the rendezvous ``TCPStore``.
    ``abort()``, asked at every discovery, returns a reason to fail the job at once (a front
    end that knows no slot can ever come back), else None.
    """

    def __init__(self, settings: ElasticSettings, discover: Callable[[], Dict[str, int]],
                 spawn: Callable[[str, Slot], object], store, log: TextIO = sys.stderr,
                 clock: Callable[[], float] = time.monotonic,
                 abort: Optional[Callable[[], Optional[str]]] = None):
        self.s = settings
        self._abort = abort
        self._discover_fn = discover
        self._spawn = spawn
        self.store = store
        self._log = log
        self._clock = clock
        self.order = HostOrder()
        self.blacklist = Blacklist(settings.cooldown, clock=clock)
        self.available: Dict[str, int] = {}
        self.workers: Dict[str, Worker] = {}       # live and finished, by id
        self.members: List[str] = []               # worker ids of the current round
        self.round = 0
        self.resets = 0
        self.lost_hosts: List[str] = []
        self._next_id = 0
        self._next_discovery = 0.0
        self._discovery_error: Optional[str] = None
        self._short_since: Optional[float] = None
        self._notified: Optional[Tuple[frozenset, frozenset]] = None
        self._updates = 0
        self._finishing = False
        self._error: Optional[str] = None
        self._stop_signal: Optional[int] = None
        store.set(protocol.updates_key(settings.prefix), "0")
        store.add(protocol.updates_key(settings.prefix), 0)

    # -- logging --------------------------------------------------------------------------

    def info(self, message: str) -> None:
        print(f"{self.s.log_prefix}: elastic: {message}", file=self._log, flush=True)

    # -- state queries --------------------------------------------------------------------

    def live(self) -> List[Worker]:
        return [w for w in self.workers.values() if w.exit_code is None]

    def _by_slot(self) -> Dict[Slot, Worker]:
        return {w.slot: w for w in self.live() if not w.stopping}

    def target(self) -> List[Slot]:
        return plan_slots(self.order, self.available, self.blacklist.blocked(), self.s.max_np)

    def _waiting(self, worker: Worker) -> bool:
        key = protocol.waiting_key(self.s.prefix, worker.wid)
        if not self.store.check([key]):
            return False
        return int(self.store.get(key).decode()) == worker.joins

    def _answer(self, worker: Worker, text: str) -> None:
        self.store.set(protocol.assign_key(self.s.prefix, worker.wid, worker.joins), text)
        worker.joins += 1

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> DriverResult:
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS} \
            if _main_thread() else {}
        try:
            while True:
                now = self._clock()
                if self._stop_signal is not None:
                    return self._shutdown(128 + self._stop_signal,
                                          f"stopped by {signal.Signals(self._stop_signal).name}",
                                          quiet=True)
                if self._error is not None:
                    return self._shutdown(1, self._error)
                if now >= self._next_discovery and not self._finishing:
                    self._error = self._abort() if self._abort is not None else None
                    if self._error is not None:
                        continue
                    self._discover()
                    self._next_discovery = now + self.s.discovery_interval
                self._reap()
                if self._error is not None:
                    continue
                if self._finishing:
                    result = self._check_finished()
                    if result is not None:
                        return result
                else:
                    self._start_missing()
                    self._notify_changes()
                    self._form_round()
                time.sleep(self.s.poll)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def _discover(self) -> None:
        try:
            found = self._discover_fn()
        except DiscoveryError as exc:
            if str(exc) != self._discovery_error:
                self.info(f"{exc}; keeping the current hosts "
                          f"({', '.join(f'{h}:{n}' for h, n in self.available.items()) or 'none'})")
            self._discovery_error = str(exc)
            return
        self._discovery_error = None
        if found != self.available:
            gone = [h for h in self.available if h not in found]
            new = [h for h in found if h not in self.available]
            if self.available or new:
                self.info("discovered hosts: " + (", ".join(f"{h}:{n}" for h, n in found.items())
                                                  or "none")
                          + (f" (added {', '.join(new)})" if new and self.round else "")
                          + (f" (removed {', '.join(gone)})" if gone else ""))
        self.order.update(found)
        self.available = dict(found)

    def _reap(self) -> None:
        for worker in self.live():
            code = worker.process.poll()
            if code is None:
                continue
            worker.exit_code = code
            if worker.stopping:
                continue
            if code == 0:
                if worker.wid in self.members and not self._finishing:
                    self.info(f"{worker.describe()} finished; waiting for the others")
                    self._finishing = True
                continue
            self._on_failure(worker, code)

    def _on_failure(self, worker: Worker, code: int) -> None:
        host = worker.host
        first = host not in self.blacklist
        if first:
            delay = self.blacklist.add(host)
            if host not in self.lost_hosts:
                self.lost_hosts.append(host)
            until = "for good" if delay == float("inf") else f"for {delay:.0f} s"
            self.info(f"lost host {host}: {worker.describe()} exited with "
                      f"{describe_returncode(code)}; host {host} is blacklisted {until}")
        else:
            self.info(f"also lost {worker.describe()} on host {host}: "
                      f"{describe_returncode(code)}")
        # The host's other workers go too: a blacklisted host runs nothing.
        for other in self.live():
            if other.host == host and not other.stopping:
                other.stopping = True
                other.process.signal(signal.SIGKILL)

    def _start_missing(self) -> None:
        by_slot = self._by_slot()
        for slot in self.target():
            if slot not in by_slot:
                wid = f"w{self._next_id}"
                self._next_id += 1
                process = self._spawn(wid, slot)
                self.workers[wid] = Worker(wid, slot, process, self._clock())

    def _notify_changes(self) -> None:
        """Tell the running round that hosts came or went (checked at their next commit)."""
        if not self.round:
            return
        members = {self.workers[w].slot for w in self.members
                   if self.workers[w].exit_code is None}
        target = set(self.target())
        by_slot = self._by_slot()
        added = frozenset(s for s in target - members
                          if s in by_slot and self._waiting(by_slot[s]))
        removed = frozenset(members - target)
        if not added and not removed:
            return
        if (added, removed) == self._notified:
            return
        self._notified = (added, removed)
        flags = HostUpdateResult.no_update
        if added:
            flags |= HostUpdateResult.added
        if removed:
            flags |= HostUpdateResult.removed
        index = int(self.store.add(protocol.updates_key(self.s.prefix), 0))
        self._updates += 1
        self.store.set(protocol.update_key(self.s.prefix, index), f"{self._updates},{int(flags)}")
        self.store.add(protocol.updates_key(self.s.prefix), 1)
        what = []
        if added:
            what.append("added " + ", ".join(f"{h}:{i}" for h, i in sorted(added)))
        if removed:
            what.append("removed " + ", ".join(f"{h}:{i}" for h, i in sorted(removed)))
        self.info("hosts updated (" + "; ".join(what) + "): the workers reset at their "
                  "next commit")

    def _form_round(self) -> None:
        now = self._clock()
        target = self.target()
        by_slot = self._by_slot()
        # Workers no longer wanted (host removed, over --max-np) leave when they ask.
        wanted = set(target)
        for worker in self.live():
            if worker.slot not in wanted and not worker.stopping and self._waiting(worker):
                worker.stopping = True
                self._answer(worker, protocol.stop_order(
                    0, f"host {worker.host} slot {worker.slot[1]} is no longer in the job"))
        if self.round and [self.workers[w].slot for w in self.members] == target and \
                all(self.workers[w].exit_code is None for w in self.members) and \
                not any(self._waiting(self.workers[w]) for w in self.members):
            self._short_since = None
            return  # the current round is what we want and nobody asks for another
        candidates = [by_slot[s] for s in target if s in by_slot]
        # The first round waits for -np slots, unless a host already failed on the way.
        minimum = self.s.min_np if self.round or self.lost_hosts else \
            max(self.s.min_np, self.s.num_proc or 0)
        flag = self.s.name("-np" if minimum > self.s.min_np else "--min-np")
        if len(candidates) < minimum:
            if self._short_since is None:
                self._short_since = now
                self.info(f"{len(candidates)} slot(s) usable, fewer than the "
                          f"{flag} of {minimum}: waiting up to "
                          f"{self.s.elastic_timeout:g} s "
                          f"({self.s.name('--elastic-timeout')}) for more hosts")
            elif now - self._short_since > self.s.elastic_timeout:
                self._error = (f"only {len(candidates)} slot(s) usable, fewer than the "
                               f"{flag} of {minimum}, for "
                               f"{self.s.elastic_timeout:g} s "
                               f"({self.s.name('--elastic-timeout')}); "
                               f"lost hosts: {', '.join(self.lost_hosts) or 'none'}")
            return
        self._short_since = None
        late = [w for w in candidates if not self._waiting(w)]
        if late:
            for w in late:  # a worker that never asks (hung at start) is bounded too
                if w.joins == 0 and now - w.started > self.s.start_timeout:
                    self._error = (f"{w.describe()} did not start within "
                                   f"{self.s.start_timeout:g} s "
                                   f"({self.s.name('--start-timeout')})")
            return
        if self.round:
            if self.s.reset_limit is not None and self.resets >= self.s.reset_limit:
                self._error = (f"reset limit reached: the job was reset {self.resets} "
                               f"time(s) and another reset is needed "
                               f"({self.s.name('--reset-limit')} {self.s.reset_limit})")
                return
            self.resets += 1
        self.round += 1
        self._notified = None
        seen = int(self.store.add(protocol.updates_key(self.s.prefix), 0))
        identities = assign_ranks([w.slot for w in candidates])
        for worker in candidates:
            ident = identities[worker.slot]
            worker.rank = ident.rank
            text = protocol.assignment(self.round, ident.rank, ident.size, ident.local_rank,
                                       ident.local_size, ident.cross_rank, ident.cross_size,
                                       worker.host, updates_seen=seen)
            self._answer(worker, text)
        self.members = [w.wid for w in candidates]
        self.info(f"round {self.round}: {len(candidates)} rank(s) on "
                  + ", ".join(dict.fromkeys(w.host for w in candidates))
                  + (f" (reset {self.resets})" if self.resets else ""))

    def final_workers(self) -> List[Worker]:
        """The workers of the last round, in rank order (whose results a function job
        returns)."""
        return sorted((self.workers[w] for w in self.members), key=lambda w: w.rank)

    def _check_finished(self) -> Optional[DriverResult]:
        for worker in self.live():
            if worker.wid not in self.members and not worker.stopping:
                if self._waiting(worker):
                    worker.stopping = True
                    self._answer(worker, protocol.stop_order(0, "the job has finished"))
                elif worker.joins == 0:
                    worker.stopping = True
                    worker.process.signal(signal.SIGTERM)
        if any(w.exit_code is None and w.wid in self.members for w in self.workers.values()):
            return None
        failed = [self.workers[w] for w in self.members if self.workers[w].exit_code != 0]
        if failed:
            return self._shutdown(shell_status(failed[0].exit_code) or 1,
                                  f"{failed[0].describe()} exited with "
                                  f"{describe_returncode(failed[0].exit_code)} after others "
                                  "had finished")
        self._stop_all(grace=self.s.stop_grace)
        self.info(f"job finished: {len(self.members)} rank(s) in round {self.round}, "
                  f"{self.resets} reset(s)")
        return DriverResult(0, self.round, self.resets, list(self.lost_hosts))

    # -- ending ---------------------------------------------------------------------------

    def _stop_all(self, grace: float, message: Optional[str] = None) -> None:
        """End every worker: one waiting for a world gets a stop order (``message``: the
        job failed, so it exits non-zero), the others SIGTERM; SIGKILL after ``grace``."""
        for worker in self.live():
            if message is not None and self._waiting(worker):
                self._answer(worker, protocol.stop_order(1, message))
            elif worker.process.poll() is None:
                worker.process.signal(signal.SIGTERM)
            worker.stopping = True
        deadline = self._clock() + grace
        while self._clock() < deadline and any(w.process.poll() is None for w in self.live()):
            time.sleep(self.s.poll)
        left = [w for w in self.live() if w.process.poll() is None]
        for w in left:
            w.process.signal(signal.SIGKILL)
        end = self._clock() + 5.0
        while self._clock() < end and any(w.process.poll() is None for w in left):
            time.sleep(self.s.poll)
        for worker in self.live():
            worker.exit_code = worker.process.poll()

    def _shutdown(self, code: int, message: str, quiet: bool = False) -> DriverResult:
        self.info(f"stopping every worker: {message}")
        self._stop_all(grace=self.s.stop_grace, message=f"elastic job failed: {message}")
        if not quiet:
            # Last on the console, after the workers' own messages.
            print(f"{self.s.log_prefix}: error: elastic job failed: {message}", file=self._log,
                  flush=True)
        return DriverResult(code, self.round, self.resets, list(self.lost_hosts), message)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
