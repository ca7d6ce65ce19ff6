"""A local port that drops connection attempts, as a firewall does, for real.

A listener whose accept queue is full makes the kernel drop new SYNs: a client's connect
then times out instead of being refused, which is what a packet-dropping firewall does.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Iterator


@contextlib.contextmanager
def dropping_port() -> Iterator[int]:
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                fillers.append(c)
            time.sleep(0.1)
            yield port
        finally:
            for c in fillers:
                c.close()
