"""One TCP transfer, to measure a simulated link: ``python -m tfdist.launcher.machine.linkprobe``.

    python -m tfdist.launcher.machine.linkprobe recv ADDRESS PORT      # prints "ready", then one JSON line
    python -m tfdist.launcher.machine.linkprobe send ADDRESS PORT BYTES

The receiver times from its first byte to the sender's close, so the TCP
handshake and process start-up are not counted.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 16


def receive(address: str, port: int, timeout: float = 30.0) -> dict:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((address, port))
        server.listen(1)
        server.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            total, first = 0, None
            while chunk := conn.recv(CHUNK):
                if first is None:
                    first = time.perf_counter()
                total += len(chunk)
            seconds = time.perf_counter() - first if first is not None else 0.0
    return {"bytes": total, "seconds": seconds}


def send(address: str, port: int, size: int, timeout: float = 30.0) -> None:
    block = b"\0" * CHUNK
    with socket.create_connection((address, port), timeout=timeout) as conn:
        left = size
        while left > 0:
            n = min(left, CHUNK)
            conn.sendall(block[:n])
            left -= n


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 3 and argv[0] == "recv":
        print(json.dumps(receive(argv[1], int(argv[2]))), flush=True)
        return 0
    if len(argv) >= 4 and argv[0] == "send":
        send(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print("error: usage: python -m tfdist.launcher.machine.linkprobe recv ADDRESS PORT | send ADDRESS PORT BYTES",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
