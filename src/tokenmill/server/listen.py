"""The listening side of `tokenmill serve`: the socket is bound before anything else, so a busy
port fails in a second instead of after minutes of loading (vLLM does the same); the server says
where it listens while the engine loads, and once it is ready which routes it serves (uvicorn says
nothing about a socket it is handed)."""

from __future__ import annotations

import errno
import logging
import socket

logger = logging.getLogger("tokenmill.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); uvicorn listens on it later. ValueError if it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} is in use (on {host}): stop what listens there or choose another --port"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def announce(app, sock: socket.socket, https: bool = False) -> None:
    """Log the app's routes, then the URL it is served on."""
    by_path: dict[str, set[str]] = {}
    for path, methods in _routes(app.routes):
        by_path.setdefault(path, set()).update(methods or ())
    for path, methods in by_path.items():
        if methods:
            logger.info("Route: %s, Methods: %s", path, ", ".join(sorted(methods)))
        else:
            logger.info("Route: %s (mounted)", path)
    logger.info("tokenmill is serving on %s; Ctrl-C (SIGINT) or SIGTERM to stop", _url(sock, https))


def announce_listening(sock: socket.socket, https: bool = False) -> None:
    """Says that the server answers while the engine loads, and how to know when it is ready."""
    logger.info(
        "tokenmill is listening on %s while the engine loads: GET /health and /health/ready answer "
        "503 until it is ready, /health/live 200",
        _url(sock, https),
    )


def _url(sock: socket.socket, https: bool) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    where = " (all interfaces)" if host in ("0.0.0.0", "::") else ""
    return f"{'https' if https else 'http'}://{shown}:{port}{where}"


def _routes(routes):
    """(path, methods) of every route, those of included routers too: recent FastAPI keeps an
    included router as one lazily resolved entry (effective_candidates); older ones flatten it."""
    for route in routes:
        if isinstance(getattr(route, "path", None), str):
            yield route.path, getattr(route, "methods", None)
        elif callable(getattr(route, "effective_candidates", None)):
            yield from _routes(route.effective_candidates())
