"""Large non-streamed responses (many choices, logprobs, content blocks, embeddings) against a real
uvicorn server over the tiny Llama: their bodies are built and encoded on the prep pool, not on
the event loop, so that other requests (a /health probe) are answered meanwhile; the encoding
goes a piece at a time (one json.dumps call holds the GIL throughout); and --max-response-values
refuses, in each API's own error body, a request whose response could hold more."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest
from conftest import running_server

from tokenmill.server import anthropic_messages, openai_chat, openai_completions, openai_responses, response_body

GREEDY = {"temperature": 0, "ignore_eos": True}
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with running_server(tiny_llama_dir) as (server, aengine):
        yield server, aengine.engine.config.model.name, server.server.config.app.state.ctx


@pytest.fixture(scope="module")
def embed_served(tiny_llama_dir):
    with running_server(tiny_llama_dir, task="embed", served_model_name="tiny") as (server, _):
        yield server, "tiny", server.server.config.app.state.ctx


def _spy(monkeypatch, module, name: str, threads: list[str]) -> None:
    """Record the thread each call of module.name runs on."""
    inner = getattr(module, name)

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return inner(*args, **kw)

    monkeypatch.setattr(module, name, spy)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_bodies_are_built_on_the_prep_pool(served, embed_served, monkeypatch):
    """Each route's builder runs on a tokenmill-prep thread (the event loop's thread is uvicorn's)."""
    (server, model, _), (embed, embed_model, _) = served, embed_served
    cases = [  # (module, a function that builds part of the body, path, request)
        (
            openai_chat,
            "chat_logprobs",
            "/v1/chat/completions",
            {"messages": MSGS, "n": 3, "logprobs": True, "top_logprobs": 2, "max_tokens": 4, **GREEDY},
        ),
        (
            openai_completions,
            "completion_logprobs",
            "/v1/completions",
            {"prompt": ["Hello", "Hi there"], "n": 2, "logprobs": 2, "max_tokens": 4, **GREEDY},
        ),
        (
            anthropic_messages,
            "chat_messages",
            "/v1/messages",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}] * 50}], "max_tokens": 4},
        ),
        (anthropic_messages, "_stop_reason", "/v1/messages", {"messages": MSGS, "max_tokens": 4}),
        (openai_responses, "input_messages", "/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
        (openai_responses, "_item", "/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
    ]
    for module, name, path, body in cases:
        threads: list[str] = []
        _spy(monkeypatch, module, name, threads)
        r = _post(server.url, path, {"model": model, **body})
        assert r.status_code == 200, r.text
        assert threads and all(t.startswith("tokenmill-prep") for t in threads), (name, threads)
    threads = []
    _spy(monkeypatch, response_body, "encode_json", threads)
    r = _post(embed.url, "/v1/embeddings", {"model": embed_model, "input": ["a b c"] * 40})
    assert r.status_code == 200 and len(r.json()["data"]) == 40
    assert threads and all(t.startswith("tokenmill-prep") for t in threads), threads


def test_health_is_answered_while_a_body_is_built(served, monkeypatch):
    """The chat body's build is held (inside it) until a /health probe has been answered: the probe
    gets its answer while the build is still held, so the event loop was free meanwhile."""
    server, model, _ = served
    building, released = threading.Event(), threading.Event()
    inner = openai_chat.chat_logprobs

    def held(*args):
        building.set()
        released.wait(120)  # without the fix this holds the event loop, and the probe below times out
        return inner(*args)

    monkeypatch.setattr(openai_chat, "chat_logprobs", held)
    got: dict[str, httpx.Response] = {}
    body = {"model": model, "messages": MSGS, "n": 2, "logprobs": True, "top_logprobs": 2, "max_tokens": 4, **GREEDY}
    t = threading.Thread(target=lambda: got.update(chat=_post(server.url, "/v1/chat/completions", body)))
    t.start()
    try:
        assert building.wait(120)
        health = httpx.get(server.url + "/health", timeout=30)
        answered_while_held = not released.is_set()
    finally:
        released.set()
        t.join(120)
    assert health.status_code == 200 and answered_while_held
    assert got["chat"].status_code == 200 and len(got["chat"].json()["choices"]) == 2


def test_large_lists_are_encoded_a_piece_at_a_time(monkeypatch):
    """The same bytes as one json.dumps (JSONResponse's compact UTF-8), but a long list of objects
    goes one element per call, while a list of numbers (an embedding) stays one piece."""
    calls: list[object] = []
    inner = response_body._dumps
    monkeypatch.setattr(response_body, "_dumps", lambda obj: calls.append(obj) or inner(obj))
    data = [{"object": "embedding", "embedding": [i / 7, -1.5, 2e-9], "index": i} for i in range(100)]
    body = {"id": "x", "data": data, "choices": [{"text": "é", "logprobs": {"content": data}}], "usage": {"n": 1}}
    assert response_body.encode_json(body) == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    assert sum(1 for c in calls if isinstance(c, dict) and "embedding" in c) == 200  # each element alone
    assert not any(isinstance(c, list) and len(c) > 3 for c in calls)
    assert response_body.encode_json([1, {"a": [2]}]) == b'[1,{"a":[2]}]'
    with pytest.raises(ValueError):
        response_body.encode_json({"x": float("nan")})


@pytest.fixture
def bounded(served, embed_served):
    """Both servers with --max-response-values 100, put back afterwards."""
    ctxs = [served[2], embed_served[2]]
    saved = [c.max_response_values for c in ctxs]
    for c in ctxs:
        c.max_response_values = 100
    yield
    for c, v in zip(ctxs, saved):
        c.max_response_values = v


def test_responses_over_the_bound_are_400_in_each_apis_error_body(served, embed_served, bounded):
    server, model, _ = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        # n=4 x 8 tokens x (1 + 3 logprob entries) = 128 values: over 100; streamed, nothing is built whole
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MSGS, n=4, max_tokens=8, logprobs=True, top_logprobs=2)
        assert e.value.body["param"] == "max_tokens" and "--max-response-values" in e.value.body["message"]
        stream = client.chat.completions.create(
            model=model, messages=MSGS, n=4, max_tokens=8, logprobs=True, top_logprobs=2, stream=True
        )
        assert {c.index for chunk in stream for c in chunk.choices} == {0, 1, 2, 3}
        assert client.chat.completions.create(model=model, messages=MSGS, n=4, max_tokens=8).choices
        with pytest.raises(openai.BadRequestError) as e:  # 101 sequences of 1 token
            client.completions.create(model=model, prompt=["a"] * 101, max_tokens=1)
        assert e.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="Hi", max_output_tokens=101)
        assert e.value.body["param"] == "max_output_tokens"
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=model, max_tokens=101, messages=MSGS)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "--max-response-values" in e.value.body["error"]["message"]
    embed, embed_model, ctx = embed_served
    width = ctx.aengine.engine.config.model.hf_config.hidden_size
    r = _post(embed.url, "/v1/embeddings", {"model": embed_model, "input": ["a"] * (100 // width + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
