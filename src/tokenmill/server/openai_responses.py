"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
route's machinery (conversation.py). `instructions` is a system message first; input items become
chat messages (function_call items an assistant turn's tool calls, function_call_output items
tool turns); `text.format` json_schema is the chat route's structured output; function tools and
tool_choice are the chat route's. The answer is a message item and function_call items, whole or
as the Responses stream events (each with its sequence_number). Responses with `store` (the
default) are kept in memory, the last --max-stored-responses of them (least recently used
dropped first), with their conversation, for GET and `previous_response_id`."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.sampling_params import GuidedDecodingParams
from tokenmill.server import conversation
from tokenmill.server.args import DEFAULT_MAX_STORED
from tokenmill.server.checks import log_ignored_fields
from tokenmill.server.context import ServerContext, get_ctx
from tokenmill.server.errors import APIError, CheckedRoute
from tokenmill.server.openai_completions import ERROR_RESPONSES
from tokenmill.server.protocol import ChatContentPart, ChatMessage, ErrorResponse, sse_content
from tokenmill.server.response_body import encode_json
from tokenmill.server.responses_protocol import (
    STREAM_EVENTS,
    ResponsesDeleted,
    ResponsesFunctionCall,
    ResponsesFunctionCallInput,
    ResponsesFunctionCallOutput,
    ResponsesInputMessage,
    ResponsesInputTokensDetails,
    ResponsesOutputMessage,
    ResponsesOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesUsage,
)
from tokenmill.server.sampling import structured_output
from tokenmill.server.sse import SSEResponse, run_cancellable, stream_error
from tokenmill.server.tool_calls import CallArgs, CallEnd, CallStart, ToolPlan, function_tool, plan_tools

router = APIRouter(tags=["OpenAI Responses"], route_class=CheckedRoute)


@dataclass
class Stored:
    response: dict  # the Response object as sent
    messages: list[ChatMessage]  # its conversation, answer included, without its instructions


class ResponseStore:
    """Stored responses, in memory, at most `capacity` (least recently used dropped first)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                f"Response with id {response_id!r} not found (responses are kept in memory, the last "
                f"{self.capacity}; stored only with store: true)",
                404,
                param=param,
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


def store_of(ctx: ServerContext) -> ResponseStore:
    return ctx.response_store


_NOT_FOUND = {404: {"model": ErrorResponse, "description": "no stored response with this id"}}


@router.post(
    "/v1/responses",
    response_model=None,
    responses={
        200: {
            "model": ResponsesResponse,
            "description": "a Response, or with stream=true the Responses SSE events "
            "(`event: <type>` and `data: {...}`), ending with "
            "response.completed or response.incomplete",
            "content": sse_content(*STREAM_EVENTS, done=False),
        },
        **ERROR_RESPONSES,
    },
)
async def create_response(body: ResponsesRequest, raw: Request):
    return await run_cancellable(raw, _create_response(get_ctx(raw), body, raw))


@router.get(
    "/v1/responses/{response_id}", response_model=ResponsesResponse, responses={**ERROR_RESPONSES, **_NOT_FOUND}
)
async def retrieve_response(response_id: str, raw: Request) -> JSONResponse:
    return JSONResponse(store_of(get_ctx(raw)).get(response_id).response)


@router.delete(
    "/v1/responses/{response_id}", response_model=ResponsesDeleted, responses={**ERROR_RESPONSES, **_NOT_FOUND}
)
async def delete_response(response_id: str, raw: Request) -> ResponsesDeleted:
    store_of(get_ctx(raw)).delete(response_id)
    return ResponsesDeleted(id=response_id)


async def _create_response(ctx: ServerContext, body: ResponsesRequest, raw: Request):
    log_ignored_fields(body)
    if body.background:
        raise APIError("background responses are not supported", param="background")
    history = []
    if body.previous_response_id is not None:
        history = store_of(ctx).get(body.previous_response_id, "previous_response_id").messages
    turn = history + await ctx.offload(input_messages, body)  # 10,000s of items: off the event loop
    messages = ([ChatMessage(role="system", content=body.instructions)] if body.instructions else []) + turn
    fmt = body.text.format if body.text is not None else None
    guided = structured_output(fmt.type, getattr(fmt, "schema_", None), param="text.format") if fmt else None
    sampling = conversation.Sampling(
        max_tokens=body.max_output_tokens,
        max_param="max_output_tokens",
        temperature=body.temperature,
        top_p=body.top_p,
        guided=guided,
    )
    gen = await conversation.start(ctx, raw, "resp", body, messages, tool_plan(body), sampling)
    created = int(time.time())
    if body.stream:
        return SSEResponse(_stream(ctx, body, gen, created, turn))
    answer = await conversation.answer(gen)
    response, content = await ctx.offload(_whole, body, gen, created, answer)
    _store(ctx, body, response, turn, answer)  # here: the store is the event loop's
    return Response(content, media_type="application/json")


def _whole(
    body: ResponsesRequest, gen: conversation.Generation, created: int, answer: conversation.Answer
) -> tuple[dict, bytes]:
    """The Response object and its JSON (on the prep pool, as response_body.json_response builds)."""
    response = _response(body, gen, created, [_item(p, "completed") for p in answer.parts], answer)
    return response, encode_json(response)


# ---- the Responses request -> the chat route's ---------------------------------------------
def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The input items as chat messages: function_call items join the assistant turn before them
    (or open one), function_call_output items are tool messages; reasoning items are left out."""
    out: list[ChatMessage] = []
    for item in body.input:
        if isinstance(item, ResponsesInputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append(
                ChatMessage(role=role, content=[ChatContentPart(type="text", text=p.text) for p in item.content])
            )
        elif isinstance(item, ResponsesFunctionCallInput):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1].role == "assistant":
                out[-1] = out[-1].model_copy(update={"tool_calls": [*(out[-1].tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, ResponsesFunctionCallOutput):
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
    return out


def tool_plan(body: ResponsesRequest) -> ToolPlan | None:
    tools = [function_tool(t.name, t.description, t.parameters) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    plan = plan_tools(tools, choice)
    if plan is not None and plan.mode == "required" and body.parallel_tool_calls is False:
        plan.guided = GuidedDecodingParams(json={**plan.guided.json, "maxItems": 1})
    return plan


# ---- the answer -> Responses' ----------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(part: str | conversation.ToolCall, status: str, item_id: str | None = None) -> dict:
    if isinstance(part, str):
        return ResponsesOutputMessage(
            id=item_id or _new_id("msg"), status=status, content=[ResponsesOutputText(text=part)]
        ).model_dump()
    return ResponsesFunctionCall(
        id=item_id or _new_id("fc"), call_id=part.id, name=part.name, arguments=part.arguments, status=status
    ).model_dump()


def _response(
    body: ResponsesRequest,
    gen: conversation.Generation,
    created: int,
    items: list[dict],
    answer: conversation.Answer | None,
) -> dict:
    """The Response object: in progress while `answer` is None."""
    status, incomplete, usage = "in_progress", None, None
    if answer is not None:
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = ResponsesUsage(
            input_tokens=gen.prompt_tokens,
            output_tokens=answer.output_tokens,
            total_tokens=gen.prompt_tokens + answer.output_tokens,
            input_tokens_details=ResponsesInputTokensDetails(cached_tokens=answer.cached_tokens),
        )
        if incomplete and items:
            items[-1]["status"] = "incomplete"
    fmt = body.text.format.model_dump(by_alias=True) if body.text is not None and body.text.format else {"type": "text"}
    choice = body.tool_choice
    return ResponsesResponse(
        id=gen.request_id,
        created_at=created,
        status=status,
        incomplete_details=incomplete,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=gen.model,
        output=items,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        store=body.store,
        temperature=body.temperature,
        top_p=body.top_p,
        text={"format": fmt},
        tool_choice=(choice if isinstance(choice, str) or choice is None else choice.model_dump()) or "auto",
        tools=[t.model_dump() for t in body.tools or []],
        truncation=body.truncation or "disabled",
        usage=usage,
        user=body.user,
        metadata=body.metadata or {},
    ).model_dump()


def _store(
    ctx: ServerContext, body: ResponsesRequest, response: dict, turn: list[ChatMessage], answer: conversation.Answer
) -> None:
    if not body.store:
        return
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls
    ]
    reply = ChatMessage(role="assistant", content=answer.text or None, tool_calls=calls or None)
    store_of(ctx).put(response["id"], Stored(response, [*turn, reply]))


class _Items:
    """The Responses stream events for the answer's text pieces and tool calls, in order: a message
    item per run of text, a function_call item per call; every event numbered."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []  # finished items
        self.current: dict | None = None  # the item being streamed

    def event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def on(self, e) -> list[bytes]:
        cur, out = self.current, []
        if isinstance(e, str):
            if cur is None or cur["type"] != "message":
                out += self.close()
                cur = self.current = _item("", "in_progress")
                cur["content"] = []
                out.append(self.event("response.output_item.added", output_index=len(self.items), item=cur))
                cur["content"] = [ResponsesOutputText(text="").model_dump()]
                out.append(self.event("response.content_part.added", **self._at(), part=cur["content"][0]))
            cur["content"][0]["text"] += e
            out.append(self.event("response.output_text.delta", **self._at(), delta=e, logprobs=[]))
        elif isinstance(e, CallStart):
            out += self.close()
            self.current = _item(conversation.ToolCall(e.id, e.name, ""), "in_progress")
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.current))
        elif isinstance(e, CallArgs) and e.delta:
            cur["arguments"] += e.delta
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=cur["id"],
                    output_index=len(self.items),
                    delta=e.delta,
                )
            )
        elif isinstance(e, CallEnd):
            # Left open: the next item closes it; or, when it is the last, the end of the answer does,
            # with the response's status (a forced call cut by max_output_tokens is "incomplete").
            cur["arguments"] = e.arguments
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        item = self.current
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            out = [
                self.event("response.output_text.done", **self._at(), text=item["content"][0]["text"], logprobs=[]),
                self.event("response.content_part.done", **self._at(), part=item["content"][0]),
            ]
        else:
            out = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=len(self.items),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.current = None
        return out

    def _at(self) -> dict:
        return {"item_id": self.current["id"], "output_index": len(self.items), "content_index": 0}


async def _stream(
    ctx: ServerContext, body: ResponsesRequest, gen: conversation.Generation, created: int, turn: list[ChatMessage]
):
    """response.created and .in_progress; per output item output_item.added, then for a message
    content_part.added, output_text.delta... output_text.done, content_part.done, for a function
    call function_call_arguments.delta... .done, then output_item.done; response.completed (or
    response.incomplete when max_output_tokens cut it)."""
    out, answer = _Items(), None
    yield (
        out.event("response.created", response=_response(body, gen, created, [], None))
        + out.event("response.in_progress", response=_response(body, gen, created, [], None))
    )
    try:
        async with aclosing(conversation.answer_chunks(gen, out.on)) as steps:  # closed with the response: aborts
            async for chunk, answer in steps:  # noqa: B007 - the last answer is read after the loop
                if chunk:
                    yield chunk
        last = out.close("incomplete" if answer.finish_reason == "length" else "completed")
        response = _response(body, gen, created, out.items, answer)
        _store(ctx, body, response, turn, answer)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield b"".join([*last, out.event(done, response=response)])
    except (ValueError, RuntimeError, APIError) as e:
        err = stream_error(e, gen.request_id)
        yield out.event("error", code=str(err.status), message=err.message, param=err.param)
