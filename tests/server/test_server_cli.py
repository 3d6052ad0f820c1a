"""`tokenmill serve` as users run it: a subprocess that authenticates, serves, says where and what
it serves, and on SIGTERM stops accepting, finishes the in-flight request and exits 0; `serve --help`;
a busy port refused before the model loads; drain timeout."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import free_port

from tokenmill.cli import build_parser


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_serve_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--max-waiting",
        "--served-model-name",
        "--drain-timeout",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--dtype",
        "--block-size",
        "--model",
        "--kv-cache-memory",
        "--max-logprobs",
        "--chat-template",
    ):
        assert flag in out, flag
    for action in _serve_parser()._actions:
        assert action.help and action.help.strip(), action.option_strings or action.dest


def _help(parser: argparse.ArgumentParser, dest: str) -> str:
    return next(a.help for a in parser._actions if a.dest == dest)


def test_serve_help_tells_the_truth_about_methods_and_dtypes():
    """Every speculative method the config accepts is listed; the dtypes said to run on the CPU are
    exactly those the engine takes there (float16 is GPU-only)."""
    from tokenmill.config import parse_dtype
    from tokenmill.spec_decode.config import METHODS

    parser = _serve_parser()
    spec = _help(parser, "speculative_config")
    assert all(m in spec for m in METHODS) and "draft_model" in spec, spec
    dtype = _help(parser, "dtype")
    cpu_said = dtype.split("the CPU runs ", 1)[1].split(",", 1)[0]
    for name in ("float32", "bfloat16", "float16"):
        try:
            parse_dtype(name, "cpu")
            runs_on_cpu = True
        except ValueError:
            runs_on_cpu = False
        assert (name in cpu_said.split(" and ")) == runs_on_cpu, (name, dtype)
        assert name in dtype.split("a GPU ", 1)[1]


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["serve", "--bogus"], "usage: tokenmill serve "),
        (["generate", "hi", "--bogus"], "usage: tokenmill generate "),
        (["bench", "serve", "--base-url", "http://x", "--bogus"], "usage: tokenmill bench serve "),
    ],
)
def test_an_unknown_flag_prints_the_subcommands_usage(argv, usage, capsys):
    from tokenmill.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    command = usage.removeprefix("usage: ").strip()
    assert f"{command}: error: unrecognized arguments: --bogus" in err


def test_a_gguf_file_is_served_under_its_model_name(tiny_llama_dir, tmp_path, monkeypatch):
    """Not under its path: clients send "model": "SmolLM2-135M-Instruct" whatever file serves it. The
    path and the file's stem are still accepted."""
    from conftest import running_server
    from gguf_writer import write_gguf_from_hf

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf_from_hf(tiny_llama_dir, tmp_path / "tiny-chat.Q8_0.gguf", "Q8_0", name="Tiny Chat 1M"))
    with running_server(path) as (server, _):
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny-chat"]
        for model, status in (("tiny-chat", 200), (path, 200), ("tiny-chat.Q8_0", 200), ("tiny", 404)):
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == status, (model, r.text)
            if status == 200:
                assert r.json()["model"] == "tiny-chat"


def test_sigterm_drains_in_flight_request_and_exits_0(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "TOKENMILL_API_KEY": "k3y"}
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
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
        "--served-model-name",
        "tiny",
        "--drain-timeout",
        "60",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    auth = {"Authorization": "Bearer k3y"}
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401  # --api-key from TOKENMILL_API_KEY
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"

        max_tokens = 300
        started, result = threading.Event(), {}

        def client():
            body = {
                "model": "tiny",
                "prompt": "Hello world",
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        started.set()
            result["events"] = events

        t = threading.Thread(target=client)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        refused = False  # new connections are refused while the old request drains
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(url + "/health", timeout=1)
                time.sleep(0.05)
            except httpx.ConnectError:
                refused = True
            except httpx.TransportError:
                time.sleep(0.05)
        assert refused
        t.join(60)
        assert proc.wait(60) == 0
        events = result["events"]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == max_tokens
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
        assert finishes[-1] == "length"
        output = open(tmp_path / "serve.log").read()
        assert "SIGTERM received" in output
        # Once up it says where it listens and what it serves (vLLM's route lines).
        assert f"tokenmill is serving on http://127.0.0.1:{port};" in output
        assert "Route: /v1/chat/completions, Methods: POST" in output and "Route: /health, Methods: GET" in output
        access = [ln for ln in output.splitlines() if "tokenmill.access" in ln and "/v1/completions" in ln]
        assert len(access) == 1 and f"completion_tokens={max_tokens}" in access[0]
        assert "prompt_tokens=" in access[0] and "ttft=" in access[0] and "latency=" in access[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_serve_fails_fast_on_a_busy_port(capsys):
    """The port is bound before the model loads: a model path that does not exist is never reached."""
    from tokenmill.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "/no/such/model", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"port {port} is in use" in capsys.readouterr().err
