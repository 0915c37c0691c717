"""The exception a rank's program died of, read from its stderr; secondary tracebacks cut.

aiakrun's summary names the rank that failed first and repeats its exception, so the cause is
the last line on the console.  A Python program says what it died of only in the traceback it
prints, so the task wrapper reads the rank's stderr through :class:`TracebackWatch`, which
remembers the exception line (``ValueError: boom``) of each traceback and when it appeared.
That time decides which rank failed first: the rank whose exception came first, not the one
whose process happened to end first (a rank that raised may still wait in ``MPI_Finalize``
while its peers end on the consequences).

When one rank fails, every other rank's next collective fails with Horovod's "Horovod has
been shut down ..." ``HorovodInternalError``.  Those tracebacks, 30 lines each, say nothing
about the cause and bury it, so the watch replaces each of them by its exception line and a
short note; every other traceback passes unchanged.  ``--output-filename`` files keep
everything.  Standard library only (the task wrapper imports it).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import List, Optional

from aiak_training.runner.guard.interrupt_filter import InterruptTracebackFilter
from aiak_training.runner.report.traceback_lines import (MAX_HELD as _MAX_HELD, START as _START,
                                                         LineFilter, continues_traceback)

# Horovod's message for every operation after the job failed (common/horovod_strings.py).
_SHUT_DOWN = re.compile(rb"^(?:[\w.]+\.)?HorovodInternalError: Horovod has been shut down\b")
# A dotted module path in front of the exception's class name.
_QUALIFIED = re.compile(r"^(?:[A-Za-z_][\w]*\.)+(?=[A-Za-z_]\w*(?::|$))")
CUT_NOTE = b" [traceback not shown: a consequence of another rank's failure]"
#: How much of an exception message the summary repeats.
MAX_MESSAGE = 300
#: An indented line of a multi-line message that names an error: ``    TypeError: 'list'
#: object is not callable`` (TensorFlow puts the real cause there, under "in user code:").
_CAUSE = re.compile(r"^\s+(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)"
                    r"(?:: .*)?$")
#: How many lines of a multi-line message are searched for the cause.
MAX_MESSAGE_LINES = 60


@dataclass(frozen=True)
class RankException:
    """The exception line of a traceback the rank printed, and when."""

    line: str        # ``ValueError: boom`` (the module path of the class left out)
    time: float      # wall clock, comparable between processes of one machine
    secondary: bool  # Horovod's "has been shut down": a consequence of another failure


def short_exception(line: str) -> str:
    """``pkg.mod.Error: message`` as ``Error: message``, cut to :data:`MAX_MESSAGE`."""
    line = _QUALIFIED.sub("", line.strip(), count=1)
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "..."


def announces_more(line: str) -> bool:
    """Whether an exception line's message is only a heading for the lines below it
    (``TypeError: in user code:``, or no message at all)."""
    _, sep, message = line.partition(": ")
    message = message.strip() if sep else ""
    return not message or message.endswith(":")


class TracebackWatch(LineFilter):
    """``feed(bytes) -> bytes`` over a rank's stderr (see the module doc).

    A traceback is held from its first line to its exception line (it is then known whether
    to cut it); anything else passes at once.  :attr:`last` is the latest exception seen."""

    def __init__(self) -> None:
        super().__init__()
        self.last: Optional[RankException] = None
        # Lines still to search for the cause under an exception line that only announced
        # it (see announces_more); 0 when not searching.
        self._cause_lines = 0

    def _line(self, line: bytes) -> List[bytes]:
        body = line.rstrip(b"\r\n")
        if self._cause_lines:
            self._look_for_cause(body)
        if not self._held:
            if body.startswith(_START):
                self._held = [line]
                return []
            return [line]
        self._held.append(line)
        if continues_traceback(body):
            if len(self._held) > _MAX_HELD:  # not a traceback after all, or a huge one
                held, self._held = self._held, []
                return held
            return []
        # The exception line ends the traceback.
        held, self._held = self._held, []
        secondary = bool(_SHUT_DOWN.match(body))
        text = body.decode("utf-8", "replace")
        self.last = RankException(short_exception(text), time.time(), secondary)
        self._cause_lines = MAX_MESSAGE_LINES if announces_more(text) else 0
        if secondary:
            return [body + CUT_NOTE + line[len(body):]]
        return held

    def _reading_message(self) -> bool:
        return self._cause_lines > 0

    def _look_for_cause(self, body: bytes) -> None:
        """A line after an exception line that announced more: the first indented one that
        names an error becomes the exception the summary repeats.  A line that is not
        indented ends the message (and the search)."""
        text = body.decode("utf-8", "replace")
        if text.strip() and text[:1] not in (" ", "\t"):
            self._cause_lines = 0
            return
        self._cause_lines -= 1
        if self.last is not None and _CAUSE.match(text):
            self.last = RankException(short_exception(text), self.last.time,
                                      self.last.secondary)
            self._cause_lines = 0

    def flush(self) -> bytes:
        """At the end of the stream: whatever is still held."""
        out = b"".join(self._held) + self._partial
        self._held, self._partial = [], b""
        return out


class StderrFilter:
    """The task wrapper's filter on a rank's stderr: Ctrl-C tracebacks dropped (after a
    forwarded Ctrl-C, :mod:`interrupt_filter`), then secondary tracebacks cut and the rank's
    exception noted (:class:`TracebackWatch`)."""

    def __init__(self) -> None:
        self.interrupts = InterruptTracebackFilter()
        self.watch = TracebackWatch()

    def activate(self) -> None:
        """A Ctrl-C was forwarded (see :meth:`InterruptTracebackFilter.activate`)."""
        self.interrupts.activate()

    def feed(self, data: bytes) -> bytes:
        passed = self.interrupts.feed(data)
        return self.watch.feed(passed) if passed else b""

    def flush(self) -> bytes:
        return self.watch.feed(self.interrupts.flush()) + self.watch.flush()
