"""`mtrain serve`: a trained model behind a local HTTP API, with a page that shows it working."""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

import typer

from mtrain.commands.common import (
    CheckpointOption,
    Decoding,
    DeviceOption,
    Engine,
    EngineOption,
    Quantize,
    QuantizeOption,
    RunOption,
    fail,
    load_engine,
    log,
    resolve_run,
    setup_logging,
)
from mtrain.core.files import stamp
from mtrain.run.directory import BEST, resolve
from mtrain.serve.batcher import Policy, PolicyError
from mtrain.serve.edge import (
    GRACE_SECONDS,
    READ_TIMEOUT,
    RESERVED_DESCRIPTORS,
    Access,
    Net,
    connection_cap,
    wrap,
)

TOKEN_ENV = "MTRAIN_SERVE_TOKEN"
# Every request carries the token in a header, and h11 takes 16 KiB of headers at most: a
# longer token could never be sent.
MAX_TOKEN = 4096

HostOption = Annotated[
    str,
    typer.Option(
        help="Address to listen on; 0.0.0.0 lets other machines in (then set a token: see "
        "--token-file)."
    ),
]
PortOption = Annotated[int, typer.Option(min=0, max=65535, help="Port; 0 picks a free one.")]
BatchingOption = Annotated[
    bool,
    typer.Option(
        "--batching/--no-batching",
        help="Decode concurrent requests together (--no-batching: one request at a time).",
    ),
]


def policy_option(kind: type, flag: str, field: str, help: str, scale: float = 1) -> Any:
    """An option bounded by `Policy`'s range for `field` (in the option's unit: × `scale`)."""
    low, high = Policy.range(field)
    return Annotated[kind, typer.Option(flag, min=low * scale, max=high * scale, help=help)]


WaitOption = policy_option(
    float,
    "--wait-ms",
    "max_wait",
    "The most a batch waits for the clients the last one answered to send again.",
    scale=1000,
)
QueueOption = policy_option(
    int, "--queue", "max_queue", "Sentences that may wait; past that, requests get 503 (busy)."
)
DeadlineOption = policy_option(
    float,
    "--deadline",
    "deadline",
    "Seconds a request may take; past that it is dropped: 503 if it never started, 504.",
)
BatchSecondsOption = policy_option(
    float,
    "--batch-seconds",
    "batch_seconds",
    "Seconds a batch may take, at the pace measured for its beam size: a small request "
    "waits a batch or two behind a big one.",
)

ReadTimeoutOption = Annotated[
    float,
    typer.Option(
        "--read-timeout",
        min=0.1,
        max=3600.0,
        help="Seconds a client has to send a request, headers and body; then it is closed.",
    ),
]
GraceOption = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=3600.0,
        help="Seconds requests in flight get to finish after Ctrl-C or SIGTERM; then they get 503.",
    ),
]
MaxConnectionsOption = Annotated[
    int | None,
    typer.Option(
        "--max-connections",
        min=1,
        help="Open connections at most; past that a new one gets 503 (default: 1024, or the "
        "descriptor limit less 64).",
    ),
]
TokenFileOption = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        exists=True,
        dir_okay=False,
        readable=True,
        help=f"Requests need 'Authorization: Bearer TOKEN': TOKEN in this file (or ${TOKEN_ENV}).",
    ),
]
AllowOriginOption = Annotated[
    str | None,
    typer.Option(
        "--allow-origin",
        help="A web origin (https://example.org) whose pages may call the API (CORS).",
    ),
]


def read_token(path: Path | None) -> str | None:
    """The token from --token-file, else from $MTRAIN_SERVE_TOKEN; None if neither is set."""
    if path is not None:
        with path.open("rb") as f:  # bounded: a huge file (or a device) is not read whole
            data = f.read(2 * MAX_TOKEN)
        where, text = f"--token-file {path}", data.decode("utf-8", errors="replace")
    elif os.environ.get(TOKEN_ENV):
        where, text = f"${TOKEN_ENV}", os.environ[TOKEN_ENV]
    else:
        return None
    token = text.strip()
    if len(text) >= 2 * MAX_TOKEN or len(token) > MAX_TOKEN:
        fail(
            f"{where}: a token of more than {MAX_TOKEN} characters cannot be sent in a "
            "request's headers (16 KiB at most); make a shorter one"
        )
    if len(token) < 16 or not all(33 <= ord(c) < 127 for c in token):
        fail(
            f"{where}: a token is at least 16 characters, printable ASCII without spaces; "
            "make one: python -c 'import secrets; print(secrets.token_urlsafe())' > FILE"
        )
    return token


def check_origin(origin: str) -> str:
    """An origin as browsers send it: scheme://host[:port], no path."""
    parts = urllib.parse.urlsplit(origin)
    if (
        parts.scheme not in ("http", "https")
        or not parts.netloc
        or parts.path
        or parts.query
        or parts.fragment
    ):
        fail(f"--allow-origin {origin!r}: one origin, as http(s)://host[:port] with no path")
    return origin


def serve(
    run: RunOption = None,
    engine: EngineOption = Engine.mtrain,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    which: CheckpointOption = BEST,
    device: DeviceOption = "auto",
    quantize: QuantizeOption = Quantize.none,
    batching: BatchingOption = True,
    wait_ms: WaitOption = Policy.max_wait * 1000,
    queue: QueueOption = Policy.max_queue,
    read_timeout: ReadTimeoutOption = READ_TIMEOUT,
    grace: GraceOption = GRACE_SECONDS,
    max_connections: MaxConnectionsOption = None,
    token_file: TokenFileOption = None,
    allow_origin: AllowOriginOption = None,
    deadline: DeadlineOption = Policy.deadline,
    batch_seconds: BatchSecondsOption = Policy.batch_seconds,
) -> None:
    """Serve a model over HTTP until Ctrl-C or SIGTERM: a JSON API and a page at /.

    POST /translate {"text": "我是谁"} or {"text": [...], "beam": 4, "nbest": 2, "alpha": 0.6};
    POST /explain {"text": "我是谁"}: every decoding step and attention weight; GET /health,
    GET /model and GET /training (the run's curves and examples, drawn on the page). A checkpoint
    that changes (a run still training) is served from the next batch. The URL is printed on
    stderr once the model is loaded. On a signal, requests in flight are finished (a second
    signal cuts them) and the command exits with status 0. On a loopback address only Host
    headers naming it are answered; elsewhere set a token.
    """
    try:
        from mtrain.serve import server
        from mtrain.serve.app import build
    except ImportError as e:  # starlette or uvicorn missing
        fail(f"mtrain serve needs {e.name}: pip install 'mtrain[serve]'")
    from mtrain.serve.api import Limits
    from mtrain.serve.service import Service

    setup_logging()
    policy = serve_policy(batching, wait_ms / 1000, queue, deadline, batch_seconds)
    token = read_token(token_file)
    allow_origin = allow_origin and check_origin(allow_origin)
    sock, connections = listen(host, port, max_connections)
    net = Net(connections, read_timeout, grace=grace)
    run_dir, cfg, translator, watcher, step = load_served(
        engine, Decoding(run, device, quantize, which)
    )
    policy = dataclasses.replace(policy, batch_tokens=cfg.decode.batch_tokens)
    service = Service(translator, run_dir, engine.value, which, step)
    address = server.browsable_url(sock)
    bound, port = sock.getsockname()[:2]
    access = Access.bound_to(bound, port, token=token, allow_origin=allow_origin)
    if access.hosts is None:
        warn_open(bound, port, token)
    how = "batching" if batching else "no batching"
    serving = "mtrain: serving %s (%s, %s) on %s  (Ctrl-C stops)"
    ready = functools.partial(log.info, serving, run_dir, engine.value, how, address)
    server.run(wrap(build(service, policy, Limits(), watcher), access), sock, net, ready)


def serve_policy(
    batching: bool, wait: float, queue: int, deadline: float, batch_seconds: float
) -> Policy:
    """The batching policy of the options (the run's decode.batch_tokens comes later)."""
    try:  # NaN passes the options' ranges, not the policy's
        return Policy(
            batching, wait, max_queue=queue, deadline=deadline, batch_seconds=batch_seconds
        )
    except PolicyError as e:
        fail(f"a serve option out of range: {e}")


def listen(host: str, port: int, max_connections: int | None) -> tuple[socket.socket, int]:
    """The socket bound to `host`:`port`, before the model loads (a port in use is known at
    once), and the open connections allowed: --max-connections, within the descriptors."""
    from mtrain.serve import server

    descriptors = server.raise_descriptor_limit()
    cap = connection_cap(descriptors)
    if cap == 0 or (max_connections or 0) > cap:
        fail(
            f"--max-connections {max_connections or cap}: at most {cap} under the limit of "
            f"{descriptors} open files (ulimit -n), which keeps {RESERVED_DESCRIPTORS}"
        )
    try:
        sock = server.bind(host, port)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        fail(f"cannot listen on {host} port {port}: {reason}")
    return sock, max_connections or cap


def load_served(engine: Engine, decoding: Decoding) -> tuple:
    """The run directory, config and translator to serve, and (engine mtrain) the watcher
    that reloads a checkpoint that changes and the step it holds."""
    if engine is not Engine.mtrain:
        return *load_engine(engine, decoding), None, None
    from mtrain.serve.reload import ModelWatcher, wait_for_checkpoint

    run, which = resolve_run(decoding.run), decoding.checkpoint
    wait_for_checkpoint(resolve(run, which), run)  # a run still training: its first best.pt
    before = stamp(resolve(run, which))
    run_dir, cfg, translator = load_engine(engine, dataclasses.replace(decoding, run=run))
    int8 = decoding.quantize is Quantize.int8
    watcher, step = ModelWatcher.after_load(run_dir / which, translator, int8, before)
    return run_dir, cfg, translator, watcher, step


def warn_open(bound: str, port: int, token: str | None) -> None:
    """Warn that the server listens beyond loopback, and who can use it."""
    who = (
        "requests need the token"
        if token
        else f"there is no token: anyone who can reach port {port} can use the API "
        f"(--token-file FILE or ${TOKEN_ENV} sets one)"
    )
    log.warning("mtrain: warning: listening on %s, not loopback; %s", bound, who)
