"""Link rates and sizes as tc(8) writes them: parsing, the tbf bucket of a rate, and the
command-line converters."""
from __future__ import annotations

import argparse
import math
import re



_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*?)(?:/s|ps)?\s*$", re.I)
# Multipliers to Gbit/s.  Bit units only, as in tc(8); tc's "bps" family means *bytes* per
# second, which is a classic source of 8x mistakes, so those are rejected below.
_RATE_UNITS = {
    "bit": 1e-9,
    "kbit": 1e-6,
    "mbit": 1e-3,
    "gbit": 1.0,
    "tbit": 1e3,
    "kibit": 1024 / 1e9,
    "mibit": 1024**2 / 1e9,
    "gibit": 1024**3 / 1e9,
    "tibit": 1024**4 / 1e9,
}


def parse_rate(text: str | float | int) -> float:
    """Parse a link rate such as ``"1gbit"``, ``"500mbit"``, ``"5Gbit/s"`` into Gbit/s.

    A bare number is taken as Gbit/s.  Byte-based units (``"mbps"``, ``"MB"``) are refused,
    because tc reads ``mbps`` as megaBYTES per second.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        raw = text.strip()
        if re.search(r"(bps|b/s|byte)$", raw, re.I) or re.search(r"[0-9\s][kKmMgGtT]?i?B$", raw):
            raise ValueError(f"rate {text!r}: use bit units such as '1gbit' or '500mbit' "
                             "(tc reads 'bps' as bytes per second)")
        m = _RATE_RE.match(raw)
        if not m:
            raise ValueError(f"cannot parse rate {text!r}; expected e.g. '1gbit', '500mbit'")
        number, unit = m.group(1), m.group(2).lower()
        if unit == "":
            mult = 1.0
        elif unit in _RATE_UNITS:
            mult = _RATE_UNITS[unit]
        elif unit + "bit" in _RATE_UNITS:  # "1g", "500m"
            mult = _RATE_UNITS[unit + "bit"]
        else:
            raise ValueError(f"rate {text!r}: unknown unit {unit!r}; use bit/kbit/mbit/gbit/tbit")
        value = float(number) * mult
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"rate must be a positive number of Gbit/s, got {text!r}")
    return value


def tbf_burst_bytes(rate_gbit: float) -> int:
    """tbf bucket size for a rate: 0.5 ms of traffic, clamped to [256 KiB, 4 MiB].

    With GSO/TSO a veth hands tbf "packets" of up to 64 KiB; a bucket near that size makes
    throughput collapse, hence the floor of 4x that.  A bigger bucket is not better: after
    an idle gap a node may send a whole bucket at memory speed, which makes bursty traffic
    (ping-pong, one allreduce at a time) look faster than the link.  Measured on a 2-vCPU VM:
    256 KiB sustains 95% of 5 Gbit/s and 512 KiB 95% of 10 Gbit/s, while a 2 MiB bucket let
    an 8 MiB ping-pong run at 1.2x the 10 Gbit/s rate.
    """
    rate_bytes = rate_gbit * 1e9 / 8
    return int(min(max(rate_bytes * 0.0005, 256 * 1024), 4 * 1024 * 1024))


def rate_arg(text: str) -> float:
    """argparse type for --rate, with parse_rate's message instead of argparse's generic one."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"256kb"``, ``"1mb"``, ``"300000"`` (k, m: 1024-based, as tc)."""
    m = re.match(r"^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib)?\s*$", text, re.I)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; expected e.g. '256kb', '1mb', '300000'")
    unit = (m.group(2) or "b").lower()[:1]
    return int(m.group(1)) * {"b": 1, "k": 1024, "m": 1024 * 1024}[unit]


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tc_rate(rate_gbit: float) -> str:
    """A tc rate argument in kbit (exact for any rate this tool accepts)."""
    return f"{max(1, round(rate_gbit * 1e6))}kbit"
