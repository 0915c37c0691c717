"""What the task wrapper's stderr filters share: Python's traceback markers, and the split of a
byte stream into whole lines for a filter that looks at one line at a time.

Standard library only (the task wrapper imports it).
"""
from __future__ import annotations

from typing import List

START = b"Traceback (most recent call last):"
#: Lines that continue a chained traceback rather than end it.
CHAIN = (b"During handling of the above exception, another exception occurred:",
         b"The above exception was the direct cause of the following exception:")
#: A "traceback" longer than this is let through: it is not one, or too big to hold.
MAX_HELD = 2000


def continues_traceback(body: bytes) -> bool:
    """Whether a line (without its newline) inside a traceback is not yet its exception line."""
    return body[:1] in (b" ", b"\t") or not body.strip() or body.startswith(START) \
        or body in CHAIN


class LineFilter:
    """``feed(bytes) -> bytes`` over a byte stream, one whole line at a time (:meth:`_line`).

    Subclasses keep the traceback they are reading in ``_held``.  A partial last line waits for
    the next chunk when it may belong to a traceback; otherwise (a prompt) it passes at once.
    """

    def __init__(self) -> None:
        self._partial = b""
        self._held: List[bytes] = []

    def _line(self, line: bytes) -> List[bytes]:
        raise NotImplementedError

    def _reading_message(self) -> bool:
        """Whether the lines now arriving belong to something the filter reads whole (a
        partial line then waits for its end, like one of a traceback)."""
        return False

    def feed(self, data: bytes) -> bytes:
        data = self._partial + data
        self._partial = b""
        lines = data.splitlines(keepends=True)
        partial = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        out: List[bytes] = []
        for line in lines:
            out += self._line(line)
        if partial:
            if self._held or self._reading_message() or START.startswith(partial) or \
                    partial.startswith(START):
                self._partial = partial  # the rest comes with the next chunk
            else:
                out.append(partial)  # a prompt, not part of a traceback
        return b"".join(out)
