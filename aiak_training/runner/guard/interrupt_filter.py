"""Ctrl-C without a traceback per rank.

aiakrun forwards Ctrl-C (SIGINT) to every rank, so that programs may catch
``KeyboardInterrupt`` and save their state.  Python's default, though, is to print the whole
traceback of the interrupted statement, once per rank, which buries aiakrun's one-line
``aiakrun: stopped by SIGINT``.  The task wrapper runs the rank's stderr through
:class:`InterruptTracebackFilter`, which, once the wrapper has passed a Ctrl-C on, drops
tracebacks that end in ``KeyboardInterrupt`` and passes everything else (other exceptions
included) unchanged.
``--output-filename`` files keep the raw output.  Standard library only (the wrapper imports
it).
"""
from __future__ import annotations

import re
import threading
from typing import List

from aiak_training.runner.report.traceback_lines import (CHAIN as _CHAIN, MAX_HELD as _MAX_HELD,
                                                         START as _START, LineFilter,
                                                         continues_traceback)

_INTERRUPT = re.compile(rb"^KeyboardInterrupt\b")


class InterruptTracebackFilter(LineFilter):
    """``feed(bytes) -> bytes`` over a byte stream.  Drops a traceback ending in
    ``KeyboardInterrupt`` once :meth:`activate` was called (the wrapper forwarded a Ctrl-C).

    The rank may receive the signal straight from the launcher and print its traceback before
    the wrapper's own handler has run, so a traceback is held until its exception line, and a
    ``KeyboardInterrupt`` there waits up to :attr:`grace_s` for the activation.  Any other
    traceback is passed on as soon as its exception line arrives.
    """

    grace_s = 0.5

    def __init__(self) -> None:
        super().__init__()            # _held: the traceback being read
        self._active = threading.Event()
        self._ended = False           # it ended in KeyboardInterrupt, to be dropped ...
        self._chained = False         # ... unless a chained traceback follows

    @property
    def active(self) -> bool:
        return self._active.is_set()

    @active.setter
    def active(self, value: bool) -> None:
        if value:
            self._active.set()
        else:
            self._active.clear()

    def activate(self) -> None:
        """A Ctrl-C was forwarded: from now on, interrupt tracebacks are not shown."""
        self._active.set()

    def _line(self, line: bytes) -> List[bytes]:
        body = line.rstrip(b"\r\n")
        if not self._held:
            if body.startswith(_START):
                self._held, self._ended, self._chained = [line], False, False
                return []
            return [line]
        if self._ended:
            # After "KeyboardInterrupt": blank lines and a chaining note, then the next
            # traceback of the chain, continue it; anything else ends it (and it is dropped).
            if not body.strip() or body in _CHAIN:
                self._held.append(line)
                self._chained = self._chained or body in _CHAIN
                return []
            if body.startswith(_START) and self._chained:
                self._held.append(line)
                self._ended = self._chained = False
                return []
            self._held, self._ended, self._chained = [], False, False
            return self._line(line)
        self._held.append(line)
        if continues_traceback(body):
            if len(self._held) > _MAX_HELD:
                return self._release()
            return []
        # The exception line: "KeyboardInterrupt", "ValueError: ...".
        if _INTERRUPT.match(body) and self._active.wait(self.grace_s):
            self._ended = True
            return []
        return self._release()

    def _release(self) -> List[bytes]:
        held, self._held = self._held, []
        self._ended = self._chained = False
        return held

    def flush(self) -> bytes:
        """At the end of the stream: what is still held (an interrupt traceback is not)."""
        out = b"" if self._ended else b"".join(self._held)
        self._held, self._ended, self._chained = [], False, False
        out += self._partial
        self._partial = b""
        return out
