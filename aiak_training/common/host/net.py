"""This host's network interfaces and addresses, for every layer: the watchdog's liveness
probe and link checks, aiakrun's liveness server and the Gloo rendezvous address.

Standard library only (the rank wrapper imports it); Linux ioctls, as ``ip`` uses them.
"""
from __future__ import annotations

import fcntl
import socket
import struct
from typing import List, Optional, Sequence, Tuple

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_RUNNING = 0x40


def _ifreq(name: str) -> bytes:
    return struct.pack("256s", name.encode()[:15])


def interface_flags(name: str) -> Optional[int]:
    """``ifr_flags`` of a network interface in this network namespace, None if unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return struct.unpack_from("h", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS,
                                                       _ifreq(name)), 16)[0] & 0xFFFF
    except OSError:
        return None


def interface_is_up(name: str) -> Optional[bool]:
    """Whether an interface is administratively up and has carrier; None if unknown."""
    flags = interface_flags(name)
    if flags is None:
        return None
    return bool(flags & _IFF_UP) and bool(flags & _IFF_RUNNING)


def local_ipv4_addresses() -> List[Tuple[str, str]]:
    """(interface, IPv4 address) of every interface that is up, loopback excluded."""
    found = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            if name == "lo" or not interface_is_up(name):
                continue
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, _ifreq(name))
            except OSError:  # no IPv4 address on it
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                found.append((name, addr))
    return found


def host_ipv4_addresses(preferred: Sequence[str] = ()) -> List[str]:
    """This machine's IPv4 addresses (loopback excluded), those of ``preferred`` interfaces
    first."""
    found: List[Tuple[int, str]] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            if name == "lo":
                continue
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, _ifreq(name))
            except OSError:  # no IPv4 address, or down
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                order = list(preferred).index(name) if name in preferred else len(preferred)
                found.append((order, addr))
    return [addr for _, addr in sorted(found, key=lambda x: x[0])]


def route_address(host: str) -> Optional[str]:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of the interface ``name`` (up, on this host), None if it has none."""
    return next((addr for iface, addr in local_ipv4_addresses() if iface == name), None)
