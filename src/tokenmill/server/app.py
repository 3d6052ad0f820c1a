"""The FastAPI app over an AsyncLLMEngine, its middleware (Bearer auth, one access-log line
per request), and `BackgroundServer` to run one in a thread. `serve()`, for `tokenmill serve`
(listening while the engine loads; SIGTERM drains in-flight requests, then exits 0), is
startup.py's, re-exported here."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import secrets
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server import (
    anthropic_messages,
    lora_routes,
    misc_routes,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    tgi_routes,
    web_ui,
)
from tokenmill.server.args import ServerArgs
from tokenmill.server.chat_template import install_template_bounds
from tokenmill.server.context import ServerContext
from tokenmill.server.engine_streams import new_request_id
from tokenmill.server.errors import error_response, install_error_handlers, internal_error_response
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.startup import (  # noqa: F401 - serve, END_STREAMS_GRACE_S: re-exported
    END_STREAMS_GRACE_S,
    LIVE_PATH,
    READY_PATH,
    DrainingServer,
    make_config,
    serve,
)
from tokenmill.server.tracing import RequestTracer

# The routes that generate, served alike by `tokenmill serve` and the Ray Serve ingress.
GENERATION_ROUTES = (openai_completions, openai_chat, openai_responses, anthropic_messages, tgi_routes)

logger = logging.getLogger("tokenmill.server")
access_logger = logging.getLogger("tokenmill.access")

UNAUTHENTICATED_PATHS = frozenset({"/health", LIVE_PATH, READY_PATH, "/docs", "/redoc", "/openapi.json"})
DOCS_STATIC = "/docs-static"


class ServerMiddleware:
    """Pure ASGI (it must not buffer streams): Bearer auth, the 500 of an unexpected exception
    (errors.internal_error_response), then one access-log line per request once its response is
    fully sent (streams included)."""

    def __init__(self, app, ctx: ServerContext):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path = scope.get("path", "")
        status = [0]
        headers = dict(scope.get("headers", ()))
        client_id = headers.get(b"x-request-id")

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if client_id is not None:  # echoed (vLLM does too); the engine's ids are our own
                    message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", client_id)]}
            await send(message)

        try:
            key = self.ctx.api_key
            if key and not _public(path) and not _authorized(headers, key):
                resp = error_response(
                    path, "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", 401
                )
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send_wrapper)
            limit = self.ctx.max_request_body_bytes
            if limit:
                length = headers.get(b"content-length")
                if length is not None and length.isdigit() and int(length) > limit:
                    return await error_response(path, _too_large(limit), 413)(scope, receive, send_wrapper)
                receive = _limited(receive, limit)
            try:
                return await self.app(scope, receive, send_wrapper)
            except Exception as exc:
                if status[0]:  # the response started: closing the connection is how HTTP says it is cut
                    raise
                # Answered here, not re-raised: uvicorn closes a connection whose app raised, and the
                # client's next request on it would meet a reset.
                tracker = (scope.get("state") or {}).get("tracker")
                request_id = tracker.request_id if tracker is not None else new_request_id("req")
                resp = internal_error_response(scope.get("method", ""), path, exc, request_id)
                return await resp(scope, receive, send_wrapper)
        finally:
            if self.ctx.args.log_requests:
                self._log(scope, path, status[0], time.perf_counter() - t0, client_id)

    def _log(self, scope, path: str, status: int, latency: float, client_id: bytes | None) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        tracker = (scope.get("state") or {}).get("tracker")
        line = f'{who} "{scope.get("method")} {path}" {status or 499} latency={latency:.3f}s'
        if tracker is not None:
            line += " " + tracker.log_fields()
        if client_id is not None:
            line += f" x_request_id={client_id.decode('latin-1')[:200]!r}"
        access_logger.info(line)


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server accepts ({limit:,} bytes; --max-request-body-bytes)"


def _limited(receive, limit: int):
    """receive() that refuses (413) a body growing past `limit` bytes (chunked bodies have no length)."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, _too_large(limit))
        return message

    return wrapped


def _public(path: str) -> bool:
    """Open without the API key: health checks, the API's own documentation and the web UI's page
    (whose data calls need the key)."""
    return path in UNAUTHENTICATED_PATHS or path.startswith(DOCS_STATIC + "/") or web_ui.is_public(path)


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    """`Authorization: Bearer <key>` (OpenAI's clients), or `x-api-key: <key>` (Anthropic's)."""
    x_api_key = headers.get(b"x-api-key")
    if x_api_key is not None and secrets.compare_digest(x_api_key.strip(), key.encode()):
        return True
    value = headers.get(b"authorization")
    if value is None:
        return False
    scheme, _, token = value.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def _add_offline_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc from assets shipped in the fastapi-offline package: FastAPI's
    own pages load them from a CDN, so they are blank on a machine without one."""
    spec = importlib.util.find_spec("fastapi_offline")
    static = Path(spec.origin).parent / "static"  # type: ignore[union-attr, arg-type]
    app.mount(DOCS_STATIC, StaticFiles(directory=static), name="docs-static")

    def root(req: Request) -> str:
        return req.scope.get("root_path", "").rstrip("/")

    @app.get("/docs", include_in_schema=False)
    async def swagger(req: Request) -> HTMLResponse:
        r = root(req)
        return get_swagger_ui_html(
            openapi_url=r + app.openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{r}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{r}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{r}{DOCS_STATIC}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(req: Request) -> HTMLResponse:
        r = root(req)
        return get_redoc_html(
            openapi_url=r + app.openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{r}{DOCS_STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{r}{DOCS_STATIC}/favicon.png",
            with_google_fonts=False,
        )


def build_app(
    aengine: AsyncLLMEngine,
    args: ServerArgs | None = None,
    *,
    shutdown_engine: bool = False,
    tracer: RequestTracer | None = None,
) -> FastAPI:
    """The HTTP app over a running AsyncLLMEngine, as `args` (ServerArgs) configure it. With
    shutdown_engine, the app stops the engine when it shuts down (after uvicorn has drained
    in-flight requests). `tracer`: spans of requests (tracing.py), shut down (flushed) with the app."""
    args = args if args is not None else ServerArgs()
    model_name = aengine.engine.config.model.name
    if aengine.engine.task == "generate":
        # In the background from now, as the server becomes ready: the first structured-output request
        # then finds the grammar backend built (or waits for it off the engine thread and event loop).
        aengine.engine.structured_output.start_background_init()
    if not install_template_bounds():
        logger.warning("this transformers version compiles chat templates elsewhere: template operators unbounded")
    ctx = ServerContext(
        aengine=aengine,
        model_name=model_name,
        metrics=ServerMetrics(aengine, model_name, args.metrics_prefix),
        args=args,
        response_store=openai_responses.ResponseStore(args.max_stored_responses),
        tracer=tracer,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        loop = asyncio.get_running_loop()
        if tracer is not None:  # after the drain: the last requests' spans go out too
            await loop.run_in_executor(None, tracer.shutdown)
        if shutdown_engine:
            await loop.run_in_executor(None, aengine.shutdown)

    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible and TGI-compatible LLM server.",
        docs_url=None,
        redoc_url=None,
        strict_content_type=False,
    )  # a JSON body without a Content-Type header is read as JSON
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_offline_docs(app)
    for module in (*GENERATION_ROUTES, openai_embeddings, misc_routes):
        app.include_router(module.router)
    # vLLM registers these only with runtime updating on; here they answer 404 saying how to turn it on
    app.include_router(lora_routes.router, include_in_schema=lora_routes.runtime_updating_allowed(ctx))
    if not args.disable_web_ui:
        web_ui.install(app)
    app.add_middleware(ServerMiddleware, ctx=ctx)
    return app


class BackgroundServer:
    """Runs the app on a uvicorn server in a thread (tests, notebooks, embedding)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 5.0):
        """`app`: build_app's, or any ASGI app (a startup.StartupApp)."""
        self.server = DrainingServer(make_config(app, host, port, drain_timeout))
        self.thread = threading.Thread(target=self.server.run, name="tokenmill-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
