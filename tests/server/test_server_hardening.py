"""Defects a stress test found (issue 14), one regression test each: request ids that clients
repeat, request chat templates, where requests are tokenized, lone surrogates, body and list
sizes, conflicting constraints, the KV sizing hint, the drain timeout, offline /docs."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from conftest import PROMPTS, running_server

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server import chat_template
from tokenmill.server.app import BackgroundServer, build_app

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with running_server(tiny_llama_dir) as (server, aengine):
        yield server, aengine, server.server.config.app.state.ctx


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=60) as h:
        yield h


@pytest.fixture
def ctx(served):
    """The server's context, with any setting a test changes put back afterwards."""
    ctx = served[2]
    saved = dict(vars(ctx))
    yield ctx
    vars(ctx).update(saved)


def _greedy(n=12):
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True}


def _idle(aengine) -> bool:
    kv = aengine.engine.core.kv
    return kv.num_free_blocks == kv.num_usable_blocks and not aengine.engine.core.scheduler.requests


# ---- 1. a repeated X-Request-Id -------------------------------------------------------------
def test_same_x_request_id_twice_each_client_gets_its_own_stream(http, served, tiny_llama_llm):
    prompts = PROMPTS[:2]
    want = [
        o.outputs[0].text
        for o in tiny_llama_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    ]
    got, headers, both_started = {}, {}, threading.Barrier(2, timeout=60)

    def client(i):
        text = ""
        with http.stream(
            "POST", C, json={"prompt": prompts[i], "stream": True, **_greedy(40)}, headers={"X-Request-Id": "same-id"}
        ) as r:
            headers[i] = r.headers.get("x-request-id")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not text:
                        both_started.wait()  # both requests are in flight under the one client id
                    text += json.loads(line[6:])["choices"][0]["text"]
        got[i] = text

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[0], got[1]] == want
    assert headers == {0: "same-id", 1: "same-id"}  # echoed back, as vLLM does


def test_engine_refuses_a_request_id_in_flight(served):
    import asyncio

    aengine = served[1]

    async def main():
        first = aengine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await first.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use"):
                await aengine.generate([4, 5], SamplingParams(max_tokens=2), "dup").__anext__()
        finally:
            await first.aclose()

    asyncio.run(main())


# ---- 2. chat templates sent in a request ------------------------------------------------------
def test_request_chat_template_refused_unless_trusted(http, ctx):
    for path in (CHAT, "/tokenize"):
        r = http.post(path, json={"messages": MSGS, "chat_template": "{{ messages[0].content }}", "max_tokens": 2})
        assert r.status_code == 400, path
        err = r.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    ctx.trust_request_chat_template = True
    r = http.post("/tokenize", json={"messages": MSGS, "chat_template": "{{ messages[0].content }}!"})
    assert (
        r.status_code == 200
        and r.json()["tokens"]
        == http.post("/tokenize", json={"prompt": "Hi!", "add_special_tokens": False}).json()["tokens"]
    )


@pytest.mark.parametrize(
    "template,what",
    [
        ("{{ 'ab ' * 10000000 }}", "computes a value"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
            "computes a value",
        ),
        ("{{ 10 ** 100000000 }}", "computes a value"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passed"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer"),
    ],
)
def test_trusted_request_template_is_bounded(http, ctx, monkeypatch, template, what):
    ctx.trust_request_chat_template = True
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.5)
    r = http.post(CHAT, json={"messages": MSGS, "chat_template": template, "max_tokens": 2})
    assert r.status_code == 400 and what in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_models_own_template_renders_the_same(http, served):
    aengine = served[1]
    want = aengine.engine.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert http.post("/tokenize", json={"messages": MSGS}).json()["tokens"] == list(want)


# ---- 3. tokenization off the engine thread and the event loop -------------------------------------
def test_requests_are_prepared_on_the_prep_pool(http, served, monkeypatch):
    engine = served[1].engine
    threads = []
    encode = engine.encode

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return encode(*a, **kw)

    monkeypatch.setattr(engine, "encode", spy)
    r = http.post(C, json={"prompt": "Hello world", "bad_words": ["fox", "dog"], **_greedy(3)})
    assert r.status_code == 200
    r = http.post(CHAT, json={"messages": MSGS, **_greedy(3)})
    assert r.status_code == 200
    assert len(threads) >= 6 and all(t.startswith("tokenmill-prep") for t in threads), threads


def test_too_many_bad_words_or_stops_is_400(http):
    r = http.post(C, json={"prompt": "Hi", "bad_words": [f"w{i}" for i in range(20_000)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    r = http.post(C, json={"prompt": "Hi", "stop": [f"s{i}" for i in range(65)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


# ---- 4. lone UTF-16 surrogates ----------------------------------------------------------------
@pytest.mark.parametrize(
    "path,body",
    [
        (C, '{"prompt": "hi \\ud800 there", "max_tokens": 2}'),
        (C, '{"prompt": ["ok", "hi \\udfff"], "max_tokens": 2}'),
        (C, '{"prompt": "hi", "bad_words": ["\\ud800"], "max_tokens": 2}'),
        (CHAT, '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'),
        ("/tokenize", '{"prompt": "hi \\ud800 there"}'),
        ("/generate", '{"inputs": "hi \\ud800 there"}'),
        ("/generate_stream", '{"inputs": "hi \\ud800 there"}'),
    ],
)
def test_lone_surrogate_is_a_client_error(http, served, path, body):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    if path.startswith("/generate"):
        assert r.status_code == 422 and r.json()["error_type"] == "validation"
        assert "surrogate" in r.json()["error"]
    else:
        assert r.status_code == 400, r.text
        assert "surrogate" in r.json()["error"]["message"]


# Echoed fields: the unknown model's 404 quotes `model`, a response echoes `user` and `metadata`; each
# failed while its answer was encoded (500, or a cut stream). Every string is now checked at the edge.
@pytest.mark.parametrize(
    "path,body,param",
    [
        (C, {"model": "x\ud800", "prompt": "Hi", "max_tokens": 2}, "model"),
        (CHAT, {"model": "x\ud800", "messages": MSGS, "max_tokens": 2}, "model"),
        ("/v1/responses", {"model": "x\ud800", "input": "Hi", "max_output_tokens": 2}, "model"),
        ("/tokenize", {"model": "x\ud800", "prompt": "Hi"}, "model"),
        ("/detokenize", {"model": "x\ud800", "tokens": [1, 2]}, "model"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "user": "\udc00"}, "user"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "\ud800"}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "metadata": {"\ud800": "v"}}, "metadata"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": True, "user": "\ud800"}, "user"),
    ],
    ids=[
        "completions-model",
        "chat-model",
        "responses-model",
        "tokenize-model",
        "detokenize-model",
        "responses-user",
        "responses-metadata",
        "responses-metadata-key",
        "responses-stream-user",
    ],
)
def test_echoed_lone_surrogate_is_400_naming_the_field(http, served, path, body, param):
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"] and err["type"] == "BadRequestError"
    assert _idle(served[1])  # refused before anything was generated


def test_lone_surrogate_on_anthropic_route_is_its_400(http):
    body = {"model": "x", "max_tokens": 2, "messages": MSGS, "metadata": {"user_id": "\ud800"}}
    r = http.post("/v1/messages", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "metadata.user_id" in r.json()["error"]["message"]


def test_every_post_route_refuses_a_lone_surrogate(http, served):
    """Whatever the route (the LoRA routes too, answered even when off): a 400, TGI's 422, never a 500;
    also when the surrogate comes as raw bytes (JSON parsers read those with surrogatepass)."""
    paths = [p for p, ops in http.get("/openapi.json").json()["paths"].items() if "post" in ops]
    paths += ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    assert len(paths) >= 12
    escaped = '{"model": "m\\ud800", "prompt": "Hi", "inputs": "Hi", "input": "Hi", "messages": []}'
    raw = escaped.replace("\\ud800", "").encode().replace(b'"m"', b'"m\xed\xa0\x80"')
    for path in paths:
        for content in (escaped.encode(), raw):
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == (422 if path.startswith("/generate") else 400), (path, r.text)
            assert "surrogate" in r.text, (path, r.text)
    assert _idle(served[1])


# ---- 7. constraints that cannot both hold -------------------------------------------------------
def test_empty_only_grammar_with_min_tokens_is_400(http):
    r = http.post(C, json={"prompt": "Hi", "guided_regex": "", "min_tokens": 3, "max_tokens": 8})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


def test_grammar_ends_the_output_before_min_tokens(http, tiny_llama_llm):
    r = http.post(
        C, json={"prompt": "Hi", "guided_choice": ["ab"], "min_tokens": 20, "max_tokens": 30, "temperature": 0}
    )
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "stop"


# ---- 8. the KV cache sizing hint ----------------------------------------------------------------
def test_kv_cache_hint_is_enough(tiny_llama_dir):
    with pytest.raises(ValueError, match="at least") as e:
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1e-6)
    hint = float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1))
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=hint)
    assert llm.engine.core.kv.num_usable_blocks >= llm.engine.core.kv.blocks_needed(512)


# ---- 9. sizes of a request ----------------------------------------------------------------------
def test_body_over_the_limit_is_413(http, ctx):
    ctx.max_request_body_bytes = 10_000
    big = {"prompt": "x " * 6_000, "max_tokens": 2}
    r = http.post(C, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and "10,000 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    r = http.post("/generate", json={"inputs": "x " * 6_000})
    assert r.status_code == 413 and "error" in r.json()
    assert http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_too_many_prompts_is_400(http, ctx):
    ctx.max_prompts_per_request = 4
    r = http.post(C, json={"prompt": ["a"] * 5, "max_tokens": 1})
    assert r.status_code == 400 and "at most 4 prompts" in r.json()["error"]["message"]
    assert http.post(C, json={"prompt": ["a"] * 4, "max_tokens": 1}).status_code == 200
    ctx.max_prompts_per_request = 256
    r = http.post(C, json={"prompt": ["a"] * 9, "n": 128, "max_tokens": 1})  # 1,152 sequences
    assert r.status_code == 400 and "at most 1024" in r.json()["error"]["message"]


# ---- /docs without a CDN ------------------------------------------------------------------------------
def test_docs_are_served_offline(http):
    for path, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = http.get(path).text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", html) + re.findall(r"url: ?'([^']+)'", html)
        assert all(u.startswith("/") for u in urls), urls  # nothing from another host
        assert f"/docs-static/{asset}" in urls
        r = http.get(f"/docs-static/{asset}")
        assert r.status_code == 200 and len(r.content) > 100_000
    assert http.get("/docs-static/swagger-ui.css").status_code == 200


# ---- 6. the drain timeout -------------------------------------------------------------------------
def test_drain_timeout_ends_streams_with_an_error_and_done(tiny_llama_dir, caplog):
    aengine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)
    server = BackgroundServer(build_app(aengine), drain_timeout=0.3)
    expired, gate_on = threading.Event(), threading.Event()
    abort_all = aengine.abort_all

    def on_expiry(error):
        expired.set()
        abort_all(error)

    aengine.abort_all = on_expiry  # type: ignore[method-assign]
    # Once both requests run, the engine waits for the drain timeout: they cannot finish before it.
    aengine.step_observers.append(lambda outputs, dt: gate_on.is_set() and expired.wait(60))
    try:
        server.start()
        lines, result = [], {}
        first = threading.Event()

        def streaming():
            body = {"prompt": "Hello", "stream": True, **_greedy(500)}
            with httpx.stream("POST", server.url + C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        def plain():
            r = httpx.post(server.url + C, json={"prompt": "Hi", **_greedy(500)}, timeout=60)
            result["status"], result["body"] = r.status_code, r.json()

        threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first.wait(60)
        deadline = time.monotonic() + 60
        while aengine.num_in_flight() < 2:  # the plain request is in too
            assert time.monotonic() < deadline and threads[1].is_alive()
            time.sleep(0.01)
        gate_on.set()
        with caplog.at_level("WARNING", logger="tokenmill.server"):
            server.stop(timeout=30)
        for t in threads:
            t.join(30)
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and "drain timeout" in err["message"]
        assert result["status"] == 503 and "drain timeout" in result["body"]["error"]["message"]
        assert [r.getMessage() for r in caplog.records if "drain timeout" in r.getMessage()] == [
            "drain timeout (0.3s) expired: aborting 2 request(s) still in flight"
        ]
        assert _idle(aengine)
    finally:
        expired.set()
        server.stop()
        aengine.shutdown()
