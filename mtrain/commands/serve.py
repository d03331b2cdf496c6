"""`mtrain serve`: a trained model behind a local HTTP API, with a page that shows it working."""

from __future__ import annotations

import os
from typing import Annotated

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
    setup_logging,
)
from mtrain.run_dir import BEST
from mtrain.serve.batcher import Policy

HostOption = Annotated[
    str, typer.Option(help="Address to listen on; 0.0.0.0 lets other machines in.")
]
PortOption = Annotated[int, typer.Option(min=0, max=65535, help="Port; 0 picks a free one.")]
BatchingOption = Annotated[
    bool,
    typer.Option(
        "--batching/--no-batching",
        help="Decode concurrent requests together (--no-batching: one request at a time).",
    ),
]
WaitOption = Annotated[
    float,
    typer.Option(
        "--wait-ms",
        min=0.0,
        help="The most a batch waits for the clients the last one answered to send again.",
    ),
]
QueueOption = Annotated[
    int,
    typer.Option(
        "--queue", min=1, help="Sentences that may wait; past that, requests get 503 (busy)."
    ),
]


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
) -> None:
    """Serve a model over HTTP until Ctrl-C or SIGTERM: a JSON API and a page at /.

    POST /translate {"text": "我是谁"} or {"text": [...], "beam": 4, "nbest": 2, "alpha": 0.6};
    POST /explain {"text": "我是谁"}: every decoding step and attention weight; GET /health and
    GET /model. The URL is printed on stderr once the model is loaded. On a signal, requests in
    flight are finished and the command exits with status 0.
    """
    try:
        from mtrain.serve import server
        from mtrain.serve.app import build
    except ImportError as e:  # starlette or uvicorn missing
        fail(f"mtrain serve needs {e.name}: pip install 'mtrain[serve]'")
    from mtrain.serve.api import Limits
    from mtrain.serve.service import Service

    setup_logging()
    limits = Limits()
    if queue < limits.max_sentences:
        fail(f"--queue {queue}: at least {limits.max_sentences}, the most one request may send")
    try:  # before the model loads: a port in use is known at once
        sock = server.bind(host, port)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        fail(f"cannot listen on {host} port {port}: {reason}")
    run_dir, cfg, translator = load_engine(engine, Decoding(run, device, quantize, which))
    policy = Policy(batching, wait_ms / 1000, cfg.decode.batch_tokens, queue)
    service = Service(translator, run_dir, engine.value, which)
    address = server.url(sock)

    def ready() -> None:
        how = "batching" if batching else "no batching"
        log.info(
            "mtrain: serving %s (%s, %s) on %s  (Ctrl-C stops)", run_dir, engine.value, how, address
        )

    stopped_by = server.run(build(service, policy, limits, ready), sock)
    log.info("mtrain: stopped%s", f" by {stopped_by}" if stopped_by else "")
