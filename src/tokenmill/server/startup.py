"""`tokenmill serve` answers HTTP from its first second: the socket listens, then the engine loads
on a thread of its own (StartupApp). Until it is ready, `/health` and `/health/ready` answer 503
`{"status": "loading", "phase": ...}` (server/../progress.py says what the load is doing),
`/health/live` 200, and every other route a 503 in its API's error shape with Retry-After; then
the full app (app.build_app) serves everything. Kubernetes-style probes: liveness is "the process
serves HTTP", readiness "it can take requests", so a slow load is neither killed nor sent traffic.

Also the uvicorn server that `serve()` runs (SIGTERM drains in-flight requests, then exits 0).
This module stays light (no torch, no engine): the port answers before the heavy imports, which
are part of the load."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import uvicorn
from starlette.responses import JSONResponse

from tokenmill import progress
from tokenmill.server.args import ServerArgs
from tokenmill.server.errors import error_response
from tokenmill.server.listen import announce, announce_listening, bind_socket

logger = logging.getLogger("tokenmill.server")

HEALTH_PATH, LIVE_PATH, READY_PATH = "/health", "/health/live", "/health/ready"
END_STREAMS_GRACE_S = 5.0  # after the drain timeout: time for aborted streams to send their last event
ENGINE_WATCH_INTERVAL_S = 0.5  # how often `serve` looks whether the engine is still alive
# Loads take seconds to minutes (a first run converts a GGUF file): a client retrying every second
# would only add requests to a server that cannot answer them yet.
LOADING_RETRY_AFTER_S = 5

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class StartupApp:
    """The ASGI app of a server whose engine is still loading: `load()` builds the engine on a
    thread of its own (`start()`), `build(engine)` the full app over it, which then answers every
    request. Until then: the health routes and 503s. `done` resolves to the engine, or to the
    load's exception (the app then stays in this state: /health says "failed")."""

    def __init__(self, load: Callable[[], Any], build: Callable[[Any], ASGIApp]):
        self._load, self._build = load, build
        self.app: ASGIApp | None = None  # the full app, once the engine is ready
        self.aengine: Any = None
        self.done: Future = Future()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tokenmill-load", daemon=True)

    def start(self) -> StartupApp:
        self._started = time.monotonic()
        self.done.set_running_or_notify_cancel()  # running: an awaiter that is cancelled cannot cancel it
        self._thread.start()
        return self

    @property
    def state(self):
        """The full app's state (its ServerContext as .ctx), None while loading: for DrainingServer."""
        return getattr(self.app, "state", None)

    def _run(self) -> None:
        try:
            self.aengine = self._load()
            progress.set_phase("starting the API")
            app = self._build(self.aengine)
        except BaseException as e:  # noqa: BLE001 - handed to `done`; serve() raises it again
            self.done.set_exception(e)
            return
        # Start-up's objects (the model's modules, the tokenizer, the app: ~300,000) go to the permanent
        # generation, as vLLM does after start-up: a full collection no longer walks them (~0.17 s a
        # collection holding the GIL, every stream and /health waiting, under load).
        # Thawed at exit, so that what start-up left in cycles is still freed before the interpreter
        # ends (extensions such as nanobind's report instances alive then as leaks).
        gc.freeze()
        atexit.register(gc.unfreeze)
        self.app = app  # from here on every request goes to it
        self.done.set_result(self.aengine)

    async def __call__(self, scope: dict, receive, send) -> None:
        app = self.app
        if scope["type"] == "lifespan":  # the full app needs none; serve() stops the engine itself
            return await _lifespan(receive, send)
        if app is not None:
            return await app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1013})  # "try again later"
        path, method = scope.get("path", ""), scope.get("method", "GET")
        failed = self.done.done()  # and no app: the load raised
        if path in (HEALTH_PATH, LIVE_PATH, READY_PATH) and method in ("GET", "HEAD"):
            body: dict[str, Any] = {"status": "failed" if failed else "loading"}
            if failed:
                body["error"] = repr(self.done.exception())
            else:
                body.update(progress.current() or {})
                body["elapsed_s"] = round(time.monotonic() - self._started, 1)
            live = path == LIVE_PATH and not failed  # alive while loading; a failed load exits
            return await JSONResponse(body, status_code=200 if live else 503)(scope, receive, send)  # HEAD: no body
        if failed:
            message = f"the engine failed to load ({self.done.exception()!r}); the server is stopping"
            return await error_response(path, message, 503, tgi_type="generation")(scope, receive, send)
        phase = (progress.current() or {}).get("phase", "starting")
        message = (
            f"the model is loading ({phase}): retry in {LOADING_RETRY_AFTER_S} s, or wait for "
            f"GET {READY_PATH} to answer 200"
        )
        resp = error_response(
            path, message, 503, headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}, tgi_type="overloaded"
        )
        return await resp(scope, receive, send)


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


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
            logger.info(
                "%s received: not accepting new connections; draining in-flight requests (up to %ss)",
                signal.Signals(sig).name,
                self.drain_timeout,
            )
        super().handle_exit(sig, frame)

    @property
    def drain_timeout(self) -> float | None:
        t = self.config.timeout_graceful_shutdown
        return None if t is None else max(t - END_STREAMS_GRACE_S, 0.0)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, except that when the drain timeout expires every request still in
        flight is aborted with an error its client sees (an error event and [DONE] on a stream, a
        503 otherwise); uvicorn cancels tasks only if they have not ended END_STREAMS_GRACE_S later."""
        expiry = None
        if self.drain_timeout is not None:
            expiry = asyncio.get_running_loop().call_later(self.drain_timeout, self._end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            if expiry is not None:
                expiry.cancel()

    def _end_streams(self) -> None:
        ctx = getattr(getattr(self.config.app, "state", None), "ctx", None)
        if ctx is None:
            return
        n = ctx.aengine.num_in_flight()
        if n:
            # lazy: the server answers /health (503 while loading) before the engine's imports have run
            from tokenmill.engine.async_engine import ServerShutdownError

            logger.warning("drain timeout (%gs) expired: aborting %d request(s) still in flight", self.drain_timeout, n)
            ctx.aengine.abort_all(
                ServerShutdownError(
                    f"the server is shutting down and its drain timeout ({self.drain_timeout:g} s) expired"
                )
            )


def make_config(app, host: str, port: int, drain_timeout: float | None = 30.0, **kw) -> uvicorn.Config:
    grace = None if drain_timeout is None else drain_timeout + END_STREAMS_GRACE_S
    return uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=grace, **kw
    )


def serve(engine: Any, args: ServerArgs | None = None, *, sock: socket.socket | None = None, tracer: Any = None) -> int:
    """Serve until SIGTERM / SIGINT; returns 0 after draining. `engine`: a running AsyncLLMEngine,
    or a function that builds one: the server then listens at once and the engine loads on a thread
    of its own (StartupApp). `args`: the ServerArgs (server/args.py; default: its defaults). Used by
    `tokenmill serve`, which binds `sock` (listen.bind_socket) before anything else; without one,
    args.host:args.port is bound here.

    A dead engine ends the server with 1; a load that fails ends it and raises the load's error
    here; SIGTERM / SIGINT while loading ends the process at once with 0 (os._exit: the load is a
    thread, which nothing can interrupt, and at interpreter exit it would still be running torch code)."""
    args = args if args is not None else ServerArgs()

    def build(aengine):
        # lazy: the socket listens before the app's imports run
        from tokenmill.server.app import build_app

        return build_app(aengine, args, tracer=tracer)

    sock = sock or bind_socket(args.host, args.port)
    gate = StartupApp(engine if callable(engine) else (lambda: engine), build)
    if tracer is not None:
        logger.info("OpenTelemetry: one span per request, exported to %s", tracer.endpoint)
    config = make_config(
        gate,
        args.host,
        args.port,
        args.drain_timeout,
        log_level=args.uvicorn_log_level,
        timeout_keep_alive=args.timeout_keep_alive,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
    )
    https = args.ssl_certfile is not None

    class Server(DrainingServer):
        engine_died = False

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                if not gate.done.done():
                    announce_listening(sock, https)
                self._watch = asyncio.create_task(self.watch_engine())

        async def watch_engine(self) -> None:
            """Announces the server once the engine is ready; then a dead engine (its loop raised, a
            tensor-parallel worker died) ends the server with exit code 1, so that a supervisor
            restarts it; until then /health says 503."""
            try:
                aengine = await asyncio.wrap_future(gate.done)
            except BaseException:  # noqa: BLE001 - serve() raises it once the server has stopped
                self.should_exit = True
                return
            announce(gate.app, sock, https=https)
            while not self.should_exit:
                if not aengine.is_running:
                    logger.error("the engine has died (%r): shutting the server down", aengine.error)
                    self.engine_died = self.should_exit = True
                    return
                await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)

    server = Server(config)
    try:
        gate.start()
        # The full app's modules (every API's routes: ~0.5-1 s of imports) load beside the engine, which
        # spends much of its load in C++ without the GIL, instead of after it.
        threading.Thread(
            target=importlib.import_module, args=("tokenmill.server.app",), name="tokenmill-import", daemon=True
        ).start()
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not gate.done.done():
            _exit_while_loading(server.started)
        if gate.aengine is not None:
            gate.aengine.shutdown()
        if tracer is not None:  # after the drain: the last requests' spans go out too
            tracer.shutdown()
    if gate.done.exception() is not None:
        raise gate.done.exception()  # as an engine built before the server would have raised it
    if not server.started or server.engine_died:
        return 1
    logger.info("server stopped")
    return 0


def _exit_while_loading(started: bool) -> None:
    """Stopped (SIGTERM, Ctrl-C) while the engine loads: end the process now, not when the load
    ends (minutes, for a first run's GGUF conversion), and not through interpreter exit, which
    would tear down modules under the load's thread."""
    logger.info("stopped before the engine finished loading (%s)", (progress.current() or {}).get("phase", "starting"))
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if started else 1)
