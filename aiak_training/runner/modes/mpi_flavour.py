"""Which MPI launcher is installed: found on PATH and identified by its ``--version`` text."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from enum import Enum
from typing import List, Mapping, Optional


class Flavour(str, Enum):
    """MPI implementations whose launchers take different flags."""

    MPICH = "mpich"          # MPICH and derivatives with the Hydra process manager
    INTEL = "intelmpi"       # Intel MPI (Hydra based, but -hosts/-ppn and -bootstrap flags)
    OPENMPI = "openmpi"      # Open MPI 4 (ORTE) and 5 (PRRTE)
    SPECTRUM = "spectrum"    # IBM Spectrum MPI (Open MPI based, socket binding, -tcp)


@dataclass(frozen=True)
class MpiLauncher:
    """An MPI launcher executable and what it is."""

    path: str
    flavour: Flavour
    version_text: str
    major_version: Optional[int] = None


class MpiNotFoundError(RuntimeError):
    """No usable MPI launcher."""


def parse_flavour(version_text: str) -> Optional[Flavour]:
    """Identify the implementation from ``mpirun --version`` output; None if unknown.

    Order matters: Intel MPI is Hydra based (so test it before the Hydra/MPICH markers), and
    Spectrum MPI is Open MPI based.  MPICH's Hydra prints "HYDRA build details" without the
    word MPICH, which horovodrun's check misses, so both markers are accepted.
    """
    text = version_text or ""
    if "Intel(R) MPI" in text or "Intel MPI" in text:
        return Flavour.INTEL
    if "IBM Spectrum MPI" in text:
        return Flavour.SPECTRUM
    if ("Open MPI" in text or "OpenRTE" in text or "PRRTE" in text
            or "PMIx Reference RunTime" in text):
        return Flavour.OPENMPI
    if "HYDRA" in text or "MPICH" in text:
        return Flavour.MPICH
    return None


def parse_major_version(flavour: Flavour, version_text: str) -> Optional[int]:
    """Major version where it changes the command line (Open MPI 5 dropped openib)."""
    if flavour is Flavour.OPENMPI:
        m = re.search(r"\(Open MPI\)\s+(\d+)\.", version_text)
        if m:
            return int(m.group(1))
    m = re.search(r"Version:\s+(\d+)\.", version_text)
    return int(m.group(1)) if m else None


def interpreter_dirs(python: Optional[str] = None) -> List[str]:
    """Where an MPI installed into this Python's environment puts its launcher: the
    directory of the interpreter as called (a venv's ``bin``) and, if different, of the file
    it resolves to."""
    python = python or sys.executable
    if not python:
        return []
    dirs = [os.path.dirname(os.path.abspath(python)),
            os.path.dirname(os.path.realpath(python))]
    return list(dict.fromkeys(d for d in dirs if d))


def find_launcher(env: Optional[Mapping[str, str]] = None,
                  python: Optional[str] = None) -> str:
    """Path of the MPI launcher.

    ``$AIAK_MPIRUN`` wins; inside an emulated cluster, ``$AIAK_CLUSTER_MPIEXEC`` (the hydra the
    emulator was set up with); else ``mpirun``, then ``mpiexec`` beside the Python interpreter
    aiakrun runs under (``pip install mpich`` puts them there, and ``venv/bin/aiakrun`` may be
    called without the venv on PATH), then on PATH.
    """
    env = os.environ if env is None else env
    override = env.get("AIAK_MPIRUN")
    if not override and env.get("AIAK_CLUSTER_LAUNCHER_EXEC"):
        override = env.get("AIAK_CLUSTER_MPIEXEC")
    if override:
        found = shutil.which(override, path=env.get("PATH"))
        if not found:
            raise MpiNotFoundError(f"MPI launcher {override!r} (from AIAK_MPIRUN or "
                                   "AIAK_CLUSTER_MPIEXEC) is not an executable")
        return found
    beside = interpreter_dirs(python)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=os.pathsep.join(beside)) if beside else None
        if found:
            return found
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return found
    places = beside + [f"PATH={env.get('PATH', '')}"]
    raise MpiNotFoundError(
        "aiakrun could not find mpirun or mpiexec; it looked in " + ", ".join(places) +
        ". Install an MPI (for example `pip install mpich` into this Python's environment, or "
        "Open MPI / Intel MPI from your system) or set AIAK_MPIRUN.")


def detect_launcher(env: Optional[Mapping[str, str]] = None, timeout: float = 20.0) -> MpiLauncher:
    """Find the launcher and identify it by running ``<launcher> --version``."""
    path = find_launcher(env)
    try:
        proc = subprocess.run([path, "--version"], env=None if env is None else dict(env),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpiNotFoundError(f"could not run {path} --version: {exc}") from exc
    text = proc.stdout.decode("utf-8", "replace")
    flavour = parse_flavour(text)
    if flavour is None:
        raise MpiNotFoundError(f"unknown MPI implementation; `{path} --version` printed:\n{text}")
    return MpiLauncher(path, flavour, text, parse_major_version(flavour, text))
