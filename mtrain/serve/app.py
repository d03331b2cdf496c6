"""The HTTP app: JSON endpoints over the batcher, the page and its assets, errors as JSON."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mtrain.figures.common import CJK_FONT
from mtrain.serve import api
from mtrain.serve.api import ApiError, Limits
from mtrain.serve.batcher import Batcher, Closed, Job, Policy, QueueFull, Solo, WorkerDown
from mtrain.serve.edge import json_body
from mtrain.serve.reload import Loaded, ModelWatcher
from mtrain.serve.service import Service
from mtrain.serve.training_view import TrainingView

log = logging.getLogger(__name__)

STATIC = resources.files("mtrain.serve") / "static"
MAX_VALIDATION = 1 << 31  # the index of a validation line in examples.jsonl


class JSONUnicode(JSONResponse):
    """JSON with Chinese as itself, not as \\u escapes."""

    def render(self, content: Any) -> bytes:
        import json

        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error answer, its body as edge.json_body writes every one."""
    return Response(json_body(status, message), status, headers, media_type="application/json")


Handler = Callable[..., Awaitable[Response]]


def endpoint(handler: Handler) -> Handler:
    """An endpoint whose refusals are JSON errors and whose bugs are one log line and a 500."""

    @functools.wraps(handler)
    async def wrapped(*args: Any) -> Response:  # (request) or (self, request)
        request = args[-1]
        try:
            return await handler(*args)
        except ApiError as e:
            return error(e.status, e.message)
        except QueueFull:
            return error(
                503, "server busy: the queue is full; try again shortly", {"Retry-After": "1"}
            )
        except Closed:
            return error(503, "server shutting down")
        except ClientDisconnect:  # it hung up before its body was in: no one to answer, no bug
            return error(400, "client disconnected")
        except WorkerDown as e:
            return error(503, f"server down: {e}")
        except ClientGone:  # nobody reads this answer
            return error(499, "the client closed the connection")
        except Exception as e:
            log.error(
                "mtrain serve: %s %s failed: %s: %s",
                request.method,
                request.url.path,
                type(e).__name__,
                e,
            )
            return error(500, f"internal error: {type(e).__name__}")

    return wrapped


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def disconnected(request: Request) -> None:
    """Return once the client has hung up; its body must have been read already."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 as soon as it passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and api.whole_number(length, "Content-Length", 1 << 62) > limit:
        raise ApiError(413, f"request body of {length} bytes; at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body over {limit} bytes")
    return bytes(body)


class Server:
    """The endpoints, around one service and its batcher."""

    def __init__(
        self,
        service: Service,
        policy: Policy,
        limits: Limits,
        watcher: ModelWatcher | None = None,
    ):
        self.service, self.policy, self.limits = service, policy, limits
        self.batcher: Batcher | None = None
        self.description = service.describe()
        self.watcher = watcher
        self.logs = TrainingView(service.run)

    async def _submit(
        self, request: Request, make: Callable[[Callable[[Any], None]], Job | Solo]
    ) -> Any:
        """Queue the job `make` builds around a completion callback; await its result.

        The job is cancelled if the client hangs up (ClientGone) or past the policy's deadline:
        503 if it never started, 504 if it did.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result: Any) -> None:
            if future.done():  # cancelled
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        job = make(lambda result: loop.call_soon_threadsafe(settle, result))
        self.batcher.submit(job)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait(
                (future, gone), timeout=self.policy.deadline, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            gone.cancel()
            if not future.done():  # hung up, too late, or the server stops: drop the work
                self.batcher.cancel(job)
                future.cancel()
        if not future.cancelled():
            return future.result()
        if gone.done() and not gone.cancelled():
            raise ClientGone
        limit = f"{self.policy.deadline:g} s"
        if not job.taken:
            raise ApiError(503, f"server busy: the request waited {limit} without starting")
        raise ApiError(504, f"the request took more than {limit}; send fewer sentences")

    async def _body(self, request: Request) -> dict[str, Any]:
        return api.parse_body(await read_body(request, self.limits.max_body))

    @endpoint
    async def translate(self, request: Request) -> Response:
        req = api.translate_request(
            await self._body(request), self.service.base.decode, self.limits
        )
        sources = await run_in_threadpool(self.service.sources, req.texts)
        tokens = [len(s.ids) for s in sources]
        results = await self._submit(request, lambda done: Job(req.options, sources, tokens, done))
        cut = self.service.cfg.data.max_src_len
        items = []
        for decoded, source in zip(results, sources):
            nbest = decoded.nbest
            item = {"text": nbest[0].text, "score": nbest[0].score, "truncated": source.truncated}
            if req.options.nbest > 1:
                item["nbest"] = [{"text": t.text, "score": t.score} for t in nbest]
            items.append(item)
        warnings = [
            f"sentence {i}: truncated to {cut} tokens" for i, s in enumerate(sources) if s.truncated
        ]
        # A request decoded over several batches may straddle a reload: it names the newer.
        steps = [d.step for d in results if d.step is not None]
        return JSONUnicode(
            {
                "translations": items,
                "warnings": warnings,
                "options": vars(req.options),
                "checkpoint_step": max(steps, default=None),
            }
        )

    @endpoint
    async def explain(self, request: Request) -> Response:
        if not self.service.can_explain:
            raise ApiError(501, "/explain needs --engine mtrain: CTranslate2 shows no steps")
        req = api.explain_request(await self._body(request), self.service.base.decode, self.limits)
        (source,) = await run_in_threadpool(self.service.sources, [req.text])

        def run() -> dict[str, Any]:
            return self.service.explain(req.text, source, req.options, req.top_k)

        answer = await self._submit(request, lambda done: Solo(run, done))
        cut = self.service.cfg.data.max_src_len
        answer["warnings"] = [f"truncated to {cut} tokens"] if source.truncated else []
        answer["options"] = vars(req.options)
        return JSONUnicode(answer)

    @endpoint
    async def health(self, request: Request) -> Response:
        b = self.batcher
        counts = {"queued": b.waiting, "batches": b.batches, "decoded": b.decoded}
        if not b.alive:  # nothing would ever be answered
            why = b.stopped or "the worker thread is not running"
            return JSONUnicode({"status": "down", "error": why, **counts}, 503)
        return JSONUnicode({"status": "ok", **counts})

    @endpoint
    async def model(self, request: Request) -> Response:
        return JSONUnicode({**self.description, "checkpoint_step": self.service.step})

    @endpoint
    async def training(self, request: Request) -> Response:
        """The run's curves and example translations; 304 while no log has changed."""
        snapshot = await asyncio.to_thread(self.logs.read)
        headers = {"ETag": snapshot.etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == snapshot.etag:
            return Response(status_code=304, headers=headers)
        return Response(snapshot.body, media_type="application/json", headers=headers)

    @endpoint
    async def training_attention(self, request: Request) -> Response:
        """?validation=N&source=TEXT: one example's cross-attention at the N-th validation."""
        query = request.query_params
        if "validation" not in query or "source" not in query:
            raise ApiError(422, "expected ?validation=N (0 for the first)&source=the example")
        validation = api.whole_number(query["validation"], "validation", MAX_VALIDATION)
        source = query["source"]
        found = await asyncio.to_thread(self.logs.attention, validation, source)
        if found is None:
            raise ApiError(404, f"no example {source!r} at validation {validation}")
        return JSONUnicode(found)

    def _offer(self, loaded: Loaded) -> bool:
        """Queue the swap to `loaded` behind the work waiting; False if the queue is full."""
        try:
            self.batcher.submit(Solo(lambda: self.service.adopt(loaded), lambda result: None))
        except QueueFull:
            return False
        except (Closed, WorkerDown):  # no batch will run it
            pass
        return True

    async def page(self, request: Request) -> Response:
        return HTMLResponse((STATIC / "index.html").read_text("utf-8"))

    async def font(self, request: Request) -> Response:
        import mplfonts

        path = Path(mplfonts.__file__).parent / "fonts" / CJK_FONT
        return FileResponse(path, media_type="font/otf", headers={"Cache-Control": "max-age=86400"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.batcher = Batcher(self.service.translate, self.policy)
        if self.watcher is not None:
            self.watcher.start(self._offer)
        try:
            yield
        finally:
            if self.watcher is not None:
                await asyncio.to_thread(self.watcher.close)
            await asyncio.to_thread(self.batcher.close)


API = (
    "POST /translate, POST /explain, GET /health, GET /model, GET /training, "
    "GET /training/attention, GET / (the page)"
)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """404, 405 and the like, as JSON."""
    where = f"{exc.detail}: {request.method} {request.url.path}"
    return error(exc.status_code, f"{where}; the API is {API}", getattr(exc, "headers", None))


def build(
    service: Service,
    policy: Policy,
    limits: Limits,
    watcher: ModelWatcher | None = None,
) -> Starlette:
    """The app; with a `watcher`, a new checkpoint is served from the first batch after it loads."""
    server = Server(service, policy, limits, watcher)
    routes = [
        Route("/", server.page),
        Route("/translate", server.translate, methods=["POST"]),
        Route("/explain", server.explain, methods=["POST"]),
        Route("/health", server.health),
        Route("/model", server.model),
        Route("/training", server.training),
        Route("/training/attention", server.training_attention),
        Route("/static/cjk.otf", server.font),
        Mount("/static", StaticFiles(packages=[("mtrain.serve", "static")])),
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=server.lifespan
    )
