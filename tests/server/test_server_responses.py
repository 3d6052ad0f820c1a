"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}), driven by the
official `openai` client's responses.create against a real uvicorn server over SmolLM2 (the real
model: real text and function calls). Greedy answers are checked against the chat route's for
the same conversation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import wait_engine_idle

from tokenmill.server.errors import APIError
from tokenmill.server.openai_responses import ResponseStore, Stored

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CHAT_TOOLS = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def served(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


@pytest.fixture(scope="module")
def client(smollm2_client):
    return smollm2_client


def _chat(client, model, messages, max_tokens, **kw):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content, r


def test_text_and_instructions_equal_chat_route(client, model):
    r = client.responses.create(
        model=model,
        instructions="You are a terse assistant.",
        input="Name a fruit.",
        max_output_tokens=24,
        temperature=0,
    )
    want, c = _chat(
        client,
        model,
        [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a fruit."}],
        24,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == want and [i.type for i in r.output] == ["message"]
    assert r.status == {"length": "incomplete", "stop": "completed"}[c.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
        c.usage.total_tokens,
    )
    # items in, developer as a system message, output_text parts in an assistant turn
    items = [
        {"role": "developer", "content": "You are a terse assistant."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
    ]
    assert client.responses.create(model=model, input=items, max_output_tokens=24, temperature=0).output_text == want


def test_stream_events(client, model):
    whole = client.responses.create(
        model=model, input="Count from one to ten in words.", max_output_tokens=30, temperature=0
    )
    events = list(
        client.responses.create(
            model=model, input="Count from one to ten in words.", max_output_tokens=30, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", done]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_output(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=model,
        input=ASK,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )
    assert set(json.loads(r.output_text)) == {"city"} and r.status == "completed"


def test_function_call_then_output_with_previous_response_id(client, model):
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model=model, input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=60, temperature=0
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"}
    events = list(
        client.responses.create(
            model=model,
            input=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(deltas) == json.loads(args_done.arguments) == args and args_done.name == "get_weather"
    # the call's output, continuing the stored response; the same conversation given as items, and on
    # the chat route, gives the same answer
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    follow = client.responses.create(
        model=model,
        previous_response_id=r.id,
        input=[output],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert follow.previous_response_id == r.id and follow.output_text
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        output,
    ]
    again = client.responses.create(
        model=model, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=24, temperature=0
    )
    chat_convo = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"},
    ]
    want, _ = _chat(client, model, chat_convo, 24, tools=CHAT_TOOLS, tool_choice="none")
    assert follow.output_text == again.output_text == want


def test_required_tool_choice_one_call(client, model):
    r = client.responses.create(
        model=model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert [(i.type, i.name) for i in r.output] == [("function_call", "get_weather")]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_call_cut_by_max_output_tokens_is_an_incomplete_function_call(client, model, choice):
    """As OpenAI answers: a function_call item with the arguments so far, item and response incomplete
    (reason max_output_tokens), whole or streamed; never an output_text message of partial JSON."""
    kw = {
        "model": model,
        "input": ASK,
        "tools": [WEATHER],
        "tool_choice": choice,
        "temperature": 0,
        "store": False,
        "parallel_tool_calls": False,
    }  # required: one call, then the answer ends
    whole = client.responses.create(**kw, max_output_tokens=100)  # greedy: the cut one is its prefix
    kw["max_output_tokens"] = whole.usage.output_tokens - 3  # cut inside the arguments
    r = client.responses.create(**kw)
    (call,) = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "incomplete")
    assert call.arguments and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(**kw, stream=True))
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert (done.item.type, done.item.status, done.item.arguments) == ("function_call", "incomplete", call.arguments)
    assert events[-1].type == "response.incomplete"
    assert [(i.type, i.status) for i in events[-1].response.output] == [("function_call", "incomplete")]
    assert not [e for e in events if e.type == "response.output_text.delta"]


def test_store_retrieve_delete(client, served, model):
    r = client.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="Hi", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    assert httpx.delete(f"{served.url}/v1/responses/{unstored.id}", timeout=30).status_code == 404


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    for k in "abc":
        store.put(k, Stored({"id": k}, []))
        if k == "b":
            store.get("a")  # a is now the most recently used: b goes first
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(APIError, match="not found"):
        store.get("b")
    off = ResponseStore(0)
    off.put("a", Stored({}, []))
    assert len(off) == 0


def test_cache_salt_separates_prefix_cache_tenants(client, model):
    """vLLM's cache_salt reaches the engine: a prompt is served from the prefix cache only for its own salt."""
    text = "Summarise: " + " ".join(f"item {i} is a sentence about paged attention." for i in range(12))

    def cached(salt: str) -> int:
        r = client.responses.create(
            model=model, input=text, max_output_tokens=1, store=False, extra_body={"cache_salt": salt}
        )
        return r.usage.input_tokens_details.cached_tokens

    first = cached("tenant-a")
    assert cached("tenant-a") > first  # the same salt: the prompt's blocks are hits
    assert cached("tenant-b") == first  # another salt: none of tenant a's blocks


def test_errors_in_openai_shape(client, served, model):
    url = served.url + "/v1/responses"
    for body, param in (
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "priority": 1}, "priority"),
    ):  # vLLM's extra, refused under fcfs
        r = httpx.post(url, json={"model": model, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == 400 and err["param"] == param, err
    r = httpx.post(url, json={"model": model, "input": 7}, timeout=60)  # the Responses API's own wording
    assert r.status_code == 400 and "a string or a list of input items" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    assert wait_engine_idle(served.aengine)  # every request of this module finished and gave its blocks back
