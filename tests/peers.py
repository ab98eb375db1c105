"""Loopback peers where Redis should be that never answer: one that accepts connections and stays silent, one
whose accept queue is full so connects hang (as on a host that drops packets). Loopback only."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PEERS", "silent_peer"]

PEERS = ["accepts_and_never_answers", "never_accepts"]


@contextmanager
def silent_peer(kind: str) -> Iterator[str]:
    """A ``redis://`` URL on 127.0.0.1 whose peer never answers, as ``kind`` (one of :data:`PEERS`) says."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    held: list[socket.socket] = []
    stop = threading.Event()
    acceptor = threading.Thread(target=_accept_and_hold, args=(server, held, stop), daemon=True)
    if kind == "accepts_and_never_answers":
        server.settimeout(0.05)
        acceptor.start()
    else:  # fill the accept queue: the kernel drops further connection attempts, so they hang
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(server.getsockname())
            held.append(filler)
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        if acceptor.is_alive():
            acceptor.join()
        server.close()
        for s in held:
            s.close()


def _accept_and_hold(server: socket.socket, held: list[socket.socket], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        held.append(conn)  # never read, never written: the client waits for a reply that never comes
