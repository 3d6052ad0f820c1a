"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), driven by the official
`anthropic` client against a real uvicorn server over SmolLM2 (the real model: real text and
tool calls). Greedy answers are checked against the chat route's for the same conversation."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import wait_engine_idle

GREEDY = {"temperature": 0}  # not a keyword of this client's messages.create any more: sent as an extra field
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "Current time in a time zone",
    "input_schema": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


@pytest.fixture(scope="module")
def chat(smollm2_client):
    return smollm2_client


@pytest.fixture(scope="module")
def client(served):
    with anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _chat_text(chat, model, messages, max_tokens, **kw):
    r = chat.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content, r


def test_text_equals_chat_route_and_usage(client, chat, model):
    system = "You are a terse assistant."
    m = client.messages.create(
        model=model,
        max_tokens=24,
        system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}],
        extra_body=GREEDY,
    )
    want, r = _chat_text(
        chat, model, [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}], 24
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[r.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    n = client.messages.count_tokens(
        model=model, system=system, messages=[{"role": "user", "content": "Name a fruit."}]
    )
    assert n.input_tokens == r.usage.prompt_tokens


def test_stream_events_and_stop_sequence(client, served, model):
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = client.messages.create(model=model, max_tokens=30, messages=ask, extra_body=GREEDY)
    text = whole.content[0].text
    with client.messages.stream(model=model, max_tokens=30, messages=ask, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    # the wire format: `event:` lines (the client drops events without one), a ping after message_start
    with httpx.stream(
        "POST",
        served.url + "/v1/messages",
        timeout=120,
        json={"model": model, "max_tokens": 5, "messages": ask, "stream": True, **GREEDY},
    ) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # a stop sequence from the middle of the greedy answer ends it there
    word = text.split()[len(text.split()) // 2]
    m = client.messages.create(model=model, max_tokens=30, messages=ask, stop_sequences=[word], extra_body=GREEDY)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == text[: text.index(word)]


def test_forced_tool_call_then_tool_result(client, chat, model):
    m = client.messages.create(
        model=model,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) == {"city", "unit"} and m.stop_reason == "tool_use"
    with client.messages.stream(
        model=model,
        max_tokens=60,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(deltas) == {"input_json_delta"}
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", block.input)]
    # the tool's result in a user turn; the answer equals the chat route's on the same conversation
    convo = ASK + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 degrees, sunny"}],
                }
            ],
        },
    ]
    m = client.messages.create(
        model=model, max_tokens=24, messages=convo, tools=TOOLS, tool_choice={"type": "none"}, extra_body=GREEDY
    )
    chat_convo = ASK + [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees, sunny"},
    ]
    want, _ = _chat_text(chat, model, chat_convo, 24, tools=CHAT_TOOLS, tool_choice="none")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want


def test_any_tool_choice_and_count_tokens(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=80,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    (block,) = m.content
    assert block.type == "tool_use" and block.name in ("get_weather", "get_time") and m.stop_reason == "tool_use"
    bare = client.messages.count_tokens(model=model, messages=ASK).input_tokens
    assert client.messages.count_tokens(model=model, messages=ASK, tools=TOOLS).input_tokens > bare


@pytest.mark.parametrize(
    "choice", [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}]
)
def test_forced_tool_use_cut_by_max_tokens_is_a_tool_use_block(client, model, choice):
    """A forced call cut by max_tokens is a tool_use block (stop_reason max_tokens), whole or streamed,
    never a text block of partial JSON."""
    kw = {"model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": choice, "extra_body": GREEDY}
    whole = client.messages.create(**kw, max_tokens=100)  # greedy: the cut one is its prefix
    kw["max_tokens"] = whole.usage.output_tokens - 3  # cut inside the input
    m = client.messages.create(**kw)
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_weather")] and m.stop_reason == "max_tokens"
    with client.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(kinds) == {"input_json_delta"} and streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in streamed.content] == [("tool_use", "get_weather")]


def test_structured_output(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    m = client.messages.create(
        model=model,
        max_tokens=40,
        messages=ASK,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert set(json.loads(m.content[0].text)) == {"city"} and m.stop_reason == "end_turn"


def test_errors_in_anthropic_shape(client, served, model):
    url = served.url + "/v1/messages"
    base = {"model": model, "max_tokens": 8, "messages": ASK}
    for body, words in (
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content blocks must be"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]}, "name"),
        ({"temperature": 1.5}, "temperature"),
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"max_tokens": 10**6}, "maximum context length"),
        ({"priority": 1}, "--scheduling-policy priority"),
    ):  # vLLM's extra, refused under fcfs
        r = httpx.post(url, json={**base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"], err
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model,
            max_tokens=8,
            messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}],
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert httpx.post(url + "/count_tokens", json={"model": model}, timeout=60).json()["type"] == "error"


def test_api_key_as_x_api_key(served, model):
    served.ctx.api_key = "s3cret"
    try:
        with anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0) as c:
            with pytest.raises(anthropic.AuthenticationError) as e:
                c.messages.count_tokens(model=model, messages=ASK)
            assert e.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=served.url, api_key="s3cret", max_retries=0) as c:
            assert c.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
        r = httpx.post(
            served.url + "/v1/messages/count_tokens",
            json={"model": model, "messages": ASK},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert r.status_code == 200
        # x-api-key opens the OpenAI routes too
        assert httpx.get(served.url + "/v1/models", headers={"x-api-key": "s3cret"}, timeout=60).status_code == 200
    finally:
        served.ctx.api_key = None
    assert wait_engine_idle(served.aengine)  # every request of this module finished and gave its blocks back
