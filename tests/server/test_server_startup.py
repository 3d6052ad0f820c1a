"""`tokenmill serve` while its engine loads: the server answers from the start; /health and
/health/ready say 503 "loading" (with the load's phase) and then 200, /health/live 200 throughout;
every other route answers 503 in its API's error shape with Retry-After; a load that fails ends
the server with its error and a non-zero exit; SIGTERM while loading exits 0 at once. Every load
here is held on a threading.Event inside the real loading step, never on timing."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import types
from contextlib import suppress

import httpx
import pytest
from conftest import free_port

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.model import loader
from tokenmill.server.app import BackgroundServer, build_app
from tokenmill.server.args import ServerArgs
from tokenmill.server.startup import LOADING_RETRY_AFTER_S, StartupApp


@pytest.fixture
def held(tiny_llama_dir, monkeypatch):
    """A server whose engine load stops inside the weight loading (after the first tensor) until
    .release is set; the app over it asks for an API key."""
    reached, release = threading.Event(), threading.Event()
    real = loader._iter_safetensors

    def held_weights(*args, **kwargs):
        tensors = real(*args, **kwargs)
        yield next(tensors)
        reached.set()
        assert release.wait(120)
        yield from tensors

    monkeypatch.setattr(loader, "_iter_safetensors", held_weights)
    gate = StartupApp(
        lambda: AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05),
        lambda aengine: build_app(aengine, ServerArgs(api_key="k3y")),
    )
    server = BackgroundServer(gate).start()
    gate.start()
    try:
        assert reached.wait(120)
        yield types.SimpleNamespace(url=server.url, gate=gate, release=release)
    finally:
        release.set()
        server.stop()
        with suppress(Exception):
            gate.done.result(120).shutdown()


def test_health_is_503_while_loading_then_200(held):
    url = held.url
    r = httpx.get(url + "/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "loading" and body["phase"] == "loading weights", body
    assert body["unit"] == "tensor" and body["total"] > 1 and body["elapsed_s"] >= 0
    assert httpx.head(url + "/health").status_code == 503
    ready = httpx.get(url + "/health/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "loading"
    live = httpx.get(url + "/health/live")  # the process serves: a liveness probe must not kill it
    assert live.status_code == 200 and live.json()["phase"] == "loading weights"

    frozen = gc.get_freeze_count()
    held.release.set()
    held.gate.done.result(120)
    assert gc.get_freeze_count() > frozen  # start-up's objects left out of full collections
    for path in ("/health", "/health/ready", "/health/live"):  # no API key needed, like /health
        r = httpx.get(url + path)
        assert (r.status_code, r.json()) == (200, {"status": "ok"}), path
        assert httpx.head(url + path).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401  # the rest asks for the key


def test_every_other_route_is_a_503_in_its_apis_shape_while_loading(held):
    url = held.url
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 503 and r.headers["Retry-After"] == str(LOADING_RETRY_AFTER_S)
    error = r.json()["error"]  # OpenAI's body
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "loading (loading weights)" in error["message"] and "/health/ready" in error["message"]
    models = httpx.get(url + "/v1/models")
    assert models.status_code == 503 and models.json()["error"]["code"] == 503
    tgi = httpx.post(url + "/generate", json={"inputs": "Hi"})
    assert tgi.status_code == 503 and tgi.json()["error_type"] == "overloaded" and "Retry-After" in tgi.headers
    anthropic = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": []})
    assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"

    held.release.set()
    held.gate.done.result(120)
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k3y"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_a_failed_load_ends_serve_with_its_error(capsys):
    from tokenmill.cli import main

    assert main(["serve", "/no/such/model", "--host", "127.0.0.1", "--port", str(free_port())]) == 2
    assert "tokenmill: error: model path '/no/such/model' does not exist" in capsys.readouterr().err


def test_a_failed_load_says_so_on_health():
    def load():
        raise ValueError("no weights here")

    gate = StartupApp(load, build_app)
    with BackgroundServer(gate) as server:
        gate.start()
        with pytest.raises(ValueError):
            gate.done.result(60)
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "no weights here" in r.json()["error"]
        assert httpx.get(server.url + "/health/live").status_code == 503
        assert httpx.get(server.url + "/v1/models").status_code == 503


# A `tokenmill serve` whose weight loading never ends (held after the first tensor on an event nobody sets).
_HELD_SERVE = """
import sys, threading
from tokenmill.model import loader

real = loader._iter_safetensors

def held_weights(*args, **kwargs):
    tensors = real(*args, **kwargs)
    yield next(tensors)
    threading.Event().wait()

loader._iter_safetensors = held_weights
from tokenmill.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_loading_exits_0_at_once(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _HELD_SERVE,
            "serve",
            tiny_llama_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "0.05",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # until the load is inside its weights (the server answers all along)
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            with suppress(httpx.TransportError):
                r = httpx.get(url + "/health", timeout=1)
                if r.json().get("phase") == "loading weights":
                    break
            assert time.monotonic() < deadline, "the load never reached its weights"
            time.sleep(0.1)
        assert r.status_code == 503 and httpx.get(url + "/health/live").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        output = open(tmp_path / "serve.log").read()
        assert f"tokenmill is listening on http://127.0.0.1:{port} while the engine loads" in output
        assert "SIGTERM received" in output and "stopped before the engine finished loading (loading weights)" in output
        assert "Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
