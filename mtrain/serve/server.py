"""Run the app with uvicorn on a socket of our own until Ctrl-C or SIGTERM.

Below the app, each connection keeps to the limits of `Net`: a cap on open connections under
the descriptor limit, a deadline for a request's headers and body, idle keep-alive connections
closed; a failure that repeats (accept() out of descriptors) is one log line per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mtrain.serve.edge import SHUTTING_DOWN, Net, raw_response

log = logging.getLogger(__name__)

REPORT_EVERY = 10.0  # seconds between two log lines about the same repeated failure
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one); OSError if it cannot be had.

    It listens only once the server starts (uvicorn calls listen() after the app's startup):
    until the model is loaded, a connection is refused at once, not left waiting unanswered,
    while the bound port is already this server's, so one in use is known at the start. The
    URL is said once it listens (`run`'s `ready`): a client that waits for it is not refused.

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
    except OSError:
        sock.close()
        raise
    return sock


def url(sock: socket.socket) -> str:
    return http_url(*sock.getsockname()[:2])


def http_url(host: str, port: int) -> str:
    """The URL of a host and port; an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def browsable_url(sock: socket.socket) -> str:
    """An address a browser can open: for 0.0.0.0 or ::, this machine's outward address."""
    host, port = sock.getsockname()[:2]
    if host not in ("0.0.0.0", "::"):
        return url(sock)
    family, probe = (
        (socket.AF_INET, "192.0.2.1") if host == "0.0.0.0" else (socket.AF_INET6, "2001:db8::1")
    )
    try:  # connecting a UDP socket sends nothing: it only picks the route's source address
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect((probe, 9))
            host = udp.getsockname()[0]
    except OSError:  # no route out: the machine's name
        host = socket.gethostname()
    return http_url(host, port)


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is Linux's nr_open in truth: 2**20 unless raised.
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a lower nr_open: keep the soft limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Repeats:
    """Logs a failure once, then once per interval with how many more times it came."""

    def __init__(self, every: float = REPORT_EVERY, schedule: Callable[..., Any] | None = None):
        self.every, self._schedule = every, schedule
        self.counts: dict[str, int] = {}

    def note(self, what: str) -> None:
        if what in self.counts:
            self.counts[what] += 1
            return
        log.warning("mtrain serve: %s", what)
        try:
            self.schedule(self.every, self.flush, what)
        except RuntimeError:  # no event loop to count with: each one is said
            return
        self.counts[what] = 0

    def flush(self, what: str) -> None:
        more = self.counts.pop(what, 0)
        if more:
            log.warning("mtrain serve: %s (%d more times in %g s)", what, more, self.every)
            self.counts[what] = 0
            self.schedule(self.every, self.flush, what)

    def schedule(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        (self._schedule or asyncio.get_running_loop().call_later)(delay, fn, *args)

    def filter(self, record: logging.LogRecord) -> bool:
        """A logging filter: uvicorn's own warnings (a malformed request each) counted, too."""
        what = record.getMessage().strip()
        if record.exc_info and record.exc_info[1] is not None:
            what += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.note(what)
        return False

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's handler for errors nothing awaits: one line, never a traceback per event."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
            # asyncio retries accept() a second later; until then, connections wait in the backlog.
            self.note(f"cannot accept connections: {os.strerror(exc.errno)}")
        elif exc is not None:
            self.note(f"{context.get('message', 'error')}: {type(exc).__name__}: {exc}")
        else:
            self.note(str(context.get("message", "error")))


BUSY = raw_response(
    503,
    "Service Unavailable",
    "server busy: too many open connections; try again shortly",
    {"retry-after": "1"},
)
TOO_SLOW = raw_response(408, "Request Timeout", "request not sent in time", {})


class Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection, refused past the cap and closed past its read deadline.

    uvicorn's own `limit_concurrency` answers 503 only once a request's headers are in, so idle
    connections still hold descriptors until accept() fails; its keep-alive timer runs only
    after an answer and stops at the first byte, so a slow or silent client is never closed.
    """

    def __init__(self, *args: Any, net: Net, repeats: Repeats, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.net, self.repeats = net, repeats
        self.deadline: asyncio.TimerHandle | None = None
        self.reading = False  # bytes of a request have come and the request is not whole
        self.opened = 0.0  # loop time the connection was made

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.opened = self.loop.time()
        super().connection_made(transport)
        if len(self.connections) > self.net.max_connections and not self._evict_idle():
            self.repeats.note(
                f"refused connections: {self.net.max_connections} open, the most allowed"
            )
            transport.write(BUSY)
            transport.close()
            return
        self._arm()

    def _evict_idle(self) -> bool:
        """Make room by closing the oldest other connection that is answering nothing (idle,
        or its request not whole yet): one client holding idle connections must not lock
        every other out. False if every other connection has a request being answered."""
        idle = [
            c
            for c in self.connections
            if c is not self
            and isinstance(c, Connection)
            and not c.transport.is_closing()
            and (c.cycle is None or c.cycle.response_complete)
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened)
        self.repeats.note("closed idle connections to make room: the connection cap is reached")
        oldest.transport.close()
        return True

    def data_received(self, data: bytes) -> None:
        self.reading = True
        super().data_received(data)
        self._disarm_if_whole()

    def on_response_complete(self) -> None:
        self.reading = False
        if not self.transport.is_closing():
            self._arm()
        super().on_response_complete()
        self._disarm_if_whole()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm_if_whole(self) -> None:
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE):
            self.reading = False
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.net.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        """Past the read deadline: close; with a 408 if a request had begun and no one answers."""
        self.deadline = None
        if self.transport.is_closing():
            return
        # A request whose body is still coming has a task reading it: closing tells that task
        # the client has gone; otherwise nothing else answers on this connection.
        if self.reading and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(TOO_SLOW)
        self.transport.close()


class Stopper(uvicorn.Server):
    """uvicorn's server, where any second signal, or the grace run out, cuts what is in flight."""

    def __init__(self, config: uvicorn.Config, grace: float, ready: Callable[[], None]):
        super().__init__(config)
        self.grace, self.ready = grace, ready
        self.signals: list[int] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the sockets listen now
            self.ready()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signals.append(sig)
        if self.should_exit:  # uvicorn forces only on a second SIGINT
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def watch_grace(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(self._forced(), self.grace)
        except TimeoutError:
            self.force_exit = True

    async def _forced(self) -> None:
        while not self.force_exit:
            await asyncio.sleep(0.1)

    async def cut(self) -> int:
        """Answer every request still in flight 503 (see edge.CutAnswers503); how many."""
        tasks = list(self.server_state.tasks)
        for task in tasks:
            task.cancel(SHUTTING_DOWN)
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        return len(tasks)


def run(app, sock: socket.socket, net: Net, ready: Callable[[], None]) -> None:
    """Serve on `sock` until a signal; log how it stopped. `ready` runs once `sock` listens.

    The first signal stops taking connections and lets requests in flight finish, for up to
    `net.grace` seconds; a second signal, or the grace run out, answers what is left 503 and
    exits at once: the batch the worker thread holds is not waited for.
    """
    # uvicorn raises each signal it caught again once it has stopped, for the handler it found:
    # this one takes it, so that a stop by signal is a clean exit rather than a kill.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    repeats = Repeats()
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(repeats)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        http=functools.partial(Connection, net=net, repeats=repeats),
        loop="asyncio",
        lifespan="on",
        proxy_headers=False,
        timeout_keep_alive=net.keep_alive,
        timeout_graceful_shutdown=None,  # Stopper.watch_grace keeps the grace
    )
    server = Stopper(config, net.grace, ready)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(repeats.loop_exception)
        watcher = asyncio.create_task(server.watch_grace())
        await server.serve(sockets=[sock])
        watcher.cancel()
        if server.force_exit:
            cut = await server.cut()
            stopped(server.signals, cut)
            # Leaving through asyncio.run would wait for the app's lifespan to close the
            # batcher, and so for the batch in hand.
            logging.shutdown()
            sys.stderr.flush()
            os._exit(0)

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("uvicorn.error").removeFilter(repeats)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    stopped(server.signals, None)


def stopped(signals: list[int], cut: int | None) -> None:
    """Log how the server stopped: by which signal, and how many requests were cut."""
    by = f" by {signal.Signals(signals[0]).name}" if signals else ""
    if cut is None:
        log.info("mtrain: stopped%s", by)
    else:
        how = "a second signal" if len(signals) > 1 else "the grace ran out"
        log.info("mtrain: stopped%s (%s: %d requests cut)", by, how, cut)
