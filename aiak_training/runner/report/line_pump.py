"""Copy a rank's output in whole lines, so MPI launchers label it cleanly.

MPICH's ``-l`` (and similar rank labels) prefix every chunk they read: with unbuffered Python
(``PYTHONUNBUFFERED=1``), ``print("x")`` writes ``x`` and the newline separately, and when the
two reads are apart the console shows ``[0] x[0]``.  The task wrapper therefore reads the rank's
pipes and passes on complete lines; a partial line is passed on once no more output arrives for
a moment (prompts) or when a carriage return ends it (progress bars).  Standard library only.
"""
from __future__ import annotations

import os
import select
from typing import IO, Callable, Optional

IDLE_FLUSH_S = 0.2
MAX_PENDING = 65536


class LineAssembler:
    """Accumulates bytes and releases them up to the last line end (``\\n`` or ``\\r``)."""

    def __init__(self, max_pending: int = MAX_PENDING):
        self._pending = b""
        self._max = max_pending

    def feed(self, chunk: bytes) -> bytes:
        """Add ``chunk``; return what is ready to be written (possibly empty)."""
        data = self._pending + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if len(data) - cut > self._max:  # a huge line without end: do not hold it forever
            cut = len(data)
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """Return and forget the pending partial line."""
        data, self._pending = self._pending, b""
        return data

    @property
    def pending(self) -> bool:
        """True if a partial line is held back."""
        return bool(self._pending)


def write_all(fd: int, data: bytes) -> None:
    """os.write until everything is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _emit(data: bytes, dst_fd: int, log: Optional[IO[bytes]],
          console_filter: Optional[Callable[[bytes], bytes]] = None) -> None:
    if not data:
        return
    shown = console_filter(data) if console_filter is not None else data
    for target in ((lambda: write_all(dst_fd, shown)) if shown else None,
                   (lambda: log.write(data)) if log is not None else None):
        if target is None:
            continue
        try:
            target()
        except OSError:
            pass  # a closed console must not stop the file copy, and vice versa


def pump_lines(src_fd: int, dst_fd: int, log: Optional[IO[bytes]] = None,
               idle_flush_s: float = IDLE_FLUSH_S, console_filter=None) -> None:
    """Copy ``src_fd`` to ``dst_fd`` (and ``log``) in whole lines until EOF, then close it.

    ``console_filter``: an object with ``feed(bytes) -> bytes`` and ``flush() -> bytes``
    that edits what reaches ``dst_fd`` (the log keeps the raw bytes), e.g.
    :class:`interrupt_filter.InterruptTracebackFilter`."""
    lines = LineAssembler()
    edit = console_filter.feed if console_filter is not None else None
    try:
        while True:
            if lines.pending:
                ready, _, _ = select.select([src_fd], [], [], idle_flush_s)
                if not ready:
                    _emit(lines.flush(), dst_fd, log, edit)
                    continue
            try:
                chunk = os.read(src_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            _emit(lines.feed(chunk), dst_fd, log, edit)
        _emit(lines.flush(), dst_fd, log, edit)
        if console_filter is not None:
            _emit(console_filter.flush(), dst_fd, None)
    finally:
        os.close(src_fd)
