"""Bad input gets a 4xx with OpenAI's error body (one test per case), auth, a full waiting
queue gets 503 + Retry-After, an unexpected error a generic 500 on a connection that stays open;
nothing is left behind in the engine."""

from __future__ import annotations

import json
import logging
import re
import time
from http.client import HTTPConnection

import httpx
import openai
import pytest

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server.app import BackgroundServer, build_app


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    aengine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)
    app = build_app(aengine)
    server = BackgroundServer(app)
    try:
        server.start()
        yield server, aengine, app
    finally:
        server.stop()
        aengine.shutdown()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=30) as h:
        yield h


@pytest.fixture(scope="module")
def model(served):
    return served[1].engine.config.model.name


LONG = "Hello world " * 300  # ~600 tokens with the tiny tokenizer; the context is 512
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]

# (test id, path, JSON body (or raw bytes), status, param, words the message must contain)
CASES = [
    ("malformed_json", C, b'{"prompt": "Hi", ', 400, None, ["Malformed JSON"]),
    ("body_not_an_object", C, b'["Hi"]', 400, None, []),
    ("missing_prompt", C, {"max_tokens": 5}, 400, "prompt", ["prompt"]),
    ("prompt_wrong_type", C, {"prompt": 5}, 400, "prompt", ["prompt", "string"]),
    ("prompt_mixed_list", C, {"prompt": ["Hi", [1, 2]]}, 400, "prompt", ["prompt"]),
    ("temperature_wrong_type", C, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", ["temperature"]),
    ("max_tokens_not_integer", C, {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens", ["max_tokens"]),
    ("stream_wrong_type", C, {"prompt": "Hi", "stream": {"a": 1}}, 400, "stream", ["stream"]),
    ("messages_wrong_type", CHAT, {"messages": "Hi"}, 400, "messages", ["messages"]),
    ("messages_empty", CHAT, {"messages": []}, 400, "messages", ["messages"]),
    ("message_without_role", CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages", ["role"]),
    (
        "image_content_part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "messages",
        ["image_url", "text"],
    ),
    ("empty_prompt", C, {"prompt": ""}, 400, "prompt", ["empty"]),
    ("empty_prompt_list", C, {"prompt": []}, 400, "prompt", ["empty"]),
    ("token_id_out_of_vocab", C, {"prompt": [1, 2, 10**6]}, 400, "prompt", ["token ids"]),
    ("negative_token_id", C, {"prompt": [1, -2]}, 400, "prompt", ["token ids"]),
    (
        "stop_token_id_out_of_vocab",
        C,
        {"prompt": "Hi", "stop_token_ids": [10**6], "min_tokens": 2},
        400,
        "stop_token_ids",
        ["token ids"],
    ),
    ("max_tokens_zero", C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ("max_tokens_negative", CHAT, {"messages": USER, "max_tokens": -1}, 400, "max_tokens", ["max_tokens"]),
    ("temperature_negative", C, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature", ["temperature"]),
    ("top_p_above_one", C, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", ["top_p"]),
    ("top_k_below_minus_one", C, {"prompt": "Hi", "top_k": -5}, 400, "top_k", ["top_k"]),
    ("min_p_above_one", CHAT, {"messages": USER, "min_p": 2}, 400, "min_p", ["min_p"]),
    (
        "presence_penalty_out_of_range",
        C,
        {"prompt": "Hi", "presence_penalty": 3},
        400,
        "presence_penalty",
        ["presence_penalty"],
    ),
    (
        "frequency_penalty_out_of_range",
        CHAT,
        {"messages": USER, "frequency_penalty": -2.5},
        400,
        "frequency_penalty",
        ["frequency_penalty"],
    ),
    (
        "repetition_penalty_zero",
        C,
        {"prompt": "Hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        ["repetition_penalty"],
    ),
    (
        "min_tokens_over_max_tokens",
        C,
        {"prompt": "Hi", "max_tokens": 4, "min_tokens": 9},
        400,
        "min_tokens",
        ["min_tokens"],
    ),
    ("empty_stop_string", C, {"prompt": "Hi", "stop": [""]}, 400, "stop", ["stop"]),
    ("seed_out_of_range", C, {"prompt": "Hi", "seed": 2**70}, 400, "seed", ["seed"]),
    ("logprobs_too_many", C, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", ["logprobs", "20"]),
    (
        "top_logprobs_too_many",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
        ["top_logprobs"],
    ),
    ("top_logprobs_without_logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    ("n_zero", C, {"prompt": "Hi", "n": 0}, 400, "n", ["n must be in"]),
    ("n_too_many_chat", CHAT, {"messages": USER, "n": 1000}, 400, "n", ["n must be in"]),
    ("best_of_below_n", C, {"prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of", ["best_of"]),
    ("best_of_streamed", C, {"prompt": "Hi", "n": 1, "best_of": 2, "stream": True}, 400, "best_of", ["stream"]),
    ("suffix", C, {"prompt": "Hi", "suffix": "end"}, 400, "suffix", ["suffix", "not supported"]),
    (
        "echo_only_streamed",
        C,
        {"prompt": "Hi", "echo": True, "max_tokens": 0, "stream": True},
        400,
        "max_tokens",
        ["cannot be streamed"],
    ),
    ("max_tokens_zero_without_echo", C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", ["at least 1"]),
    ("logit_bias_not_a_token_id", C, {"prompt": "Hi", "logit_bias": {"x5": 10}}, 400, "logit_bias", ["token ids"]),
    ("logit_bias_out_of_vocab", C, {"prompt": "Hi", "logit_bias": {"5000000": 10}}, 400, "logit_bias", ["token ids"]),
    (
        "stream_options_without_stream",
        C,
        {"prompt": "Hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        ["stream"],
    ),
    (
        "tools_malformed",
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {}}]},
        400,
        "tools",
        ["tools[0]"],
    ),
    (
        "unknown_response_format",
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "response_format",
        ["json_schema"],
    ),
    (
        "json_schema_without_schema",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
        ["schema"],
    ),
    (
        "two_kinds_of_structure",
        C,
        {"prompt": "Hi", "guided_regex": "a+", "guided_choice": ["a"]},
        400,
        "response_format",
        ["one kind"],
    ),
    ("empty_guided_choice", C, {"prompt": "Hi", "guided_choice": []}, 400, "guided_choice", ["choice"]),
    (
        "continue_and_generation_prompt",
        CHAT,
        {"messages": USER + [{"role": "assistant", "content": "A"}], "continue_final_message": True},
        400,
        "continue_final_message",
        ["add_generation_prompt"],
    ),
    ("prompt_over_context", C, {"prompt": LONG, "max_tokens": 5}, 400, "prompt", ["512", "input tokens"]),
    (
        "prompt_plus_max_tokens_over_context",
        C,
        {"prompt": "Hello world", "max_tokens": 600},
        400,
        "max_tokens",
        ["512", "602", "600 in the completion"],
    ),
    ("chat_over_context", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", ["512"]),
    (
        "chat_max_completion_tokens_over_context",
        CHAT,
        {"messages": USER, "max_completion_tokens": 1000},
        400,
        "max_completion_tokens",
        ["512", "1000 in the completion"],
    ),
    ("unknown_model", C, {"model": "gpt-17", "prompt": "Hi"}, 404, "model", ["gpt-17", "does not exist"]),
    ("unknown_model_chat", CHAT, {"model": "gpt-17", "messages": USER}, 404, "model", ["gpt-17"]),
    ("unknown_model_tokenize", "/tokenize", {"model": "gpt-17", "prompt": "Hi"}, 404, "model", ["gpt-17"]),
    ("detokenize_bad_ids", "/detokenize", {"tokens": [10**6]}, 400, "tokens", ["token ids"]),
    ("unknown_route", "/v1/moderations", {"input": "Hi"}, 404, None, ["/v1/moderations"]),
    ("embeddings_on_a_generator", "/v1/embeddings", {"input": "Hi"}, 400, "model", ["Embeddings API"]),
]


@pytest.mark.parametrize("path,body,status,param,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(http, served, model, path, body, status, param, words):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        if path != "/v1/embeddings":
            body = {"model": model, **body} if "model" not in body else body
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    aengine = served[1]
    assert aengine.is_running and not aengine.engine.core.scheduler.requests


def test_bad_input_streaming_is_a_status_not_a_stream(http, model):
    """Errors found before the first token come back as an HTTP status even when stream=true."""
    r = http.post(C, json={"model": model, "prompt": "Hi", "top_p": 7, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = http.post(CHAT, json={"model": model, "messages": USER, "max_tokens": 5000, "stream": True})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]


def test_openai_client_raises_typed_errors(served, model):
    with openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model, prompt="Hi", temperature=-1)
        assert "temperature" in e.value.message
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=USER)


def test_queue_full_is_503_with_retry_after(http, served, model):
    aengine = served[1]
    aengine.max_waiting = 0  # every new request finds the waiting queue full
    try:
        r = http.post(C, json={"model": model, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "waiting" in err["message"]
        r = http.post(C, json={"model": model, "prompt": "Hi", "max_tokens": 4, "stream": True})
        assert r.status_code == 503
    finally:
        aengine.max_waiting = None
    assert http.post(C, json={"model": model, "prompt": "Hi", "max_tokens": 4}).status_code == 200


def test_api_key(served, model):
    server, _, app = served
    ctx = app.state.ctx
    ctx.api_key = "s3cret"
    try:
        with httpx.Client(base_url=server.url, timeout=30) as h:
            assert h.get("/health").status_code == 200  # health stays open for load balancers
            # the API's documentation too (a browser cannot send the key), as vLLM's
            for path in ("/openapi.json", "/docs", "/docs-static/swagger-ui.css"):
                assert h.get(path).status_code == 200, path
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", C),
                ("POST", CHAT),
                ("GET", "/metrics"),
                ("POST", "/tokenize"),
                ("POST", "/generate"),
                ("GET", "/version"),
            ):
                r = h.request(method, path, json={"model": model, "prompt": "Hi"})
                assert r.status_code == 401, path
                if path != "/generate":
                    err = r.json()["error"]
                    assert err["code"] == 401 and err["type"] == "AuthenticationError" and "API key" in err["message"]
            assert h.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert h.get("/v1/models", headers={"Authorization": "s3cret"}).status_code == 401
            assert h.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0) as c:
            assert c.completions.create(model=model, prompt="Hi", max_tokens=3).usage.completion_tokens >= 1
    finally:
        ctx.api_key = None


def test_dead_engine_is_503_and_unhealthy(http, served, model):
    aengine = served[1]
    aengine._error = RuntimeError("simulated engine failure")  # what the engine loop records when it dies
    try:
        assert http.get("/health").status_code == 503
        r = http.post(C, json={"model": model, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert "simulated" not in r.text  # the cause stays in the log
    finally:
        aengine._error = None
    assert http.get("/health").status_code == 200


def test_engine_clean_after_errors(served):
    aengine = served[1]
    kv = aengine.engine.core.kv
    deadline = time.monotonic() + 5
    while kv.num_free_blocks != kv.num_usable_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert kv.num_free_blocks == kv.num_usable_blocks and aengine.is_running


# ---- unexpected errors: a generic 500 with a request id, and the connection stays open ------------
SECRET = "contents of /etc/shadow"


@pytest.fixture
def failing_encode(served):
    """Every tokenization raises an error a client must not see (it quotes a file)."""
    engine = served[1].engine

    def boom(*args, **kwargs):
        raise RuntimeError(SECRET)

    engine.encode = boom
    yield
    del engine.encode  # the class's method again


@pytest.mark.parametrize(
    "path,body,shape",
    [
        ("/tokenize", {"prompt": "Hi"}, "openai"),
        ("/v1/messages/count_tokens", {"model": "MODEL", "messages": USER}, "anthropic"),
        ("/generate", {"inputs": "Hi"}, "tgi"),
    ],
)
def test_internal_error_is_generic_and_keeps_the_connection(served, model, failing_encode, caplog, path, body, shape):
    """One keep-alive connection: the 500 names a request id, never the exception (that is in the
    log, under the id), and the next request on the connection is answered."""
    body = {k: model if v == "MODEL" else v for k, v in body.items()}
    conn = HTTPConnection("127.0.0.1", served[0].port, timeout=30)
    try:
        with caplog.at_level(logging.ERROR, logger="tokenmill.server"):
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
        assert r.status == 500 and r.getheader("connection", "").lower() != "close"
        assert SECRET not in raw.decode() and "RuntimeError" not in raw.decode()
        err = json.loads(raw)
        message = {
            "openai": lambda: err["error"]["message"],
            "anthropic": lambda: err["error"]["message"],
            "tgi": lambda: err["error"],
        }[shape]()
        if shape == "anthropic":
            assert err["type"] == "error" and err["error"]["type"] == "api_error"
        elif shape == "tgi":
            assert err["error_type"] == "generation"
        else:
            assert err["error"]["code"] == 500 and err["error"]["type"] == "InternalServerError"
        request_id = re.search(r"request id (\S+?)\)", message).group(1)
        logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
        assert logged and SECRET in str(logged[0].exc_info[1])
        conn.request("GET", "/v1/models")  # the same connection, after the 500
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == model
    finally:
        conn.close()
