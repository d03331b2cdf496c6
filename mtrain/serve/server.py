"""Run the app with uvicorn on a socket of our own until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

# Requests in flight when a signal comes get this long to finish before they are cut.
GRACE_SECONDS = 30


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); OSError if it cannot be had.

    Made with its protocol named, IPPROTO_TCP: asyncio turns Nagle's algorithm off only on
    connections whose socket says so (`socket.create_server` says 0), and with it on, a response
    body written after its headers waits for the client's delayed ACK: 40 ms a request.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # this address only, as socket.create_server does
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def run(app, sock: socket.socket) -> str | None:
    """Serve on `sock` until a signal; return the signal's name, once requests in flight are done.

    uvicorn stops on SIGINT and SIGTERM, then raises the signal again for the handler it found:
    ours records it, so that a stop by signal is a clean exit rather than a kill.
    """
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda number, frame: received.append(number))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        http="h11",
        loop="asyncio",
        lifespan="on",
        timeout_graceful_shutdown=GRACE_SECONDS,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    return signal.Signals(received[0]).name if received else None
