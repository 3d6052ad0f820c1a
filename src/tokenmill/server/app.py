"""The FastAPI app over an AsyncLLMEngine, its middleware (Bearer auth, one access-log line
per request), and the uvicorn server that runs it: `serve()` for `tokenmill serve` (SIGTERM
drains in-flight requests, then exits 0) and `BackgroundServer` to run one in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI

import tokenmill
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server import misc_routes, openai_chat, openai_completions, tgi_routes
from tokenmill.server.errors import error_response, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.serving import ServerContext

logger = logging.getLogger("tokenmill.server")
access_logger = logging.getLogger("tokenmill.access")

UNAUTHENTICATED_PATHS = frozenset({"/health"})


class ServerMiddleware:
    """Pure ASGI (it must not buffer streams): Bearer auth, then one access-log line per request
    once its response is fully sent (streams included)."""

    def __init__(self, app, ctx: ServerContext, log_requests: bool = True):
        self.app = app
        self.ctx = ctx
        self.log_requests = log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path = scope.get("path", "")
        status = [0]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            key = self.ctx.api_key
            if key and path not in UNAUTHENTICATED_PATHS and not _authorized(scope, key):
                resp = error_response(path, "invalid or missing API key: send 'Authorization: Bearer <key>'", 401)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send_wrapper)
            return await self.app(scope, receive, send_wrapper)
        finally:
            if self.log_requests:
                self._log(scope, path, status[0], time.perf_counter() - t0)

    def _log(self, scope, path: str, status: int, latency: float) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        tracker = (scope.get("state") or {}).get("tracker")
        line = f'{who} "{scope.get("method")} {path}" {status or 499} latency={latency:.3f}s'
        if tracker is not None:
            line += " " + tracker.log_fields()
        access_logger.info(line)


def _authorized(scope, key: str) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
    return False


def build_app(aengine: AsyncLLMEngine, *, api_key: str | None = None, max_logprobs: int = 20,
              chat_template: str | None = None, log_requests: bool = True,
              shutdown_engine: bool = False) -> FastAPI:
    """The HTTP app over a running AsyncLLMEngine. With shutdown_engine, the app stops the
    engine when it shuts down (after uvicorn has drained in-flight requests)."""
    model_name = aengine.engine.config.model.name
    ctx = ServerContext(aengine=aengine, model_name=model_name, metrics=ServerMetrics(aengine, model_name),
                        api_key=api_key or None, max_logprobs=max_logprobs, chat_template=chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            await asyncio.get_running_loop().run_in_executor(None, aengine.shutdown)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan,
                  description="OpenAI-compatible and TGI-compatible LLM server.",
                  strict_content_type=False)  # a JSON body without a Content-Type header is read as JSON
    app.state.ctx = ctx
    install_error_handlers(app)
    for module in (openai_completions, openai_chat, misc_routes, tgi_routes):
        app.include_router(module.router)
    app.add_middleware(ServerMiddleware, ctx=ctx, log_requests=log_requests)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that SIGTERM / SIGINT end in a clean exit: uvicorn stops
    accepting, waits up to timeout_graceful_shutdown for in-flight requests, cancels what is
    left, and then we return normally (stock uvicorn re-raises the signal, so the process would
    die of SIGTERM instead of exiting 0)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, handler in original.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("%s received: not accepting new connections; draining in-flight requests (up to %ss)",
                        signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)


def make_config(app: FastAPI, host: str, port: int, drain_timeout: float | None = 30.0, **kw) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                          timeout_graceful_shutdown=drain_timeout, **kw)


class BackgroundServer:
    """Runs the app on a uvicorn server in a thread (tests, notebooks, embedding)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 5.0):
        self.server = DrainingServer(make_config(app, host, port, drain_timeout))
        self.thread = threading.Thread(target=self.server.run, name="tokenmill-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
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

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(aengine: AsyncLLMEngine, *, host: str = "0.0.0.0", port: int = 8000, api_key: str | None = None,
          drain_timeout: float = 30.0, max_logprobs: int = 20, chat_template: str | None = None,
          log_requests: bool = True, uvicorn_log_level: str = "info", timeout_keep_alive: int = 5,
          ssl_keyfile: str | None = None, ssl_certfile: str | None = None, root_path: str = "") -> int:
    """Serve until SIGTERM / SIGINT; returns 0 after draining. Used by `tokenmill serve`."""
    app = build_app(aengine, api_key=api_key, max_logprobs=max_logprobs, chat_template=chat_template,
                    log_requests=log_requests, shutdown_engine=True)
    config = make_config(app, host, port, drain_timeout, log_level=uvicorn_log_level,
                         timeout_keep_alive=timeout_keep_alive, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                         root_path=root_path)
    server = DrainingServer(config)
    server.run()
    aengine.shutdown()
    if not server.started:
        return 1
    logger.info("server stopped")
    return 0
