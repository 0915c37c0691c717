"""aiakrun's view of the MPI launcher's own output: quiet, truthful endings.

When a job fails or is stopped, MPICH's hydra prints a "BAD TERMINATION ... EXIT CODE: 15
... signal 15" banner (and "Sending Ctrl-C to processes as requested" on Ctrl-C), and Open MPI
prints "Primary job terminated ..." / "mpirun noticed that process rank ..." boxes.  They
describe how the launcher tore the job down, not why it failed, and they contradict aiakrun's
exit status.  aiakrun therefore reads the launcher's stdout and stderr through pipes, drops
those blocks, and passes everything else on unchanged, line by line; its own summary is
printed after the launcher's output has ended, so it is the last thing on the console.
``--verbose`` keeps the raw output.

While reading, it also notices ``ModuleNotFoundError: No module named 'horovod...'`` from a
rank, so that aiakrun can hint at ``--horovod-compat`` once per job, and the Horovod shim's
Keras 2 hint (compat/keras_hint.py), which aiakrun repeats after its summary.

Rank output is labelled by the launcher (``[3] ...`` or ``[1,3]<stdout>:...``), so a line
this filter recognises as the launcher's own cannot come from a rank's program.
"""
from __future__ import annotations

import os
import re
import select
import threading
from typing import List, Optional, Tuple

from aiak_training.runner.cli.hosts import ssh_failure
from aiak_training.runner.report.line_pump import LineAssembler, write_all

# A box delimiter: a line of only '=' or '-' (hydra and Open MPI draw boxes with them).
_RULE = re.compile(rb"^\s*(=|-){20,}\s*$")
# What makes a box (or the lines after it) a termination banner.
_BANNER_BOX = re.compile(
    rb"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES|Primary job\s+terminated|"
    rb"mpirun detected that one or more processes exited|mpirun noticed that process rank|"
    rb"prterun detected that one or more processes exited|"
    rb"prterun noticed that process rank|exited on signal \d+")
_BANNER_LINE = re.compile(
    rb"^(YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*|"
    rb"This typically refers to a problem with your application\.|"
    rb"Please see the FAQ page for debugging suggestions|"
    rb"\[mpiexec@[^\]]*\] Sending Ctrl-C to processes as requested|"
    rb"\[mpiexec@[^\]]*\] Press Ctrl-C again to force abort|"
    rb"mpirun noticed that process rank \d+ .*|prterun noticed that process rank \d+ .*)\s*$")
_MAX_BOX_LINES = 60
_HOROVOD_MISSING = re.compile(rb"ModuleNotFoundError: No module named '(horovod)(\.[\w.]+)?'")
# The line a rank's Horovod shim prints after a Keras 3 error (compat/keras_hint.py).
_KERAS2_HINT = re.compile(
    rb"(aiak-training: hint: this Horovod script uses the Keras 2 API[^\r\n]*)")

HOROVOD_COMPAT_HINT = ("aiakrun: hint: the program imports horovod, which is not installed "
                       "here; run it with aiakrun --horovod-compat (or AIAK_HOROVOD_COMPAT=1) "
                       "to load aiak-training under Horovod's module names")


class BannerFilter:
    """Line filter that drops the launcher's termination banners (see the module doc)."""

    def __init__(self) -> None:
        self._box: Optional[List[bytes]] = None  # lines of an open box, first rule included
        self._blank: List[bytes] = []            # blank lines held until we know what follows
        self.dropped = 0

    def feed(self, line: bytes) -> List[bytes]:
        """One line (with its line end); returns the lines to pass on now."""
        out: List[bytes] = []
        body = line.rstrip(b"\r\n")
        if self._box is not None:
            self._box.append(line)
            if _RULE.match(body) or len(self._box) > _MAX_BOX_LINES:
                box, self._box = self._box, None
                if len(box) > 2 or not _RULE.match(body):
                    out += self._settle(box)
                else:  # two rules in a row: the second may open the box
                    out += self._settle(box[:1])
                    self._box = box[1:]
            return out
        if not body.strip():
            self._blank.append(line)
            return out
        if _RULE.match(body):
            self._box = [line]
            return out
        if _BANNER_LINE.match(body):
            self._blank.clear()
            self.dropped += 1
            return out
        out += self._blank
        self._blank = []
        out.append(line)
        return out

    def _settle(self, box: List[bytes]) -> List[bytes]:
        if _BANNER_BOX.search(b"".join(box)):
            self._blank.clear()
            self.dropped += 1
            return []
        out, self._blank = self._blank + box, []
        return out

    def flush(self) -> List[bytes]:
        """Everything still held (at the end of the stream)."""
        out = list(self._blank) + (self._box or [])
        self._blank, self._box = [], None
        return out


class LauncherOutput:
    """Pumps the launcher's stdout and stderr to ours, filtered unless ``raw``."""

    def __init__(self, raw: bool = False):
        self.raw = raw
        self.horovod_missing = False
        self.keras2_hint: Optional[str] = None  # the shim's Keras 2 line, repeated at the end
        # (host, reason) of the first "ssh: ..." failure the launcher printed: hydra starts
        # its proxies through ssh, and on failure says only "Launch proxy failed".
        self.ssh_failure: Optional[Tuple[str, str]] = None
        self._threads: List[threading.Thread] = []

    def start(self, stdout_fd: int, stderr_fd: int) -> None:
        """Copy the two pipes (which this object then owns and closes) on daemon threads."""
        for src, dst in ((stdout_fd, 1), (stderr_fd, 2)):
            t = threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                                 name="aiakrun-output")
            t.start()
            self._threads.append(t)

    def join(self, timeout: float) -> None:
        """Wait (bounded: a lingering process may hold a pipe open) for the output to end."""
        for t in self._threads:
            t.join(timeout)

    def _emit(self, dst: int, data: bytes) -> None:
        if not data:
            return
        if not self.horovod_missing and _HOROVOD_MISSING.search(data):
            self.horovod_missing = True
        if self.keras2_hint is None:
            found = _KERAS2_HINT.search(data)
            if found:
                self.keras2_hint = found.group(1).decode("utf-8", "replace")
        if self.ssh_failure is None and (b"ssh" in data or b"Permission denied" in data):
            for line in data.splitlines():
                self.ssh_failure = self.ssh_failure or ssh_failure(line)
        try:
            write_all(dst, data)
        except OSError:
            pass

    def _pump(self, src: int, dst: int) -> None:
        lines = LineAssembler()
        banner = None if self.raw else BannerFilter()
        try:
            while True:
                if lines.pending:
                    ready, _, _ = select.select([src], [], [], 0.2)
                    if not ready:  # a prompt without a line end: show it
                        self._emit(dst, lines.flush())
                        continue
                try:
                    chunk = os.read(src, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                data = lines.feed(chunk)
                if banner is None:
                    self._emit(dst, data)
                    continue
                for line in data.splitlines(keepends=True):
                    self._emit(dst, b"".join(banner.feed(line)))
            rest = lines.flush()
            if banner is not None:
                held = banner.flush()
                self._emit(dst, b"".join(held) + rest)
            else:
                self._emit(dst, rest)
        finally:
            os.close(src)
