"""Short command-line errors for aiakrun, with "did you mean".

argparse answers a mistyped flag with the whole usage text (twenty lines for aiakrun) and
no suggestion.  :class:`FlagParser` prints one line naming the problem, a suggestion where
a known flag is close (``--np`` -> ``-np``, ``--fusion-treshold-mb`` ->
``--fusion-threshold-mb``), and where to find the full list.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Iterable, List, NoReturn, Optional

_UNRECOGNIZED = "unrecognized arguments: "


def suggest(flag: str, known: Iterable[str]) -> Optional[str]:
    """The known flag ``flag`` was most likely meant to be, or None."""
    known = sorted(set(known))
    name = flag.split("=", 1)[0]
    bare = name.lstrip("-")
    # The same name with another number of dashes (--np / -np, -hosts / --hosts) first.
    for candidate in known:
        if candidate.lstrip("-") == bare and candidate != name:
            return candidate
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return close[0] if close else None


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one or two lines instead of the usage text."""

    def _known_flags(self) -> List[str]:
        return [s for s in self._option_string_actions if s.startswith("-")]

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's hook
        lines = [f"{self.prog}: error: {message}"]
        tokens: List[str] = []
        if message.startswith(_UNRECOGNIZED):
            tokens = [t for t in message[len(_UNRECOGNIZED):].split() if t.startswith("-")]
        hints = []
        for token in tokens:
            meant = suggest(token, self._known_flags())
            if meant:
                hints.append(f"{token}: did you mean {meant}?")
        if hints:
            lines.append(f"{self.prog}: " + "; ".join(hints))
        lines.append(f"{self.prog}: run `{self.prog} --help` for the list of flags")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.exit(2)
