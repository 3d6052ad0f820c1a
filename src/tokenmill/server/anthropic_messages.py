"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the chat
route's machinery (conversation.py): the conversation becomes chat messages (tool_use blocks an
assistant turn's tool calls, tool_result blocks tool turns), Anthropic's tools and tool_choice
become the chat route's (any: a grammar forcing one or more calls; tool: that tool's input),
and the answer comes back as text and tool_use blocks, whole or as Anthropic's stream events.
Errors are Anthropic's body, `{"type": "error", "error": {"type", "message"}}` (errors.py)."""

from __future__ import annotations

import json
from contextlib import aclosing

from fastapi import APIRouter, Request

from tokenmill.sampling_params import GuidedDecodingParams
from tokenmill.server import conversation
from tokenmill.server.anthropic_protocol import (
    STREAM_EVENTS,
    AnthropicConversation,
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicTextBlock,
    AnthropicTextOut,
    AnthropicToolChoiceAny,
    AnthropicToolChoiceTool,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    AnthropicToolUseOut,
    AnthropicUsage,
)
from tokenmill.server.checks import check_model, log_ignored_fields
from tokenmill.server.context import get_ctx
from tokenmill.server.errors import APIError, CheckedRoute, anthropic_error_body
from tokenmill.server.protocol import ChatContentPart, ChatMessage, sse_content
from tokenmill.server.response_body import json_response
from tokenmill.server.sampling import structured_output
from tokenmill.server.sse import SSEResponse, run_cancellable, stream_error
from tokenmill.server.tool_calls import CallArgs, CallEnd, CallStart, ToolPlan, function_tool, plan_tools

router = APIRouter(tags=["Anthropic"], route_class=CheckedRoute)

ERRORS = {
    400: {"model": AnthropicErrorResponse, "description": "bad input (invalid_request_error)"},
    401: {
        "model": AnthropicErrorResponse,
        "description": "missing or wrong API key (x-api-key or Authorization: Bearer)",
    },
    404: {"model": AnthropicErrorResponse, "description": "unknown model"},
    413: {"model": AnthropicErrorResponse, "description": "body over --max-request-body-bytes"},
    503: {
        "model": AnthropicErrorResponse,
        "description": "too many waiting requests, or the engine is down (overloaded_error)",
    },
}


@router.post(
    "/v1/messages",
    response_model=None,
    responses={
        200: {
            "model": AnthropicMessage,
            "description": "a Message, or with stream=true Anthropic's SSE events "
            "(`event: <type>` and `data: {...}`), ending with message_stop",
            "content": sse_content(*STREAM_EVENTS, done=False),
        },
        **ERRORS,
    },
)
async def create_message(body: AnthropicMessagesRequest, raw: Request):
    return await run_cancellable(raw, _create_message(body, raw))


@router.post("/v1/messages/count_tokens", response_model=AnthropicCountTokensResponse, responses=ERRORS)
async def count_tokens(body: AnthropicCountTokensRequest, raw: Request) -> AnthropicCountTokensResponse:
    """The prompt's tokens as /v1/messages would render it (system, messages and tools)."""
    ctx = get_ctx(raw)
    check_model(ctx, body.model)
    messages, continue_final = await ctx.offload(chat_messages, body)  # 10,000s of blocks: off the event loop
    ids = await conversation.prompt_ids(ctx, messages, tool_plan(body), continue_final)
    return AnthropicCountTokensResponse(input_tokens=len(ids))


async def _create_message(body: AnthropicMessagesRequest, raw: Request):
    log_ignored_fields(body)
    ctx = get_ctx(raw)
    messages, continue_final = await ctx.offload(chat_messages, body)  # 10,000s of blocks: off the event loop
    fmt = body.output_config.format if body.output_config is not None else None
    guided = structured_output("json_schema", fmt.schema_, param="output_config.format") if fmt else None
    sampling = conversation.Sampling(
        max_tokens=body.max_tokens,
        max_param="max_tokens",
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or None,
        stop=body.stop_sequences,
        guided=guided,
    )
    gen = await conversation.start(ctx, raw, "msg", body, messages, tool_plan(body), sampling, continue_final)
    if body.stream:
        return SSEResponse(_stream(gen))
    return await json_response(ctx, _message, gen, await conversation.answer(gen))


def _message(gen: conversation.Generation, answer: conversation.Answer) -> dict:
    """The whole Message (on the prep pool, by json_response), its blocks dumped one at a time."""
    content = [
        (
            AnthropicTextOut(text=p)
            if isinstance(p, str)
            else AnthropicToolUseOut(id=_tool_id(p.id), name=p.name, input=_input(p.arguments))
        ).model_dump()
        for p in answer.parts
    ]
    msg = AnthropicMessage(
        id=gen.request_id,
        model=gen.model,
        content=[],
        stop_reason=_stop_reason(answer),
        stop_sequence=answer.stop_string,
        usage=AnthropicUsage(input_tokens=gen.prompt_tokens, output_tokens=answer.output_tokens),
    )
    return {**msg.model_dump(), "content": content}


# ---- Anthropic's request -> the chat route's ----------------------------------------------
def chat_messages(body: AnthropicConversation) -> tuple[list[ChatMessage], bool]:
    """The chat route's messages, and whether the last (an assistant message) is to be continued."""
    out = []
    if body.system:
        system = body.system if isinstance(body.system, str) else [_part(b.text) for b in body.system]
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(body.messages):
        texts, calls = [], []
        for b in m.content:
            if isinstance(b, AnthropicTextBlock):
                texts.append(_part(b.text))
            elif isinstance(b, AnthropicToolUseBlock):
                if m.role != "assistant":
                    raise APIError(f"messages[{i}]: tool_use blocks belong in assistant messages", param="messages")
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
                    }
                )
            elif isinstance(b, AnthropicToolResultBlock):
                if m.role != "user":
                    raise APIError(f"messages[{i}]: tool_result blocks belong in user messages", param="messages")
                out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b)))
            # thinking blocks of earlier turns are left out
        if m.role == "assistant":
            out.append(ChatMessage(role="assistant", content=texts or None, tool_calls=calls or None))
        elif texts or not any(isinstance(b, AnthropicToolResultBlock) for b in m.content):
            out.append(ChatMessage(role="user", content=texts))
    return out, body.messages[-1].role == "assistant"


def _part(text: str) -> ChatContentPart:
    return ChatContentPart(type="text", text=text)


def _result_text(b: AnthropicToolResultBlock) -> str:
    text = b.content if isinstance(b.content, str) else "\n".join(t.text for t in b.content or [])
    return f"Error: {text}" if b.is_error else text


def tool_plan(body: AnthropicConversation) -> ToolPlan | None:
    """Anthropic's tools and tool_choice as the chat route's plan: auto, any (required: one call
    or more, exactly one with disable_parallel_tool_use), tool (named) or none."""
    tools = [function_tool(t.name, t.description, t.input_schema) for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, AnthropicToolChoiceTool):
        openai_choice = {"type": "function", "function": {"name": choice.name}}
    else:
        openai_choice = {"any": "required"}.get(choice.type, choice.type) if choice is not None else None
    plan = plan_tools(tools, openai_choice)
    if isinstance(choice, AnthropicToolChoiceAny) and choice.disable_parallel_tool_use:
        plan.guided = GuidedDecodingParams(json={**plan.guided.json, "maxItems": 1})
    return plan


# ---- the answer -> Anthropic's -------------------------------------------------------------
def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A tool_use block's input: the arguments' JSON object ({} when they are cut short or not an object)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(answer: conversation.Answer) -> str | None:
    if answer.finish_reason == "length":
        return "max_tokens"
    if answer.finish_reason != "stop":
        return None
    if answer.calls:
        return "tool_use"
    return "stop_sequence" if answer.stop_string is not None else "end_turn"


def _event(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """Anthropic's content-block events for the answer's text pieces and tool calls, in order."""

    def __init__(self):
        self.index, self.open = -1, None  # the current block and its kind

    def on(self, e) -> list[bytes]:
        out = []
        if isinstance(e, str):
            if self.open != "text":
                out += self.close() + self._start("text", {"type": "text", "text": ""})
            out.append(
                _event({"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": e}})
            )
        elif isinstance(e, CallStart):
            out += self.close() + self._start(
                "tool_use", {"type": "tool_use", "id": _tool_id(e.id), "name": e.name, "input": {}}
            )
        elif isinstance(e, CallArgs) and e.delta:
            out.append(
                _event(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": e.delta},
                    }
                )
            )
        elif isinstance(e, CallEnd):
            out += self.close()
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str, block: dict) -> list[bytes]:
        self.index, self.open = self.index + 1, kind
        return [_event({"type": "content_block_start", "index": self.index, "content_block": block})]


async def _stream(gen: conversation.Generation):
    """message_start, ping, then per block content_block_start / _delta / _stop (text_delta for
    text, input_json_delta for a tool's input), message_delta (stop_reason, usage), message_stop."""
    start = AnthropicMessage(
        id=gen.request_id,
        model=gen.model,
        content=[],
        usage=AnthropicUsage(input_tokens=gen.prompt_tokens, output_tokens=0),
    )
    yield _event({"type": "message_start", "message": start.model_dump()}) + _event({"type": "ping"})
    blocks, answer = _Blocks(), None
    try:
        async with aclosing(conversation.answer_chunks(gen, blocks.on)) as steps:  # closed with the response: aborts
            async for chunk, answer in steps:  # noqa: B007 - the last answer is read after the loop
                if chunk:
                    yield chunk
        delta = {"stop_reason": _stop_reason(answer), "stop_sequence": answer.stop_string}
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": answer.output_tokens}
        yield b"".join(
            [
                *blocks.close(),
                _event({"type": "message_delta", "delta": delta, "usage": usage}),
                _event({"type": "message_stop"}),
            ]
        )
    except (ValueError, RuntimeError, APIError) as e:
        err = stream_error(e, gen.request_id)
        yield _event(anthropic_error_body(err.message, err.status))
