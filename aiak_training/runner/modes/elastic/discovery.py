"""Running the host discovery script and reading its answer.

The script prints one host per line, ``hostname`` or ``hostname:slots`` (Horovod's
format); ``--slots-per-host`` gives the slots of lines without a count (default 1).
Every problem (missing script, not executable, failing, timing out, a line that is not a
host) raises :class:`DiscoveryError` naming the script and, for bad output, the line; the
driver then keeps its current hosts.
"""
from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, Optional

_HOST = re.compile(r"^[A-Za-z0-9_.-]+$")


class DiscoveryError(RuntimeError):
    """The discovery script could not be run or printed something that is not a host list."""


def parse_hosts_output(text: str, script: str, slots_per_host: Optional[int] = None
                       ) -> Dict[str, int]:
    """``{host: slots}`` in the order printed.  Blank lines and ``#`` comments are skipped."""
    hosts: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, count = line.partition(":")
        name = name.strip()
        problem = None
        if not _HOST.match(name):
            problem = "not a host name"
        elif sep:
            if not count.strip().isdigit() or int(count) < 1:
                problem = "slots must be a positive integer"
        if problem:
            raise DiscoveryError(f"host discovery script {script}: line {number}: {raw!r}: "
                                 f"{problem} (expected 'hostname' or 'hostname:slots')")
        if name in hosts:
            raise DiscoveryError(f"host discovery script {script}: line {number}: {raw!r}: "
                                 f"host {name} is listed twice")
        hosts[name] = int(count) if sep else (slots_per_host or 1)
    return hosts


class HostDiscoveryScript:
    """Runs ``script`` (an executable) and returns the hosts it lists."""

    def __init__(self, script: str, slots_per_host: Optional[int] = None,
                 timeout: float = 30.0):
        self.script = script
        self.slots_per_host = slots_per_host
        self.timeout = timeout

    def check(self) -> None:
        """Raise :class:`DiscoveryError` when the script cannot be run at all."""
        if not os.path.exists(self.script):
            raise DiscoveryError(f"host discovery script {self.script} does not exist")
        if os.path.isdir(self.script):
            raise DiscoveryError(f"host discovery script {self.script} is a directory")
        if not os.access(self.script, os.X_OK):
            raise DiscoveryError(f"host discovery script {self.script} is not executable "
                                 f"(chmod +x {self.script})")

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        self.check()
        try:
            done = subprocess.run([os.path.abspath(self.script)], capture_output=True,
                                  text=True, timeout=self.timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script} did not finish within "
                                 f"{self.timeout:g} s") from None
        except OSError as exc:
            raise DiscoveryError(f"host discovery script {self.script} could not be run: "
                                 f"{exc}") from None
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] if done.stderr else []
            raise DiscoveryError(f"host discovery script {self.script} failed with exit code "
                                 f"{done.returncode}" + (f": {tail[0]}" if tail else ""))
        return parse_hosts_output(done.stdout, self.script, self.slots_per_host)
