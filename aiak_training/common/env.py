"""Reading settings from environment variables, one vocabulary for the whole project.

Switches take ``1/true/yes/on`` or ``0/false/no/off`` (any case); numbers take plain decimal
text; byte counts also take K/M/G suffixes (binary).  An unset or blank variable gives the
default.  Anything else raises ``ValueError`` naming the variable, so a typo in a job script
stops the job at start-up instead of silently meaning "off".
"""
import os
from typing import Mapping, Optional, Sequence, TypeVar

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}

N = TypeVar("N", int, float)


def _raw(name: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def parse_bool(name: str, text: str) -> bool:
    """``text`` as a switch; ``name`` is only for the error message."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected one of 1/true/yes/on or 0/false/no/off.")


def env_bool(name: str, default: bool = False,
             environ: Optional[Mapping[str, str]] = None) -> bool:
    """A switch (see the module docstring)."""
    raw = _raw(name, environ)
    return default if raw is None else parse_bool(name, raw)


def env_optional_bool(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """A switch, or None when the variable is unset: for settings where "not said" differs
    from "off"."""
    raw = _raw(name, environ)
    return None if raw is None else parse_bool(name, raw)


def _check_minimum(name: str, raw: str, value: N, minimum: Optional[N]) -> N:
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r}: must be at least {minimum}.")
    return value


def env_int(name: str, default: int, minimum: Optional[int] = None,
            environ: Optional[Mapping[str, str]] = None) -> int:
    """An integer."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer.") from None
    return _check_minimum(name, raw, value, minimum)


def env_float(name: str, default: float, minimum: Optional[float] = None,
              environ: Optional[Mapping[str, str]] = None) -> float:
    """A real number."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number.") from None
    return _check_minimum(name, raw, value, minimum)


def parse_bytes(text: str) -> Optional[int]:
    """``'4194304'``, ``'4M'``, ``'4MiB'``, ``'512k'`` -> bytes; None if malformed."""
    s = text.strip().lower()
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, unit = s[:i], s[i:].strip()
    if unit not in _UNITS or not number:
        return None
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        return None


def env_bytes(name: str, default: int, minimum: int = 0,
              environ: Optional[Mapping[str, str]] = None) -> int:
    """A byte count, with optional K/M/G suffix."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    value = parse_bytes(raw)
    if value is None:
        raise ValueError(f"{name}={raw!r}: expected a byte count (e.g. 4194304, 4M or 4MiB).")
    return _check_minimum(name, raw, value, minimum)


def env_choice(name: str, default: str, choices: Sequence[str],
               environ: Optional[Mapping[str, str]] = None) -> str:
    """One word out of ``choices`` (compared in lower case)."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    word = raw.lower()
    if word not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}.")
    return word


def env_str(name: str, default: Optional[str] = None,
            environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Free text, stripped."""
    raw = _raw(name, environ)
    return default if raw is None else raw
