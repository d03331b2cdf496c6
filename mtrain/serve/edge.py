"""The network edge of `mtrain serve`: who may ask (Host, token, origin), what a body must be,
and what a request cut by a stop is answered."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# Served to anyone who reaches the server: the page asks for the token only once it has loaded.
PUBLIC_PATHS = ("/",)
PUBLIC_PREFIX = "/static/"
SHUTTING_DOWN = "server shutting down"

# Requests in flight when a signal comes get this long to finish before they are cut.
GRACE_SECONDS = 30.0
# A client gets this long to send a request, headers and body, counted from when its
# connection opened or its last answer went.
READ_TIMEOUT = 30.0
# An idle keep-alive connection is closed after this long.
KEEP_ALIVE_SECONDS = 5
MAX_CONNECTIONS = 1024  # a new connection past this many open ones is answered 503
# Descriptors kept for the process's own files, threads and pipes, below the connections'.
RESERVED_DESCRIPTORS = 64


@dataclass(frozen=True)
class Net:
    """The limits at the network edge: connections, their deadlines, the stop's grace."""

    max_connections: int = MAX_CONNECTIONS
    read_timeout: float = READ_TIMEOUT
    keep_alive: int = KEEP_ALIVE_SECONDS
    grace: float = GRACE_SECONDS


def connection_cap(descriptors: int) -> int:
    """The most open connections under a descriptor limit; 0 if it leaves none."""
    return max(0, min(MAX_CONNECTIONS, descriptors - RESERVED_DESCRIPTORS))


def json_body(status: int, message: str) -> bytes:
    """The body of every error answer: {"error": "one line", "status": N}."""
    answer = {"error": message, "status": status}
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def raw_response(status: int, reason: str, message: str, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 error answer that closes its connection, for use below the app."""
    body = json_body(status, message)
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"content-length: {len(body)}", "connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def header(scope: Scope, name: bytes) -> str | None:
    """The one value of a request header; None if it is missing or repeated."""
    values = [v for k, v in scope["headers"] if k == name]
    return values[0].decode("latin-1") if len(values) == 1 else None


@dataclass(frozen=True)
class Access:
    """Who may use the API: the names a loopback server answers to, the token, the origin."""

    hosts: frozenset[str] | None  # the Host names accepted; None: any (a non-loopback address)
    port: int
    token: str | None = None
    allow_origin: str | None = None

    @classmethod
    def bound_to(cls, address: str, port: int, **kwargs: Any) -> Access:
        """The rules for a server listening on address:port."""
        import ipaddress

        if not ipaddress.ip_address(address).is_loopback:
            return cls(None, port, **kwargs)
        own = f"[{address}]" if ":" in address else address
        return cls(LOOPBACK_NAMES | {own}, port, **kwargs)

    def host_allowed(self, value: str | None) -> bool:
        """Whether a Host header names this server: a loopback name, with or without its port."""
        if self.hosts is None:
            return True
        if not value:
            return False
        value = value.strip().lower()
        if value.startswith("["):  # an IPv6 address: [::1] or [::1]:8000
            end = value.find("]") + 1
            name, rest = value[:end], value[end:]
        else:
            name, colon, port = value.partition(":")
            rest = colon + port
        if rest and not rest.startswith(":"):
            return False
        port = rest[1:]
        return name in self.hosts and port in ("", str(self.port))

    def token_given(self, value: str | None) -> bool:
        """Whether an Authorization header carries the token (compared in constant time)."""
        scheme, _, given = (value or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("utf-8"), self.token.encode("utf-8"))


def is_public(method: str, path: str) -> bool:
    """The page and its assets, which hold nothing a token protects."""
    return method in ("GET", "HEAD") and (path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX))


@dataclass
class Refusal:
    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)


class Guard:
    """Refuse requests the server's user did not send: a foreign Host (DNS rebinding) on a
    loopback address, a POST body that is not JSON (a cross-site form or "simple" request), no
    token where one is set; and add CORS headers only for the one origin `--allow-origin` names."""

    def __init__(self, app: ASGIApp, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = header(scope, b"origin")
        allowed_origin = self.access.allow_origin is not None and origin == self.access.allow_origin
        cors = {"access-control-allow-origin": origin, "vary": "Origin"} if allowed_origin else {}
        if (refusal := self.refusal(scope)) is not None:
            return await respond(send, refusal.status, refusal.message, refusal.headers | cors)
        if scope["method"] == "OPTIONS" and allowed_origin:  # a preflight from the named origin
            preflight = cors | {
                "access-control-allow-methods": "GET, POST",
                "access-control-allow-headers": "Content-Type, Authorization",
                "access-control-max-age": "600",
            }
            return await respond(send, 204, "", preflight)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start" and cors:
                extra = [(k.encode(), v.encode("latin-1")) for k, v in cors.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def refusal(self, scope: Scope) -> Refusal | None:
        """Why this request is refused, or None."""
        access, method, path = self.access, scope["method"], scope["path"]
        host = header(scope, b"host")
        if not access.host_allowed(host):
            return Refusal(
                403,
                f"Host {host!r} is not this server: on a loopback address it answers only to "
                "localhost, 127.0.0.1 and [::1]",
            )
        if method == "OPTIONS":
            return None
        needs_token = access.token is not None and not is_public(method, path)
        if needs_token and not access.token_given(header(scope, b"authorization")):
            return Refusal(
                401,
                "this server needs its token: Authorization: Bearer TOKEN",
                {"www-authenticate": "Bearer"},
            )
        if method == "POST":
            kind = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                said = f"not {kind!r}" if kind else "none was given"
                return Refusal(415, f"the body must be Content-Type: application/json; {said}")
        return None


class CutAnswers503:
    """A request cut by a stop (a second signal, or the grace run out) is answered a JSON 503,
    not uvicorn's plain-text 500 and a traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            # Only the stop cancels a request; the task ends here, its answer sent, so that the
            # stop needs no traceback to say what happened.
            if not started:
                await respond(send, 503, SHUTTING_DOWN, {"retry-after": "1"})


async def respond(send: Send, status: int, message: str, headers: dict[str, str]) -> None:
    """Send a JSON error answer (an empty one for 204) straight through ASGI."""
    body = json_body(status, message) if status != 204 else b""
    raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
    if body:
        raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def wrap(app: ASGIApp, access: Access) -> ASGIApp:
    """The app behind the access rules and the stop's 503."""
    return CutAnswers503(Guard(app, access))
