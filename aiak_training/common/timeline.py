"""Chrome-trace timeline (``HOROVOD_TIMELINE``), written by rank 0 as Horovod does.

Each tensor gets its own trace "process"; its life shows as NEGOTIATE_<OP> then <OP> with
nested activities (MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE, ...).  Open in chrome://tracing
or Perfetto.
"""
import json
import threading
import time
from typing import Callable, Dict, Optional, TextIO


class Timeline:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: Optional[TextIO] = None
        self._pids: Dict[str, int] = {}
        self._t0 = 0.0
        self.mark_cycles = False
        # Told True/False when recording starts/stops (the engine's C++ core records its events
        # only while someone listens).
        self.on_active: Optional[Callable[[bool], None]] = None

    @property
    def active(self) -> bool:
        return self._file is not None

    @property
    def tensor_count(self) -> int:
        """Tensor names given a trace process so far (kept until the timeline restarts)."""
        return len(self._pids)

    def start(self, path: str, mark_cycles: bool = False) -> None:
        with self._lock:
            self._close_locked()
            self._file = open(path, "w")
            self._pids = {}
            self._t0 = time.monotonic()
            self.mark_cycles = mark_cycles
            self._file.write("[\n")
            if self.on_active is not None:
                self.on_active(True)
            self._write_locked({"name": "process_name", "ph": "M", "pid": 0,
                                "args": {"name": "aiak_training",
                                         "start_time_since_epoch_in_micros":
                                             int(time.time() * 1e6)}})

    def stop(self) -> None:
        with self._lock:
            self._close_locked()
        if self.on_active is not None:
            self.on_active(False)

    def _close_locked(self) -> None:
        if self._file is not None:
            self._file.write("{}\n]\n")  # empty last object keeps the array valid JSON
            self._file.close()
            self._file = None

    def _write_locked(self, event: dict) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _pid_locked(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._write_locked({"name": "process_name", "ph": "M", "pid": pid,
                                "args": {"name": name}})
            self._write_locked({"name": "process_sort_index", "ph": "M", "pid": pid,
                                "args": {"sort_index": pid}})
        return pid

    def _ts(self, ts: Optional[float]) -> int:
        """Microseconds since start of ``ts`` (a ``time.monotonic()`` reading; now if None)."""
        return int(((time.monotonic() if ts is None else ts) - self._t0) * 1e6)

    def _event(self, name: str, phase: str, activity: str = "", args: Optional[dict] = None,
               ts: Optional[float] = None) -> None:
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            ev = {"ph": phase, "pid": self._pid_locked(name), "tid": 0,
                  "ts": self._ts(ts)}
            if activity:
                ev["name"] = activity
            if args:
                ev["args"] = args
            self._write_locked(ev)

    def begin(self, name: str, activity: str, args: Optional[dict] = None,
              ts: Optional[float] = None) -> None:
        self._event(name, "B", activity, args, ts)

    def end(self, name: str, ts: Optional[float] = None) -> None:
        self._event(name, "E", ts=ts)

    def mark_cycle(self, ts: Optional[float] = None) -> None:
        if self._file is None or not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._write_locked({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0,
                                    "tid": 0, "ts": self._ts(ts)})
