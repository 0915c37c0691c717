"""The emulated cluster's link-rate measurement: one TCP stream between two nodes, standard library only.

Run as a program inside the node namespaces::

    link_rate.py sink HOST PORT LIMIT_S WARMUP_BYTES
    link_rate.py source HOST PORT DURATION_S MAX_BYTES

The sink prints ``ready``, accepts one connection and, when it closes, prints one JSON line
``{"bytes", "seconds", "total"}``: the bytes and time counted after the first WARMUP_BYTES,
because TCP slow start and the tbf bucket would otherwise inflate the rate.  The source
streams zeros for DURATION_S or MAX_BYTES, whichever ends first, so the measurement is bounded in
time and size.
"""
import json
import socket
import sys
import time
from typing import List

_BLOCK = 1 << 20


def sink(host: str, port: int, limit_s: float, warmup_bytes: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1)
    listener.settimeout(limit_s)
    print("ready", flush=True)
    conn, _ = listener.accept()
    conn.settimeout(limit_s)
    block = bytearray(_BLOCK)
    received = 0
    counted_from = None  # (time, bytes) when the warm-up ended
    last = None
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        n = conn.recv_into(block)
        if n == 0:
            break
        received += n
        last = time.monotonic()
        if counted_from is None and received >= warmup_bytes:
            counted_from = (last, received)
    conn.close()
    if counted_from is None or last is None:
        counted = (0, 0.0)
    else:
        counted = (received - counted_from[1], last - counted_from[0])
    print(json.dumps({"bytes": counted[0], "seconds": counted[1], "total": received}),
          flush=True)


def source(host: str, port: int, duration_s: float, max_bytes: int) -> None:
    give_up = time.monotonic() + 5
    while True:  # the sink may still be binding its port
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.05)
    zeros = bytes(_BLOCK)
    sent = 0
    stop = time.monotonic() + duration_s
    while time.monotonic() < stop and sent < max_bytes:
        conn.sendall(zeros)
        sent += len(zeros)
    conn.shutdown(socket.SHUT_WR)
    # Wait for the sink to close, so the sender's exit means the sink has counted everything.
    conn.settimeout(duration_s + 10)
    conn.recv(1)
    conn.close()


def main(argv: List[str]) -> int:
    roles = {"sink": sink, "source": source}
    if len(argv) != 5 or argv[0] not in roles:
        sys.stderr.write("usage: link_rate.py {sink|source} HOST PORT SECONDS BYTES\n")
        return 2
    role, host, port, seconds, size = argv
    roles[role](host, int(port), float(seconds), int(size))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
