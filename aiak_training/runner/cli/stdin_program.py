"""A program piped to ``python -``: read it once and give every rank its own copy.

MPI launchers pass aiakrun's standard input to rank 0 only.  With ``python -`` (or a bare
``python``) the program itself arrives on it, so rank 0 would run it and every other rank
would wait for a program that never comes (and rank 0 with them, inside ``MPI_Init``).
aiakrun therefore reads the program before the launch, keeps it in the job's run directory
and names that file in :data:`STDIN_FILE_ENV`; each rank's task wrapper then gives its rank
the file as standard input.  This works when every rank can read aiakrun's run directory
(all of them on this host); otherwise, and when standard input is a terminal or empty,
aiakrun refuses up front and says how to run the program instead.

Every other command keeps standard input on rank 0 only; the wrappers of the other ranks
give theirs an empty one, so no rank can block reading it.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import IO, Dict, Optional, Sequence

# Standard library only at import: the task wrapper imports this module for every rank.

#: Set by aiakrun for the task wrappers: the file every rank reads as its standard input.
STDIN_FILE_ENV = "AIAK_STDIN_FILE"
#: A program larger than this is not a script typed into a pipe; refuse rather than copy it.
MAX_PROGRAM_BYTES = 64 << 20

_PYTHON = re.compile(r"^(python|pypy)[\d.]*(-dbg)?$")
# CPython options that take a value, in their short spellings (-c and -m name the program).
_VALUE_OPTIONS = "WX"
_PROGRAM_OPTIONS = "cm"


def reads_program_from_stdin(command: Sequence[str]) -> bool:
    """Whether ``command`` is a Python interpreter told to read its program from stdin:
    ``python -``, ``python -u - arg`` or ``python`` with no program at all."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return False
    args = list(command[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-":
            return True
        if arg == "--":
            return i + 1 >= len(args) or args[i + 1] == "-"
        if arg.startswith("--"):
            # --check-hash-based-pycs takes a value; the others (--help, ...) do not.
            if arg == "--check-hash-based-pycs":
                i += 1
            i += 1
            continue
        if not arg.startswith("-"):
            return False  # a script file
        for pos, flag in enumerate(arg[1:], start=1):
            if flag in _PROGRAM_OPTIONS:
                return False
            if flag in _VALUE_OPTIONS:
                if pos == len(arg) - 1:
                    i += 1  # the value is the next argument
                break
        i += 1
    return True


def _how_to(command: Sequence[str], num_proc: Optional[int]) -> str:
    python = shlex.quote(command[0]) if command else "python"
    np = f"-np {num_proc} " if num_proc else ""
    return (f"save the program to a file (on every host) and run it: "
            f"aiakrun {np}{python} program.py")


def refusal(command: Sequence[str], num_proc: Optional[int], why: str) -> ValueError:
    """The error aiakrun gives when it cannot hand a stdin program to every rank (a
    :class:`rank_setup.UsageError`, exit status 2)."""
    from aiak_training.runner.cli.rank_setup import UsageError
    return UsageError(f"`{shlex.join(command)}` reads its program from standard input, and "
                      f"{why}; {_how_to(command, num_proc)}")


def stdin_program_env(command: Sequence[str], num_proc: Optional[int], all_local: bool,
                      run_dir: str, stdin: Optional[IO[bytes]]) -> Dict[str, str]:
    """For a ``python -`` job: read the program from ``stdin`` into ``run_dir`` and return
    ``{STDIN_FILE_ENV: path}`` for the ranks.  Empty for every other command.  Raises
    :class:`rank_setup.UsageError` (naming what to do instead) when the program cannot be
    handed on."""
    if not reads_program_from_stdin(command):
        return {}
    if stdin is None:
        raise refusal(command, num_proc, "aiakrun has no standard input")
    try:
        interactive = os.isatty(stdin.fileno())
    except (OSError, ValueError):
        interactive = False
    if interactive:
        raise refusal(command, num_proc, "standard input is a terminal (an interactive "
                      "session cannot be shared by several ranks)")
    if not all_local:
        raise refusal(command, num_proc, "some ranks run on other hosts, which cannot read "
                      "the copy aiakrun keeps on this one")
    program = stdin.read(MAX_PROGRAM_BYTES + 1)
    if not program:
        raise refusal(command, num_proc, "standard input is empty")
    if len(program) > MAX_PROGRAM_BYTES:
        raise refusal(command, num_proc, f"it is larger than {MAX_PROGRAM_BYTES >> 20} MiB")
    path = os.path.join(run_dir, "stdin-program")
    with open(path, "wb") as f:
        f.write(program)
    return {STDIN_FILE_ENV: path}


def launcher_stdin() -> Optional[IO[bytes]]:
    """aiakrun's own standard input, as bytes (None when it has none)."""
    import sys
    return getattr(sys.stdin, "buffer", None) if sys.stdin is not None else None


def rank_stdin(env: Dict[str, str], rank: Optional[int]):
    """What the task wrapper gives its rank as standard input (``subprocess`` ``stdin=``):
    the program file aiakrun saved (the variable is removed from ``env``), the wrapper's own
    stdin for rank 0 (and for a rank that does not know its number), else nothing."""
    path = env.pop(STDIN_FILE_ENV, "")
    if path:
        return open(path, "rb")  # noqa: SIM115 - the child owns it; closed by the caller
    if rank is None or rank == 0:
        return None
    return subprocess.DEVNULL
