"""Tool calling in chat (tools / tool_choice), through the server with the official `openai` smollm2_client."""

from __future__ import annotations

import json

import httpx
import pytest

from tokenmill.server.tool_calls import add_tool_prompt, parse_tool_calls, plan_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 30}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_gives_calls_of_the_given_tools(smollm2_client, smollm2_model):
    r = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.7, seed=1
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def _accumulate(chunks) -> tuple[list[tuple[str, str, str]], str, str | None]:
    """A streamed chat completion's choice 0 put together as OpenAI's clients do: (tool calls as
    (id, name, arguments), content, finish_reason). Each call's first delta carries its index, id,
    type and name; later ones add fragments of its arguments."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for ch in chunks:
        for c in ch.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    assert t.index not in calls and t.type == "function" and t.function.name
                    calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
                else:
                    assert t.function.name is None and t.index in calls
                    calls[t.index][2] += t.function.arguments or ""
            finish = c.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[k]) for k in sorted(calls)], content, finish


def test_named_function_and_streaming(smollm2_client, smollm2_model, smollm2_server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=100
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert r.choices[0].finish_reason == "stop"
    stream = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=100, stream=True
    )
    calls, content, finish = _accumulate(stream)
    assert len(calls) == 1 and calls[0][1] == "get_weather" and finish == "stop" and not content
    assert set(json.loads(calls[0][2])) == {"city", "unit"}


def test_auto_and_a_conversation_with_tool_results(smollm2_client, smollm2_model):
    r = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0
    )
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls  # the smollm2_model may answer or call; either comes back well-formed
    convo = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = smollm2_client.chat.completions.create(
        model=smollm2_model, messages=convo, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_bad_tool_requests(smollm2_server, smollm2_model):
    url = smollm2_server.url + "/v1/chat/completions"
    for body, param in (
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ):
        r = httpx.post(url, json={"model": smollm2_model, "messages": ASK, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_parser_and_generic_prompt():
    plan = plan_tools(TOOLS, "auto")
    text = (
        'Sure.\n<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>\n'
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(plan, text)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"timezone": "UTC"}
    assert content.startswith("Sure.")
    assert parse_tool_calls(plan, "no calls here") == ("no calls here", [])
    msgs = add_tool_prompt([{"role": "user", "content": "hi"}], plan)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]


def _events(plan, pieces):
    from tokenmill.server.tool_calls import ToolCallStream

    s = ToolCallStream(plan)
    out = [e for p in pieces for e in s.feed(p)] + s.finish()
    text, calls = "", []
    for e in out:  # adjacent text pieces joined, calls as (name, arguments)
        if isinstance(e, str):
            text += e
        elif type(e).__name__ == "CallStart":
            calls.append([e.name, ""])
            text += "|"
        elif type(e).__name__ == "CallArgs":
            calls[-1][1] += e.delta
        else:
            assert e.arguments.strip() == calls[-1][1].strip()
    return text, calls


def test_tool_call_stream_splits_text_and_calls_however_the_text_arrives():
    """The streaming parser the Anthropic and Responses routes use: the same events whether the
    answer comes whole or one character at a time; text before and after calls streams, a possible
    tag is held back, and a block that is not a call of a known tool stays text."""
    plan = plan_tools(TOOLS, "auto")
    text = (
        'Sure.\n<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>\n'
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> and 1 < 2 <tool'
    )
    whole = _events(plan, [text])
    assert whole == _events(plan, list(text))
    shown, calls = whole
    assert calls == [["get_time", '{"timezone": "UTC"}']]
    assert shown == 'Sure.|<tool_call>{"name": "unknown", "arguments": {}}</tool_call> and 1 < 2 <tool'
    assert _events(plan, list("no calls, trailing space ")) == ("no calls, trailing space ", [])
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert _events(named, [' {"timezone":', ' "UTC"}']) == ("|", [["get_time", '{"timezone": "UTC"}']])
    required = plan_tools(TOOLS, "required")
    assert _events(required, ['[{"name": "get_time", ', '"arguments": {"timezone": "UTC"}}]']) == (
        "|",
        [["get_time", '{"timezone": "UTC"}']],
    )
    # cut short (max_tokens): still a call, named once its name can only be one tool's, arguments so far
    assert _events(required, ['[{"name": "get_ti']) == ("|", [["get_time", ""]])
    assert _events(required, ['[{"name": "get_time", "arguments": {"timezone": "U']) == (
        "|",
        [["get_time", '{"timezone": "U']],
    )


def test_required_calls_cut_short_are_parsed_as_calls():
    """tool_choice required cut by max_tokens anywhere: the whole calls, then the cut one (its name when
    it can only be one tool's, its arguments as far as they got); never content."""
    plan = plan_tools(TOOLS, "required")
    for text, want in (
        ("", [("", "")]),
        ('[\n{\n  "name', [("", "")]),
        ('[{"name": "get_w', [("get_weather", "")]),
        ('[{"name": "get_time", "arguments": {"timezone": "U', [("get_time", '{"timezone": "U')]),
        ('[{"name": "get_time", "arguments": {}}, {"arguments": {"city', [("get_time", "{}"), ("", '{"city')]),
        ('[{"name": "get_time", "arguments": {}}, ', [("get_time", "{}")]),
    ):
        content, calls = parse_tool_calls(plan, text)
        assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want, text
    one = plan_tools(TOOLS[:1], "required")  # one tool: the cut call is that tool's whatever was written
    assert [c["function"]["name"] for c in parse_tool_calls(one, "[")[1]] == ["get_weather"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_by_max_tokens_is_a_tool_call(smollm2_client, smollm2_model, choice):
    """As OpenAI answers: tool_calls entries, the last with the arguments so far, finish_reason length;
    never content."""
    kw = {
        "model": smollm2_model,
        "messages": ASK,
        "tools": TOOLS[:1],
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 100,
    }
    whole = smollm2_client.chat.completions.create(**kw)  # greedy: a shorter answer is its prefix
    if whole.choices[0].finish_reason != "length":  # (required may go on calling until max_tokens anyway)
        kw["max_tokens"] = whole.usage.completion_tokens - 3  # cut inside the (last) call's arguments
    r = smollm2_client.chat.completions.create(**kw)
    choice0 = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in choice0.message.tool_calls]
    assert choice0.finish_reason == "length" and choice0.message.content is None
    assert {name for name, _ in calls} == {"get_weather"} and calls[-1][1]
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[-1][1])  # partial
    chunks = list(smollm2_client.chat.completions.create(**kw, stream=True))
    assert [(name, args) for _, name, args in _accumulate(chunks)[0]] == calls
    assert not any(c.delta.content for ch in chunks for c in ch.choices)
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


TOOL_CHOICES = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("choice", TOOL_CHOICES, ids=["auto", "required", "named"])
@pytest.mark.parametrize(
    "ask", [ASK, [{"role": "user", "content": "Say hello, then call get_time for UTC."}]], ids=["weather", "text"]
)
def test_streamed_tool_calls_add_up_to_the_whole_answer(smollm2_client, smollm2_model, choice, ask):
    """Streaming (the official client) gives what the whole answer gives: the calls (names and
    arguments), the content and the finish reason; each call opened by a delta with its index, id,
    type and name, and its arguments streamed after. Greedy, so both runs generate the same text."""
    kw = {
        "model": smollm2_model,
        "messages": ask,
        "tools": TOOLS,
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 80,
    }
    whole = smollm2_client.chat.completions.create(**kw).choices[0]
    calls, content, finish = _accumulate(list(smollm2_client.chat.completions.create(**kw, stream=True)))
    want = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert [(name, args) for _, name, args in calls] == want
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert content == (whole.message.content or "") and finish == whole.finish_reason
    if choice == "required":
        assert calls and finish in ("tool_calls", "length") and not content


def test_named_call_arguments_stream_in_fragments(smollm2_client, smollm2_model):
    """A forced function's arguments stream as they are generated: several argument deltas after the
    one that opens the call, none carrying the id or name again."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        smollm2_client.chat.completions.create(
            model=smollm2_model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [t for ch in chunks for c in ch.choices for t in c.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert len(deltas) > 3 and all(t.id is None and t.function.name is None for t in deltas[1:])
    assert {t.index for t in deltas} == {0}


def test_tool_deltas_with_n_and_logprobs(smollm2_server, smollm2_model):
    """n > 1 with tools: each choice streams its own calls (indices from 0), and logprobs come along."""
    body = {
        "model": smollm2_model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "n": 2,
        "max_tokens": 40,
        "temperature": 0.8,
        "seed": 3,
        "logprobs": True,
        "stream": True,
    }
    with httpx.stream("POST", smollm2_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for i in (0, 1):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        opened = [t for c in mine for t in c["delta"].get("tool_calls") or [] if "id" in t]
        assert opened and opened[0]["index"] == 0 and opened[0]["function"]["name"] in ("get_weather", "get_time")
        assert any(c["logprobs"] for c in mine)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] in (["tool_calls"], ["length"])


def _fake_outputs(pieces: list[str], finish_reason: str = "stop"):
    """A one-sample engine stream (as the chat route sees it) generating `pieces`, one per step."""
    import types

    async def gen():
        text = ""
        for k, piece in enumerate(pieces):
            text += piece
            last = k == len(pieces) - 1
            c = types.SimpleNamespace(
                index=0,
                text=text,
                delta_text=piece,
                token_ids=[0] * (k + 1),
                delta_token_ids=[0],
                logprobs=None,
                stop_reason=None,
                finish_reason=finish_reason if last else None,
            )
            yield types.SimpleNamespace(
                outputs=[c], finished=last, prompt_token_ids=[1, 2], num_cached_tokens=0, prompt_logprobs=None
            )

    return gen()


@pytest.mark.parametrize("pieces", ["whole", "chars"])
def test_auto_calls_between_text_stream_as_the_whole_answer_parses(pieces):
    """tool_choice auto, an answer with text and calls (the model in the other tests does not call on
    its own): the chat route's stream, put together by the client, equals its whole response, whether
    the engine's text arrives whole or a character at a time."""
    import asyncio

    from openai.types.chat import ChatCompletionChunk

    from tokenmill.server import conversation, openai_chat
    from tokenmill.server.protocol import ChatCompletionRequest

    text = (
        'Checking.\n<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    )
    plan = plan_tools(TOOLS, "auto")

    async def streamed():
        gen = conversation.Generation(
            "chatcmpl-1", "m", 2, plan, [_fake_outputs([text] if pieces == "whole" else list(text))], None
        )
        body = ChatCompletionRequest(model="m", messages=ASK, stream=True)
        return [chunk async for chunk in openai_chat._stream(body, gen, 0, None)]

    async def whole():
        outs = [out async for out in _fake_outputs([text])]
        gen = conversation.Generation("chatcmpl-2", "m", 2, plan, [], None)
        return openai_chat._response(gen, 0, outs[-1], None)

    raw = asyncio.run(streamed())
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(c[6:])) for c in raw[:-1]]
    calls, content, finish = _accumulate(chunks)
    message = asyncio.run(whole())["choices"][0]
    assert message["message"]["content"] == content == "Checking."
    assert (
        [(name, args) for _, name, args in calls]
        == [(t["function"]["name"], t["function"]["arguments"]) for t in message["message"]["tool_calls"]]
        == [("get_time", '{"timezone": "UTC"}'), ("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    )
    assert finish == message["finish_reason"] == "tool_calls"
