"""The OpenAI endpoint: one FastAPI app in front of every model's engine.

Routes::

    GET  /v1/models              every configured model (awake or not)
    POST /v1/completions         forwarded to the engine of the body's ``model``
    POST /v1/chat/completions    same; ``"stream": true`` answers are relayed chunk by chunk (SSE)
    GET  /health                 200 while the server serves, 503 while it shuts down (liveness)
    GET  /ready                  200 once the start-up is done, 503 before and while it shuts down (readiness)
    GET  /status                 the supervisor's state (``elastic-kv status`` reads it)
    GET  /metrics                Prometheus text format

With API keys configured (:mod:`elastic_kv_serve.auth`), every route but the two probes and ``/metrics``
needs one.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a body that is
not a JSON object with a string ``model``, or that asks for more than ``max_tokens`` tokens; 401 without a
valid API key; 404 for an unknown model (or one the key may not use); 413 for a body over
``max_request_bytes``; 429 when the model already has ``max_queued`` requests waiting; 503 when the model
cannot serve (its engine died mid-request, it did not become ready or free a request slot within
``wake_timeout_s``, it was given up on, the server is stopping); 429s and 503s carry ``Retry-After``. A
client that disconnects has its upstream request closed, which makes the engine abort it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from elastic_kv_serve.auth import ApiKey, Keys, open_paths
from elastic_kv_serve.config import ServeConfig
from elastic_kv_serve.errors import ModelUnavailable, QueueFull, UnknownModel
from elastic_kv_serve.runtime import ModelRuntime
from elastic_kv_serve.supervisor import Supervisor

__all__ = ["create_app", "openai_error"]

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def openai_error(
    status: int, message: str, param: str | None = None, retry_after_s: int | None = None
) -> JSONResponse:
    """An OpenAI-style error response; 429s and 503s say when to retry (``Retry-After``, 1 s by default)."""
    if retry_after_s is None and status in (429, 503):
        retry_after_s = 1
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# Times a request is sent to its model's engine at most: again only while the engine never answered it and is
# gone (see _proxy), each time after the model is ready again.
_SEND_ATTEMPTS = 3


class _ClosingStream(StreamingResponse):
    """A streamed answer whose relay is closed however the response ends. When the client leaves, Starlette
    cancels the task sending the stream; a relay suspended at its ``yield`` then would hold the upstream
    request (the engine goes on decoding) and its slot until the garbage collector finalized it."""

    def __init__(self, relay: AsyncGenerator[bytes, None], **kwargs: Any) -> None:
        super().__init__(relay, **kwargs)
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


# The token-count fields of a request body (completions: max_tokens; chat: either).
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _too_many_tokens(payload: dict[str, Any], limit: int) -> str | None:
    """The field of ``payload`` asking for more than ``limit`` tokens, if one does (other values are the
    engine's to judge)."""
    for field in _TOKEN_FIELDS:
        value = payload.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            return field
    return None


def create_app(
    config: ServeConfig, supervisor: Supervisor | None = None, keys: Keys | None = None
) -> FastAPI:
    """The app; its lifespan starts the supervisor and, after the HTTP server drained, stops it. ``keys``:
    the API keys every route but the probes needs (none: an open server)."""
    sup = supervisor or Supervisor(config)
    fleet = sup.fleet
    keys = keys or Keys([])
    unlocked = open_paths(config.server)
    max_tokens = config.server.max_tokens
    # One loopback connection per request: a kept-alive connection that the engine's HTTP server closes
    # (idle timeout) just as a request is sent on it fails that request, and a retry is not safe.
    upstream = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await sup.start()
        try:
            yield
        finally:
            logger.info("draining done; stopping the engines")
            await upstream.aclose()
            await sup.shutdown()

    app = FastAPI(title="elastic-kv serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.supervisor = sup

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if keys.enabled and request.url.path not in unlocked:
            key = keys.check(request.headers.get("authorization"))
            if key is None:
                reply = openai_error(401, "a valid API key is needed (Authorization: Bearer <key>)")
                reply.headers["www-authenticate"] = "Bearer"
                return reply
            request.state.api_key = key
        response: Response = await call_next(request)
        return response

    def allowed(request: Request, model: str) -> bool:
        key: ApiKey | None = getattr(request.state, "api_key", None)
        return key is None or key.allows(model)

    @app.get("/health")
    async def health() -> Response:
        if fleet.closing:
            return openai_error(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if fleet.closing:
            return openai_error(503, "the server is shutting down")
        if not sup.started_up:
            return openai_error(503, "the server is starting its models")
        return JSONResponse({"status": "ready"})

    @app.get("/status")
    async def status() -> Response:
        return JSONResponse(fleet.status())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(fleet.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        data = [
            {
                "id": rt.name,
                "object": "model",
                "created": 0,
                "owned_by": "elastic-kv",
                "state": rt.state.value,
            }
            for rt in fleet.models.values()
            if allowed(request, rt.name)
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _proxy(request, "/v1/chat/completions")

    async def _proxy(request: Request, path: str) -> Response:
        t0 = time.monotonic()
        try:
            body = await _read_body(request, config.server.max_request_bytes)
        except _TooLarge:
            return openai_error(
                413, f"the request body is larger than {config.server.max_request_bytes} bytes"
            )
        try:
            payload: Any = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return openai_error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict) or not isinstance(payload.get("model"), str):
            return openai_error(400, "the request body must be a JSON object with a string 'model'", "model")
        name = payload["model"]
        try:
            rt = sup.model(name)
        except UnknownModel:
            rt = None
        if rt is None or not allowed(request, name):
            return openai_error(404, f"The model `{name}` does not exist.", "model")
        if max_tokens is not None:
            field = _too_many_tokens(payload, max_tokens)
            if field is not None:
                return openai_error(
                    400, f"{field} is {payload[field]}, more than this server allows ({max_tokens})", field
                )
            if path == "/v1/chat/completions" and not any(f in payload for f in _TOKEN_FIELDS):
                # chat's own default is "up to the context length": the server's limit applies instead
                body = json.dumps({**payload, "max_tokens": max_tokens}).encode()

        def done(code: int) -> None:
            fleet.metrics.requests.labels(name, path, str(code)).inc()
            fleet.metrics.request_seconds.labels(name, path).observe(time.monotonic() - t0)

        # A request refused at connect never reached the engine (it died before the supervisor noticed): it
        # is sent again. One the engine took and then died under, before any answer, is sent again once:
        # nothing of it reached the client, and what the engine held died with it; a request that kills its
        # engine twice is not sent a third time. Either waits for the restart like any other request. One
        # an engine that lives failed to answer is not sent twice.
        lost_once = False
        for attempt in range(_SEND_ATTEMPTS):
            stack = contextlib.AsyncExitStack()
            try:
                url = await stack.enter_async_context(sup.admit(rt))
                upstream_request = upstream.build_request(
                    "POST", url + path, content=body, headers={"content-type": "application/json"}
                )
                reply = await upstream.send(upstream_request, stream=True)
                break
            except ModelUnavailable as exc:
                await stack.aclose()
                code = 429 if isinstance(exc, QueueFull) else 503
                done(code)
                return openai_error(code, str(exc), retry_after_s=exc.retry_after_s)
            except httpx.HTTPError as exc:
                await stack.aclose()
                gone = await sup.upstream_failed(rt)
                refused = isinstance(exc, httpx.ConnectError)
                if (refused or (gone and not lost_once)) and attempt + 1 < _SEND_ATTEMPTS:
                    lost_once = lost_once or not refused
                    logger.info(
                        "model %s: no answer from its engine (%r), sending the request again", name, exc
                    )
                    continue
                done(503)
                return openai_error(503, f"the engine of model {name} failed: {type(exc).__name__}")
            except BaseException:
                await stack.aclose()
                raise

        if payload.get("stream") and reply.status_code == 200:
            return _ClosingStream(
                _relay(reply, stack, done, sup, rt),
                status_code=200,
                media_type=reply.headers.get("content-type", "text/event-stream"),
                headers={"cache-control": "no-cache"},
            )
        try:
            content = await _read_unless_gone(request, reply)
        except httpx.HTTPError as exc:
            with anyio.CancelScope(shield=True):
                await reply.aclose()
                await stack.aclose()
                await sup.upstream_failed(rt)
            done(503)
            return openai_error(503, f"the engine of model {name} failed mid-request: {type(exc).__name__}")
        finally:
            with anyio.CancelScope(shield=True):
                await reply.aclose()
                await stack.aclose()
        if content is None:
            done(499)
            return Response(status_code=499)
        done(reply.status_code)
        return Response(content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    return app


async def _read_unless_gone(request: Request, reply: httpx.Response) -> bytes | None:
    """The whole upstream body, or ``None`` once the client disconnected (the upstream read is cancelled)."""
    read = asyncio.ensure_future(reply.aread())
    try:
        while True:
            done, _ = await asyncio.wait({read}, timeout=0.25)
            if done:
                return read.result()
            if await request.is_disconnected():
                logger.info("client went away: closing the upstream request")
                return None
    finally:
        if not read.done():
            read.cancel()
            with contextlib.suppress(BaseException):
                await read


async def _relay(
    reply: httpx.Response, stack: contextlib.AsyncExitStack, done: Any, sup: Supervisor, rt: ModelRuntime
) -> AsyncGenerator[bytes, None]:
    """Chunks of the upstream SSE stream as they come. On a client disconnect Starlette cancels the sending
    and :class:`_ClosingStream` closes this relay; the upstream response is closed (shielded) so the engine
    aborts the request."""
    code = 200
    failed = False
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        code, failed = 503, True
        error = error_body(503, f"the engine of model {rt.name} failed mid-stream: {type(exc).__name__}")
        yield f"data: {json.dumps(error)}\n\n".encode()
    except BaseException:
        code = 499
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await reply.aclose()
            await stack.aclose()
            if failed:
                await sup.upstream_failed(rt)
            done(code)
